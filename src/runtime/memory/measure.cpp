#include "remat/measure.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

#include "remat/memory.h"

namespace remat {

double median(std::vector<double> values) {
  TORCH_CHECK(!values.empty(), "remat::median: no values");
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

namespace {
void zero_grads(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}
}  // namespace

StepStats measure_step(torch::nn::Module& model, const std::function<torch::Tensor()>& loss_fn,
                       const MeasureOptions& options) {
  TORCH_CHECK(options.warmup() >= 0, "remat::measure_step: warmup must be >= 0, got ", options.warmup());
  TORCH_CHECK(options.steps() >= 1, "remat::measure_step: steps must be >= 1, got ", options.steps());
  const torch::Device device = options.device();
  auto run_loss = [&] {
    torch::Tensor loss = loss_fn();
    TORCH_CHECK(loss.defined(),
                "remat::measure_step: loss_fn must return a scalar tensor, got an undefined tensor");
    TORCH_CHECK(loss.numel() == 1,
                "remat::measure_step: loss_fn must return a scalar tensor, got a tensor of shape ",
                loss.sizes());
    return loss;
  };
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index() < 0 ? -1 : device.index());
  };

  for (int64_t i = 0; i < options.warmup(); ++i) {
    zero_grads(model);
    run_loss().backward();
  }
  StepStats stats;
  for (int64_t i = 0; i < options.steps(); ++i) {
    zero_grads(model);
    sync();
    const int64_t base = memory::active_bytes(device);
    memory::PeakWindow scope(device);  // resets no statistic the caller reads
    const auto t0 = std::chrono::steady_clock::now();
    torch::Tensor loss = run_loss();
    sync();
    const auto t_forward = std::chrono::steady_clock::now();
    const int64_t after_forward = scope.active_over_base();
    loss.backward();
    sync();
    const auto t1 = std::chrono::steady_clock::now();
    loss = torch::Tensor();
    stats.base_bytes = base;
    stats.after_forward_bytes = std::max(stats.after_forward_bytes, after_forward);
    stats.after_backward_bytes = scope.active_over_base();
    stats.peak_bytes = std::max(stats.peak_bytes, scope.peak_over_base());
    stats.step_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    stats.forward_ms.push_back(std::chrono::duration<double, std::milli>(t_forward - t0).count());
  }
  stats.median_ms = median(stats.step_ms);
  stats.median_forward_ms = median(stats.forward_ms);
  return stats;
}

}  // namespace remat
