#pragma once
/// \file
/// Running a Plan (remat/plan.h) over a chain of stages, and checkpoint_sequential, which is that executor
/// with the uniform plan.
///
///   auto y = remat::checkpoint_sequential(seq, 4, x);                  // like torch.utils.checkpoint
///
///   remat::Chain chain = remat::profile_chain(seq, x);                 // measure
///   remat::CheckpointedSequential model(seq, remat::optimal(chain, 64 << 20));  // plan
///   model->forward(x).sum().backward();                                // execute
///   model->replan(chain, 32 << 20);                                    // a new budget: one call
///
/// The executor is one custom autograd Function over the whole chain: its forward runs the operations of the
/// plan up to the loss, its backward replays the rest (recomputations, then each stage's backward with a
/// nested autograd call). Each stage replays the RNG state of its first run (dropout masks match), and module
/// buffers are restored after every later run (BatchNorm is updated once). It works under backward() and
/// torch::autograd::grad, with retain_graph.

#include <c10/util/Type.h>
#include <remat/chain.h>
#include <remat/checkpoint.h>
#include <remat/offload.h>
#include <remat/plan.h>
#include <remat/planner.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace remat {

/// How finely a model offers itself as a chain of stages: whole layers (blocks), or the pieces of a layer
/// (for a transformer: attention core, projections, feed-forward halves), which let a plan recompute some
/// pieces of a layer and keep others.
enum class Granularity { kLayer, kSublayer };

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

/// The modules of a Sequential as stages (named by their position and type, e.g. "3:Linear"). The stages
/// share the modules. Throws c10::Error naming the function when the Sequential is empty.
std::vector<StageFn> stages_of(torch::nn::Sequential& seq);

/// The stages of a chain whose modules live in several containers of one model, found by path from `root`
/// (dotted, as root.named_modules() names them: "layer1", "encoder.layer", "layer2.0"): a path to a
/// Sequential contributes each of its modules as a stage, in order; a path to an element of a Sequential
/// ("layer1.0") contributes that module. The stages share the modules: nothing is registered, copied or
/// re-parented, so root.parameters() (what the optimizer sees) lists every parameter once. Stage names are
/// "<path>.<index>:<Type>" ("layer1.0:BasicBlock"). Use them with run_plan, profile_chain,
/// checkpoint_sequential and checkpoint_segments. A ModuleList's elements need their type (stages_at<Impl>).
///
///   auto stages = remat::stages_at(*resnet, {"layer1", "layer2", "layer3"});
///   auto h = resnet->stem(x);
///   h = remat::checkpoint_sequential(stages, 3, h);
///
/// Throws c10::Error naming remat::stages_at and the path when paths is empty, a path names no submodule
/// (the message lists root's children), names a ModuleList (use stages_at<ElementImpl>), or names a module
/// that is neither a container nor an element of one (make a StageFn for it).
std::vector<StageFn> stages_at(torch::nn::Module& root, const std::vector<std::string>& paths);

namespace detail {
template <typename Impl, typename = void>
struct forwards_one_tensor : std::false_type {};
template <typename Impl>
struct forwards_one_tensor<
    Impl, std::void_t<decltype(std::declval<Impl&>().forward(std::declval<const torch::Tensor&>()))>>
    : std::is_same<decltype(std::declval<Impl&>().forward(std::declval<const torch::Tensor&>())),
                   torch::Tensor> {};

/// The stage of one container element, or nullopt when it is not of the type asked (for stages_at<Impl>).
using ElementStage = std::function<std::optional<StageFn>(const std::shared_ptr<torch::nn::Module>& element,
                                                          const std::string& name)>;
std::vector<StageFn> stages_at(torch::nn::Module& root, const std::vector<std::string>& paths,
                               const ElementStage& typed, const std::string& type);
}  // namespace detail

/// The stages at `paths` (as stages_at above), each element called as an `Impl` (the module type, BlockImpl
/// for a TORCH_MODULE(Block)): what a torch::nn::ModuleList holds, or a Sequential. Its forward must take one
/// tensor and return one.
///
///   auto blocks = remat::stages_at<BlockImpl>(*gpt, {"h"});       // gpt->h is a ModuleList of Blocks
///   auto x = remat::checkpoint_sequential(blocks, 3, gpt->embed(ids));
///
/// Throws c10::Error as stages_at does, and naming the element and its type when an element is not an Impl.
template <typename Impl>
std::vector<StageFn> stages_at(torch::nn::Module& root, const std::vector<std::string>& paths) {
  static_assert(std::is_base_of_v<torch::nn::Module, Impl>,
                "remat::stages_at<Impl>: Impl is the module's type (BlockImpl for a TORCH_MODULE(Block))");
  static_assert(
      detail::forwards_one_tensor<Impl>::value,
      "remat::stages_at<Impl>: Impl::forward must take one tensor and return one (make StageFns for other "
      "modules)");
  return detail::stages_at(
      root, paths,
      [](const std::shared_ptr<torch::nn::Module>& element,
         const std::string& name) -> std::optional<StageFn> {
        auto typed = std::dynamic_pointer_cast<Impl>(element);
        if (!typed) return std::nullopt;
        return StageFn{name, [typed](const torch::Tensor& x) { return typed->forward(x); }, element};
      },
      c10::demangle_type<Impl>());
}

/// How many times each stage's forward ran, counted by the executor.
struct ExecutionStats {
  std::vector<int64_t> forward_calls;
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

/// Options of checkpoint_sequential.
struct SequentialOptions {
  /// The options of every checkpointed segment: each runs as one remat::checkpoint region in options.mode
  /// (kNonReentrant or kReentrant, as use_reentrant in PyTorch's checkpoint_sequential), with its modules
  /// added to options.modules (buffers restored after the recompute; in kReentrant, parameters trained).
  TORCH_ARG(CheckpointOptions, checkpoint) = {};
  /// PyTorch leaves the last segment un-checkpointed: its activations are needed first in the backward pass,
  /// so keeping them costs no extra peak and saves its recompute. Set true to checkpoint it too.
  TORCH_ARG(bool, checkpoint_last_segment) = false;
};

/// Splits seq's modules into `segments` contiguous runs whose lengths differ by at most one (the longer runs
/// first) and checkpoints each run but the last (unless asked), like torch.utils.checkpoint.
/// checkpoint_sequential. PyTorch instead makes every run n / segments long and puts the whole remainder in
/// the last run, which balances memory worse (10 modules in 4 segments: 2, 2, 2, 4 there; 3, 3, 2, 2 here).
/// Each checkpointed segment is a remat::checkpoint region in the mode of options.checkpoint (see
/// SequentialOptions); a segment in which nothing can receive a gradient (input and parameters without
/// requires_grad) records no graph and simply runs. For the plan executor over the same split, use
/// run_plan(stages_of(seq), uniform(chain, segments)). Throws c10::Error naming the value given and the
/// module count, before any module runs, when seq is empty or segments < 1 or > the module count.
torch::Tensor checkpoint_sequential(torch::nn::Sequential& seq, int64_t segments, const torch::Tensor& input,
                                    const SequentialOptions& options = {});

/// checkpoint_sequential over any stages (stages_at, stages_of, or your own): the same count-balanced split;
/// each checkpointed segment declares its stages' modules. Throws as the Sequential version, naming the
/// stage count.
torch::Tensor checkpoint_sequential(const std::vector<StageFn>& stages, int64_t segments,
                                    const torch::Tensor& input, const SequentialOptions& options = {});

/// Any segmentation: segments start at `starts` (starts[0] == 0, strictly increasing, < module count).
/// For a split balanced by profiled memory or time, pass remat::balanced_starts(chain, segments, by)
/// (remat/planner.h). Throws c10::Error naming the bad start, before any module runs.
torch::Tensor checkpoint_segments(torch::nn::Sequential& seq, const std::vector<int64_t>& starts,
                                  const torch::Tensor& input, const SequentialOptions& options = {});

/// checkpoint_segments over any stages. Throws as the Sequential version, naming the stage count.
torch::Tensor checkpoint_segments(const std::vector<StageFn>& stages, const std::vector<int64_t>& starts,
                                  const torch::Tensor& input, const SequentialOptions& options = {});

}  // namespace remat
