#pragma once
/// \file
/// A model's containers as chains of stages (stages_of, stages_at), and checkpoint_sequential and
/// checkpoint_segments, each checkpointed segment one remat::checkpoint region (sequential.cpp). Running any
/// Plan over the stages is the plan executor's (remat/executor.h, included here):
///
///   auto y = remat::checkpoint_sequential(seq, 4, x);                  // like torch.utils.checkpoint
///   auto stages = remat::stages_of(seq);                               // for profile_chain and run_plan

#include <c10/util/Type.h>
#include <remat/checkpoint.h>
#include <remat/executor.h>
#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>
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
/// (remat/planner/planner.h). Throws c10::Error naming the bad start, before any module runs.
torch::Tensor checkpoint_segments(torch::nn::Sequential& seq, const std::vector<int64_t>& starts,
                                  const torch::Tensor& input, const SequentialOptions& options = {});

/// checkpoint_segments over any stages. Throws as the Sequential version, naming the stage count.
torch::Tensor checkpoint_segments(const std::vector<StageFn>& stages, const std::vector<int64_t>& starts,
                                  const torch::Tensor& input, const SequentialOptions& options = {});

}  // namespace remat
