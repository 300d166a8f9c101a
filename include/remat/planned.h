#pragma once
/// \file
/// Planning in place: remat::Planned takes the place of the loop over a model's blocks. In its first training
/// step it profiles its stages where they sit, on their real input, and measures what the rest of the step
/// (everything after it, the loss, and the backward pass down to its output) holds; from the next step on it
/// runs the plan optimal() finds for the budget.
///
///   // in the model: remat::Planned planned{nullptr};  in its constructor, after the blocks:
///   planned = register_module("planned", remat::Planned(remat::stages_at<BlockImpl>(*this, {"h"}),
///                                                       remat::PlannedOptions().budget(300 << 20)));
///   // in its forward, where the loop over the blocks was:
///   x = planned->forward(x);
///
/// The budget bounds the training step's peak, as remat's meter reads it, above the bytes alive when
/// planned->forward is called: what ran before it (the embeddings and what they saved, the parameters, the
/// gradients, the optimizer's state) is the base, not part of the budget. Planned registers no parameters.
///
/// Every step gives the plain run's loss and gradients and leaves the generators where the plain run does,
/// the profiling step included: the profiler puts the gradients, the buffers and the generators back as they
/// were, and that step runs every stage under remat::checkpoint.
///
/// Limits of this version (issue 22 is open): CPU only; stages take and return one tensor (no per-step extra
/// arguments such as an attention mask); a new input shape is profiled again (shapes seen before keep their
/// plan); one forward per step (the base is taken at each call); the meter's peak is reset and raised back
/// around Planned's own measurements; under DataParallel each rank plans for itself.

#include <remat/chain.h>
#include <remat/checkpoint.h>
#include <remat/plan.h>
#include <remat/planner.h>
#include <remat/policy.h>
#include <remat/sequential.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <map>
#include <memory>
#include <optional>
#include <vector>

namespace remat {

struct PlannedOptions {
  /// The step's peak above the bytes alive when forward() is called (bytes, > 0).
  TORCH_ARG(int64_t, budget) = 0;
  /// Operator-level policies profiled as Fk[name], so that the plan may keep a stage's matrix
  /// multiplications (remat/policy.h).
  TORCH_ARG(std::vector<Policy>, policies) = {};
  /// Timed runs per stage in the profile (>= 1); one costs about three plain steps of the stages.
  TORCH_ARG(int64_t, profile_repeats) = 1;
  /// What the planner may use (e.g. exclude Fk).
  TORCH_ARG(PlannerOptions, planner) = {};
};

/// What Planned measured of the rest of the step in its profiling step.
struct RestOfStep {
  int64_t peak_bytes = 0;  ///< the peak between forward()'s return and the backward pass reaching its output,
                           ///< above what was alive at the return (bytes)
  double ms = 0;           ///< the time between the two (milliseconds)
};

class PlannedImpl : public torch::nn::Module {
 public:
  /// Throws c10::Error naming remat::Planned when `stages` is empty or the budget is not positive.
  PlannedImpl(std::vector<StageFn> stages, PlannedOptions options);

  /// Runs the stages on x: plainly in eval mode or under NoGradGuard; in training, the plan for x's shape,
  /// or, for a shape without one, a profiling step (then planned at the next call). Throws c10::Error
  /// naming remat::Planned for an undefined or non-CPU input, and, at planning time, when the budget is
  /// below the least feasible one (named in the message; the step that measured it trained correctly).
  torch::Tensor forward(const torch::Tensor& x);

  /// Whether a plan is in force for the shape of the last input.
  bool is_planned() const;
  /// The plan in force for the last input's shape, or nullptr.
  const Plan* plan() const;
  /// The profile of the stages for the last input's shape, or nullptr.
  const Chain* chain() const;
  /// The predicted step peak above the base for the plan in force (bytes), or -1.
  int64_t predicted_peak_bytes() const;
  /// The measured step peak above the base of the last planned step, up to the end of the backward pass
  /// through the stages (bytes), or -1 (measured when the input is the output of an autograd node, as an
  /// embedding's is).
  int64_t last_peak_bytes() const;
  /// Training steps run before the plan for the last shape came into force.
  int64_t profiling_steps() const;

 private:
  struct Shape {
    std::optional<Chain> chain;
    // Written by a gradient hook, which may outlive this module: shared with it.
    std::shared_ptr<std::optional<RestOfStep>> rest = std::make_shared<std::optional<RestOfStep>>();
    std::optional<Plan> plan;
    int64_t predicted = -1;
    int64_t grads_to_come = 0;
    int64_t steps_before_plan = 0;
    std::shared_ptr<int64_t> last_peak = std::make_shared<int64_t>(-1);
  };
  torch::Tensor profiling_step(Shape& shape, const torch::Tensor& x);
  void make_plan(Shape& shape, int64_t input_bytes);

  std::vector<StageFn> stages_;
  PlannedOptions options_;
  std::map<std::vector<int64_t>, Shape> shapes_;
  const Shape* last_ = nullptr;
};
TORCH_MODULE(Planned);

}  // namespace remat
