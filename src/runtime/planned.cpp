// remat::Planned (remat/planned.h): profiling in place, planning for the step's budget, running the plan.
#include "remat/planned.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <stdexcept>
#include <string>

#include "detail/cpu_meter.h"
#include "remat/memory.h"
#include "remat/profile.h"

namespace remat {

namespace {

constexpr const char* kWho = "remat::Planned";
using Clock = std::chrono::steady_clock;

// The whole step as a chain for simulate(): stage 0 what is before the stages (its output, the stages' input,
// is alive from the start), the stages, and last the rest of the step, charged as holding its measured peak
// from its forward to its backward (an upper bound: the loss and what it saves are usually gone sooner).
Chain step_chain(const Chain& chain, const RestOfStep& rest) {
  Chain step;
  step.input_bytes = 0;
  step.keep = chain.keep;
  step.policies = chain.policies;
  Stage before;
  before.name = "before";
  before.output_bytes = chain.input_bytes;
  before.saved_bytes = chain.input_bytes;
  step.stages.push_back(before);
  step.stages.insert(step.stages.end(), chain.stages.begin(), chain.stages.end());
  Stage after;
  after.name = "rest of the step";
  after.output_bytes = 0;
  after.saved_bytes = rest.peak_bytes;
  after.fwd_ms = rest.ms;
  step.stages.push_back(after);
  return step;
}

// The step's predicted peak above the base (the bytes alive when forward() is called, the stages' input
// among them).
int64_t step_peak_over_base(const Chain& step, const Plan& plan, int64_t input_bytes) {
  return simulate(step, step_plan(plan)).peak_bytes - input_bytes;
}

}  // namespace

PlannedImpl::PlannedImpl(std::vector<StageFn> stages, PlannedOptions options)
    : stages_(std::move(stages)), options_(std::move(options)) {
  TORCH_CHECK(!stages_.empty(), kWho, ": no stages");
  TORCH_CHECK(options_.budget() > 0, kWho, ": the budget must be a positive number of bytes, got ",
              options_.budget());
  TORCH_CHECK(options_.profile_repeats() >= 1, kWho, ": profile_repeats must be >= 1, got ",
              options_.profile_repeats());
}

torch::Tensor PlannedImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.defined(), kWho, ": the input is an undefined tensor");
  if (!is_training() || !at::GradMode::is_enabled()) {
    torch::Tensor h = x;
    for (const StageFn& s : stages_)
      h = s.fn(h);
    return h;
  }
  TORCH_CHECK(x.device().is_cpu(), kWho, ": only CPU inputs for now, got one on ", x.device());
  Shape& shape = shapes_[x.sizes().vec()];
  last_ = &shape;
  if (!shape.plan && shape.chain && *shape.rest) make_plan(shape, static_cast<int64_t>(x.nbytes()));
  if (!shape.plan) {
    ++shape.steps_before_plan;
    return profiling_step(shape, x);
  }
  // The plan, and the step's peak above the base measured up to the backward pass through the stages.
  const int64_t outer_peak = memory::peak_bytes();
  const int64_t base = memory::active_bytes();
  memory::reset_peak();
  torch::Tensor out = run_plan(stages_, *shape.plan, x);
  if (x.requires_grad() && x.grad_fn()) {  // a hook on a leaf would stay for the steps after
    std::shared_ptr<int64_t> last = shape.last_peak;
    // The hook's tensor is x itself: it fires when the gradient of the stages' input is ready, after the
    // stages' backward pass.
    x.register_hook([last, base, outer_peak](const torch::Tensor& g) {
      *last = memory::peak_bytes() - base;
      detail::cpu_meter_raise_peak(outer_peak);
      return g;
    });
  } else {
    detail::cpu_meter_raise_peak(outer_peak);
  }
  return out;
}

torch::Tensor PlannedImpl::profiling_step(Shape& shape, const torch::Tensor& x) {
  const int64_t outer_peak = memory::peak_bytes();

  if (!shape.chain) {
    // The profiler puts gradients, buffers and the generators back, so the step below is the plain run's.
    shape.chain = profile_chain(
        stages_, x,
        ProfileOptions().warmup(0).repeats(options_.profile_repeats()).policies(options_.policies()));
  }
  // Every stage checkpointed (the profiler's own memory bound), and the rest of the step measured from the
  // return to the moment the backward pass reaches the stages' output.
  torch::Tensor out = run_plan(stages_, checkpoint_all(*shape.chain), x);
  detail::cpu_meter_raise_peak(outer_peak);
  if (!out.requires_grad()) return out;
  const int64_t peak_so_far = memory::peak_bytes();
  const int64_t at_return = memory::active_bytes();
  memory::reset_peak();
  const auto t0 = Clock::now();
  std::shared_ptr<std::optional<RestOfStep>> measured = shape.rest;
  out.register_hook([measured, at_return, peak_so_far, t0](const torch::Tensor& g) {
    RestOfStep rest;
    rest.peak_bytes = std::max<int64_t>(0, memory::peak_bytes() - at_return);
    rest.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    *measured = rest;
    detail::cpu_meter_raise_peak(peak_so_far);
    return g;
  });
  return out;
}

void PlannedImpl::make_plan(Shape& shape, int64_t input_bytes) {
  // Parameter gradients the backward pass will allocate (zero_grad setting them to none), seen at the step
  // that plans (the profiling step may be the first, before any gradient exists): charged as alive from the
  // stages' backward pass on, an upper bound (they come one stage at a time).
  shape.grads_to_come = 0;
  for (const StageFn& s : stages_) {
    if (!s.module) continue;
    for (const auto& p : s.module->parameters())
      if (p.requires_grad() && !p.grad().defined()) shape.grads_to_come += static_cast<int64_t>(p.nbytes());
  }
  const Chain step = step_chain(*shape.chain, **shape.rest);
  // optimal() bounds the stages' own peak; the rest of the step comes on top of part of it, so the stages'
  // budget is lowered by what the whole step's prediction exceeds until it fits.
  int64_t chain_budget = options_.budget() + input_bytes;
  const int64_t floor = min_feasible_budget(*shape.chain, options_.planner());
  for (int attempt = 0; attempt < 64; ++attempt) {
    if (chain_budget < floor) break;
    Plan plan = optimal(*shape.chain, chain_budget, options_.planner());
    const int64_t predicted = step_peak_over_base(step, plan, input_bytes) + shape.grads_to_come;
    if (predicted <= options_.budget()) {
      shape.plan = std::move(plan);
      shape.predicted = predicted;
      return;
    }
    chain_budget -= std::max<int64_t>(predicted - options_.budget(), 1);
  }
  const Plan least = optimal(*shape.chain, floor, options_.planner());
  TORCH_CHECK(false, kWho, ": the budget of ", options_.budget(), " bytes is below the least feasible one, ",
              step_peak_over_base(step, least, input_bytes) + shape.grads_to_come,
              " bytes (the step's peak above the bytes alive when forward() is called, with the rest of the "
              "step measured at ",
              (*shape.rest)->peak_bytes, " bytes)");
}

bool PlannedImpl::is_planned() const {
  return last_ && last_->plan.has_value();
}
const Plan* PlannedImpl::plan() const {
  return last_ && last_->plan ? &*last_->plan : nullptr;
}
const Chain* PlannedImpl::chain() const {
  return last_ && last_->chain ? &*last_->chain : nullptr;
}
int64_t PlannedImpl::predicted_peak_bytes() const {
  return last_ ? last_->predicted : -1;
}
int64_t PlannedImpl::last_peak_bytes() const {
  return last_ ? *last_->last_peak : -1;
}
int64_t PlannedImpl::profiling_steps() const {
  return last_ ? last_->steps_before_plan : 0;
}

}  // namespace remat
