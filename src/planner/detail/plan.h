#pragma once
// The one writer of plans' JSON (plan.cpp), for the reports too, and the offload cost of an operation's way,
// for simulate() and the step's model (private to the planner library).

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>

#include <nlohmann/json.hpp>
#include <optional>

namespace remat::detail {

/// The offload cost of the way `op` runs stage op.stage of `chain` (Fa: Stage::offload; Fc:
/// checkpoint_offload; Fk: its keep tags', its policy's, named in `plan`, or its group assignment's), or none
/// (Fn, a stage out of range, a policy the chain lacks).
std::optional<OffloadCost> way_offload(const Chain& chain, const Plan& plan, const Op& op);

/// The plan's JSON object (what remat::to_json(plan) prints): the one writer of plans.
nlohmann::ordered_json plan_json(const Plan& plan);

}  // namespace remat::detail
