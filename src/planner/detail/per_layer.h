#pragma once
// The per-layer program within a step, for plan_step() (per_layer.cpp; private to the planner library).

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>
#include <remat/planner/step.h>

#include <cstdint>
#include <optional>

namespace remat::detail {

/// plan_step()'s per-layer case, exact: the per-layer program run on step_chain(chain, context) (what comes
/// before the chain and the rest of the step kept, each stage's gradients charged from its backward on, the
/// rest's from after its backward), so that the plan is the fastest per-layer plan whose step_peak_bytes() is
/// within budget_bytes. nullopt, with *least_bytes the least step peak of any per-layer plan, when none is.
///
/// `filter` (here and below; true but in a test): the program leaves out each candidate that one of its
/// anchors (each frontier point followed by the choice of the index it chose) beats in a way that every point
/// beating the anchor beats it too, so that no frontier changes; and each candidate that even the fastest
/// choices after it would take past the time of a plan a rough program found first (frontiers thinned to a
/// few points), or, for the least peak, whose peak so far is above that plan's, so that the best plan and its
/// ties stay. False makes and sorts every candidate: the
/// tests' reference, the plans the same.
std::optional<Plan> per_layer_in_step(const Chain& chain, const StepContext& context, int64_t budget_bytes,
                                      const PlannerOptions& options, int64_t* least_bytes,
                                      bool filter = true);
/// step_time_ms()'s time of the chain's stages under `plan` (of the chain's size, checked by the caller): the
/// per-layer program's charge for it (plan.predicted.time_ms where the program chose it), without
/// context.rest_ms. Throws std::invalid_argument for a plan that is not per-layer.
double per_layer_step_time(const Chain& chain, const StepContext& context, const Plan& plan);
/// The least step_peak_bytes() of any per-layer plan of `chain` in `context`.
int64_t per_layer_step_min(const Chain& chain, const StepContext& context, const PlannerOptions& options,
                           bool filter = true);
/// per_layer(), with the filter as given.
Plan per_layer_with(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options, bool filter);

/// With `filter`, planning for time: the widest frontier of the first rough program (points, before thinning)
/// past which a second rough program, thinned less, runs before the exact one, to bound it more tightly
/// (per_layer.cpp's solve()). 1024; a test lowers it so that small chains run the second program too.
extern size_t second_rough_after;

/// The fewest candidates a stage of the per-layer program makes (the points of the frontier before it times its
/// choices) for them to be made and sorted in parts on PlannerOptions::threads threads, then merged; fewer are
/// made on the caller's thread alone (starting threads would cost more). 16,384; a test lowers it to 0 so that
/// small chains are planned in parts too.
extern size_t parts_from;

}  // namespace remat::detail
