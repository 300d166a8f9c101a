#pragma once
/// \file
/// What the remat command reports about a chain, as library functions: a plan beside its baselines (remat
/// plan), the memory of a training step and what checkpointing can save of it (remat profile), and the
/// optimal planner's trade-off curve (remat sweep). Plain C++ (no torch headers).
///
///   remat::PlanSummary s = remat::summarize_plan(chain, remat::optimal(chain, 64 << 20));
///   std::cout << remat::to_json(s);                          // what `remat plan --json` prints
///   auto m = remat::memory_breakdown(chain, param_bytes, trainable_bytes, remat::Optimizer::kAdam);
///   std::cout << m.verdict();                                // what `remat profile` concludes

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace remat {

/// A plan with the figures `remat plan` prints beside it.
struct PlanSummary {
  Plan plan;                        ///< with its prediction (plan.predicted)
  int64_t baseline_peak_bytes = 0;  ///< no_checkpoint's predicted peak (bytes, the input included)
  double baseline_time_ms = 0;      ///< no_checkpoint's predicted time (milliseconds)
  double time_overhead = 0;         ///< plan time / baseline time - 1 (0 when the baseline takes no time)
  int64_t min_feasible_budget_bytes = 0;  ///< min_feasible_budget(chain) (bytes)
  int64_t stages_recomputed = 0;          ///< stages whose forward runs more than once
  /// Stages that run as Fk (Fk or Fk[name]: only their kept calls' outputs kept, the rest of the stage
  /// recomputed inside its backward).
  int64_t stages_fk = 0;
  /// For a chain inside a model (the whole step given, see step_plan): the step's predicted peak under the
  /// plan and without checkpointing (bytes, the model's input included).
  std::optional<int64_t> step_peak_bytes, step_baseline_peak_bytes;
  /// The budget the caller passed (bytes), when one was: to_json prints it as "budget_bytes" (what scripts
  /// written against `remat plan --json` read) and the plan's own as "plan_budget_bytes".
  std::optional<int64_t> requested_budget_bytes;
};

/// The figures of `plan` on `chain`, and those of the whole step when `step` (the chain's stages plus a
/// prefix and a suffix, see step_plan) is given. Throws std::invalid_argument when the plan does not fit
/// the chain (as simulate()), or when step does not have chain.size() + 2 stages.
PlanSummary summarize_plan(const Chain& chain, const Plan& plan, const Chain* step = nullptr);

/// The JSON `remat plan --json` prints: the plan's own JSON (to_json(plan): "num_stages", "planner",
/// "budget_bytes", "ops", "predicted", "keep") and beside it "predicted_peak_bytes", "predicted_time_ms",
/// "forward_calls", "baseline_peak_bytes", "baseline_time_ms", "time_overhead", "min_feasible_budget_bytes",
/// "stages_recomputed", "stages_fk" and, with a step, "step_predicted_peak_bytes" and
/// "step_baseline_peak_bytes". With requested_budget_bytes, "budget_bytes" is that budget and
/// "plan_budget_bytes" the plan's own (0 for the planners that take none: sqrt, uniform:N, all, none).
/// plan_from_json() reads it back (the plan's budget from "plan_budget_bytes" when present).
std::string to_json(const PlanSummary& summary);

/// The chain inside a step chain: stages 1..n of a step of n + 2 stages (prefix, the chain, suffix), its
/// input the prefix's output. Throws std::invalid_argument naming remat::chain_of_step when the step has
/// fewer than 3 stages, and as validate().
Chain chain_of_step(const Chain& step);

/// Optimizer state kept per trainable parameter byte: none, SGD with momentum (one buffer), Adam (two).
enum class Optimizer { kNone, kSgdMomentum, kAdam };

/// "none", "sgd-momentum" or "adam". Throws std::invalid_argument naming the text otherwise.
Optimizer parse_optimizer(const std::string& name);

/// The memory of one training step, predicted from a profiled chain, and what checkpointing can save of it.
/// Bytes throughout.
struct MemoryBreakdown {
  int64_t parameters = 0;   ///< every parameter
  int64_t gradients = 0;    ///< one per trainable parameter
  int64_t optimizer = 0;    ///< the optimizer's state
  int64_t inputs = 0;       ///< the chain's input
  int64_t activations = 0;  ///< peak of activations and transients without checkpointing (above the input)
  int64_t least_activations = 0;  ///< the least any schedule reaches (min_feasible_budget, above the input)
  int64_t per_layer_activations = 0;  ///< checkpointing every stage (checkpoint_all, above the input)
  std::string optimizer_name;         ///< as parse_optimizer spells it

  /// parameters + gradients + optimizer + inputs + activations.
  int64_t total() const { return parameters + gradients + optimizer + inputs + activations; }
  /// The most checkpointing can save: activations - least_activations.
  int64_t saving() const { return activations - least_activations; }
  /// parameters + gradients + optimizer: what checkpointing does not touch.
  int64_t weights() const { return parameters + gradients + optimizer; }
  /// Whether the weights are more than the activations (checkpointing then cannot help much).
  bool weights_dominate() const { return weights() > activations; }
  /// `bytes` as a share of total(), in percent (0 when total() is 0).
  double percent(int64_t bytes) const;
  /// The conclusion, in sentences: "checkpointing can save at most ... (..% of the step's memory):
  /// activations go from ... to at least ...; checkpointing every stage alone gives ...", then whether the
  /// weights or the activations dominate and what to do about it.
  std::string verdict() const;
};

/// The breakdown of a step whose model has `parameter_bytes` of parameters, `trainable_bytes` of them
/// trainable, trained with `optimizer`, on `chain` (its activations). Throws std::invalid_argument for an
/// invalid chain (as validate()) or negative byte counts, or when trainable_bytes > parameter_bytes.
MemoryBreakdown memory_breakdown(const Chain& chain, int64_t parameter_bytes, int64_t trainable_bytes,
                                 Optimizer optimizer);

/// One point of the planner's trade-off curve.
struct SweepPoint {
  std::string kind;                  ///< "optimal" or "baseline"
  std::string name;                  ///< the planner
  int64_t budget_bytes = 0;          ///< the budget it was planned for (0 for baselines)
  int64_t predicted_peak_bytes = 0;  ///< simulate()'s peak, the chain's input included (bytes)
  double predicted_time_ms = 0;      ///< simulate()'s time (milliseconds)
  double overhead = 0;               ///< predicted time / predicted time without checkpointing - 1
  int64_t input_bytes = 0;  ///< the chain's input: predicted_peak_bytes - input_bytes is comparable to a
                            ///< measured peak over parameters, gradients and inputs
};

/// The optimal planner at `budgets` budgets spread evenly from the chain's minimum to the peak without
/// checkpointing, and the baselines (none, all, sqrt, uniform:2..8) as points. Predictions only. `options` go
/// to optimal() (its exclusions to min_feasible_budget() too). Throws std::invalid_argument naming
/// remat::sweep when budgets < 2, and for an invalid chain or options. `progress`, when given, is called
/// after each budget is planned (done of total = budgets).
std::vector<SweepPoint> sweep(const Chain& chain, int64_t budgets, const PlannerOptions& options = {},
                              const std::function<void(int64_t done, int64_t total)>& progress = {});

/// The curve as CSV: a "# title" line, the header "kind,name,budget_bytes,predicted_peak_bytes,
/// predicted_time_ms,overhead,input_bytes" and one line per point (what scripts/plot_tradeoff.py reads).
std::string sweep_csv(const std::vector<SweepPoint>& points, const std::string& title);

}  // namespace remat
