#pragma once
// The one writer of plans' JSON (plan.cpp), for the reports too (private to the planner library).

#include <remat/planner/plan.h>

#include <nlohmann/json.hpp>

namespace remat::detail {

/// The plan's JSON object (what remat::to_json(plan) prints): the one writer of plans.
nlohmann::ordered_json plan_json(const Plan& plan);

}  // namespace remat::detail
