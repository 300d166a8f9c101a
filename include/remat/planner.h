#pragma once
/// \file
/// Planners: given a chain (remat/chain.h), return a Plan (remat/plan.h). They all have one shape, take the
/// chain and budget as plain data, and fill plan.predicted through simulate(). No torch headers.
///
///   remat::Chain chain = remat::profile_chain(seq, x);              // or load_chain("model.json")
///   remat::Plan plan = remat::optimal(chain, 256 << 20);            // fastest schedule within 256 MiB
///   std::cout << plan.predicted.peak_bytes << " bytes, " << plan.predicted.time_ms << " ms\n";
///
/// Baselines: no_checkpoint (keep everything), checkpoint_all (every stage is a checkpoint, like per-layer
/// torch.utils.checkpoint), uniform (like checkpoint_sequential), sqrt_n (Chen et al. 2016). optimal is the
/// persistent dynamic program of Beaumont, Eyraud-Dubois, Herrmann, Joly and Shilova (2019), multi-level;
/// revolve is Griewank and Walther's binomial checkpointing for long homogeneous chains.

#include <remat/chain.h>
#include <remat/plan.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace remat {

/// Options of optimal().
struct PlannerOptions {
  /// Memory is discretised into this many slots: unit = floor(budget / slots) bytes, and every size becomes
  /// ceil(size / unit) slots, so a schedule that fits in slots fits in bytes. Time and table memory grow
  /// linearly with it. At least 1.
  int64_t slots = 500;
  /// Also simulate the baselines (exactly, in bytes) and return one when it fits the budget and is faster
  /// than the dynamic program's schedule, which can happen when rounding to slots costs a little memory.
  bool compare_baselines = true;
  /// Operations the planner may not use: "Fk" (no Fk at all), "Fk[tags]" (no Fk with the remat::keep tags),
  /// "Fk[NAME]" (no Fk under policy NAME; names the chain does not have are ignored). optimal() and
  /// min_feasible_budget() honour it; the baselines and revolve use no Fk. Throws std::invalid_argument (from
  /// the planner) for any other text.
  std::vector<std::string> exclude;
  /// The per-layer planner (per_layer(), plan_step()'s "per-layer") may also offload a stage: run it as Fa,
  /// Fk or Fc with what it saves sent to host memory (Fa3@host, ...; see remat/plan.h), where the chain has
  /// the stage's OffloadCost for that way and both bandwidths. Planners that recompute across stages
  /// (optimal(), min_feasible_budget(), plan_step()'s "optimal") refuse it (std::invalid_argument).
  bool offload = false;
  /// With offload: the most host memory the plan may hold (bytes; Simulation::host_peak_bytes); -1: no bound.
  int64_t max_host_bytes = -1;
  /// The per-layer planner may run a stage that has saved groups (Stage::groups) under a group assignment
  /// (Fk3{khr}: each group kept, sent to the host, or recomputed; 'h' only with offload), choosing among
  /// every assignment for the least time within the budget. The other planners ignore groups.
  bool groups = true;
};

/// Thrown when no schedule fits the budget. what() states the minimum.
class InfeasibleBudget : public std::invalid_argument {
 public:
  InfeasibleBudget(const std::string& what, int64_t budget_bytes, int64_t min_bytes)
      : std::invalid_argument(what), budget_bytes_(budget_bytes), min_bytes_(min_bytes) {}
  int64_t budget_bytes() const { return budget_bytes_; }
  /// The smallest budget for which a schedule exists (bytes).
  int64_t min_bytes() const { return min_bytes_; }

 private:
  int64_t budget_bytes_;
  int64_t min_bytes_;
};

/// Keep every activation: Fa(0) .. Fa(n-1), L, B(n-1) .. B(0). Throws std::invalid_argument for an invalid
/// chain (as remat::validate), as do all planners.
Plan no_checkpoint(const Chain& chain);

/// Every stage is a checkpoint (per-layer checkpointing): Fc(0) .. Fc(n-1), L, then Fa(i), B(i) for each i.
Plan checkpoint_all(const Chain& chain);

/// What checkpoint_sequential does: `segments` contiguous runs whose lengths differ by at most one (the
/// longer ones first), each run but the last checkpointed (the last too when checkpoint_last_segment). Throws
/// std::invalid_argument when segments < 1 or > the number of stages.
Plan uniform(const Chain& chain, int64_t segments, bool checkpoint_last_segment = false);

/// Any segmentation of n stages: segments start at `starts` (strictly increasing, starts[0] == 0, all < n).
/// Each segment but the last is checkpointed (the last too when checkpoint_last_segment). Needs no chain.
/// Throws std::invalid_argument naming the bad start.
Plan segmented(int64_t num_stages, const std::vector<int64_t>& starts, bool checkpoint_last_segment = false);

/// Starts of `segments` contiguous runs of num_stages stages whose lengths differ by at most one, the longer
/// ones first (the split of uniform() and checkpoint_sequential). Throws std::invalid_argument when
/// segments < 1 or > num_stages.
std::vector<int64_t> even_starts(int64_t num_stages, int64_t segments);

/// What balanced_starts() balances.
enum class Balance {
  kCount,   ///< stages per segment (even_starts)
  kMemory,  ///< the bytes a segment's stages keep for backward (sum of saved_bytes): what its recompute holds
  kTime,    ///< a segment's forward time (sum of fwd_ms): what its recompute costs
};

/// Starts of `segments` contiguous segments of the chain (starts[0] == 0) that make the largest segment's
/// cost (see Balance) as small as possible; among equal splits, the earliest cut points. On chains of
/// unequal stages (a ResNet's full-resolution blocks beside its downsampled ones) kMemory evens out what
/// each segment's recompute holds, where kCount lets the largest stages pile up in one segment. Exact
/// (a dynamic program, O(segments * n^2)). Throws std::invalid_argument for an invalid chain or segments
/// < 1 or > the stage count.
std::vector<int64_t> balanced_starts(const Chain& chain, int64_t segments, Balance by);

/// segmented() at balanced_starts(chain, segments, by), named "balanced:K" (kMemory), "balanced-time:K"
/// (kTime) or "uniform:K" (kCount).
Plan balanced(const Chain& chain, int64_t segments, Balance by, bool checkpoint_last_segment = false);

/// Chen et al. 2016: ceil(sqrt(n)) uniform segments, the last one kept.
Plan sqrt_n(const Chain& chain);

/// The fastest persistent schedule in the model of remat/plan.h whose peak fits budget_bytes: the paper's
/// dynamic program, memory discretised into options.slots slots, multi-level (a stage may be recomputed
/// several times). Stages with keep_ fields (Stage::has_keep) may also run as Fk, keeping only their kept
/// calls' outputs, and stages profiled under policies as Fk[NAME], each variant its own choice per stage; the
/// plan then carries the chain's tags in Plan::keep and its policies in Plan::policies (options.exclude
/// removes variants). Persistent means a checkpoint, once
/// kept, stays until its stage's backward; the tests check the result against an exhaustive search of all
/// persistent schedules. (Freeing a checkpoint early and recomputing it later is sometimes faster still: the
/// same search found that in about 1% of random 8-stage chains.) The result's predicted peak is <=
/// budget_bytes. Cost: O(n^3 * slots) time and O(n^2 * slots) memory; chains too large for that are refused
/// with a message suggesting fewer slots or revolve(). Throws InfeasibleBudget (stating the minimum) when no
/// schedule fits, std::invalid_argument for an invalid chain or slots < 1.
Plan optimal(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options = {});

/// The fastest per-layer plan within budget_bytes: each stage on its own is kept whole (Fa), kept under one
/// of its Fk variants (Fk[NAME] for the chain's policies, Fk for its keep tags; options.exclude removes
/// them), or checkpointed (Fc, recomputed right before its backward), with no recomputation across stages:
/// what per-layer torch.utils.checkpoint (non-reentrant, with or without a selective checkpointing policy)
/// and remat::checkpoint per layer run, so that a plan can be applied layer by layer through a model's own
/// checkpointing hooks. An exact dynamic program over Pareto frontiers (O(n * frontier * choices); the
/// frontier of a chain of equal layers stays small). plan.predicted.peak_bytes is simulate()'s;
/// plan.predicted.time_ms counts a checkpointed stage as run per call (Stage::per_call_fwd_ms() +
/// per_call_bwd_ms()), a kept one as fwd_ms + bwd_ms and an Fk one as its variant's fwd_ms + bwd_ms.
/// With options.offload, a stage may also run offloaded (Fa@host, Fk@host, Fk[NAME]@host, Fc@host: what it
/// saves, or a checkpointed stage's input, copied to host memory from its own forward on, on one link with
/// the other stages' copies, waited for when the next stage's forward ends, and brought back while the stage
/// after it runs its backward), its time the choice's plus the copies' time that the forwards and the
/// backward do not hide (Chain::transfer_ms; simulate()'s model, remat/plan.h), its host bytes bounded by
/// options.max_host_bytes; the same program, exact (the tests compare it with an exhaustive search).
/// Throws InfeasibleBudget (stating per_layer_min_budget()) when no per-layer plan fits, and
/// std::invalid_argument for an invalid chain, a negative budget, an unknown exclusion, or offload on a chain
/// without bandwidths (not profiled for offloading).
///
///   remat::Plan plan = remat::per_layer(chain, 300 << 20);   // "Fa0 Fk1[matmuls] Fc2 L Fa2 B2 B1 B0"
Plan per_layer(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options = {});
/// The least predicted peak of any per-layer plan (bytes): the smallest budget per_layer() accepts. At least
/// min_feasible_budget(), which may recompute across stages. Throws as per_layer().
int64_t per_layer_min_budget(const Chain& chain, const PlannerOptions& options = {});
/// Binomial checkpointing (Griewank and Walther's Revolve) with at most `snapshots` checkpoints held at once
/// besides the chain's input: the fewest forward recomputations for a homogeneous chain, in O(n log n).
/// For chains of thousands of stages, where optimal() is too slow. Throws std::invalid_argument when
/// snapshots < 0.
Plan revolve(const Chain& chain, int64_t snapshots);

/// revolve() with the most snapshots whose predicted peak fits budget_bytes (every count is tried on chains
/// of up to 512 stages; longer chains, where each snapshot costs one activation, are searched from the
/// estimate budget - peak without snapshots = snapshots x largest activation). Throws InfeasibleBudget when
/// not even zero snapshots fit.
Plan revolve_within(const Chain& chain, int64_t budget_bytes);

/// The smallest budget (bytes) for which optimal() finds a schedule with these options (their exclusions),
/// computed exactly in bytes (for chains longer than 1500 stages: the peak of recomputing every stage from
/// the input, an upper bound).
int64_t min_feasible_budget(const Chain& chain, const PlannerOptions& options = {});

/// A planner by name, in the one strategy grammar of remat/strategy.h ("none", "all", "sqrt", "uniform:K",
/// "balanced:K", "balanced-time:K", "optimal", "optimal:SIZE", "revolve", "revolve:S", ...):
/// plan_strategy(parse_strategy(planner), chain, budget_bytes, options). budget_bytes is the budget of
/// "optimal" and "revolve". Throws std::invalid_argument for an unknown or malformed name (naming it), and
/// what the planner throws (InfeasibleBudget when nothing fits).
Plan make_plan(const Chain& chain, const std::string& planner, int64_t budget_bytes,
               const PlannerOptions& options = {});

}  // namespace remat
