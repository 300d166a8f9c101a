#pragma once
/// \file
/// A Plan is a schedule as data: a sequence of operations over stage indices, in the vocabulary of
/// Beaumont et al. 2019 (rotor). simulate() charges it against a Chain: the single source of predicted
/// figures. No torch headers.
///
///   remat::Plan plan = remat::optimal(chain, 512 << 20);
///   std::cout << plan.to_string();                      // "Fc0 Fn1 Fa2 L B2 Fa1 B1 Fa0 B0"
///   remat::Simulation sim = remat::simulate(chain, plan);  // peak_bytes, time_ms, forward_calls
///
/// Operations and how simulate() charges them (sizes as in remat/planner/chain.h; "resident" is everything
/// held when the operation starts, always including the chain's input a_0):
/// - Fn(i), forward without keeping anything: needs a_i (or abar_i); peak = resident + a_{i+1} +
///   nosave_tmp_i (Stage::nosave_tmp_bytes(): fwd_nosave_tmp_bytes, or fwd_tmp_bytes when unmeasured);
///   afterwards a_{i+1} is held and a_i is freed if it was held as a plain a_i (never a_0).
/// - Fc(i), forward keeping its input (a checkpoint): as Fn(i), but a_i stays.
/// - Fa(i), forward keeping everything for backward: needs a_i; peak = resident + abar_{i+1} + fwd_tmp_i;
///   afterwards abar_{i+1} is held (it includes a_{i+1}) and a_i stays.
/// - Fk(i), forward keeping only its kept calls' outputs (remat::checkpoint with CheckpointOptions::keep,
///   e.g. a layer's matrix multiplications): needs a_i and a stage with keep_ fields (Stage::has_keep);
///   peak = resident + keep_saved_bytes_{i+1} + Stage::keep_fwd_tmp_bytes(keep_saved_bytes_{i+1}) (at most
///   what it holds above them: fwd_tmp_i for a chain without fwd_nosave_tmp_bytes); afterwards those bytes
///   are held (they include a_{i+1}) and a_i stays. Time keep_fwd_ms.
/// - L, the loss: needs a_n; creates d_n (size a_n) at zero time; a_n is freed if held as a plain a_n.
/// - B(i), backward: needs abar_{i+1}, d_{i+1} and a_i (or abar_i); peak = resident + d_i + bwd_tmp_i;
///   afterwards abar_{i+1} and d_{i+1} are freed, and a_i too if it was held as a plain a_i (never a_0).
///   After Fk(i), B(i) first recomputes the rest of abar_{i+1}: peak = resident + (saved_bytes_{i+1} -
///   keep_saved_bytes_{i+1}) + max(d_i + bwd_tmp_i, fwd_tmp_i) (the recompute holds its forward's transient,
///   the backward d_i and its own; the larger since 2026-12-03), time keep_bwd_ms (recompute and backward)
///   instead of bwd_ms. A group assignment (Fk(i){khr}) the same, with what it keeps and sends for
///   keep_saved_bytes.
/// Time is the sum over every forward that runs (recomputations count each time) of its cost, fwd_ms for Fa
/// and Stage::nosave_ms() (fwd_nosave_ms, which the profiler measures under no-grad) for Fn and Fc, plus the
/// sum of bwd_ms.
///
/// Offloading (written with "@host": Fa3@host, Fk3[matmuls]@host, Fc3@host; before the loss only, a stage's
/// only forward there): the forward is charged as without it; what the stage's OffloadCost says goes to host
/// memory (its bytes, its input when it saves it, its output when it saves it) is copied from the start of
/// its own forward (once one link, shared by all copies to the host, has finished the copies before it)
/// through the next forward, and leaves the device when that forward ends (its input only if the stage before
/// does not hold it there: that stage ran without offloading and saves its output, or its OffloadCost is
/// unknown; never a_0). It comes back when the backward pass first reaches the stage after it (a recompute or
/// a backward of stage i + 1) or the stage itself, and is on the device from then on. Time adds what the
/// copies do not hide: the copy to the host beyond its own forward (from when the link was free) and the next
/// forward (what is left of it when the loss comes next: the runtimes wait for it there), the copy back
/// beyond the time of the operations between its return and the stage's first backward-phase operation. The
/// bandwidths are the chain's (Chain::to_host_gb_per_s, to_device_gb_per_s). Simulation::host_peak_bytes
/// counts what is on the host, each offloaded stage's bytes from its forward until its backward.

#include <cstdint>
#include <string>
#include <vector>

namespace remat {

struct Chain;

/// The kinds of operation.
enum class OpKind {
  kForwardNoSave,      ///< Fn(i)
  kForwardCheckpoint,  ///< Fc(i)
  kForwardAll,         ///< Fa(i)
  kLoss,               ///< L
  kBackward,           ///< B(i)
  kForwardKeep,        ///< Fk(i)
};

/// One operation; stage is -1 for the loss.
struct Op {
  OpKind kind = OpKind::kForwardNoSave;  ///< what it does
  int64_t stage = -1;                    ///< the stage it runs, in [0, num_stages); -1 for the loss
  /// Fk only: the operator-level policy it keeps with (an index into Plan::policies; written Fk3[matmuls]),
  /// or -1 for the remat::keep tags of Plan::keep (written Fk3).
  int32_t policy = -1;
  /// Fa, Fk, Fc before the loss: what the stage saves goes to host memory and comes back for its backward
  /// (written with "@host": Fa3@host).
  bool offload = false;
  /// Fk only, before the loss: a group assignment (written Fk3{khr}): one character per group of the
  /// stage's saved tensors (Stage::groups), 'k' kept on the device, 'h' sent to the host, 'r' recomputed; the
  /// stage runs as a checkpoint whose recompute skips the kept and sent calls (remat::group_cost). Its sent
  /// groups are offloaded as `@host` offloads (see simulate()); such an op carries no policy and no @host.
  /// Empty: not one.
  std::string groups{};
  /// Fa only, before the loss: streamed (written "@stream": Fa3@stream): what the stage saves goes to host
  /// memory as its forward makes it and comes back tensor by tensor, each just ahead of its use in the
  /// stage's backward, at most the stage's window in flight each way (the stage offload's stream figures, see
  /// simulate()). Not with offload: an op is one or the other. Written "@stream0" (Fa3@stream0) where the
  /// plan's window for the stage (Plan::stream_windows) is 0: streamed with no window.
  bool stream = false;
  /// Whether it sends anything to the host: offload, stream, or a group assignment with an 'h'.
  bool offloads() const { return offload || stream || groups.find('h') != std::string::npos; }
  bool operator==(const Op& o) const {
    return kind == o.kind && stage == o.stage && policy == o.policy && offload == o.offload &&
           stream == o.stream && groups == o.groups;
  }
  bool operator!=(const Op& o) const { return !(*this == o); }
};

/// Predicted figures of a plan on a chain (what simulate() returns).
struct Simulation {
  int64_t peak_bytes = 0;              ///< highest memory held during the plan, a_0 included (bytes)
  double time_ms = 0;                  ///< forward and backward time (milliseconds)
  std::vector<int64_t> forward_calls;  ///< how many times each stage's forward runs
  int64_t peak_op = -1;                ///< index in ops of the operation at the peak
  std::vector<int64_t> op_peak_bytes;  ///< the peak during each operation, in the order of ops (bytes)
  /// What is held once each operation is done, in the order of ops (bytes); for a backward B_i, with a_i
  /// still held where a recompute alone held it (the plan lets it go right after).
  std::vector<int64_t> op_done_bytes;
  /// For a backward B_i that first recomputes what its way did not keep (Fk with keep tags or a group
  /// assignment), the peak while that recompute runs (bytes; op_peak_bytes holds the larger of it and the
  /// backward's own); 0 for every other operation. The step's model adds to it what only a recompute holds.
  std::vector<int64_t> op_recompute_peak_bytes;
  /// For the same backwards, what is held as that recompute ends (bytes: what Fa saves, made again, and the
  /// forward's transient, beside what the way kept; at most op_recompute_peak_bytes, which is the larger of
  /// it and what is held as the recompute begins), and the peak of the backward proper after it (bytes;
  /// op_peak_bytes is the larger of it and op_recompute_peak_bytes); 0 for every other operation. The step's
  /// model charges the two apart: the recompute with the gradients made before it and the output it makes
  /// anew where the step let go of the first one, the backward with those at its peak.
  std::vector<int64_t> op_recompute_end_bytes;
  std::vector<int64_t> op_backward_peak_bytes;
  /// When each operation ends, in the order of ops (milliseconds from the plan's start: time_ms so far, the
  /// copies no computation hides included; all 0 without a chain, as check_plan() runs it).
  std::vector<double> op_end_ms;
  int64_t host_peak_bytes = 0;  ///< the most held in host memory by offloaded stages at once (bytes)
  double transfer_ms = 0;  ///< of time_ms, the copies to and from the host that no computation hides (ms)
};

/// A schedule for a chain of num_stages stages.
struct Plan {
  int64_t num_stages = 0;
  std::vector<Op> ops;
  std::string planner;       ///< the planner that made it ("optimal", "uniform:4", ...); free text
  int64_t budget_bytes = 0;  ///< the budget it was made for; 0 when none (bytes)
  Simulation predicted;      ///< filled by the planners through simulate(); empty for a hand-made plan
  /// The remat::keep tags Fk runs its stages with (the chain's Chain::keep); empty when the plan has no Fk.
  std::vector<std::string> keep;
  /// The operator-level policies its Fk[name] operations keep with (names; Op::policy indexes this).
  std::vector<std::string> policies;
  /// Per stage, the names of its saved groups (the chain's Stage::groups' SavedGroup::name, in order), which
  /// its Fk{...} operations assign: what the runtime runs them by (remat::group_policy). The planners fill it
  /// when the plan has a group assignment; empty otherwise (and in a plan parsed from text, which the
  /// executor then refuses to run with a group assignment).
  std::vector<std::vector<std::string>> group_names;
  /// Per stage, the window its streamed run holds in flight each way (bytes; -1 where it is not streamed):
  /// what the runtime runs an Fa3@stream with (OffloadOptions::window) and simulate() charges. per_layer()
  /// chooses, per streamed stage, the chain's OffloadCost::window_bytes (copies hidden behind the work
  /// around them, as @host's) or 0: no window, each copy waited for as the forward makes it and each tensor
  /// brought back when its backward asks for it, so the stage holds its working set only and the copies'
  /// whole time is charged. The planners fill it when the plan streams a stage; empty otherwise (and in a
  /// plan parsed from text, which the executor then refuses to run with @stream; simulate() then charges
  /// the chain's window). An operation written @stream0 gives its stage 0 here (plan_from_json).
  std::vector<int64_t> stream_windows;

  /// "Fc0 Fn1 Fa2 Fk3[matmuls] L B3 ...": operations separated by spaces.
  std::string to_string() const;
  /// Number of operations of the given kind.
  int64_t count(OpKind kind) const;
};

/// Short name of an operation kind: "Fn", "Fc", "Fa", "Fk", "L", "B".
std::string op_name(OpKind kind);

/// The text of one operation of `plan`: "Fn3", "Fk5", "Fk5[matmuls]", "Fa2@host", "L".
std::string op_text(const Plan& plan, const Op& op);

/// One point of a plan's offload schedule (offload_schedule()): what a runtime does about an offloaded
/// stage's copies.
struct OffloadPoint {
  enum class Action {
    kWaitToHost,  ///< wait for the stage's copies to the host; what they freed leaves the device
    kStartBack,   ///< start bringing the stage's tensors back to the device
  };
  Action action = Action::kWaitToHost;
  int64_t stage = -1;  ///< the offloaded stage
  bool operator==(const OffloadPoint& o) const { return action == o.action && stage == o.stage; }
  bool operator!=(const OffloadPoint& o) const { return !(*this == o); }
};

/// When the copies of a plan's offloaded stages are waited for and brought back: the one schedule that
/// simulate() charges and both runtimes carry out (remat::run_plan, and the Python package's planned layers).
/// A stage's copies to the host start with its forward; they are waited for once the next forward of another
/// stage has run (`after` that operation); when the loss comes first, before the first operation after the
/// loss of the stage or of the one after it, and brought back there. Otherwise they start coming back before
/// the first operation after the loss of the stage after it (or of the stage itself, when that comes
/// first): `before` that operation. Within a stage's backward each tensor is waited for where it is used.
struct OffloadSchedule {
  std::vector<std::vector<OffloadPoint>> before;  ///< per operation of the plan: before it runs
  std::vector<std::vector<OffloadPoint>> after;   ///< per operation of the plan: once it has run
};

/// The plan's offload schedule (see OffloadSchedule; empty lists for a plan that offloads nothing). Throws
/// std::invalid_argument as check_plan().
OffloadSchedule offload_schedule(const Plan& plan);

/// Checks that a plan computes every gradient in the model of this file: each operation finds what it
/// needs, the loss comes once after a_n exists, and the plan ends with d_0; every Fk[name] names one of
/// plan.policies; an offloaded operation is an Fa, Fk or Fc before the loss and its stage's only forward
/// there. Throws std::invalid_argument naming remat::check_plan, the operation's index and text, and what is
/// missing.
void check_plan(const Plan& plan);

/// Charges the plan against the chain (see the top of this file); Fk[name] is charged what the chain measured
/// under that policy (Stage::policies). Throws std::invalid_argument when the chain is invalid
/// (remat::validate), when its size differs from plan.num_stages, when an Fk runs a stage the chain has no
/// costs for (no keep_ fields, or not profiled under the policy), when an offloaded operation has no
/// OffloadCost for its way of running the stage or the chain no bandwidths, or as check_plan.
Simulation simulate(const Chain& chain, const Plan& plan);

/// Checkpoints exactly the stages listed, each on its own: a listed stage keeps only its input in the
/// forward pass and is recomputed right before its backward; every other stage keeps its activations
/// (selective checkpointing, e.g. only the attention cores of a transformer's sub-layer stages). Needs no
/// chain. Throws std::invalid_argument naming the stage when one is out of [0, num_stages) or listed twice,
/// and when num_stages < 1.
Plan checkpoint_stages(int64_t num_stages, const std::vector<int64_t>& stages);

/// The predicted step time when the stages listed are each checkpointed by its own remat::checkpoint call
/// (kNonReentrant, as gradient_checkpointing_enable does per layer) and the others run plainly: the sum of
/// fwd_ms + bwd_ms over plain stages and of Stage::per_call_fwd_ms() + per_call_bwd_ms() over the listed
/// ones (their recompute with early stopping, as the profiler measured it). The peak is that of
/// simulate(chain, checkpoint_stages(...)). Milliseconds. Throws std::invalid_argument as validate() and
/// checkpoint_stages().
double per_call_time_ms(const Chain& chain, const std::vector<int64_t>& stages);

/// The whole training step around a plan for a chain that sits inside a bigger model: stage 0 is everything
/// before the chain (the prefix), stages 1..n the chain, stage n+1 everything after it up to the loss (the
/// suffix). The prefix and suffix run once and keep what they save, as without checkpointing:
/// Fa0, chain_plan's forward operations shifted by one, Fa(n+1), L, B(n+1), the rest shifted, B0.
/// simulate(step_chain, step_plan(plan)) predicts the step's peak as a meter sees it (the model's input
/// included), beside simulate(chain, plan) for the chain alone. Throws as check_plan for an invalid plan.
Plan step_plan(const Plan& chain_plan);

/// The plan as JSON: {"num_stages": n, "planner": "...", "budget_bytes": N, "ops": ["Fc0", "Fn1", ..., "L",
/// "B0"], "predicted": {"peak_bytes": N, "time_ms": x, "forward_calls": [..]}}, plus "keep": ["matmul"] for
/// a plan with Fk, "policies": ["matmuls"] for one with Fk[matmuls], "group_names": [[], ["aten::linear#0",
/// ...], ...] for one with group names (Plan::group_names), "stream_windows": [-1, 65536, ...] for one with
/// stream windows (Plan::stream_windows), and in "predicted" "host_peak_bytes" and
/// "transfer_ms" for one that offloads.
std::string to_json(const Plan& plan);

/// Parses that JSON ("predicted", "keep", "group_names" and "stream_windows" optional; "policies" optional,
/// the Fk[name] operations naming them) and checks the plan. An operation written "@stream0" sets its
/// stage's window to 0 (filling "stream_windows" with -1 elsewhere when it is absent). Throws
/// std::invalid_argument naming the problem: malformed JSON, a missing key, an unknown operation, an
/// "@stream0" operation whose stage "stream_windows" gives another window, or what check_plan rejects.
Plan plan_from_json(const std::string& json);

/// Parses one operation: "Fn3", "Fc0", "Fa12", "Fk5", "L", "B4", and with "@host" after an Fa, Fk or Fc
/// ("Fa12@host"), "@stream" or "@stream0" after an Fa (both give Op::stream; the window is the plan's),
/// "Fk5{khr}". Throws std::invalid_argument for anything
/// else, and for "Fk5[name]" (parse it with the plan's policies, below).
Op parse_op(const std::string& text);

/// Parses one operation of a plan whose policies are `policies`: also "Fk5[name]", whose name is appended to
/// `policies` when it is not there yet. Throws std::invalid_argument as above, and for an invalid name.
Op parse_op(const std::string& text, std::vector<std::string>& policies);

}  // namespace remat
