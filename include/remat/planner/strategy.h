#pragma once
/// \file
/// Strategy strings, parsed once. Every place that takes a strategy by name (the remat command's --strategy
/// and --planner, the benchmark harness, max-batch, the Python binding) parses it here, so each word means
/// the same everywhere. Plain C++ (no torch headers).
///
///   remat::Strategy s = remat::parse_strategy("optimal:overhead=0.5");
///   remat::Plan plan = remat::plan_strategy(s, chain);      // the least memory within half "all"'s overhead
///   remat::make_plan(chain, "uniform:4", 0);                // both steps in one call (planner.h)
///
/// The words (kStrategyWords lists them for help texts):
/// - "none": keep everything (no checkpointing).
/// - "all": every stage checkpointed on its own, per-layer checkpointing (the plan checkpoint_all). Where a
///   model checkpoints its own layers (the benchmarks, max-batch) it runs through them, one remat::checkpoint
///   per layer; its variants run that way too: "all-reentrant" (CheckpointMode::kReentrant),
///   "all-no-early-stop" (each recompute runs its layer to the end), "all-keep-TAG" (kNonReentrant keeping
///   the outputs of the layers' remat::keep calls tagged TAG, e.g. all-keep-matmul; as a plan: every stage
///   Fk), "all-policy-NAME" (kNonReentrant under the policy preset NAME, e.g. all-policy-matmuls; as a plan:
///   every stage Fk[NAME]).
/// - "plan-all": the schedule of "all", always run by the plan executor.
/// - "selective": only the stages named "<...>.attention_core" checkpointed (Megatron's selective
///   recomputation; BERT's sub-layer chain has them).
/// - "sqrt" (ceil(sqrt(n)) segments), "uniform:K" (checkpoint_sequential's K segments), "balanced:K" and
///   "balanced-time:K" (K segments balanced by memory or forward time), "revolve:S" (S snapshots).
/// - "revolve": the most snapshots whose plan fits the budget given beside the string.
/// - "optimal": the fastest schedule within the budget given beside the string; "optimal:SIZE" within SIZE
///   (300MiB, 1.5GiB, bytes); "optimal:as=P" within the peak strategy P's plan predicts;
///   "optimal:overhead=F" the least memory whose predicted time overhead is at most F times that of "all";
///   "optimal:time=R" the least memory whose predicted time is at most R times that of "none".
/// - "per-layer": the fastest per-layer plan within the budget given beside the string (remat::per_layer:
/// each
///   stage kept, kept under an Fk variant, or checkpointed on its own); "per-layer:SIZE" within SIZE.
/// - Any of them followed by "/no-Fk" (the planner uses no Fk), "/no-Fk[NAME]" (no Fk under policy NAME) or
///   "/no-Fk[tags]" (no Fk with the remat::keep tags), as many as wanted: optimal:300MiB/no-Fk[matmuls].

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace remat {

/// Every strategy word, as help texts and error messages list them.
inline constexpr char kStrategyWords[] =
    "none, all, all-reentrant, all-no-early-stop, all-keep-TAG, all-policy-NAME, plan-all, selective, sqrt, "
    "uniform:K, balanced:K, balanced-time:K, revolve, revolve:S, optimal, optimal:SIZE, optimal:as=P, "
    "optimal:overhead=F, optimal:time=R, per-layer, per-layer:SIZE; each optionally followed by /no-Fk or "
    "/no-Fk[NAME]";

/// What a strategy does (see the top of this file).
enum class StrategyKind {
  kNone,          ///< "none"
  kPerLayer,      ///< "all" and its variants "all-reentrant", "all-no-early-stop", "all-keep-TAG",
                  ///< "all-policy-NAME"
  kPlanAll,       ///< "plan-all"
  kSelective,     ///< "selective"
  kSqrt,          ///< "sqrt"
  kUniform,       ///< "uniform:K"
  kBalanced,      ///< "balanced:K"
  kBalancedTime,  ///< "balanced-time:K"
  kRevolve,       ///< "revolve:S", or "revolve" within the budget given
  kOptimal,       ///< "optimal" and "optimal:..."
  kPerLayerBest,  ///< "per-layer" and "per-layer:SIZE" (remat::per_layer)
};

/// Where "optimal" (and "per-layer", kGiven or kBytes) takes its budget from.
enum class OptimalBudget {
  kGiven,     ///< "optimal": the budget passed beside the string
  kBytes,     ///< "optimal:SIZE"
  kAs,        ///< "optimal:as=P": the peak strategy P's plan predicts
  kOverhead,  ///< "optimal:overhead=F"
  kTime,      ///< "optimal:time=R"
};

/// A parsed strategy string.
struct Strategy {
  std::string text;  ///< the string, as given
  StrategyKind kind = StrategyKind::kNone;
  int64_t count = 0;  ///< K of uniform/balanced/balanced-time; S of revolve:S (-1: "revolve")
  OptimalBudget budget = OptimalBudget::kGiven;  ///< optimal only
  int64_t budget_bytes = 0;                      ///< optimal:SIZE (bytes)
  double factor = 0;                             ///< F of optimal:overhead=F, R of optimal:time=R
  std::shared_ptr<const Strategy> as;            ///< P of optimal:as=P
  /// Per-layer variants (kPerLayer): kReentrant mode, early stopping, the remat::keep tags kept, and the
  /// policy preset kept under ("" for none).
  bool reentrant = false;
  bool early_stop = true;
  std::vector<std::string> keep;
  std::string policy;
  /// What "/no-..." excludes, as PlannerOptions::exclude spells it ("Fk", "Fk[matmuls]").
  std::vector<std::string> exclude;

  /// "all" or one of its variants: a model that checkpoints its own layers runs it that way.
  bool per_layer() const { return kind == StrategyKind::kPerLayer; }
  /// Whether running it needs a chain: every strategy but "none" and the per-layer ones, which the
  /// benchmarks run without profiling.
  bool needs_chain() const { return kind != StrategyKind::kNone && kind != StrategyKind::kPerLayer; }
  /// Whether plan_strategy() needs a budget beside the string ("optimal", "per-layer", "revolve").
  bool needs_budget() const {
    return ((kind == StrategyKind::kOptimal || kind == StrategyKind::kPerLayerBest) &&
            budget == OptimalBudget::kGiven) ||
           (kind == StrategyKind::kRevolve && count < 0);
  }
};

/// Parses a strategy string (see the top of this file). Throws std::invalid_argument naming
/// remat::parse_strategy, the string and what was expected: an unknown word (the message lists
/// kStrategyWords), a count that is not a whole number or is below 1 (below 0 for revolve:S), a size that
/// is not one (remat::parse_size), a negative factor, or an optimal:as= whose strategy needs a budget itself.
Strategy parse_strategy(const std::string& text);

/// The plan strategy `s` runs, on `chain`, filled with its prediction (simulate()). "none" is no_checkpoint;
/// "all", "all-reentrant", "all-no-early-stop" and "plan-all" are checkpoint_all; "all-keep-TAG" runs every
/// stage as Fk, which needs a chain profiled with TAG (Chain::keep) and keep_ fields on every stage;
/// "all-policy-NAME" every stage as Fk[NAME], which needs a chain profiled under NAME (Chain::policies).
/// s.exclude is added to options.exclude.
/// `budget_bytes` is the budget of "optimal" and "revolve" (< 0: none given) and is ignored by the others.
/// The plan's `planner` is the planner's own name ("uniform:4", "revolve:3"), the string itself for
/// "optimal:..." and "selective". Throws InfeasibleBudget when no schedule fits the budget (stating the
/// minimum), std::invalid_argument naming remat::plan_strategy and the strategy when a budget is needed and
/// not given, and for what the planner refuses (a segment count above the stage count, an invalid chain).
Plan plan_strategy(const Strategy& s, const Chain& chain, int64_t budget_bytes = -1,
                   const PlannerOptions& options = {});

// make_plan(chain, "uniform:4", budget), both steps in one call, is declared in remat/planner/planner.h.

}  // namespace remat
