#pragma once
// What the planners share (planner.cpp; private to the planner library): building a plan's operations,
// finishing it with its prediction, and the error for a budget no schedule fits.

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>

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

}  // namespace remat::detail
