#pragma once
/// \file
/// Operator-level policies for selective checkpointing, with no edit to a model's forward: the C++
/// counterpart of PyTorch's create_selective_checkpoint_contexts policy functions. A policy is asked, for
/// each operator call inside a kNonReentrant checkpoint, whether the call's outputs are kept from the forward
/// pass (true) or recomputed (false); or, in PyTorch's words (CheckpointPolicy), kept on the device, sent to
/// the host, or recomputed.
///
///   auto y = remat::checkpoint(block, x, remat::CheckpointOptions().policy(remat::policy::matmuls()));
///   remat::Policy mine([](const std::string& op) { return op == "aten::addmm"; });   // by name
///   remat::Policy shapes("wide", [](const remat::OpCall& c) { return c.outputs[0].numel() > 1 << 20; });
///
/// Which calls are asked. remat sees operators as they reach LibTorch's dispatcher, before autograd, through
/// a dispatcher fallback active on the checkpointing thread only. A composite operator reaches it first
/// (aten::linear, aten::matmul, aten::conv2d), then, when the policy does not keep it, each operator it calls
/// (aten::addmm, aten::bmm, aten::convolution), and so on down: the outermost call the policy keeps is kept
/// whole, and nothing inside a kept call is asked. A call is only asked when it can be kept: every output is
/// a tensor that aliases no input (views and in-place or out= operators are never kept: keeping a view would
/// keep its base), and no argument is written. The name is the operator's qualified name as the dispatcher
/// gives it ("aten::addmm"), without the overload.
///
/// What a kept call costs and gives. Its outputs stay alive from the forward pass to the region's recompute,
/// which hands them back instead of running the call; what autograd saved inside the call is rebuilt as views
/// of its inputs and outputs where it is one (a linear layer's input, a transposed weight) and kept
/// otherwise, as remat::keep does. A kept call that draws random numbers (dropout, attention with dropout)
/// keeps the numbers it drew, and the recompute moves the generators on as the call did, so every later draw
/// is the plain run's. A kept output that a later operator of the forward pass writes in place (an in-place
/// ReLU) cannot be handed back: the call is recomputed instead, with a warning naming the policy and both
/// operators.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace remat {

/// One operator call a policy is asked about, after it ran in the forward pass.
struct OpCall {
  /// The operator's qualified name, as the dispatcher gives it: "aten::addmm".
  const std::string& name;
  /// The overload name ("" for the default, "Tensor", "out"...).
  const std::string& overload;
  /// The tensors among its arguments, in order (tensors in a list argument one by one).
  const std::vector<at::Tensor>& inputs;
  /// The tensors it returned.
  const std::vector<at::Tensor>& outputs;
  /// Which call it is: the name, '#', and how many asked calls of that operator the region's forward pass
  /// made before it ("aten::addmm#2"), counted in the order the calls start, whatever the policy answered
  /// (a call inside a kept one is still asked, and counted). A chain's saved groups are named so
  /// (remat::SavedGroup::name), and group_policy() answers by it.
  const std::string& call;
};

/// What a policy answers for a call, in PyTorch's words (torch.utils.checkpoint.CheckpointPolicy; the
/// Python package accepts those and means the same by them):
/// - kMustSave: the outputs are kept on the device, always.
/// - kPreferSave (a bool policy's true): kept on the device; but inside a remat::Offload scope (the plan's
///   `Fk[name]@host` runs the stage so) sent to the host with everything else the region saves.
/// - kMustCpuOffload, kPreferCpuOffload: sent to the host by the remat::Offload scope open around the
///   checkpoint (copied once the region's forward pass is done, brought back for the recompute); with no
///   such scope open, the forward pass throws c10::Error naming the policy and the operator.
/// - kMustRecompute, kPreferRecompute (a bool policy's false): recomputed.
/// The MUST and PREFER forms differ only as said: the Offload does not take a kMustSave output.
enum class CheckpointPolicy {
  kMustSave,
  kPreferSave,
  kMustRecompute,
  kPreferRecompute,
  kMustCpuOffload,
  kPreferCpuOffload
};

/// Whether the answer keeps the call's outputs from the forward pass (on the device or on the host).
inline bool keeps(CheckpointPolicy p) {
  return p != CheckpointPolicy::kMustRecompute && p != CheckpointPolicy::kPreferRecompute;
}
/// Whether the answer sends the call's outputs to the host.
inline bool to_host(CheckpointPolicy p) {
  return p == CheckpointPolicy::kMustCpuOffload || p == CheckpointPolicy::kPreferCpuOffload;
}
/// The answer's name as PyTorch spells it ("MUST_SAVE", "PREFER_CPU_OFFLOAD", ...).
const char* to_string(CheckpointPolicy p);

/// A selective-checkpointing policy: for each call, keep its outputs on the device, send them to the host, or
/// recompute the call (CheckpointPolicy); a bool policy's true is kPreferSave, false kPreferRecompute. Every
/// policy has a name, which chains and plans record (remat/planner/chain.h, remat/planner/plan.h) and the
/// plan executor resolves (the presets' names always resolve). Copies share the decision function. The
/// function must decide the same for the same call every time (the recompute relies on it), and is called on
/// the thread that runs the region, with remat's dispatcher fallback paused (it may look at tensors freely).
class Policy {
 public:
  /// No policy: nothing is kept (CheckpointOptions' default).
  Policy() = default;
  /// A policy from the operator's name alone (true: keep). Named "custom" unless named().
  template <typename F, std::enable_if_t<std::is_invocable_r_v<bool, F&, const std::string&> &&
                                             !std::is_invocable_r_v<bool, F&, const OpCall&>,
                                         int> = 0>
  Policy(F f)  // NOLINT(google-explicit-constructor): a lambda converts as PyTorch's policy functions do
      : Policy("custom",
               [f = std::move(f)](const OpCall& call) mutable { return static_cast<bool>(f(call.name)); }) {}
  /// A policy that sees the call's inputs and outputs too.
  Policy(std::string name, std::function<bool(const OpCall&)> decide);
  /// A policy with three outcomes (see CheckpointPolicy).
  Policy(std::string name, std::function<CheckpointPolicy(const OpCall&)> decide);

  /// The same decisions under another name. Throws c10::Error naming remat::Policy when `name` is empty or
  /// holds characters other than letters, digits, '_', '-' and '.'.
  Policy named(std::string name) const;
  /// Its name ("" for no policy).
  const std::string& name() const { return name_; }
  /// Whether this is no policy.
  bool empty() const { return !decide_; }
  /// Asks the policy. Throws c10::Error naming remat::Policy when it is empty, or when the function answers
  /// a value that is no CheckpointPolicy.
  CheckpointPolicy decide(const OpCall& call) const;
  /// Whether it keeps the call's outputs (on the device or the host): remat::keeps(decide(call)).
  bool keeps(const OpCall& call) const;

 private:
  std::string name_;
  std::shared_ptr<std::function<CheckpointPolicy(const OpCall&)>> decide_;
};

/// The policy of a group assignment (a plan's `Fk3{khr}`, see remat::group_cost): the call named
/// `names[g]` (OpCall::call, as the profiler names a stage's saved groups, remat::SavedGroup::name) is kept
/// on the device for 'k' (kMustSave), sent to the host for 'h' (kMustCpuOffload: run it inside a
/// remat::Offload, as the plan executor does) or recomputed for 'r' (kPreferRecompute); every other call is
/// recomputed. Named "groups.<assignment>" ("groups.khr"). Throws c10::Error naming remat::group_policy when
/// `assignment` is not one of 'k', 'h' or 'r' per name, or names repeat.
Policy group_policy(const std::vector<std::string>& names, const std::string& assignment);

/// The presets: policies that need no tagging of the model, right at the level their calls are asked in
/// both LibTorch versions remat supports (see the top of this file).
namespace policy {

/// Keeps the matrix multiplications and convolutions (PyTorch's selective checkpointing with a policy that
/// saves mm, addmm and bmm): aten::linear (kept whole, so a bias added in place stays inside the call),
/// aten::mm, aten::addmm, aten::bmm, aten::baddbmm, aten::addbmm, aten::addmv, aten::mv, aten::dot and
/// aten::convolution (which aten::conv1d/2d/3d reach). Not aten::matmul: it copies transposed operands
/// before its bmm, and keeping it would keep the copies; its bmm is kept instead and the copies recomputed.
/// Named "matmuls".
Policy matmuls();

/// Megatron's selective recomputation: keeps everything but the attention core (scores, mask, softmax,
/// dropout, context), which is recomputed. A call is in the core when one of its tensor inputs or outputs
/// is a [batch, heads, query, key]-shaped score: four or more dimensions with the last two equal and above
/// one, or three for aten::bmm and aten::baddbmm (aten::matmul multiplies four-dimensional scores as
/// [batch * heads, query, key]); fused attention (aten::scaled_dot_product_attention and the kernels it
/// calls) is always in it. Limits: other operators on three-dimensional [batch * heads, query, key] scores
/// are not recognised, and a [batch, heads, query, head_dim] tensor whose query length equals its head
/// size is taken for a score (recomputed: slower, never wrong). Named "attention_core".
Policy attention_core();

/// Keeps everything but cheap pointwise operators (arithmetic, activations, comparisons, casts, dropout),
/// which are recomputed: the choice torch.compile's partitioner makes for its memory budget. Pointwise is
/// LibTorch 2.x's `pointwise` operator tag; LibTorch 1.13 has no such tag, and remat uses the list of the
/// 2.x operators that carry it and exist in 1.13, so both versions decide alike. Named
/// "recompute_pointwise".
Policy recompute_pointwise();

/// The presets' names, comma-separated, as errors and help texts list them.
inline constexpr char kPresetNames[] = "matmuls, attention_core, recompute_pointwise";

/// Whether `name` is a preset's name.
bool is_preset(const std::string& name);

/// The preset of that name ("matmuls", "attention_core", "recompute_pointwise"). Throws c10::Error naming
/// remat::policy::preset and the presets when there is none.
Policy preset(const std::string& name);

}  // namespace policy
}  // namespace remat
