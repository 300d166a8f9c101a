#pragma once
/// \file
/// Planning a chain for the whole training step around it: what runs before the chain (embeddings), what runs
/// after it (the head, the loss) and the parameter gradients the backward pass allocates all count against
/// the budget, as a meter reading the step's peak sees them. Plain numbers, no torch headers: remat::Planned
/// (C++) and the Python package's in-place planning measure a StepContext where the chain runs and plan
/// with plan_step().
///
///   remat::StepContext ctx;                       // measured in a profiling step
///   ctx.rest_peak_bytes = 7 << 20;                // the head and the loss
///   ctx.stage_grads_bytes = {...};                // gradients the backward pass will allocate, per stage
///   remat::StepPlan p = remat::plan_step(chain, ctx, 300 << 20);   // p.plan, p.step_peak_bytes

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>

#include <cstdint>
#include <string>
#include <vector>

namespace remat {

/// What surrounds a chain in a training step. Byte counts are above the step's base, the bytes alive when
/// the step begins (for remat::Planned, when its forward() is called).
struct StepContext {
  /// Whether the chain's input is part of the base (remat::Planned, whose base is taken with the input
  /// alive) rather than made during the step.
  bool input_in_base = false;
  /// Held from the chain's start until the backward pass is through the part before the chain, besides the
  /// chain's input: what that part (embeddings) saved for its backward (bytes).
  int64_t before_saved_bytes = 0;
  /// The peak of the part before the chain, its forward pass (bytes). The same under every plan.
  int64_t before_peak_bytes = 0;
  /// The peak of the backward pass of the part before the chain, which runs after the chain's whole
  /// backward (bytes; the gradients allocated by then included). The same under every plan.
  int64_t before_backward_peak_bytes = 0;
  /// The rest of the step (the part after the chain, the loss, and the backward pass down to the chain's
  /// output): its peak above what is alive when the chain returns, up to and with the gradient it hands the
  /// chain's output (bytes), and its time (milliseconds).
  int64_t rest_peak_bytes = 0;
  double rest_ms = 0;
  /// What the rest's backward leaves held from then on to the step's end (bytes): the gradients of its
  /// parameters it allocates, a partial gradient of a weight shared with the part before the chain (a tied
  /// embedding's, summed at its last use), outputs the caller keeps (logits). Not less the chain's output
  /// where the rest's backward lets go of it: the model lets go of that once, at the last stage's backward
  /// or where output_held_in_backward says so. Signed since 2026-12-03: less what the rest let go of that the
  /// part before the chain made and the model's code held until its forward returned (GPT-2's token and
  /// position embeddings), which before_saved_bytes charges until the part before's backward; at least
  /// -before_saved_bytes (validate() throws std::invalid_argument below that).
  int64_t rest_grads_bytes = 0;
  /// Per chain stage: the parameter gradients its backward allocates (bytes; 0 when they exist before the
  /// step), held from then on. Empty, or one entry per stage.
  std::vector<int64_t> stage_grads_bytes;
  /// The step's peak measured with every stage checkpointed (the profiling step's schedule), above the base
  /// (bytes), or -1 when not measured. plan_step() falls back to that schedule with this peak where the model
  /// refuses a budget the measured step fits (the model charges a recompute as a whole stage run, which a
  /// recompute that stops early may not hold), and with the per-layer program's time for it
  /// (per_call_time_ms() of every stage).
  int64_t checkpoint_all_peak_bytes = -1;
  /// Tensors the chain's stages take or hand on beside their input and output, made during the step (T5's
  /// position bias, which its first layer makes and every later layer takes; an encoder's output that every
  /// decoder layer attends to), with the gradients the backward pass gathers for them: held from the chain's
  /// start to its backward's end (bytes; 0 for a chain whose stages take one tensor and return one). What a
  /// stage hands on that no stage takes counts only where something holds it into the backward pass (the
  /// Python package: attention weights a caller collects, by their storage), not where the model's code drops
  /// it (GPT-J's attention weights, since 2026-12-04).
  int64_t side_bytes = 0;
  /// Per chain stage j: of side_bytes, the gradients that arrive at stage j's backward, the last stage that
  /// takes the tensor (bytes): charged from that backward on, not from the chain's start, since no gradient
  /// exists before it. Empty, or one entry per stage, together at most side_bytes.
  std::vector<int64_t> side_grads_bytes;
  /// Per chain stage j: of side_grads_bytes' entry j, what arrives after the peak of stage j's backward
  /// (nothing of that backward after it goes above its peak before it; bytes): a stage that uses the tensor
  /// first in its forward hands it its gradient last (Zamba2's hybrid layers concatenate the embeddings to
  /// their input). Charged once that backward is done, not at its peak: the rest of the entry is charged at
  /// its peak. Empty (all at the peak, as before 2026-12-06), or one entry per stage, each at most
  /// side_grads_bytes' entry.
  std::vector<int64_t> side_grads_late_bytes;
  /// Per chain stage j: of side_bytes, what is let go of once stage j's backward is done (bytes): a tensor
  /// the stages take beside their input that nothing holds past the backward of the first stage that takes it
  /// (T5's position bias, once the encoder's second layer's backward is done), and a gradient of one, used up
  /// by the backward of the stage that made the tensor (the position bias's, by its first layer's). Charged
  /// from there on no more; what the backward of what runs between two stages frees is in
  /// between_held_bytes, not here. Empty (nothing let go of: side_bytes held to the chain's end), or one
  /// entry per stage, together at most side_bytes.
  std::vector<int64_t> side_freed_bytes;
  /// Whether something besides the chain's stages holds the chain's input through their backward pass: the
  /// part before the chain (what it saved), the caller, or not known (true, the default). False where, once
  /// the forward pass is over, only the stages hold it (remat::Planned and the Python package measure it: the
  /// input's storage is freed by the time the first stage's backward is done), with input_in_base too (a
  /// caller that let go of the input once the chain returned: remat's C++ BertModel, whose embeddings'
  /// output only the chain holds; before 2026-12-05 input_in_base meant held, and such a step's first stage
  /// checkpointed on the host held one input below its prediction through the backward pass). A first stage
  /// then streamed (Fa0@stream, Fa0@stream0: the Python package's runtime sends the stage's input with what
  /// it saves) leaves the input on the host from the loss on: the rest of the step's backward and every chain
  /// stage's backward (and recompute) are charged without it, the first stage's measured backward peak
  /// bringing it back. (A rest of the step that saved the chain's input has dropped it before the reading: it
  /// would be charged too little; the Python package warns of a planned step more than 2% above its
  /// prediction.)
  bool input_held_in_backward = true;
  /// Per chain stage j >= 1: whether anything besides the stages holds stage j's input a_j, stage j - 1's
  /// output, once stage j's backward is done (the model's code, a list of hidden states it returns, what runs
  /// between the two), or not known (true, the default; empty: all true). False where only the stages held it
  /// then (the Python package reads its storage's liveness at that moment in the profiling step, every stage
  /// checkpointed): where stage j - 1's way does not save its output either (its offload cost's `output`
  /// false, as profiled for offloading) and the runtime does not hold outputs (Chain::holds_outputs false),
  /// a_j is charged as freed once stage j's backward is done, not held through stage j - 1's backward. Entry
  /// 0, the chain's input, is input_held_in_backward's, not read here; the chain's output's is
  /// output_held_in_backward. Empty, or one entry per stage.
  std::vector<bool> outputs_held_in_backward;
  /// Per chain stage j >= 1: whether anything besides the stages held stage j's input a_j, taken as stage
  /// j - 1 handed it on, from the end of stage j's forward on (the model's code, a list of hidden states,
  /// what runs between the two, or an input made by what runs between rather than a_j itself), or not known
  /// (true, the default; empty: all true). False where nothing did (the Python package reads it in the
  /// profiling step from a weak reference to the input's Python object, the stages' checkpoints holding an
  /// alias of it and an object the autograd graph holds staying alive: dead at the next stage's call, that
  /// stage taking stage j's output as handed on, or for the last stage's input dead before the count rose
  /// above its level at that stage's return): where stage j runs as Fa, not offloaded, does not save its
  /// input (Stage::saves_input false), stage j - 1's way does not hold its output (it does not save it, or it
  /// is a plain output), outputs_held_in_backward says nothing holds a_j in the backward pass and the stage's
  /// backward comes before any later forward of stage j - 1 in the plan, a_j is charged as freed once stage
  /// j's forward is done. Where what runs between made stage j's input from a_j and let go of a_j
  /// (between_frees_output: a residual sum outside the layers), the entry is that input's, the sum's result
  /// (the Python package: its object dead at the next stage's call and its storage owned by the stages'
  /// aliases only, and what ran between left held just that result less a_j): where it is false, the result
  /// goes whole (a_j and between_forward_held_bytes, which must not be negative) under the same conditions,
  /// but that stage j - 1's way may hold its output (beside the result, charged apart: between_frees_output)
  /// (since 2026-12-03; before, such an entry was read as held). For the last stage's input let go of in
  /// the rest's forward, see last_input_let_go_in_rest. Entry 0, the chain's input: whether anything held it
  /// into the backward pass (the Python package: its object alive at the end of the model's forward); where
  /// false, nothing holds it in
  /// the backward pass (input_held_in_backward false) and the first stage runs as Fa,
  /// not offloaded, once, saving none of it, it is charged as gone from the loss on (the rest's backward
  /// and every chain stage's, as where a first stage streamed takes it to the host). Empty, or one entry per
  /// stage.
  std::vector<bool> inputs_held_in_forward;
  /// Whether anything besides the rest of the step and the last stage holds the chain's output a_n once the
  /// rest's backward is done (the caller, a list of hidden states), or not known (true, the default). False
  /// where its storage was freed by then (the rest saved it and let go of it, nothing else held it: the
  /// Python package and remat::Planned read it in the profiling step): where the last stage's way does not
  /// save its output (outputs_held_in_backward's rule) and the runtime does not hold outputs, a_n is charged
  /// as freed once the rest's backward is done, not held through the last stage's backward.
  bool output_held_in_backward = true;
  /// Per chain stage j: whether anything besides the stages holds its output (a_{j+1}; the chain's output for
  /// the last stage) to the step's end (a list of hidden states the caller keeps, the caller's
  /// last_hidden_state), past where the model lets go of it: it is charged again from there (stage j's
  /// backward, or the next stage's where stage j is checkpointed, whose output is plain; the rest's for the
  /// chain's output) to the step's end. The Python package reads each output's storage's liveness at the end
  /// of the profiling step's backward pass (the last stage's too: the caller's last_hidden_state; and one the
  /// later stages take beside their input, such as BART's encoder output, of which side_bytes then charge the
  /// gradient alone); remat::Planned reads the last entry (the caller's: a C++ temporary,
  /// `model->forward(x).square().mean().backward()`, holds forward()'s result to the step's end), the others
  /// false. Empty (nothing held), or one entry per stage.
  std::vector<bool> outputs_held_to_end;
  /// What a stage run by a way that recomputes (Fc, a group assignment), or whose forward the plan runs more
  /// than once (Fn before a later forward), holds beside its input from its first forward until its backward
  /// is done (bytes): the random generators' state saved to replay its draws (for a chain whose runtime holds
  /// outputs, Chain::holds_outputs, the C++ executor, until its last forward for a stage run more than once,
  /// not a group assignment's). They are host tensors: on a
  /// CUDA device 0; where the device is the CPU, the CPU generator's state (5,056 bytes per such stage; the
  /// Python package measures it in the profiling step, remat::Planned reads it on a CPU device). 0 by
  /// default. A policy's measured saved_bytes holds it already. Each replay (a forward of the stage after its
  /// first) holds it twice (the state it saves while it replays the first), as does the recompute a group
  /// assignment's backward runs first, at that recompute's peak (Simulation::op_recompute_peak_bytes).
  int64_t checkpoint_state_bytes = 0;
  /// Per chain stage j: what runs between stage j - 1 and stage j in the model's code (a decoder's embeddings
  /// between an encoder's layers and the decoder's; nothing in a chain whose stages hand their output
  /// straight to the next).
  /// - between_forward_held_bytes: what its forward leaves held (bytes: what it saves for its backward, stage
  ///   j's input; not what the stages take beside their input, which side_bytes charges), from stage j's
  ///   forward on; negative where it frees more (what the part before the chain held through the encoder's
  ///   forward in the model's variables, before_saved_bytes charges from the chain's start, and is freed as
  ///   the encoder returns: BART's with labels of 8).
  /// - between_backward_peak_bytes: the peak of its backward pass, which runs once stage j's backward is
  /// done,
  ///   above what is held then (bytes, >= 0), charged above the step as held when stage j's backward is done
  ///   (its input a_j still held), with every gradient arrived by then.
  /// - between_held_bytes: what its backward leaves held from then on beyond what the model of the step holds
  ///   (bytes; negative where it frees more): the gradients it allocates for parameters outside the stages,
  ///   less what it frees of what its forward left held and of what the model holds to the end of the
  ///   chain's backward (the gradient of what the stages take beside their input).
  /// Entry 0 is 0 (what runs before the chain is before_backward_peak_bytes). Empty, or one entry per stage.
  std::vector<int64_t> between_forward_held_bytes;
  std::vector<int64_t> between_backward_peak_bytes;
  std::vector<int64_t> between_held_bytes;
  /// Per chain stage j >= 1: whether what runs between stage j - 1 and stage j made stage j's input from
  /// stage j - 1's output and let go of that output there (a residual sum in the model's code: `x = x +
  /// layer(x)` over layers that do not add their own), as the Python package's profiling step reads it, every
  /// stage checkpointed. The between figures are read so: a way of stage j - 1 that holds its output itself
  /// (Fa whose graph saves it, Stage::saves_output; Fk under a policy, which may keep it among the matmuls'
  /// results; not streamed or a group assignment: held_past_between_bytes(), remat/planner/detail) keeps it
  /// beside stage j's input, and is charged output_bytes more from the end of its forward until stage j's
  /// backward (and what runs between, which lets go of that input) is done. Offloaded, where its offload cost
  /// sends the output (OffloadCost::output), likewise since 2026-12-06: the copy's source stays on the device
  /// until the copies are waited for, after stage j's forward, and the copy comes back at stage j's backward
  /// (a bound between the two; before, not charged: a residual MLP ending in sigmoids with a layer kept on
  /// the host peaked 2.7-3.7% above its prediction). Before (found
  /// 2026-12-02), such a way was charged as if the output were stage j's input: a residual MLP whose layers
  /// end in a sigmoid held output_bytes per kept layer above its prediction (7.0% with four layers kept), one
  /// whose layers were kept under the matmuls policy 9.6%; until a later change that day the charge ran to
  /// stage j - 1's own backward (above what it held there, on the safe side). Entry 0 is false. Empty (none
  /// let go of), or one entry per stage.
  std::vector<bool> between_frees_output;
  /// Whether the rest of the step made what it needs from the chain's output and let go of it in its forward
  /// (a residual sum outside the layers: `x = x + layer(x)` over the last layer, as the Python package reads
  /// it at the model's forward's end in the profiling step, every stage checkpointed). The rest's peak is
  /// read so: the last stage's way that holds its output itself keeps it beside what the rest makes, and is
  /// charged output_bytes more from the end of its forward until the rest's backward is done
  /// (between_frees_output's rule, held_past_between_bytes(), unless the runtime holds outputs or something
  /// holds the output to the step's end). Before (found 2026-12-02) it was not: a residual MLP whose last
  /// layer was kept under the matmuls policy held 5.4% above its prediction. False (the default): not let go
  /// of, or not read. (Read inside the model's forward only: a loss outside it that lets go of the output is
  /// not read.)
  bool rest_frees_output = false;
  /// Whether the rest of the step also takes the last stage's input (`x = x + layer(x)` over the last layer,
  /// a skip from that input to the head): its backward hands that input a gradient, held in its gradient
  /// buffer through the last stage's backward (for a sum, the chain's output gradient itself). Where the rest
  /// let go of the chain's output too (rest_frees_output), the last stage's backward is charged what holding
  /// that gradient adds (Stage::bwd_grad_held_bytes, detail::grad_held_bytes()), as between stages; where
  /// false (a head that casts the output under autocast and lets go of it, as BERT's), nothing. Before it
  /// (2026-12-03), BERT under CPU bf16 autocast was up to 1.8% below its prediction. The Python package reads
  /// it in the profiling step (the rest's autograd graph reaches the last stage's input without passing
  /// through the stage). True (the default, not read): charged so.
  bool rest_takes_last_input = true;
  /// Per chain stage j: whether the gradient the rest of the step hands the chain's output (d_n) is alive
  /// still once stage j's backward is done, held by something besides the stages: the rest also takes an
  /// earlier stage's input (a skip from a layer's input to the head, `return x + skip`), whose gradient its
  /// backward hands on as the same tensor (an add's backward passes one gradient to both), held in that
  /// input's gradient buffer until its stage's backward. Where true, d_n is charged (activation_bytes(n))
  /// from the end of stage j's backward until the end of the next backward whose entry is false, in
  /// step_op_peaks() and the per-layer program alike; the model lets go of it at the last stage's backward
  /// otherwise. The Python package reads its storage's liveness as each layer's input gradient is ready (the
  /// first layer's at the end of the backward pass) in the profiling step. Before (found 2026-12-02) it was
  /// not read: four feed-forward layers with such a skip held 2.9-3.7% above their prediction. Empty (none
  /// held), or one entry per stage.
  std::vector<bool> output_grad_held_in_backward;
  /// Whether the last stage's input, held past that stage's forward (inputs_held_in_forward's last entry
  /// true), was let go of before the rest of the step's forward ended: a residual sum over the last layer
  /// (`x = x + layer(x)`) makes its result while the input is alive and lets go of it after, which the rest's
  /// measured peak, read with the input held, does not say when. Where true and the last stage's input may go
  /// otherwise (inputs_held_in_forward's rule: run as Fa, not offloaded, not saving it, the stage before's
  /// way not holding it, nothing holding it in the backward pass), it is charged through the rest's forward
  /// and as gone from its end (the loss, the rest's backward and the last stage's backward without it), in
  /// step_op_peaks() and the per-layer program alike. The Python package reads it in the profiling step: the
  /// input's object dead before the model's forward ended and, for an input made by what ran between, its
  /// storage held by nothing but the stages' aliases. Before (found 2026-12-03) it was not read: four layers
  /// under `x = x + layer(x)` and CPU bf16 autocast, every layer kept, were 3.4% below their prediction
  /// after inputs_held_in_forward let go of the other layers' inputs. False (the default, not read): held.
  bool last_input_let_go_in_rest = false;
  /// Per chain stage j: whether what takes its output after it (what runs between it and the next stage,
  /// or the rest of the step for the last) hands that output the very gradient tensor its own path holds (an
  /// add's backward passes one gradient to both: `x = x + layer(x)` in one dtype), rather than a tensor of
  /// the output's own (a cast of it: under autocast, a bf16 layer output summed into an fp32 residual; a
  /// scaled copy). Only where it does is the stage's backward charged the gradient held through it
  /// (Stage::bwd_grad_held_bytes, detail::grad_held_bytes()): a copy is let go of once used, as profiled,
  /// and the path's own gradient is the one the model holds at the boundary already. The Python package
  /// reads it in the profiling step: between stages, whether the output's gradient is the next input's
  /// gradient tensor; for the last stage, whether its output has its input's dtype (the rest's sum then
  /// casts). Before (found 2026-12-03), layers ending in a GELU or a sigmoid under `x = x + layer(x)` and CPU
  /// bf16 autocast were 1.9-2.8% below their predictions on every plan keeping the last layer. Empty (all
  /// shared, the default: charged), or one entry per stage.
  std::vector<bool> residual_grad_shared;
  /// Tensors made before the chain that its stages take beside their input and that nothing but the stages
  /// holds once the model's forward has returned: the attention masks a decoder makes once per step
  /// (Gemma-2's sliding-window and full ones, each taken by alternate layers). Per tensor, its bytes (>= 0),
  /// of before_saved_bytes (together at most it), which charges each through the chain's forward. From the
  /// rest of the step on, a tensor is charged only while a stage holds it: a stage that takes it (taken_by)
  /// holds it until its backward is done where its way recomputes or runs under a policy (a checkpoint holds
  /// its arguments: Fc, Fk, a group assignment, on the device or the host) or where its plain graph saves it
  /// (taken_saved_by: every way holds it). So it is charged in the rest (forward and backward) where any
  /// stage holds it, in chain stage j's backward and recompute where a stage at or before j does, in what
  /// runs between stages j - 1 and j once stage j's backward is done where a stage before j does, and never
  /// in the backward of the part before the chain; step_op_peaks() and the per-layer program alike. At most
  /// kMaxTakenTensors. The Python package reads them in the profiling step: a tensor the layers take, made
  /// before them (not the chain's input; with a gradient or not, Zamba2's copy of the embeddings), that was
  /// let go of once the first layer that takes it had run its backward (every layer checkpointed). Before
  /// (2026-12-06) such tensors were charged to the step's end: a
  /// 4-layer GPT-OSS with every layer kept was predicted 131,520 bytes (both of its masks) above what it
  /// held. (The rest's measured peak is read as after the model's forward returned: a rest whose peak came
  /// inside the model's own code, before its return, would be charged them too little.) Empty: none.
  std::vector<int64_t> taken_bytes;
  /// Per tensor of taken_bytes, per chain stage: whether the stage takes it. One entry per tensor of
  /// taken_bytes, each empty (taken by none) or one entry per stage.
  std::vector<std::vector<bool>> taken_by;
  /// Per tensor of taken_bytes, per chain stage: whether the stage's plain forward's graph saves it (an
  /// attention kernel's mask; an additive mask is not saved), so that it holds it whatever its way. As
  /// taken_by; empty entries where none saves it.
  std::vector<std::vector<bool>> taken_saved_by;
};

/// The most tensors StepContext::taken_bytes lists.
constexpr size_t kMaxTakenTensors = 4;

/// What a meter read at named points of one training step around a chain with every stage checkpointed (a
/// profiling step), turned into a StepContext by step_context(). Counts are a meter's running count of tensor
/// bytes at those points (any origin: only differences are used); remat::Planned (C++) and the Python
/// package's in-place planning take the same readings and turn them into a context with the same code.
struct StepReadings {
  /// The budget's base point: the count when the step begins. remat::Planned's is its forward() call, the
  /// chain's input alive (input_in_base); the Python package's is the model's forward call, before the
  /// chain's input exists.
  int64_t base = 0;
  bool input_in_base = false;
  /// The count when the chain's first stage starts, and the highest count from the base to then (bytes).
  int64_t at_chain = 0;
  int64_t peak_before_chain = 0;
  /// The chain's input (bytes).
  int64_t input_bytes = 0;
  /// The count when the chain returns; the highest count from then until the backward pass hands the chain's
  /// output its gradient, that gradient included; the count at that moment, the gradient's bytes, and the
  /// time between (milliseconds).
  int64_t at_return = 0;
  int64_t rest_peak = 0;
  int64_t at_output_grad = 0;
  int64_t output_grad_bytes = 0;
  double rest_ms = 0;
  /// The bytes of the storage that gradient is a view of, or -1 (not read: taken as the gradient's own).
  /// Less than output_grad_bytes where the gradient is an expanded view: a sum's backward hands the chain's
  /// output the loss's one-element gradient broadcast to the output's shape, which the backward pass holds to
  /// its end. step_context() then leaves that storage in rest_grads_bytes (held to the step's end) rather
  /// than taking output_grad_bytes off it, and reads output_grad_held_in_backward as all false (the
  /// gradient a stage's backward materializes is charged as the chain's output gradient until the last
  /// stage's backward, as a whole one). Before (found 2026-12-03), output_grad_bytes was taken off the count
  /// whatever its storage held: a rest of the step with a parameter beside such a sum read its gradient as
  /// not held, and four kept layers held 2.5% above their prediction.
  int64_t output_grad_storage_bytes = -1;
  /// The chain's output's bytes (its storage's) where that storage was freed by the time the rest handed it
  /// its gradient (the rest's backward let go of it and nothing else held it), else 0 (alive, or not read):
  /// at_output_grad is then that much lower than what the rest leaves held (StepContext::rest_grads_bytes,
  /// output_held_in_backward).
  int64_t output_freed_bytes = 0;
  /// What a checkpointed stage holds beside its input and output until its backward is done
  /// (StepContext::checkpoint_state_bytes; bytes, 0 where not read).
  int64_t checkpoint_state_bytes = 0;
  /// Per chain stage: whether its output was alive at the end of the step's backward pass
  /// (StepContext::outputs_held_to_end; empty where not read).
  std::vector<bool> outputs_held_to_end;
  /// The highest count from the chain's input gradient to the step's end (the backward pass of what runs
  /// before the chain), or -1 when that part has no backward.
  int64_t peak_after_chain_backward = -1;
  /// The highest count of the whole step (the profiler's own transients left out), or -1 when not read.
  int64_t step_peak = -1;
  /// Per chain stage: the parameter gradients its backward allocates (bytes; 0 for gradients alive before).
  std::vector<int64_t> stage_grads_bytes;
  /// What the stages take or hand on beside their input and output (StepContext::side_bytes; bytes), and of
  /// it per stage the gradients that arrive at its backward (StepContext::side_grads_bytes; empty where not
  /// read).
  int64_t side_bytes = 0;
  std::vector<int64_t> side_grads_bytes;
  /// Per chain stage: of side_grads_bytes' entry, what arrived after its backward's peak
  /// (StepContext::side_grads_late_bytes; empty where not read).
  std::vector<int64_t> side_grads_late_bytes;
  /// Per chain stage: of side_bytes, what was let go of once its backward was done
  /// (StepContext::side_freed_bytes; empty where not read).
  std::vector<int64_t> side_freed_bytes;
  /// Whether the chain's input was alive once the first stage's backward was done (or, where the part before
  /// the chain has no backward, at the step's end; StepContext::input_held_in_backward). True when not read.
  bool input_held_in_backward = true;
  /// Whether the chain's input, alive when the chain returned, was freed by the time the rest handed the
  /// chain's output its gradient (false where not read): the model's forward held it in a variable until it
  /// returned, and no stage's way holds it (its first stage has no backward: frozen, on an input that needs
  /// no gradient). The rest's readings (rest_peak, at_output_grad) have let go of it already, so
  /// step_context() reads it as held in the backward pass (input_held_in_backward): the model, which would
  /// let go of it from the loss on, lets go of it once. Before (found 2026-12-03), it was let go of twice: a
  /// model with its embeddings and first layer frozen held its input's bytes above its prediction (3.0-4.0%
  /// on four feed-forward layers, 0.7-1.0% on the frozen-layer bench's Llama).
  bool input_freed_in_rest = false;
  /// Per chain stage: whether its input was alive once its backward was done (StepContext::
  /// outputs_held_in_backward; empty where not read).
  std::vector<bool> outputs_held_in_backward;
  /// Per chain stage: whether its input was alive past its forward (StepContext::inputs_held_in_forward;
  /// empty where not read).
  std::vector<bool> inputs_held_in_forward;
  /// Per chain stage: what runs between the stage before it and it, what its forward left held, its backward
  /// pass's peak above the count when it began, and what that left held beyond the model
  /// (StepContext::between_forward_held_bytes, between_backward_peak_bytes, between_held_bytes; bytes). Empty
  /// where not read.
  std::vector<int64_t> between_forward_held_bytes;
  std::vector<int64_t> between_backward_peak_bytes;
  std::vector<int64_t> between_held_bytes;
  /// Per chain stage: whether what runs between the stage before it and it let go of that stage's output
  /// (StepContext::between_frees_output; empty where not read).
  std::vector<bool> between_frees_output;
  /// Whether the rest of the step let go of the chain's output in its forward (StepContext::
  /// rest_frees_output; false where not read).
  bool rest_frees_output = false;
  /// Whether the rest of the step also takes the last stage's input (StepContext::rest_takes_last_input;
  /// true where not read).
  bool rest_takes_last_input = true;
  /// Per chain stage: whether the chain's output gradient was alive once its backward was done
  /// (StepContext::output_grad_held_in_backward; empty where not read).
  std::vector<bool> output_grad_held_in_backward;
  /// Whether the last stage's input was let go of in the rest's forward (StepContext::
  /// last_input_let_go_in_rest; false where not read).
  bool last_input_let_go_in_rest = false;
  /// Per chain stage: whether what takes its output after it hands it its own path's gradient tensor
  /// (StepContext::residual_grad_shared; empty where not read).
  std::vector<bool> residual_grad_shared;
};

/// The StepContext of `readings`: before_saved_bytes (what the part before the chain holds at the chain's
/// start besides its input; 0 with input_in_base), before_peak_bytes and before_backward_peak_bytes above the
/// base, rest_peak_bytes above the chain's return, rest_ms, rest_grads_bytes (what the rest's backward leaves
/// held besides the output's gradient, the output it let go of counted back; signed, at least
/// -before_saved_bytes), output_held_in_backward (false
/// where output_freed_bytes > 0), checkpoint_state_bytes, stage_grads_bytes, and checkpoint_all_peak_bytes
/// (step_peak above the base), side_bytes, side_grads_bytes, side_freed_bytes, input_held_in_backward (held
/// whatever was read with input_freed_in_rest)
/// and the between figures as read (what the forward and the backward between leave held signed; a
/// backward's peak below 0 read as 0). Other negative differences are read as 0. Throws std::invalid_argument
/// naming remat::step_context for a negative input_bytes, output_grad_bytes, output_freed_bytes,
/// checkpoint_state_bytes, side_bytes or rest_ms, an output_grad_storage_bytes below -1, or between
/// figures of other sizes than each other or stage_grads_bytes (when that is not empty).
StepContext step_context(const StepReadings& readings);

/// The gradients of parameters outside the chain's stages (an embedding's, a head's) that a step makes beyond
/// those the step a StepContext was measured in made (bytes; negative: fewer, where they existed when the
/// step began, as at gradient accumulation's later micro-batches), by where its backward pass makes them.
struct GradsOutside {
  /// Made by the rest's backward, before the chain's (a head's): held from there to the step's end.
  int64_t rest_bytes = 0;
  /// Made while the chain's backward runs (by what runs between two stages: an encoder's final norm).
  int64_t between_bytes = 0;
  /// Made after the chain's backward, by the part before the chain (embeddings).
  int64_t before_bytes = 0;
};

/// The context of a step that begins in another state of the parameter gradients than the step `context` was
/// measured in (gradient accumulation: the first micro-batch's backward makes the gradients, the others add
/// to them): stage_grads_bytes (per stage, the gradients its backward makes in that state, bytes) replaced;
/// before_backward_peak_bytes, measured once the chain's backward is done and every stage's gradients are
/// held, moved by the stages' difference either way, and likewise by `outside`'s rest and between gradients,
/// and raised by its before gradients (an upper bound: the part before's peak can come before they are made;
/// not lowered where fewer, for that reason); rest_grads_bytes moved by `outside.rest_bytes` either way and
/// raised by more between gradients (charged from the rest's backward on: an upper bound); and
/// checkpoint_all_peak_bytes, the measured peak, raised by the gradients the state makes beyond the measured
/// one's (an upper bound: its peak can come before all of them are made), as measured where it makes fewer.
/// Before 2026-12-07 only stage_grads_bytes and checkpoint_all_peak_bytes moved: a step of a state that makes
/// more gradients than the measured one held them above its prediction in the part before's backward (a small
/// BERT's masked-LM step profiled at a second micro-batch, 27% above at a first one), and one that makes
/// fewer was predicted with them. Throws std::invalid_argument naming remat::context_for_grads for a negative
/// entry or one of another size than context.stage_grads_bytes (when that is not empty).
StepContext context_for_grads(const StepContext& context, const std::vector<int64_t>& stage_grads_bytes,
                              const GradsOutside& outside = {});

/// Checks a context against its chain: no negative value (but between_held_bytes and
/// between_forward_held_bytes), every per-stage figure
/// (stage_grads_bytes, side_grads_bytes, side_freed_bytes, the flags per stage, the between figures) empty or
/// of the chain's size, side_grads_bytes and side_freed_bytes each at most side_bytes in all, the between
/// figures' entry 0 zero. Throws std::invalid_argument naming remat::StepContext, the field and the value.
void validate(const StepContext& context, const Chain& chain);

/// The whole step as a chain for simulate(): stage 0 what comes before the chain (its output the chain's
/// input, holding before_saved_bytes more), the chain's stages, and last the rest of the step, charged as
/// holding its peak, less the output's gradient that simulate() adds at its backward, from its forward to its
/// backward (an upper bound: the loss and what it saves are usually gone sooner). Throws as validate().
Chain step_chain(const Chain& chain, const StepContext& context);

/// The step's predicted peak above its base under `plan` (a plan for `chain`, bytes): the largest of
/// before_peak_bytes, before_backward_peak_bytes and every operation of step_plan(plan) on step_chain(),
/// each with the gradients allocated by then (a stage's from its backward operation on, the rest's after the
/// rest's backward, what runs between two stages' after its backward: between_held_bytes), what runs between
/// two stages in the forward (between_forward_held_bytes) from the later one's forward on and in the backward
/// (between_backward_peak_bytes) after the later one's backward, less the chain's input when input_in_base.
/// Throws as validate() and simulate().
int64_t step_peak_bytes(const Chain& chain, const StepContext& context, const Plan& plan);

/// The step's predicted time under `plan` (milliseconds), as plan_step(..., "per-layer") charges it: a
/// checkpointed stage by its per-call figures (Stage::per_call_fwd_ms(), per_call_bwd_ms(): its recompute
/// stops early), the copies to and from the host that no neighbouring stage's work hides, and
/// context.rest_ms; the step_time_ms plan_step() reports for a plan it chooses, for any per-layer plan (a
/// plan of another profile's, a given one). simulate()'s time_ms charges a checkpointed stage its forward and
/// its whole recompute instead. `plan` must be a per-layer plan: each stage's forward once, in order (Fa, Fc,
/// Fk with a policy the plan names, keep tags or a group assignment; @host, @stream), the loss, then each
/// stage's backward from the last, a checkpointed stage recomputed (Fa) right before it. Throws
/// std::invalid_argument as validate() and check_plan(), for a plan of another size or shape, and naming the
/// stage for a way the chain has no figures for (offloading, a group assignment or a policy not profiled).
double step_time_ms(const Chain& chain, const StepContext& context, const Plan& plan);

/// A plan for the whole step and its predicted peak.
struct StepPlan {
  Plan plan;                    ///< a plan for the chain (plan.predicted is the chain's own)
  int64_t step_peak_bytes = 0;  ///< step_peak_bytes(chain, context, plan) (bytes)
  double step_time_ms = 0;      ///< plan.predicted.time_ms + context.rest_ms (milliseconds)
};

/// A plan whose step_peak_bytes() is within budget_bytes. `planner` is "per-layer" (each stage kept, kept
/// under an Fk variant, or checkpointed on its own): exactly the fastest such plan, per_layer()'s program run
/// on the whole step (step_chain() with each stage's gradients charged). Or "optimal" (any schedule,
/// recomputation across stages included): the fastest plan of optimal()'s frontier that fits, found by
/// lowering the chain's budget one frontier plan at a time from budget_bytes (plus the input when
/// input_in_base), then, after 256 plans, by what the step's prediction exceeds; a schedule that is slower
/// for the chain alone yet lower for the step is not considered. Throws InfeasibleBudget naming
/// remat::plan_step, the budget and the least feasible one (min_step_budget()) when nothing fits,
/// std::invalid_argument for another planner name, and as validate() and the planner.
StepPlan plan_step(const Chain& chain, const StepContext& context, int64_t budget_bytes,
                   const std::string& planner = "optimal", const PlannerOptions& options = {});

/// The least feasible budget plan_step() names with this planner (bytes): for "per-layer" the least step peak
/// of any per-layer plan, exactly; for "optimal" the step's peak under optimal()'s least-memory plan for the
/// chain, which plan_step() accepts and may go below (its walk down the chain's frontier can find a plan that
/// needs more for the chain alone and less in the step). Throws as plan_step().
int64_t min_step_budget(const Chain& chain, const StepContext& context,
                        const std::string& planner = "optimal", const PlannerOptions& options = {});

/// The tolerance of check_prediction() by default: 2% of the prediction.
inline constexpr double kPredictionTolerance = 0.02;

/// A planned model's input shapes (each profiled in its own first training step, which takes about three to
/// four planned steps' time) at which a warning says what the shapes have cost and how to have fewer (batches
/// padded to a few lengths): remat::Planned and the Python package's LayerPlan each warn once, as the step of
/// this many-th shape begins.
inline constexpr int kProfiledShapesWarnedAt = 8;

/// A planned model's input shape: the sizes of each tensor its training call takes (the input's, then the
/// others' in order).
using InputShape = std::vector<std::vector<int64_t>>;

/// The shape whose plan a training step of a new input shape `shape` runs, instead of profiling it
/// (remat::Planned's PlannedOptions::borrow_plans and the Python package's borrow_plans, both on by default):
/// among `planned`, a shape that covers it (as many tensors, each of the same rank and no size of it smaller
/// than `shape`'s), the one with the fewest elements in all, the first of those on a tie; -1 when none covers
/// it. A step of a covered shape makes no tensor larger than the covering shape's step made, so its plan's
/// predicted peak bounds it (where a model's memory grows with its inputs' sizes; the runtimes measure it).
/// Throws std::invalid_argument when a size is negative.
int64_t covering_shape(const std::vector<InputShape>& planned, const InputShape& shape);

/// A planned step's measured peak against its prediction, and what a runtime does about it (the rule both
/// use: remat::Planned and the Python package's LayerPlan).
struct PredictionCheck {
  double error = 0;  ///< (measured - predicted) / predicted: above 0 when the step held more than predicted
  bool beyond = false;  ///< |error| > the tolerance
  /// When the step held more than predicted beyond the tolerance: the budget to plan again for, the budget
  /// less the overshoot (measured - predicted; bytes, 0 when the overshoot takes it all), so that the next
  /// plan, held above its own prediction as much, stays within the budget. -1 otherwise: a step that held
  /// less is not planned again for more, since nothing measured says a faster plan would fit.
  int64_t replan_budget_bytes = -1;
};

/// Checks a planned step's measured peak (`measured_bytes`, >= 0) against its prediction (`predicted_bytes`,
/// > 0) under `budget_bytes` (> 0), with `tolerance` a share of the prediction (finite, >= 0). Throws
/// std::invalid_argument naming remat::check_prediction and the value otherwise.
PredictionCheck check_prediction(int64_t predicted_bytes, int64_t measured_bytes, int64_t budget_bytes,
                                 double tolerance = kPredictionTolerance);

}  // namespace remat

// plan_figures() and set_plan_figures(), declared here before they had a header of their own.
#include <remat/planner/figures.h>
