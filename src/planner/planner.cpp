// What every planner shares (remat/planner/planner.h, detail/planner.h): a planner by name, finishing a plan
// with its prediction, the variants a planner may use, and the error for a budget no schedule fits.

#include "remat/planner/planner.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "detail/planner.h"
#include "remat/planner/strategy.h"
#include "remat/planner/units.h"

namespace remat {
namespace detail {

namespace {
std::string bytes_text(int64_t b) {
  return format_bytes(b) + " (" + std::to_string(b) + " bytes)";
}
}  // namespace

[[noreturn]] void infeasible(const char* who, int64_t budget, int64_t min_bytes) {
  throw InfeasibleBudget(std::string(who) + ": no schedule fits a budget of " + bytes_text(budget) +
                             "; the minimum for this chain is " + bytes_text(min_bytes),
                         budget, min_bytes);
}

void refuse_offload(const PlannerOptions& options, const char* who) {
  if (options.offload) {
    throw std::invalid_argument(
        std::string(who) +
        ": only the per-layer planner plans offloading (PlannerOptions::offload); use "
        "remat::per_layer or plan_step(..., \"per-layer\")");
  }
}

std::vector<char> allowed_variants(const Chain& chain, const PlannerOptions& options, const char* who) {
  std::vector<char> allowed(1 + chain.policies.size(), 1);
  for (const std::string& e : options.exclude) {
    if (e == "Fk") {
      std::fill(allowed.begin(), allowed.end(), 0);
      continue;
    }
    const bool bracketed = e.size() > 4 && e.rfind("Fk[", 0) == 0 && e.back() == ']';
    const std::string name = bracketed ? e.substr(3, e.size() - 4) : "";
    if (!bracketed || !valid_policy_name(name)) {
      throw std::invalid_argument(std::string(who) + ": cannot exclude '" + e +
                                  "' (Fk, Fk[tags] or Fk[POLICY], e.g. Fk[matmuls])");
    }
    if (name == "tags") allowed[0] = 0;
    for (size_t p = 0; p < chain.policies.size(); ++p)
      if (chain.policies[p] == name) allowed[p + 1] = 0;
  }
  return allowed;
}

Plan finish(const Chain& chain, Plan plan, const std::string& name, int64_t budget) {
  plan.planner = name;
  plan.budget_bytes = budget;
  bool tags = false, policies = false;
  for (const Op& op : plan.ops) {
    if (op.kind != OpKind::kForwardKeep) continue;
    (op.policy < 0 ? tags : policies) = true;
  }
  if (tags) plan.keep = chain.keep;
  if (policies) plan.policies = chain.policies;  // the emitted Op::policy indexes the chain's list
  if (std::any_of(plan.ops.begin(), plan.ops.end(), [](const Op& op) { return !op.groups.empty(); })) {
    plan.group_names.clear();
    for (const Stage& s : chain.stages) {
      plan.group_names.emplace_back();
      for (const SavedGroup& g : s.groups)
        plan.group_names.back().push_back(g.name);
    }
  }
  // Plan::stream_windows: per_layer, the one planner that streams, chose each streamed stage's window.
  plan.predicted = simulate(chain, plan);
  return plan;
}

}  // namespace detail

Plan make_plan(const Chain& chain, const std::string& planner, int64_t budget_bytes,
               const PlannerOptions& options) {
  return plan_strategy(parse_strategy(planner), chain, budget_bytes, options);
}

void check_exclude(const std::vector<std::string>& exclude, const char* who) {
  PlannerOptions options;
  options.exclude = exclude;
  // The planners' own reading, on a chain of no policies: a chain's policies only narrow what is excluded.
  detail::allowed_variants(Chain{}, options, who);
}

}  // namespace remat
