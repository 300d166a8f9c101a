#pragma once
/// \file
/// A chain of stages as plain numbers: what each stage costs in time and memory. Planners read it; the
/// profiler (remat/profile.h) measures it from a real model. No torch headers.
///
///   remat::Chain chain = remat::load_chain("bert.json");     // the format of docs/chain-format.md
///   remat::validate(chain);                                  // throws std::invalid_argument naming the
///   stage
///
/// The memory model (the paper's, Beaumont et al. 2019): stage i reads a_i and produces a_{i+1}; a_0 is the
/// chain's input (input_bytes), a_{i+1} has stage i's output_bytes, abar_{i+1} (stage i's saved_bytes) is
/// a_{i+1} plus what stage i's autograd graph keeps, and the gradient d_i has the size of a_i. See
/// remat/planner/plan.h for how a schedule is charged.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace remat {

/// What offloading a stage run one way moves to host memory (the stage's "@host" operations in a plan; see
/// remat/planner/plan.h): measured by the profiler under the offloading hooks, for one way of running the
/// stage (Fa, Fk, Fk[name] or Fc).
struct OffloadCost {
  /// The bytes its saved tensors free on the device once copied to the host, besides its input and output
  /// (>= 0; at most what that way keeps beyond the output; 0 for Fc, which keeps only its input).
  int64_t bytes = 0;
  /// Whether its input is among the tensors it saves (Fc's always is): offloaded, it goes to the host too,
  /// and leaves the device unless the stage before keeps it there.
  bool input = false;
  /// Whether its output is among the tensors it saves: copied to the host too, though the next stage still
  /// reads it on the device; and run without offloading, the stage holds its output on the device.
  bool output = false;
  /// Streaming (Stage::offload only; a plan's `Fa3@stream`): the same tensors sent to the host each as the
  /// forward pass makes it, at most window_bytes in flight, and brought back each just ahead of its use in
  /// the backward pass, at most window_bytes ahead; so the stage's backward holds its working set, not all it
  /// saved. The forward's peak above the bytes alive before it (its input held), each copy waited for at once
  /// (bytes; -1: not measured, the stage cannot be streamed).
  int64_t stream_fwd_bytes = -1;
  /// The backward's peak above the bytes alive before it (its output's gradient, what it kept on the device,
  /// its input held), each tensor brought back where it is used, none ahead (bytes; -1: not measured). Its
  /// input, held through it, is found on the device there, not brought back: where it left the device with
  /// the stage (`input`, nothing else holding it), stream_bwd_input_bytes says how much higher that peak is.
  int64_t stream_bwd_bytes = -1;
  /// The most bytes the runtime holds in flight each way beside those peaks (copies to the host not yet
  /// landed; tensors brought back ahead of their use), at least the largest tensor it sends (bytes, >= 0).
  int64_t window_bytes = 0;
  /// Streaming: the backward's peak (stream_bwd_bytes) had it made the stage's parameter gradients (none
  /// before it, as in a training step after zero_grad(set_to_none)), those made by then counted (bytes; -1:
  /// not measured, and all of its gradients are charged at that peak). A backward's peak comes before the
  /// last of its gradients is made, so this is at most stream_bwd_bytes plus all of them
  /// (Stage::grads_charge_bytes() reads the two).
  int64_t stream_bwd_grads_bytes = -1;
  /// Streaming with window_bytes: what the runtime brings back ahead of the stage's backward, and the most
  /// that stays in flight past its forward (bytes; -1: not measured, window_bytes charged for both). The
  /// runtimes bring back the last tensors sent, newest first, while they fit in the window, so this is the
  /// longest run of the stage's last-sent tensors within window_bytes (0 <= ahead_bytes <= window_bytes);
  /// the profilers measure it (Offload's ahead_bytes()).
  int64_t ahead_bytes = -1;
  /// Whether its copies to the host start only once its forward has run, all its saved tensors at once (a
  /// layer compiled on its own, whose graph saves them at its end: the Python runtime's offloading around
  /// the graph), rather than as its forward makes each: simulate() and the per-layer planner then hide them
  /// behind the next stage's forward alone, not its own. It cannot stream (validate() refuses both). Last
  /// of the fields, so that aggregate initializers written before it mean what they did.
  bool after_forward = false;
  /// Streaming, where the stage sends its input (`input`): how much higher its backward's peaks
  /// (stream_bwd_bytes, stream_bwd_grads_bytes; the larger difference) are where that input comes back from
  /// the host, having left the device with the stage, than where it is found there (bytes, from 0 to the
  /// input's; -1: not measured, the input's bytes charged). The Python profiler measures it (a second
  /// streamed run, its input let go of after the forward); C++'s executor holds a stage's input, which never
  /// leaves (`input` false), so it is unread there. Before (found 2026-12-07), the input was taken as among
  /// stream_bwd_bytes, which the profilers measured with it found: DeepSeek-V4's least plan held 0.83% above
  /// its prediction, a hidden state in each streamed layer's backward.
  int64_t stream_bwd_input_bytes = -1;
  /// What the runtime holds in a streamed backward beyond stream_bwd_bytes where the stage's input, of
  /// `input_bytes`, left the device with it (its copy brought back; stream_bwd_input_bytes where measured,
  /// else `input_bytes`, at most that). simulate() and the per-layer planner charge it.
  int64_t input_back_bytes(int64_t input_bytes) const {
    return stream_bwd_input_bytes >= 0 && stream_bwd_input_bytes < input_bytes ? stream_bwd_input_bytes
                                                                               : input_bytes;
  }
  /// Whether the stream figures were measured.
  bool can_stream() const { return stream_fwd_bytes >= 0 && stream_bwd_bytes >= 0; }
  /// Streamed with a window of `window` bytes, of `leaving` bytes that leave the device: what stays in
  /// flight past its forward and comes back ahead of its backward (bytes): ahead_bytes for the chain's own
  /// window where measured, else the window; at most `leaving`. simulate() and the per-layer planner charge
  /// it.
  int64_t tail_bytes(int64_t window, int64_t leaving) const {
    const int64_t ahead = window == window_bytes && ahead_bytes >= 0 ? ahead_bytes : window;
    return ahead < leaving ? ahead : leaving;
  }
};

/// What a stage costs run as Fk under one operator-level policy (remat/policy.h; Fk[name] in a plan), as the
/// profiler measured it with ProfileOptions::policies.
struct PolicyCost {
  std::string policy;       ///< the policy's name ("matmuls")
  int64_t saved_bytes = 0;  ///< alive after the stage runs so (its output and the kept outputs; bytes)
  double fwd_ms = 0;        ///< its forward (milliseconds)
  double bwd_ms = 0;        ///< its recompute of the rest plus its backward (milliseconds)
  /// The transient peak during its backward, the recompute of what it does not keep included, above its
  /// input, what it keeps (saved_bytes), its output's gradient and its input's gradient (bytes, >= 0; the
  /// parameter gradients pre-allocated, as for Stage::bwd_tmp_bytes). Unset: what it recomputes
  /// (Stage::saved_bytes - saved_bytes) plus the stage's bwd_tmp_bytes (Stage::policy_bwd_bytes()).
  std::optional<int64_t> bwd_tmp_bytes;
  /// That peak when its backward makes the stage's parameter gradients, those made by then counted (bytes;
  /// as Stage::bwd_grads_tmp_bytes, measured in the same run). Unset: all of them charged at its peak.
  std::optional<int64_t> bwd_grads_tmp_bytes;
  /// Offloading it (Fk[name]@host); unset: it cannot be offloaded.
  std::optional<OffloadCost> offload;
  /// Whether what it keeps holds its output (a layer whose last call is one the policy keeps, a matmul for
  /// "matmuls"). saved_bytes counts the output either way. False, as the Python profiler measures it (its
  /// forward again, the output let go of with its graph held: was the output's storage freed?), tells the
  /// step's model (remat/planner/step.h) that where nothing else holds the output, it is gone by the stage's
  /// backward, as Stage::saves_output false says for Fa. Default true: charged as held (the C++ profiler
  /// leaves it so). Offloaded, the offload cost's `output` says the same. Last of the fields, so that
  /// aggregate initializers written before it mean what they did.
  bool saves_output = true;
  /// Stage::bwd_grad_held_bytes for this way: how much higher its backward peaks with the gradient it is
  /// handed held through it than with that gradient let go of once used, the larger of the two readings
  /// (the parameter gradients pre-allocated, and made by the backward) (bytes, 0..the stage's output_bytes).
  /// A layer ending in a Linear under the matmuls policy adds its bias's gradient (made after the peak the
  /// gradient let go of allows, before the one it held allows) where Fa adds none. Unset (the C++
  /// profiler, chains written before it): the stage's (Stage::bwd_grad_held()). Before (found 2026-12-05),
  /// the stage's for every way: such layers under `x = x + layer(x)`, the last one under the policy, held one
  /// bias gradient (256 bytes) above their predictions. Last of the fields, as saves_output.
  std::optional<int64_t> bwd_grad_held_bytes;
};

/// One group of a stage's saved tensors: the outputs of one operator call of its forward pass, which a group
/// assignment keeps on the device ('k'), sends to the host ('h') or recomputes ('r') (a plan's `Fk3{khr}`;
/// see group_cost() and docs/chain-format.md). The call's outputs need not be among what autograd saves: a
/// product whose output only feeds a pointwise call (which saves a mask, or nothing) is a group too, kept or
/// sent so that the recompute before the backward does not make it again. So a stage's groups may hold more
/// bytes than the stage saves.
struct SavedGroup {
  /// The call, for people and for the runtime that carries the assignment out: the operator's name, '#', and
  /// which of that operator's calls in the stage's forward pass it is, from 0 ("aten::addmm#2").
  std::string name;
  /// Its outputs' bytes: held on the device from the forward pass to the backward when kept, until their
  /// copy to the host lands and again from their return when sent (>= 0).
  int64_t bytes = 0;
  /// The call's forward time (milliseconds, >= 0): what the recompute before the stage's backward saves when
  /// the group is kept or sent rather than recomputed.
  double recompute_ms = 0;
  /// Of `bytes`, those autograd does not save in the stage's plain forward (Stage::saved_bytes does not count
  /// them; 0 to `bytes`): outputs held only because the group is kept or sent, from the forward pass (a plain
  /// forward frees them once used) until the recompute before the backward has used them. Last of the
  /// fields, so that aggregate initializers written before it mean what they did; 0 in chains written
  /// before 2026-12-04 (every group then was saved).
  int64_t unsaved_bytes = 0;
  /// Of `bytes`, those that stay on the device when the group is sent (0 to `bytes`): outputs an Offload
  /// keeps there (below its min_bytes, or not dense: an attention kernel's log-sum-exp beside its output, a
  /// layer norm's mean and reciprocal deviation). Sent, the group holds them from the forward pass to the
  /// backward as a kept one does, and only the rest leaves. Last of the fields; 0 in chains written before
  /// 2026-12-05 (profiled for offloading, a call with such an output was no group then).
  int64_t stays_bytes = 0;
  /// The stage's plain forward's peak above the bytes alive before it (its input held), from its start until
  /// this call began (bytes; -1: not measured). A group assignment's recompute holds, before this call, every
  /// group kept or sent from this one on beside what it has made again by then, where a plain forward has
  /// made none of them yet: simulate() and the per-layer program charge each such point where measured
  /// (group_recompute_peak_bytes()). Before 2026-12-05 only the recompute's two ends were: a Qwen3 layer that
  /// kept its attention kernel, output projection and MLP projections held up to 70,080 bytes above its
  /// prediction, its recompute peaking at the rotary embedding with those groups still waiting. Last of the
  /// fields; -1 in chains written before (by the C++ profiler, until it measured it too, later that day).
  int64_t fwd_peak_before_bytes = -1;
  /// The stage's forward without saving (how a group assignment's forward runs the calls it does not keep
  /// or send): its peak above the bytes alive before it (its input held), from the moment it lets go of this
  /// call's outputs (the first of them) until it has returned, its output made (bytes; -1: not measured). A
  /// group assignment's forward holds what it keeps or sends past that moment, so that its peak is, over the
  /// groups it keeps or sends, this figure plus those of them let go of by then (group_forward_peak_bytes()).
  /// Before (found 2026-12-06), the forward was charged every group it keeps beside the forward's whole peak,
  /// where a group alive at that peak (a transient autograd does not save) is in it already: GLM-MoE-DSA's
  /// plans that kept its indexer's scores were predicted up to 19.8% above what they held. An output still
  /// alive after the forward returns (held by something outside it) is read there, less its own bytes. Last
  /// of the fields; -1 in chains written before.
  int64_t fwd_peak_after_bytes = -1;
};

/// One stage of a chain.
struct Stage {
  std::string name;          ///< for people: "layer3", "2:Linear"
  double fwd_ms = 0;         ///< forward time (milliseconds)
  double bwd_ms = 0;         ///< backward time (milliseconds)
  int64_t output_bytes = 0;  ///< the stage's output a_{i+1}, which is the next stage's input (bytes)
  int64_t saved_bytes = 0;   ///< abar_{i+1}: alive after running the stage with grad: its output plus all its
                             ///< autograd graph keeps for its backward (bytes; >= output_bytes)
  int64_t fwd_tmp_bytes = 0;  ///< transient peak above that during its forward (bytes)
  /// Transient peak during its backward, above its inputs, outputs and d_i (bytes): as the chain's runtime
  /// runs it, with the output held through it where the runtime does not hold outputs (the Python package:
  /// it stays while something saves it), let go of as the backward begins where it does
  /// (Chain::holds_outputs: the C++ executor; bwd_output_freed_bytes is then what holding it adds).
  int64_t bwd_tmp_bytes = 0;
  /// The same peak when that backward makes the stage's parameter gradients (none before it, as after
  /// zero_grad(set_to_none) in a training step), the gradients made by then counted (bytes, >= 0). A
  /// backward's peak comes before the last of its gradients is made, so this is less than bwd_tmp_bytes plus
  /// all of them. Unset: that sum. Used where the step's context says the stage's gradients are made by its
  /// backward (StepContext::stage_grads_bytes), never above that sum (see grads_charge_bytes()).
  std::optional<int64_t> bwd_grads_tmp_bytes;
  /// The forward without saving for backward, as the plan executor runs Fn and Fc (under no-grad;
  /// milliseconds). Unset: fwd_ms (fwd_ms is then the cost of every forward, as before these fields).
  std::optional<double> fwd_nosave_ms;
  /// The stage's forward under remat::checkpoint (kNonReentrant: run with grad, nothing saved;
  /// milliseconds). Unset: fwd_nosave_ms.
  std::optional<double> checkpoint_fwd_ms;
  /// The stage's backward under remat::checkpoint: its recompute (early stopping included) plus its
  /// backward (milliseconds). Unset: fwd_ms + bwd_ms.
  std::optional<double> checkpoint_bwd_ms;
  /// The stage run by Fk (remat/planner/plan.h): under remat::checkpoint with
  /// CheckpointOptions::keep(Chain::keep), so that it keeps only the outputs of its kept calls (its matrix
  /// multiplications). keep_saved_bytes is what that leaves alive (its output plus the kept outputs; bytes,
  /// between output_bytes and saved_bytes), keep_fwd_ms its forward, keep_bwd_ms its recompute of the rest
  /// plus its backward (milliseconds). All three set, or none: a stage without them has no Fk.
  std::optional<int64_t> keep_saved_bytes;
  std::optional<double> keep_fwd_ms;  ///< see keep_saved_bytes
  std::optional<double> keep_bwd_ms;  ///< see keep_saved_bytes

  /// Offloading the stage run as Fa (Fa@host), as Fk with the keep tags (Fk@host) and as Fc (its input:
  /// Fc@host); unset: that way cannot be offloaded. Offloading also needs the chain's bandwidths.
  std::optional<OffloadCost> offload;
  std::optional<OffloadCost> keep_offload;        ///< see offload
  std::optional<OffloadCost> checkpoint_offload;  ///< see offload

  /// Fk under each of the chain's policies (Chain::policies), in its order; empty when the stage was not
  /// profiled under them (no Fk[name] for it).
  std::vector<PolicyCost> policies;
  /// The groups of its saved tensors, by the call that made them, in the order of its forward pass (at most
  /// kMaxGroups; see SavedGroup: they may hold more than saved_bytes); empty when it was not profiled so (no
  /// Fk{...} for it).
  std::vector<SavedGroup> groups;
  /// The stage's forward and backward as a group assignment runs them, every group kept (milliseconds): the
  /// runtime's selective checkpointing around each call included, and the backward with its recompute of the
  /// calls in no group. Unset: per_call_fwd_ms() and per_call_bwd_ms() less the groups' recompute_ms (see
  /// group_fwd_ms()). The Python profiler measures them, where a dispatch mode in Python costs time beside
  /// every call (2-3 ms a layer on an H200's Llama, whose layers run 3 ms forward); the C++ profiler, whose
  /// operator policies cost next to nothing, leaves them unset.
  std::optional<double> groups_fwd_ms;
  std::optional<double> groups_bwd_ms;  ///< see groups_fwd_ms
  /// Whether its output is among the tensors its autograd graph saves (run as Fa). saved_bytes counts the
  /// output either way (the model's abar holds it to the stage's backward); false, as the Python profiler
  /// measures it, tells the step's model (remat/planner/step.h) that a recompute that stops early (Fc where
  /// Chain::holds_outputs is false) never makes it again, so the stage's backward after that recompute holds
  /// output_bytes less. Default true: charged as saved.
  bool saves_output = true;
  /// The transient peak above its output during its forward without saving for backward, as Fn and Fc run it
  /// (bytes, >= 0): under no-grad, as the plan executor runs them, and in the Python profiler also under a
  /// checkpoint, as its per-layer plans run a checkpointed layer, the larger (the checkpoint's generators'
  /// state not counted: a step's context charges it apart). It may exceed fwd_tmp_bytes by much: such a
  /// forward lets go of each tensor once nothing reads it, but may hold several at once that its output is
  /// smaller than (a layer's feed-forward product and its activation), which a forward that saves them counts
  /// in saved_bytes. Unset: fwd_tmp_bytes (as before this field). Last of the fields, so that aggregate
  /// initializers written before it (and before saves_input) mean what they did.
  std::optional<int64_t> fwd_nosave_tmp_bytes;
  /// Whether its autograd graph, run as Fa, saves its input: a tensor on the input's storage (a Linear or a
  /// LayerNorm that reads it as it is). False, as the Python profiler measures it, where what it saves holds
  /// none of it (a layer whose first operations save a cast of it, as a Linear under bf16 autocast saves the
  /// bf16 copy of an fp32 input, or nothing of it): the step's model (remat/planner/step.h) lets go of the
  /// input once the stage's forward as Fa is done, where nothing else holds it then
  /// (StepContext::inputs_held_in_forward, outputs_held_in_backward) and the stage before does not hold it
  /// either. Default true: the input charged as saved, to the stage's backward (as before this field). Last
  /// of the fields, as fwd_nosave_tmp_bytes.
  bool saves_input = true;
  /// Where its autograd graph saves its output (saves_output) and nothing besides the stages holds it in the
  /// backward pass: how much lower the peak of its backward, run as Fa, is than with the output held through
  /// it (bytes, 0 to output_bytes). The graph lets go of the output once the operations that saved it have
  /// run backward: a stage that ends in one (a sigmoid, a ReLU, whose backward reads its result), which the
  /// backward pass runs first, holds its output only at its backward's start. The Python profiler measures it
  /// (the stage's backward run again with its graph alone holding the output: the lesser of the two peaks'
  /// drops, with the parameter gradients pre-allocated and made). The step's model (remat/planner/step.h)
  /// charges a kept stage's backward that much less where its context says nothing else holds the output then
  /// (StepContext::outputs_held_in_backward, output_held_in_backward). Before (found 2026-12-03), 4-layer
  /// MLPs ending in a sigmoid or a ReLU held 2.4-3.9% below their predictions on every plan. The C++
  /// profiler, whose executor lets go of a kept stage's output as its backward begins and whose bwd_tmp_bytes
  /// is measured so (Chain::holds_outputs), measures it too, the other way (the backward run again with the
  /// output held through it: the larger of the two drops), and the model charges it back where something else
  /// holds the output through that backward (the rest of the step, for the last stage:
  /// detail::output_held_back_bytes). 0, the default: nothing charged or credited. Last of the fields, as
  /// fwd_nosave_tmp_bytes.
  int64_t bwd_output_freed_bytes = 0;
  /// Whether the stage has a backward: false where its output needs no gradient (a layer frozen on an input
  /// that needs none, as fine-tuning freezes the lower layers: no parameter of it and nothing it reads needs
  /// a gradient), as both profilers measure it. Such a stage makes no autograd graph, so every way runs it as
  /// Fa does (a checkpoint saves nothing and recomputes nothing, an offload sends nothing): the per-layer
  /// planner (remat/planner/per_layer.h) keeps it, and offers no other way for it. The step's model charges a
  /// way a plan gives it as it would a stage with a backward (above what the step holds). Default true. Last
  /// of the fields, as fwd_nosave_tmp_bytes.
  bool has_backward = true;
  /// Under autocast, what its forward, kept as it is (Fa), leaves in autocast's cache beside what its graph
  /// saves (bytes, >= 0): the low-precision casts of parameters the graph does not save (a Linear's bias; its
  /// weight where its input takes no gradient), which the cache holds until the caller's autocast region
  /// ends. The Python profiler measures it where autocast is on (the C++ profiler leaves 0). The step's model
  /// (remat/planner/step.h) charges it, whatever the stage's way, from the stage's first forward before the
  /// loss through the rest of the step's backward (whose measured peak may be in its forward, inside the
  /// region), not in the chain's backward pass (the region ending with the loss, as in a training step).
  /// Before (found 2026-12-03), a small BERT under CPU bf16 autocast, every layer kept, peaked at its loss
  /// 0.075% above its prediction (its biases), and a model whose first layer takes the model's own input
  /// 0.58% (that layer's weight). Last of the fields, as fwd_nosave_tmp_bytes.
  int64_t autocast_cache_bytes = 0;
  /// How much higher its backward, run as Fa, peaks with the gradient it is handed held through it than with
  /// that gradient let go of once used, as the profilers measure bwd_tmp_bytes (and, the larger, as they
  /// measure bwd_grads_tmp_bytes) (bytes, 0..output_bytes; a policy's own: PolicyCost::bwd_grad_held_bytes):
  /// what a residual sum outside the layers (`x = x + layer(x)`, StepContext::between_frees_output) adds,
  /// whose backward hands the output's gradient to the residual path too, which holds it through this stage's
  /// backward. A layer whose backward peaks while it still uses that gradient (a Linear last) adds none; one
  /// that peaks after (a GELU, a LayerNorm or a sigmoid last) adds the gradient's bytes; 0 where the stage's
  /// input takes no gradient (the model's own input: a sum over it hands it nothing). The step's model
  /// (remat/planner/step.h) charges it to the stage's backward, whatever its way, where such a sum let go of
  /// the stage's output (detail::grad_held_bytes()). Unset
  /// (the C++ profiler, chains written before it): output_bytes, the gradient's size (bwd_grad_held()). Last
  /// of the fields, as fwd_nosave_tmp_bytes.
  std::optional<int64_t> bwd_grad_held_bytes;
  /// Checkpointed per call (Fc, with or without its input on the host, under torch.utils.checkpoint's
  /// non-reentrant engine, which recomputes a stage when its backward first asks for a tensor it did not
  /// keep): what that backward holds beyond the gradient it is handed when the recompute begins (bytes, >=
  /// 0): the gradients its last operations made, whose backward reads nothing saved, as a mixture of experts'
  /// sum over each token's chosen experts hands each of them the token's gradient (expanded and copied: top-k
  /// times the output's bytes). The Python profiler measures it (the meter read as the stage's checkpointed
  /// backward calls its function again); the C++ profiler leaves 0. The step's model (remat/planner/step.h)
  /// charges it to such a stage's recompute after the loss, beside what the recompute holds. Before (found
  /// 2026-12-04), a 4-layer GPT-OSS whose last layer was checkpointed held 131,072 bytes (twice its output)
  /// above its recompute's charge. 0, the default: nothing charged (as before this field). Last of the
  /// fields, as fwd_nosave_tmp_bytes.
  int64_t grads_before_recompute_bytes = 0;

  /// bwd_grad_held_bytes where measured, else output_bytes; within [0, output_bytes] (bytes).
  int64_t bwd_grad_held() const {
    const int64_t v = bwd_grad_held_bytes.value_or(output_bytes);
    return v < 0 ? 0 : (v > output_bytes ? output_bytes : v);
  }
  /// That figure for the way the stage's backward runs (`way`, grads_way()'s): a policy's own
  /// (PolicyCost::bwd_grad_held_bytes) where measured, output_bytes streamed (its backward, each tensor
  /// brought back just ahead of its use, is not measured so), else bwd_grad_held(); within [0, output_bytes].
  int64_t bwd_grad_held(int64_t way) const;
  /// Whether the stage has the three keep_ fields (Fk can run it).
  bool has_keep() const { return keep_saved_bytes.has_value(); }
  /// What Fn and Fc cost: fwd_nosave_ms, or fwd_ms when unset (milliseconds).
  double nosave_ms() const { return fwd_nosave_ms ? *fwd_nosave_ms : fwd_ms; }
  /// What Fn and Fc hold above their output at their forward's peak: fwd_nosave_tmp_bytes, or fwd_tmp_bytes
  /// when unset (bytes).
  int64_t nosave_tmp_bytes() const { return fwd_nosave_tmp_bytes.value_or(fwd_tmp_bytes); }
  /// What Fk (keep tags, a policy, a group assignment) that keeps `kept_bytes` (its output included) holds
  /// above them at its forward's peak, charged as at most that: the least of nosave_tmp_bytes() (what it does
  /// not keep it holds as a forward without saving does, and what it keeps was made by then or is to come)
  /// and saved_bytes - kept_bytes + fwd_tmp_bytes (it holds no more than Fa, which keeps all of it), and not
  /// below 0 (a policy may keep more than Fa: a product that Fa frees). A chain without
  /// fwd_nosave_tmp_bytes: fwd_tmp_bytes, as before (bytes).
  /// `unsaved_bytes`: of kept_bytes, what Fa does not save (a group assignment's, group_unsaved_bytes()),
  /// which it holds beyond Fa's peak.
  int64_t keep_fwd_tmp_bytes(int64_t kept_bytes, int64_t unsaved_bytes = 0) const {
    return std::max<int64_t>(
        0, std::min(nosave_tmp_bytes(), saved_bytes - kept_bytes + unsaved_bytes + fwd_tmp_bytes));
  }
  /// The forward of a stage checkpointed by remat::checkpoint (milliseconds).
  double per_call_fwd_ms() const { return checkpoint_fwd_ms ? *checkpoint_fwd_ms : nosave_ms(); }
  /// The backward of a stage checkpointed by remat::checkpoint, recompute included (milliseconds).
  double per_call_bwd_ms() const { return checkpoint_bwd_ms ? *checkpoint_bwd_ms : fwd_ms + bwd_ms; }
  /// A group assignment's forward (milliseconds): groups_fwd_ms where measured, else per_call_fwd_ms().
  double group_fwd_ms() const { return groups_fwd_ms ? *groups_fwd_ms : per_call_fwd_ms(); }
  /// A group assignment's backward, its recompute included (milliseconds), given the recompute_ms of the
  /// groups it keeps or sends (`skipped_ms`) and of those it recomputes (`redone_ms`), each summed in the
  /// groups' order: groups_bwd_ms + redone_ms where measured, else per_call_bwd_ms() - skipped_ms, at least
  /// bwd_ms.
  double group_bwd_ms(double skipped_ms, double redone_ms) const {
    return groups_bwd_ms ? *groups_bwd_ms + redone_ms : std::max(bwd_ms, per_call_bwd_ms() - skipped_ms);
  }
  /// What Fk under policies[p] holds in its backward above what it keeps, its output's gradient and its
  /// input's gradient (bytes): the policy's bwd_tmp_bytes where measured, else what it recomputes
  /// (saved_bytes - policies[p].saved_bytes, none where the policy keeps more) plus bwd_tmp_bytes, as Fa's
  /// backward after that recompute.
  int64_t policy_bwd_bytes(size_t p) const {
    const PolicyCost& c = policies[p];
    return c.bwd_tmp_bytes ? *c.bwd_tmp_bytes
                           : std::max<int64_t>(0, saved_bytes - c.saved_bytes) + bwd_tmp_bytes;
  }
  /// What the gradients its backward makes (`grads_bytes` of them, >= 0) add to that backward's peak above
  /// the peak measured without making them (bytes), for the way the stage ran (`policy`, see grads_way()):
  /// the way's measured difference (bwd_grads_tmp_bytes - bwd_tmp_bytes for Fa and Fc, a policy's own two
  /// for Fk under it, the offload's stream_bwd_grads_bytes - stream_bwd_bytes streamed) within
  /// [0, grads_bytes]; grads_bytes where either is not measured (kGradsUnmeasured, a policy the stage has no
  /// cost for), and 0 for none. (A backward's peak comes at its own point among the gradients it makes: each
  /// way is measured on its own.)
  /// The way argument of grads_charge_bytes() for a stage's last forward before its backward: `policy` (the
  /// chain's index) for Fk under a policy, -1 for Fa, Fc and a group assignment (a checkpoint's recompute
  /// is Fa; a group assignment's backward, once its recomputed groups are made again before it and its sent
  /// ones are back, is Fa's, over the same tensors), kGradsStreamed for Fa@stream, and kGradsUnmeasured
  /// for the keep tags, whose backward's point among its gradients is not measured (all of them charged).
  /// The one rule step_peak_bytes() and the per-layer program share.
  static constexpr int64_t kGradsUnmeasured = -2;
  static constexpr int64_t kGradsStreamed = -3;
  static int64_t grads_way(bool keep, bool stream, bool groups, int64_t policy) {
    if (stream) return kGradsStreamed;
    if (keep && groups) return -1;
    if (keep && policy < 0) return kGradsUnmeasured;
    return keep ? policy : -1;
  }
  int64_t grads_charge_bytes(int64_t grads_bytes, int64_t policy = -1) const {
    if (grads_bytes <= 0) return 0;
    if (policy == kGradsUnmeasured || (policy >= 0 && static_cast<size_t>(policy) >= policies.size()))
      return grads_bytes;
    std::optional<int64_t> tmp = bwd_tmp_bytes, with = bwd_grads_tmp_bytes;
    if (policy == kGradsStreamed) {
      if (!offload || offload->stream_bwd_bytes < 0 || offload->stream_bwd_grads_bytes < 0)
        return grads_bytes;
      tmp = offload->stream_bwd_bytes, with = offload->stream_bwd_grads_bytes;
    } else if (policy >= 0) {
      const PolicyCost& c = policies[static_cast<size_t>(policy)];
      tmp = c.bwd_tmp_bytes, with = c.bwd_grads_tmp_bytes;
    }
    if (!tmp || !with) return grads_bytes;
    const int64_t over = *with - *tmp;
    return over < 0 ? 0 : (over < grads_bytes ? over : grads_bytes);
  }
};

/// The most groups a stage may have (a group assignment is one of 3^groups).
inline constexpr size_t kMaxGroups = 10;

/// Whether a call (a SavedGroup::name, "aten::addmm#2", or an operator's name alone) is of an operator whose
/// recompute costs far more than its output takes to keep or to move: the matrix products (mm, addmm, bmm,
/// baddbmm, addbmm, addmv, mv, dot, vdot, matmul, linear, _grouped_mm, _scaled_mm), the convolutions
/// (convolution, _convolution, and cuDNN's and oneDNN's) and the attention kernels
/// (scaled_dot_product_attention and each of its fused and math forms, _efficient_attention_forward,
/// _flash_attention_forward). fit_groups() ranks them first.
bool costly_to_recompute(const std::string& call);

/// The saved groups both languages' profilers keep of the calls they found in a stage's forward pass
/// (`found`, in its order; since 2026-12-04 every call with outputs of its own, whether or not autograd saves
/// them: a group kept or sent skips its call in the recompute, which is what a call whose outputs only feed
/// others is worth): at most kMaxGroups, the calls costly_to_recompute() first, then the others, each from
/// the most bytes down (ties to the earlier call), returned in the order found. A deterministic rule (no
/// times), so that ranks profiling the same model choose the same groups. Throws std::invalid_argument naming
/// remat::fit_groups for a group of negative bytes.
std::vector<SavedGroup> fit_groups(const std::vector<SavedGroup>& found);

/// The profilers' rule before 2026-12-04, kept for callers of it: the kMaxGroups largest of `found`, then,
/// from the largest down, those that still fit in `room_bytes`, returned in the order found (ties to the
/// earlier call). Throws std::invalid_argument naming remat::fit_groups for a negative room or group bytes.
std::vector<SavedGroup> fit_groups(const std::vector<SavedGroup>& found, int64_t room_bytes);

/// What a stage costs run under a group assignment (a plan's Fk{...}): one character per group of
/// Stage::groups, 'k' (kept on the device), 'h' (sent to the host) or 'r' (recomputed). The stage runs as a
/// checkpoint whose recompute before the backward skips the kept and sent calls: `saved_bytes` is its output
/// plus the kept and sent groups' bytes (what it holds once its forward has run, before any copy lands),
/// `fwd_ms` its per-call forward (Stage::per_call_fwd_ms()), `bwd_ms` its per-call backward less the kept and
/// sent groups' recompute_ms (at least bwd_ms: the backward itself), and `offload`, when a group is sent, the
/// bytes that leave ({bytes: the sent groups' bytes less their SavedGroup::stays_bytes, which stay as kept
/// ones do; input: false, output: false}). `policy` is "{" + assignment + "}". Throws std::invalid_argument
/// naming the stage for an assignment of another length or with other characters.
PolicyCost group_cost(const Stage& stage, const std::string& assignment);

/// The most a group assignment's recompute holds part way through, above the bytes alive before the stage's
/// forward (its input held; its output not yet made again): over the groups whose fwd_peak_before_bytes is
/// measured, that peak plus the groups kept or sent ('k', 'h') from that one on, which are on the device
/// from the recompute's start until it reaches their call (bytes; -1 where no group's is measured).
/// simulate() charges it beside what the way keeps less those groups, with the recompute's two ends; the
/// per-layer program alike. Throws std::invalid_argument for an assignment that does not fit the stage (as
/// group_cost()).
int64_t group_recompute_peak_bytes(const Stage& stage, const std::string& assignment);

/// The peak of a group assignment's forward above the bytes alive before it (its input held; bytes): the
/// larger of the stage's forward without saving (output_bytes + nosave_tmp_bytes()) and, for each group it
/// keeps or sends ('k', 'h'), that group's SavedGroup::fwd_peak_after_bytes plus the bytes of the groups it
/// keeps or sends whose fwd_peak_after_bytes is at least as large (let go of no later by that forward: its
/// peak from a later moment on is no higher). -1 where one of them has fwd_peak_after_bytes unmeasured, or
/// none is kept or sent: simulate() and the per-layer program then charge Stage::keep_fwd_tmp_bytes()'s
/// bound, and they charge no more than it where it is measured. Throws std::invalid_argument for an
/// assignment that does not fit the stage (as group_cost()).
int64_t group_forward_peak_bytes(const Stage& stage, const std::string& assignment);

/// Of what a group assignment keeps and sends (group_cost()'s saved_bytes), the bytes the stage's plain
/// forward does not save: its kept and sent groups' SavedGroup::unsaved_bytes. A stage run so holds them from
/// its forward pass until the recompute before its backward has used them; its backward itself holds what Fa
/// saves. Throws std::invalid_argument as group_cost() does.
int64_t group_unsaved_bytes(const Stage& stage, const std::string& assignment);

/// The chain: its input a_0 and its stages in order.
struct Chain {
  int64_t input_bytes = 0;    ///< a_0 (bytes)
  std::vector<Stage> stages;  ///< in order; stage i reads a_i and produces a_{i+1}
  /// The remat::keep tags the keep_ fields were measured with (CheckpointOptions::keep of Fk); empty when
  /// no stage has them.
  std::vector<std::string> keep;
  /// The operator-level policies the stages' PolicyCost entries were measured under (names, each once;
  /// Fk[name] in a plan); empty when none.
  std::vector<std::string> policies;
  /// The bandwidth of copies from the device to host memory and back, measured when profiling (GB/s, 10^9
  /// bytes per second); 0 when not measured: the chain cannot be offloaded.
  double to_host_gb_per_s = 0;
  double to_device_gb_per_s = 0;  ///< see to_host_gb_per_s
  /// Whether the runtime holds the output of a stage run with grad (Fa, Fk, offloaded or not) on the device
  /// until that stage's backward, whatever the stage's saved tensors hold: true for chains the C++ profiler
  /// makes (the plan executor holds such an output as the root of the stage's backward, and lets go of it as
  /// that backward begins: Stage::bwd_tmp_bytes is measured so), false for the Python
  /// package's layers (an output stays only where something saves it, and a checkpointed stage runs as a
  /// per-call checkpoint whose recompute stops early: Stage::saves_output). Read by offloading (whether the
  /// next stage's offloaded input, Fc@host or Fk@host, leaves the device) and by the step's model.
  bool holds_outputs = false;
  /// Whether the runtime makes each copy to the host and back at once, on the thread that computes (a CPU
  /// device, which has no copy stream: the copy is the host's own memory copy, made as the hooks run), so
  /// that no computation hides it: simulate() and the per-layer planner then charge every copy's time in full
  /// (the bandwidths' time for its bytes, each way) where it is made, as they do a stream with no window.
  /// The profilers set it where their runtime has no copy stream: C++'s on a CPU device, Python's on any
  /// device but CUDA; false (the default, and a GPU's): copies run on a side stream, hidden behind the
  /// computation that follows them. Read for time only: what the device holds is the same.
  bool copies_at_once = false;
  /// Per stage, whether something besides the stages holds its input on the device to the step's end (a
  /// caller's list of hidden states): offloading the stage copies its input but frees none of it. Empty (the
  /// default): none. step_chain() sets it from StepContext::outputs_held_to_end (which ranks agree on); a
  /// profiled chain leaves it empty. Read by simulate() and the per-layer planner.
  std::vector<bool> inputs_held;

  /// Whether stage i's input is held to the step's end (inputs_held).
  bool input_held(int64_t i) const {
    return i >= 0 && static_cast<size_t>(i) < inputs_held.size() && inputs_held[static_cast<size_t>(i)];
  }
  /// Whether the chain can be offloaded: both bandwidths measured.
  bool can_offload() const { return to_host_gb_per_s > 0 && to_device_gb_per_s > 0; }
  /// The time of copying `bytes` to the host (to_host) or back (milliseconds; infinite when not measured).
  double transfer_ms(int64_t bytes, bool to_host) const;

  /// Number of stages.
  int64_t size() const { return static_cast<int64_t>(stages.size()); }
  /// Size of a_i in bytes, for i in [0, size()]: input_bytes for 0, stage i-1's output_bytes otherwise.
  int64_t activation_bytes(int64_t i) const { return i == 0 ? input_bytes : stages[i - 1].output_bytes; }
};

/// The largest total of a chain's byte counts (input_bytes plus every stage's four byte fields) that
/// validate() accepts: 2^60 bytes. Below it, no sum the simulator or the planners form overflows int64.
constexpr int64_t kMaxChainBytes = int64_t{1} << 60;
/// The largest fwd_ms, bwd_ms or optional time validate() accepts (milliseconds).
constexpr double kMaxStageMs = 1e12;

/// Checks a chain: at least one stage; no negative or non-finite value; times at most kMaxStageMs;
/// saved_bytes >= output_bytes; the keep_ fields all set or none, output_bytes <= keep_saved_bytes, and
/// `keep` tags wherever a stage has them; policy names unique and valid, each stage's PolicyCost entries
/// none or one per Chain::policies in its order, each with output_bytes <= saved_bytes; an OffloadCost's
/// bytes at most what its way keeps beyond the output (0 for checkpoint_offload), bandwidths finite and >= 0;
/// byte counts adding up to at most kMaxChainBytes. Throws std::invalid_argument naming remat::validate, the
/// stage (index and name), the field and the value.
void validate(const Chain& chain);

/// Whether `name` can name a policy: non-empty, made of letters, digits, '_', '-' and '.'.
bool valid_policy_name(const std::string& name);

/// The chain as JSON: {"input_bytes": N, "stages": [{"name": "...", "fwd_ms": x, "bwd_ms": x,
/// "output_bytes": N, "saved_bytes": N, "fwd_tmp_bytes": N, "bwd_tmp_bytes": N}, ...]}, plus
/// "fwd_nosave_ms", "fwd_nosave_tmp_bytes", "checkpoint_fwd_ms", "checkpoint_bwd_ms", "keep_saved_bytes",
/// "keep_fwd_ms" and "keep_bwd_ms" for a stage that has them, "keep": ["matmul"] for a chain measured with
/// keep tags, and for one measured under policies "policies": ["matmuls"] with, per stage, "policies":
/// [{"policy": "matmuls", "saved_bytes": N, "fwd_ms": x, "bwd_ms": x}]; for a chain profiled for offloading
/// "to_host_gb_per_s" and "to_device_gb_per_s", with per stage "offload", "keep_offload",
/// "checkpoint_offload" (and per policy entry "offload") as {"bytes": N, "input": bool, "output": bool}.
std::string to_json(const Chain& chain);

/// Parses and validates that JSON (the tmp keys are optional, default 0; the three optional times may be
/// absent; "name" defaults to "stage<i>").
/// Throws std::invalid_argument naming the problem: malformed JSON, a missing or mistyped key, or what
/// validate() rejects.
Chain chain_from_json(const std::string& json);

/// Reads a chain from a JSON file. Throws std::invalid_argument when the file cannot be read, and as
/// chain_from_json.
Chain load_chain(const std::string& path);

/// Writes a chain to a JSON file. Throws std::invalid_argument when the file cannot be written.
void save_chain(const Chain& chain, const std::string& path);

/// A homogeneous chain of n equal stages (for revolve and tests): each with the given times and sizes,
/// input_bytes = output_bytes.
Chain uniform_chain(int64_t n, double fwd_ms, double bwd_ms, int64_t output_bytes, int64_t saved_bytes);

}  // namespace remat
