#pragma once
/// \file
/// The optimal planner (optimal.cpp): the persistent dynamic program of Beaumont, Eyraud-Dubois, Herrmann,
/// Joly and Shilova (2019), multi-level, and the least budget it accepts. No torch headers.

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>

#include <cstdint>
#include <vector>

namespace remat {

/// The fastest persistent schedule in the model of remat/planner/plan.h whose peak fits budget_bytes: the
/// paper's dynamic program, memory discretised into options.slots slots, multi-level (a stage may be
/// recomputed several times). Stages with keep_ fields (Stage::has_keep) may also run as Fk, keeping only
/// their kept calls' outputs, and stages profiled under policies as Fk[NAME], each variant its own choice per
/// stage; the plan then carries the chain's tags in Plan::keep and its policies in Plan::policies
/// (options.exclude removes variants). Persistent means a checkpoint, once kept, stays until its stage's
/// backward; the tests check the result against an exhaustive search of all persistent schedules. (Freeing a
/// checkpoint early and recomputing it later is sometimes faster still: the same search found that in about
/// 1% of random 8-stage chains.) The result's predicted peak is <= budget_bytes. Cost: O(n^3 * slots) time
/// and O(n^2 * slots) memory; chains too large for that are refused with a message suggesting fewer slots or
/// revolve(). Throws InfeasibleBudget (stating the minimum) when no schedule fits, std::invalid_argument for
/// an invalid chain or slots < 1.
Plan optimal(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options = {});

/// The smallest budget (bytes) for which optimal() finds a schedule with these options (their exclusions),
/// computed exactly in bytes (for chains longer than 1500 stages: the peak of recomputing every stage from
/// the input, an upper bound).
int64_t min_feasible_budget(const Chain& chain, const PlannerOptions& options = {});

}  // namespace remat
