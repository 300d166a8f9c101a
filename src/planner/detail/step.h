#pragma once
// What step.cpp shares with the rest of the planner library (timeline.cpp).

#include <cstdint>
#include <vector>

#include "remat/planner/step.h"

namespace remat::detail {

// Entry `stage` of a StepContext's per-stage figure that may be empty (the between figures,
// side_grads_bytes), 0 where it is.
int64_t stage_figure(const std::vector<int64_t>& figures, size_t stage);

// Entry `stage` of a StepContext's per-stage flag (outputs_held_in_backward, inputs_held_in_forward, ...):
// `unread` where the flags are empty (not read), false for a stage outside them.
bool stage_flag(const std::vector<bool>& flags, int64_t stage, bool unread);

// Whether a stage's forward of this kind (with a group assignment or not) is a checkpoint's, which holds the
// generators' state it saved until the stage's backward is done (StepContext::checkpoint_state_bytes): Fc and
// a group assignment; not a policy's, whose measured saved_bytes holds it already.
bool recomputes(OpKind kind, bool groups);

// Chain stage j's output's bytes where it is held to the step's end (StepContext::outputs_held_to_end), else
// 0 (and for j outside the chain).
int64_t held_to_end_bytes(const Chain& chain, const StepContext& context, int64_t j);

// Chain stage j's output's bytes where a recompute of it that stops early never makes it again (its way Fc
// under a runtime that does not hold outputs, Chain::holds_outputs false, and the stage's graph does not save
// its output, Stage::saves_output false): its backward after that recompute holds that much less than the
// simulation's abar. 0 otherwise (and for j outside the chain).
int64_t recompute_unmade_bytes(const Chain& chain, int64_t j);

// Whether nothing besides the stages holds chain stage j's input a_j once stage j's backward is done
// (StepContext::outputs_held_in_backward false for 1 <= j < n), or the chain's output a_n once the rest's
// backward is done (j == n: output_held_in_backward false), and the runtime does not hold outputs.
bool output_unheld(const Chain& chain, const StepContext& context, int64_t j);

// What chain stage j's backward holds beyond its measured peak, whatever its way, where something besides the
// stage holds the gradient it is handed through it (bytes): where what runs between it and the next made the
// next input from its output and let go of it (output_freed_between(): a residual sum outside the layers,
// whose backward hands the output's gradient to the residual path too; over the last layer, where the rest
// takes the last stage's input too, StepContext::rest_takes_last_input), Stage::bwd_grad_held() (the profile
// measured that backward with the gradient let go of once used; unmeasured, the output's bytes); else 0. The
// one rule of step_op_peaks() and the per-layer program. Before (found 2026-12-03) it was not charged: layers
// ending in a GELU under `x = x + layer(x)` peaked 2.2-5.7% above their predictions, a sigmoid under the
// matmuls policy 3.0%; a sigmoid kept was exact only because its output's early credit was withheld there.
// `way`: the way its backward runs (Stage::grads_way()), whose figure it is (Stage::bwd_grad_held(way)): a
// policy's own where measured; streamed, whose backward (each tensor brought back just ahead of its use) was
// not measured so, the gradient's whole bytes (output_bytes). Before (found 2026-12-06), Fa's figure: layers
// ending in a Linear under such a sum, streamed, peaked one output above their predictions (3.8-4.3% on four
// layers).
int64_t grad_held_bytes(const Chain& chain, const StepContext& context, int64_t j, int64_t way = -1);

// Whether something besides chain stage j holds the gradient it is handed through its backward: where
// grad_held_bytes() charges Stage::bwd_grad_held(way), whatever the way.
bool grad_held_through(const Chain& chain, const StepContext& context, int64_t j);

// Whether the chain's output gradient is alive once chain stage j's backward is done
// (StepContext::output_grad_held_in_backward; false where empty and for j outside it).
bool output_grad_held(const StepContext& context, int64_t j);

// Whether chain stage j's input a_j (1 <= j < n) is let go of once stage j's forward as Fa (not offloaded)
// is done where the stage before's way does not hold it, as far as the chain and the context say: the stage
// does not save its input (Stage::saves_input false), nothing else held it past that forward
// (StepContext::inputs_held_in_forward false) nor holds it in the backward pass (output_unheld()), and
// nothing runs between the two stages (no between figure at j: the input is a_j itself) or what runs between
// made it from a_j and let go of a_j there (a residual sum outside the layers: output_freed_between(j - 1),
// between_forward_held_bytes not negative; the input let go of is then a_j and what that left held,
// input_let_go_extra_bytes(); where the stage before's way holds its output beside it,
// held_past_between_bytes(), the result goes alone, and the model's a_j stands for that output from the
// stage's backward on). The one rule of step_op_peaks() and the per-layer program, which add the plan's
// conditions.
bool input_let_go_in_forward(const Chain& chain, const StepContext& context, int64_t j);

// Whether the last chain stage's input, held past its forward, may go once the rest's forward is done
// (StepContext::last_input_let_go_in_rest, and input_let_go_in_forward()'s rule but the reading): the one
// rule of step_op_peaks() and the per-layer program, which add the plan's conditions (as for
// input_let_go_in_forward()) and let go of it with what input_let_go_extra_bytes() adds, once the rest's
// forward is done rather than the stage's.
bool last_input_let_go_in_rest(const Chain& chain, const StepContext& context);

// What chain stage j's input holds beyond a_j where input_let_go_in_forward() lets go of it (bytes): what
// runs between stage j - 1 and stage j left held in the forward where it made the input (a residual sum's
// result, of which the model holds a_j's bytes as a_j and the rest as between_forward_held_bytes); 0 where
// nothing runs between. Let go of with a_j once stage j's forward is done and charged back once stage j's
// backward is done, where the model lets go of it otherwise (between_held_bytes' reading): the one rule of
// step_op_peaks() and the per-layer program. Before, a residual sum outside the layers
// under autocast, whose kept layers save a bf16 cast of their fp32 input and not the input, was charged
// each layer's input through its backward (fixed 2026-12-03): 6.4-9.6% below the prediction on four layers.
int64_t input_let_go_extra_bytes(const Chain& chain, const StepContext& context, int64_t j);

// Whether stage `s` run as `kind` is known not to save its output, the one rule of leaves_output() and the
// per-layer program: Fa as its offload cost's `output` says, or, without one, Stage::saves_output false; Fk
// (the keep tags, a policy, a group assignment: `groups`) as its way's offload cost `cost` says (null where
// it has none), and without one a group assignment of a stage whose Fa does not save its output (the output
// is no group, and the assignment's recompute makes it again only where Fa saves it) or a policy (`policy`,
// its cost; null for the keep tags and a group assignment) whose PolicyCost::saves_output is false (before
// 2026-12-03, a policy without an offload cost was charged its output held: a small BERT under the matmuls
// policy, every layer kept, 1.4% below its prediction); false for Fc and Fn, whose output is held plain.
bool way_leaves_output(const Stage& s, OpKind kind, const OffloadCost* cost, bool groups,
                       const PolicyCost* policy);

// What the backward of a stage run as `kind` holds less than with its output held through it: Fa, kept or
// offloaded (the copy brought back is let go of as early; since 2026-12-03), not streamed (its backward's own
// measured peak) and no group assignment, whose graph saves its output, Stage::bwd_output_freed_bytes; 0
// otherwise. The one rule of step_op_peaks() and the per-layer program,
// which charge it where output_freed_early() says so: a kept stage's backward, and a checkpointed stage's
// after its recompute (as Fa: the output it makes again, which its graph alone holds).
int64_t output_freed_in_backward_bytes(const Stage& s, OpKind kind, bool groups, bool streamed);

// Whether chain stage j's output is held through that stage's backward by something besides a runtime that
// holds outputs (Chain::holds_outputs: the C++ executor, which lets go of a kept stage's output as the
// stage's backward begins, and whose profiler measures each backward so): the rest of the step, for the last
// stage (StepContext::output_held_in_backward: a loss that saves its input), or something to the step's end
// (outputs_held_to_end). False for a runtime that does not hold outputs (the Python package's profiler
// measures each backward with its output held through it) and for j outside the chain.
bool output_held_past_runtime(const Chain& chain, const StepContext& context, int64_t j);

// What the backward of stage `s` run as `kind` (`groups`: a group assignment; `offloaded`: offloaded or
// streamed) holds beyond its measured peak where output_held_past_runtime(): kept as Fa, not offloaded,
// Stage::bwd_output_freed_bytes (how much lower the runtime's run, which lets go of the output, peaks than
// one that holds it through); under a policy, the keep tags or a group assignment, and offloaded or streamed,
// its output's bytes (the C++ profiler measures no drop for those: at most that); 0 for Fc and Fn (whose
// recompute makes an output of its own that the runtime lets go of). The one rule of step_op_peaks() and the
// per-layer program, charged where the stage's forward ran once. Before (found 2026-12-03) it was not
// charged: BertModel's planned steps, whose layers end in a LayerNorm that does not save its output, held one
// hidden state above their prediction (1.0-1.5%) at the last layer's backward, under every plan that kept
// that layer, with the matmuls policy or without; and until later that day, not for the keep tags, group
// assignments, offloaded or streamed ways: a BertModel whose last layer was streamed held one hidden state
// above its prediction in its backward pass where the caller's temporary held the output.
int64_t output_held_back_bytes(const Stage& s, OpKind kind, bool groups, bool offloaded);

// What chain stage j, checkpointed (Fc) and recomputed as Fa, holds beyond the simulation from that
// recompute to the end of its backward where a runtime that holds outputs recomputes the output anew (a
// tensor of its own, where a per-call checkpoint does not) and the rest of the step holds the first (the
// last stage, StepContext::output_held_in_backward): its output's bytes; 0 otherwise (an output held to the
// step's end is charged through the recompute already, held_to_end_bytes()). The one rule of step_op_peaks()
// and the per-layer program. Before (found 2026-12-03) it was not charged: BertModel's last layer
// checkpointed under a loss that saves its output held one hidden state above the prediction (1.0-1.7%).
int64_t recomputed_output_held_bytes(const Chain& chain, const StepContext& context, int64_t j);

// Whether chain stage j's backward may be charged its output let go of early
// (output_freed_in_backward_bytes(), measured in the profiler with the gradient the stage is handed let go of
// once used): the runtime does not hold outputs, nothing besides the stages holds the output in the backward
// pass (output_unheld()), and, for the last stage, nothing holds the chain's output gradient past its
// backward (output_grad_held(): a skip to the head). Where a residual sum lets go of the output, the gradient
// its path holds through this backward is charged apart (grad_held_bytes()). Until that charge (2026-12-03)
// the credit was withheld there instead: with it, a residual sum outside layers ending in a sigmoid had held
// 2.3-5.7% above the prediction.
bool output_freed_early(const Chain& chain, const StepContext& context, int64_t j);

// Whether what runs between chain stage j and the next let go of stage j's output in the profiling step
// (StepContext::between_frees_output[j + 1]); for the last stage, whether the rest of the step let go of the
// chain's output in its forward (StepContext::rest_frees_output), unless the runtime holds outputs or
// something holds it to the step's end; false for j outside the chain.
bool output_freed_between(const Chain& chain, const StepContext& context, int64_t j);

// What stage `s` run as `kind` (with `cost`, its way's offload cost or null; `groups`: a group assignment;
// `offloaded`: offloaded, `streamed`: streamed; `policy`: its policy's cost, or null) holds from the end of
// its forward until the next stage's backward (and what runs between them) is done beyond what the step's
// model charges it, where what runs between it and the next stage (or the rest of the step) lets go of its
// output (output_freed_between()): its output_bytes where its way is Fa or Fk (the keep tags, a policy), not
// streamed, and saves its output: not offloaded and not known not to save it (way_leaves_output()), or
// offloaded with the output among what it sends (`cost`'s `output`: the copy's source stays on the device
// until the copies are waited for, after the next stage's forward, and the copy comes back at the next
// stage's backward; charged through both and between them, a bound); else 0. The one rule of step_op_peaks()
// and the per-layer program. Before (found 2026-12-06), 0 for every offloaded way: layers ending in a sigmoid
// under `x = x + layer(x)` with one kept on the host peaked one output above their predictions (2.7-3.7% on
// four layers), at the next layer's forward and its backward.
int64_t held_past_between_bytes(const Stage& s, OpKind kind, const OffloadCost* cost, bool groups,
                                bool offloaded, bool streamed, const PolicyCost* policy);

// Whether chain stage op.stage's way under `op` (a forward of a plan whose policies are ops.policies) is
// known not to save its output (way_leaves_output(), with the way's offload cost).
bool leaves_output(const Chain& chain, const Plan& ops, const Op& op);

// The chain's input (bytes) where nothing but the stages holds it in the backward pass
// (StepContext::input_held_in_backward false; with input_in_base too, where the caller let go of it), else 0.
int64_t input_unheld_bytes(const Chain& chain, const StepContext& context);

// Whether the chain's input, where nothing but the stages holds it in the backward pass
// (input_unheld_bytes()), is let go of by the backward pass where the first stage, kept, does not hold it:
// the first stage does not save it (Stage::saves_input false) and nothing held it into the backward pass
// (StepContext::inputs_held_in_forward[0] false).
bool first_input_let_go(const Chain& chain, const StepContext& context);

// From which step stage on the chain's input, where nothing but the stages holds it (input_unheld_bytes()),
// is off the device after the loss, by how step stage 1 (the chain's first) ran before it, sending its input
// (its way's OffloadCost::input): 1 streamed (its own measured backward holds it back), 3 offloaded whole
// (until its bytes come back, as the backward of step stage 2 begins); 1 where `let_go`: run as Fa (kept, or
// offloaded or streamed not sending it), its only forward, where first_input_let_go(): gone, not held back; 0
// otherwise (also where the input is held, and where a stage that saves it does not send it: streamed or
// offloaded, it stays on the device).
int64_t input_gone_from(bool streamed, bool sends_input, bool let_go = false);
int64_t input_gone_from(const Chain& chain, const StepContext& context, const Plan& ops);

// The step's peak during each operation of `ops` (step_plan() of a plan for `chain`) as simulated on
// step_chain() (`sim`), above the step's base: the simulated peak with the gradients allocated by then, less
// the chain's input when input_in_base, and after the loss, where input_gone_from() says it is gone, the
// chain's input in the operations of the rest of the step and the chain's stages until it is back (bytes;
// step_peak_bytes() is their maximum with the part before the chain's own peaks).
// The tensors of StepContext::taken_bytes that chain stage j holds until its backward is done, its forward
// run as `kind` (with a group assignment or not), as bits (bit m: tensor m): those it takes where its way
// recomputes or runs under a policy (any kind but Fa: a checkpoint holds its arguments), and those its plain
// graph saves (taken_saved_by) whatever its way. 0 for j outside the chain.
uint32_t taken_held_by(const StepContext& context, int64_t j, OpKind kind);

// The bytes of the tensors of StepContext::taken_bytes not among `held` (bits, as taken_held_by()'s): what a
// point of the step where only the stages of `held` hold them is charged less than before_saved_bytes says.
int64_t taken_unheld_bytes(const StepContext& context, uint32_t held);

std::vector<int64_t> step_op_peaks(const Chain& chain, const StepContext& context, const Plan& ops,
                                   const Simulation& sim);

// The step's peak from those (step_peak_bytes()): their maximum with the part before the chain's own peaks.
int64_t step_peak_of(const StepContext& context, const std::vector<int64_t>& op_peaks);

}  // namespace remat::detail
