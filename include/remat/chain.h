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
/// remat/plan.h for how a schedule is charged.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace remat {

/// What a stage costs run as Fk under one operator-level policy (remat/policy.h; Fk[name] in a plan), as the
/// profiler measured it with ProfileOptions::policies.
struct PolicyCost {
  std::string policy;       ///< the policy's name ("matmuls")
  int64_t saved_bytes = 0;  ///< alive after the stage runs so (its output and the kept outputs; bytes)
  double fwd_ms = 0;        ///< its forward (milliseconds)
  double bwd_ms = 0;        ///< its recompute of the rest plus its backward (milliseconds)
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
  int64_t bwd_tmp_bytes =
      0;  ///< transient peak during its backward, above its inputs, outputs and d_i (bytes)
  /// The forward without saving for backward, as the plan executor runs Fn and Fc (under no-grad;
  /// milliseconds). Unset: fwd_ms (fwd_ms is then the cost of every forward, as before these fields).
  std::optional<double> fwd_nosave_ms;
  /// The stage's forward under remat::checkpoint (kNonReentrant: run with grad, nothing saved;
  /// milliseconds). Unset: fwd_nosave_ms.
  std::optional<double> checkpoint_fwd_ms;
  /// The stage's backward under remat::checkpoint: its recompute (early stopping included) plus its
  /// backward (milliseconds). Unset: fwd_ms + bwd_ms.
  std::optional<double> checkpoint_bwd_ms;
  /// The stage run by Fk (remat/plan.h): under remat::checkpoint with CheckpointOptions::keep(Chain::keep),
  /// so that it keeps only the outputs of its kept calls (its matrix multiplications). keep_saved_bytes is
  /// what that leaves alive (its output plus the kept outputs; bytes, between output_bytes and
  /// saved_bytes), keep_fwd_ms its forward, keep_bwd_ms its recompute of the rest plus its backward
  /// (milliseconds). All three set, or none: a stage without them has no Fk.
  std::optional<int64_t> keep_saved_bytes;
  std::optional<double> keep_fwd_ms;  ///< see keep_saved_bytes
  std::optional<double> keep_bwd_ms;  ///< see keep_saved_bytes

  /// Fk under each of the chain's policies (Chain::policies), in its order; empty when the stage was not
  /// profiled under them (no Fk[name] for it).
  std::vector<PolicyCost> policies;

  /// Whether the stage has the three keep_ fields (Fk can run it).
  bool has_keep() const { return keep_saved_bytes.has_value(); }
  /// What Fn and Fc cost: fwd_nosave_ms, or fwd_ms when unset (milliseconds).
  double nosave_ms() const { return fwd_nosave_ms ? *fwd_nosave_ms : fwd_ms; }
  /// The forward of a stage checkpointed by remat::checkpoint (milliseconds).
  double per_call_fwd_ms() const { return checkpoint_fwd_ms ? *checkpoint_fwd_ms : nosave_ms(); }
  /// The backward of a stage checkpointed by remat::checkpoint, recompute included (milliseconds).
  double per_call_bwd_ms() const { return checkpoint_bwd_ms ? *checkpoint_bwd_ms : fwd_ms + bwd_ms; }
};

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
/// none or one per Chain::policies in its order, each with output_bytes <= saved_bytes; byte counts adding up
/// to at most kMaxChainBytes. Throws std::invalid_argument naming remat::validate, the stage (index and
/// name), the field and the value.
void validate(const Chain& chain);

/// Whether `name` can name a policy: non-empty, made of letters, digits, '_', '-' and '.'.
bool valid_policy_name(const std::string& name);

/// The chain as JSON: {"input_bytes": N, "stages": [{"name": "...", "fwd_ms": x, "bwd_ms": x,
/// "output_bytes": N, "saved_bytes": N, "fwd_tmp_bytes": N, "bwd_tmp_bytes": N}, ...]}, plus
/// "fwd_nosave_ms", "checkpoint_fwd_ms", "checkpoint_bwd_ms", "keep_saved_bytes", "keep_fwd_ms" and
/// "keep_bwd_ms" for a stage that has them, "keep": ["matmul"] for a chain measured with keep tags, and for
/// one measured under policies "policies": ["matmuls"] with, per stage, "policies": [{"policy": "matmuls",
/// "saved_bytes": N, "fwd_ms": x, "bwd_ms": x}].
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
