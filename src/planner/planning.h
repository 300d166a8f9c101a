#pragma once
// What the planners share (private to the planner library): building a plan's operations, finishing it with
// its prediction, and the error for a budget no schedule fits.

#include <remat/chain.h>
#include <remat/plan.h>
#include <remat/planner.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace remat {
struct StepContext;
}

namespace remat::detail {

/// Appends operation `kind` on `stage` (-1 for the loss).
inline void push(Plan& plan, OpKind kind, int64_t stage) {
  plan.ops.push_back(Op{kind, stage});
}

/// Names the plan, records its budget, gives it the chain's keep tags when it has Fk operations, and fills
/// plan.predicted through simulate().
Plan finish(const Chain& chain, Plan plan, const std::string& name, int64_t budget);

/// Which Fk variants a planner may use (variant 0: the keep tags; v >= 1: the chain's policy v - 1), from
/// PlannerOptions::exclude: "Fk" excludes every one, "Fk[tags]" the keep tags, "Fk[NAME]" the policy NAME.
/// Throws std::invalid_argument naming `who` for any other text.
std::vector<char> allowed_variants(const Chain& chain, const PlannerOptions& options, const char* who);

/// Throws std::invalid_argument naming `who` when options.offload is set (planners that recompute across
/// stages do not offload).
void refuse_offload(const PlannerOptions& options, const char* who);

/// Throws InfeasibleBudget "<who>: no schedule fits a budget of ...; the minimum for this chain is ...".
[[noreturn]] void infeasible(const char* who, int64_t budget, int64_t min_bytes);

/// The peak of recomputing every stage from the chain's input (nothing else kept): the least memory when only
/// a_0 may be held (O(n)); an upper bound of min_feasible_budget().
int64_t recompute_from_input_peak(const Chain& chain);

/// Chains longer than this get min_feasible_budget() from recompute_from_input_peak() (the exact dynamic
/// program is quadratic in memory).
constexpr int64_t kExactMinMemoryStages = 1500;

/// plan_step()'s per-layer case, exact: the per-layer program run on step_chain(chain, context) (what comes
/// before the chain and the rest of the step kept, each stage's gradients charged from its backward on, the
/// rest's from after its backward), so that the plan is the fastest per-layer plan whose step_peak_bytes() is
/// within budget_bytes. nullopt, with *least_bytes the least step peak of any per-layer plan, when none is.
std::optional<Plan> per_layer_in_step(const Chain& chain, const StepContext& context, int64_t budget_bytes,
                                      const PlannerOptions& options, int64_t* least_bytes);
/// The least step_peak_bytes() of any per-layer plan of `chain` in `context`.
int64_t per_layer_step_min(const Chain& chain, const StepContext& context, const PlannerOptions& options);

}  // namespace remat::detail
