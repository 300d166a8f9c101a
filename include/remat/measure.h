#pragma once
/// \file
/// Measuring a training step: exact memory from remat's meter and the median wall time.
///
///   remat::memory::track_cpu();
///   auto stats = remat::measure_step(*model, [&] { return model->forward(x).pow(2).mean(); },
///                                    remat::MeasureOptions().warmup(2).steps(5));
///   std::cout << stats.peak_bytes << " bytes over base, " << stats.median_ms << " ms\n";

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <vector>

namespace remat {

/// Options of measure_step.
struct MeasureOptions {
  /// Untimed steps first (allocates gradients and warms caches). At least 0.
  TORCH_ARG(int64_t, warmup) = 2;
  /// Timed steps; the median is reported. At least 1.
  TORCH_ARG(int64_t, steps) = 5;
  /// Device whose memory is metered (cpu needs remat::memory::track_cpu() first).
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

/// What one training step costs. Bytes are over the base: what was alive when the step began (parameters,
/// their gradients, inputs), so they count activations and the transients of forward and backward.
struct StepStats {
  int64_t base_bytes = 0;            ///< bytes alive before the forward pass (bytes)
  int64_t peak_bytes = 0;            ///< peak during forward + backward, over base (bytes; max over steps)
  int64_t after_forward_bytes = 0;   ///< alive after the forward pass, over base: what is kept for backward
  int64_t after_backward_bytes = 0;  ///< alive after backward once the loss is dropped, over base
  double median_ms = 0;              ///< median wall time of a step, forward + backward (milliseconds)
  std::vector<double> step_ms;       ///< every timed step (milliseconds)
  double median_forward_ms = 0;      ///< median wall time of the forward pass, loss included (milliseconds)
  std::vector<double> forward_ms;    ///< the forward pass of every timed step (milliseconds)
};

/// Runs `loss_fn` (the forward pass, returning a scalar loss) and backward, warmup + steps times, on
/// `model`, whose gradients are zeroed in place (not freed) before each step so that they belong to the base.
/// Throws c10::Error naming remat::measure_step when warmup < 0, steps < 1, or loss_fn returns an undefined
/// or non-scalar tensor; and what loss_fn throws.
StepStats measure_step(torch::nn::Module& model, const std::function<torch::Tensor()>& loss_fn,
                       const MeasureOptions& options = {});

/// Median of a non-empty list (the mean of the middle two for an even count). Throws c10::Error when empty.
double median(std::vector<double> values);

}  // namespace remat
