#pragma once
/// \file
/// The plan executor (executor.cpp): runs a Plan (remat/planner/plan.h) over a chain of stages, as run_plan
/// or as a module (CheckpointedSequential).
///
///   remat::Chain chain = remat::profile_chain(seq, x);                 // measure
///   remat::CheckpointedSequential model(seq, remat::optimal(chain, 64 << 20));  // plan
///   model->forward(x).sum().backward();                                // execute
///   model->replan(chain, 32 << 20);                                    // a new budget: one call
///
/// The executor is one custom autograd Function over the whole chain: its forward runs the operations of the
/// plan up to the loss, its backward replays the rest (recomputations, then each stage's backward with a
/// nested autograd call). Each stage replays the RNG state of its first run (dropout masks match), and module
/// buffers are restored after every later run (BatchNorm is updated once). Every stage runs with autocast's
/// cache off (outside NoGradGuard: under it the stages run as they are), so that none leaves its weights'
/// casts there until the caller's autocast region ends (the values are the same; a weight used twice in one
/// run is cast twice). It works under backward() and torch::autograd::grad, with retain_graph.

#include <remat/checkpoint.h>
#include <remat/offload.h>
#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace remat {

/// One stage the executor runs: a tensor-to-tensor function, and the module that owns its parameters and
/// buffers (null when it has none). The module is what the executor returns gradients for under
/// torch::autograd::grad; parameters the function uses without a module are still trained under backward()
/// (accumulated into .grad), and under torch::autograd::grad asking for one warns once, since the executor
/// cannot return it. Buffers are updated once either way (a recompute writes back what it updated in place).
struct StageFn {
  std::string name;
  TensorFn fn;
  std::shared_ptr<torch::nn::Module> module;
};

/// How many times each stage's forward ran, counted by the executor, and what it held for its later runs.
struct ExecutionStats {
  std::vector<int64_t> forward_calls;
  /// Per stage (bytes): the copies its first run kept of the tensors it read and wrote in place (an EMA
  /// buffer: docs/checkpointing.md), held to its last run; 0 for a stage that runs once or keeps none (an Fk
  /// stage's checkpoint keeps its own for its recompute, not counted here).
  std::vector<int64_t> forward_write_bytes;
};

/// Runs `plan` over `stages` on `input` and returns the chain's output; its backward runs the rest of the
/// plan. Under NoGradGuard it simply runs the stages in order. options.preserve_rng_state and
/// options.determinism_check apply per stage. Fk runs its stage under remat::checkpoint keeping the calls of
/// Plan::keep's tags, Fk[name] under the policy named so: options.policy when it has that name, else remat's
/// preset of that name (remat/policy.h). The executor is one autograd node of its own and takes each
/// stage's module from StageFn::module: options.mode must stay kNonReentrant (the default) and
/// options.modules empty, or it throws rather than ignore them. When `stats` is given, the forward calls per
/// stage are counted into it (reset first), including those of the backward pass. Throws c10::Error naming
/// remat::run_plan when the plan's stage count differs from stages.size(), the plan is invalid
/// (remat::check_plan), it keeps with a policy that is neither options.policy nor a preset, the input is
/// undefined, the options ask for kReentrant or list modules, or a stage returns an undefined tensor.
/// Fa<i>@host (the per-layer planner's offloading) runs stage i under a remat::Offload made with `offload`
/// (its min_bytes and pool; the stage's module's parameters and buffers kept on the device): what the stage
/// saves goes to host memory, its copies are waited for and brought back at the points of the plan's offload
/// schedule (remat::offload_schedule: once the next forward has run; when the backward pass reaches stage
/// i + 1). Fk<i>@host and Fk<i>[name]@host send what the stage's checkpoint keeps that way, Fc<i>@host the
/// input held for its recompute. Fk<i>{khr} (a group assignment) runs the stage as a checkpoint under
/// remat::group_policy over plan.group_names[i]: its 'k' groups kept on the device, its 'h' groups sent to
/// the host as @host sends, the rest recomputed. Fa<i>@stream runs the stage under an Offload with
/// OffloadOptions::window(plan.stream_windows[i]). Throws c10::Error naming remat::run_plan for a group
/// assignment whose groups the plan does not name, and for a streamed stage whose window it does not give
/// (a plan parsed from text).
torch::Tensor run_plan(const std::vector<StageFn>& stages, const Plan& plan, const torch::Tensor& input,
                       const CheckpointOptions& options = {}, std::shared_ptr<ExecutionStats> stats = nullptr,
                       const OffloadOptions& offload = {});

/// A Sequential that trains according to a Plan.
class CheckpointedSequentialImpl : public torch::nn::Module {
 public:
  /// Wraps `seq` (registered as the submodule "seq", shared with the caller). Throws c10::Error when the
  /// plan's stage count differs from seq's module count, the plan is invalid, or the options ask for what
  /// the executor cannot honour (see run_plan).
  CheckpointedSequentialImpl(torch::nn::Sequential seq, Plan plan, CheckpointOptions options = {});
  /// Runs the plan (see run_plan).
  torch::Tensor forward(const torch::Tensor& input);
  /// Replaces the plan. Throws as the constructor.
  void set_plan(Plan plan);
  /// Re-plans with optimal() for a new budget (bytes). Throws what optimal() throws.
  void replan(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options = {});
  const Plan& plan() const { return plan_; }
  torch::nn::Sequential& sequential() { return seq_; }
  /// Forward calls per stage of the last step (its backward pass included).
  const std::vector<int64_t>& forward_calls() const { return stats_->forward_calls; }

 private:
  torch::nn::Sequential seq_;
  Plan plan_;
  CheckpointOptions options_;
  std::shared_ptr<ExecutionStats> stats_ = std::make_shared<ExecutionStats>();
};
TORCH_MODULE(CheckpointedSequential);

}  // namespace remat
