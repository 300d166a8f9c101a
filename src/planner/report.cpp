#include "remat/planner/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "detail/json.h"
#include "detail/plan.h"
#include "remat/planner/planner.h"
#include "remat/planner/units.h"

namespace remat {

PlanSummary summarize_plan(const Chain& chain, const Plan& plan, const Chain* step) {
  if (step != nullptr && step->size() != chain.size() + 2) {
    throw std::invalid_argument("remat::summarize_plan: the step has " + std::to_string(step->size()) +
                                " stages, but the chain has " + std::to_string(chain.size()) +
                                " (a step chain has the chain's stages plus the prefix and the suffix)");
  }
  PlanSummary s;
  s.plan = plan;
  s.plan.predicted = simulate(chain, plan);
  const Plan none = no_checkpoint(chain);
  s.baseline_peak_bytes = none.predicted.peak_bytes;
  s.baseline_time_ms = none.predicted.time_ms;
  s.time_overhead = none.predicted.time_ms > 0 ? s.plan.predicted.time_ms / none.predicted.time_ms - 1 : 0;
  s.min_feasible_budget_bytes = min_feasible_budget(chain);
  for (int64_t calls : s.plan.predicted.forward_calls)
    s.stages_recomputed += calls > 1;
  std::vector<bool> fk(static_cast<size_t>(plan.num_stages), false);
  for (const Op& op : plan.ops)
    if (op.kind == OpKind::kForwardKeep) fk.at(static_cast<size_t>(op.stage)) = true;
  s.stages_fk = std::count(fk.begin(), fk.end(), true);
  if (step != nullptr) {
    s.step_peak_bytes = simulate(*step, step_plan(plan)).peak_bytes;
    s.step_baseline_peak_bytes = simulate(*step, step_plan(none)).peak_bytes;
  }
  return s;
}

std::string to_json(const PlanSummary& s) {
  nlohmann::ordered_json j = detail::plan_json(s.plan);
  if (s.requested_budget_bytes) {
    j["budget_bytes"] = *s.requested_budget_bytes;
    j["plan_budget_bytes"] = s.plan.budget_bytes;
  }
  j["predicted_peak_bytes"] = s.plan.predicted.peak_bytes;
  j["predicted_time_ms"] = s.plan.predicted.time_ms;
  j["forward_calls"] = s.plan.predicted.forward_calls;
  j["baseline_peak_bytes"] = s.baseline_peak_bytes;
  j["baseline_time_ms"] = s.baseline_time_ms;
  j["time_overhead"] = s.time_overhead;
  j["min_feasible_budget_bytes"] = s.min_feasible_budget_bytes;
  j["stages_recomputed"] = s.stages_recomputed;
  j["stages_fk"] = s.stages_fk;
  if (s.step_peak_bytes) j["step_predicted_peak_bytes"] = *s.step_peak_bytes;
  if (s.step_baseline_peak_bytes) j["step_baseline_peak_bytes"] = *s.step_baseline_peak_bytes;
  return j.dump(2);
}

Chain chain_of_step(const Chain& step) {
  if (step.size() < 3) {
    throw std::invalid_argument(
        "remat::chain_of_step: a step chain has the prefix, at least one stage and the suffix, got " +
        std::to_string(step.size()) + " stages");
  }
  Chain chain;
  chain.input_bytes = step.stages.front().output_bytes;
  chain.stages.assign(step.stages.begin() + 1, step.stages.end() - 1);
  chain.keep = step.keep;
  validate(chain);
  return chain;
}

Optimizer parse_optimizer(const std::string& name) {
  if (name == "none") return Optimizer::kNone;
  if (name == "sgd-momentum") return Optimizer::kSgdMomentum;
  if (name == "adam") return Optimizer::kAdam;
  throw std::invalid_argument("remat::parse_optimizer: unknown optimizer '" + name +
                              "' (none, sgd-momentum, adam)");
}

double MemoryBreakdown::percent(int64_t bytes) const {
  const int64_t t = total();
  return t > 0 ? 100.0 * static_cast<double>(bytes) / static_cast<double>(t) : 0.0;
}

std::string MemoryBreakdown::verdict() const {
  auto pct = [&](int64_t b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f%%", percent(b));
    return std::string(buf);
  };
  std::ostringstream os;
  os << "checkpointing can save at most " << format_bytes(saving()) << " (" << pct(saving())
     << " of the step's memory): activations go from " << format_bytes(activations) << " to at least "
     << format_bytes(least_activations) << "; checkpointing every stage alone gives "
     << format_bytes(per_layer_activations) << ".\n";
  if (weights_dominate()) {
    os << "the weights dominate: parameters, gradients and optimizer state are " << format_bytes(weights())
       << " (" << pct(weights())
       << "), which checkpointing does not touch; checkpointing one layer at a time "
       << "cannot help here. Reduce the weights instead (fewer or smaller layers, lower precision, "
       << "sharding).\n";
  } else {
    os << "activations dominate: checkpointing is the right tool; `remat plan --budget SIZE` picks what to "
          "checkpoint.\n";
  }
  return os.str();
}

MemoryBreakdown memory_breakdown(const Chain& chain, int64_t parameter_bytes, int64_t trainable_bytes,
                                 Optimizer optimizer) {
  if (parameter_bytes < 0 || trainable_bytes < 0 || trainable_bytes > parameter_bytes) {
    throw std::invalid_argument("remat::memory_breakdown: need 0 <= trainable_bytes (" +
                                std::to_string(trainable_bytes) + ") <= parameter_bytes (" +
                                std::to_string(parameter_bytes) + ")");
  }
  MemoryBreakdown m;
  m.parameters = parameter_bytes;
  m.gradients = trainable_bytes;
  m.optimizer = optimizer == Optimizer::kAdam          ? 2 * trainable_bytes
                : optimizer == Optimizer::kSgdMomentum ? trainable_bytes
                                                       : 0;
  m.optimizer_name = optimizer == Optimizer::kAdam          ? "adam"
                     : optimizer == Optimizer::kSgdMomentum ? "sgd-momentum"
                                                            : "none";
  m.inputs = chain.input_bytes;
  m.activations = no_checkpoint(chain).predicted.peak_bytes - m.inputs;
  m.least_activations = min_feasible_budget(chain) - m.inputs;
  m.per_layer_activations = checkpoint_all(chain).predicted.peak_bytes - m.inputs;
  return m;
}

std::vector<SweepPoint> sweep(const Chain& chain, int64_t budgets, const PlannerOptions& options,
                              const std::function<void(int64_t done, int64_t total)>& progress) {
  if (budgets < 2)
    throw std::invalid_argument("remat::sweep: budgets must be >= 2, got " + std::to_string(budgets));
  const Plan none = no_checkpoint(chain);
  const double base_ms = none.predicted.time_ms;
  auto point = [&](const std::string& kind, const Plan& p, int64_t budget) {
    return SweepPoint{kind,
                      p.planner,
                      budget,
                      p.predicted.peak_bytes,
                      p.predicted.time_ms,
                      base_ms > 0 ? p.predicted.time_ms / base_ms - 1 : 0,
                      chain.input_bytes};
  };
  std::vector<SweepPoint> out;
  const int64_t lo = min_feasible_budget(chain, options), hi = none.predicted.peak_bytes;
  for (int64_t i = 0; i < budgets; ++i) {
    const int64_t budget =
        lo + static_cast<int64_t>(std::llround(double(hi - lo) * double(i) / double(budgets - 1)));
    out.push_back(point("optimal", optimal(chain, budget, options), budget));
    if (progress) progress(i + 1, budgets);
  }
  out.push_back(point("baseline", none, 0));
  out.push_back(point("baseline", checkpoint_all(chain), 0));
  out.push_back(point("baseline", sqrt_n(chain), 0));
  for (int64_t k = 2; k <= std::min<int64_t>(8, chain.size()); ++k)
    out.push_back(point("baseline", uniform(chain, k), 0));
  return out;
}

std::string sweep_csv(const std::vector<SweepPoint>& points, const std::string& title) {
  std::ostringstream csv;
  csv << "# " << title
      << "\nkind,name,budget_bytes,predicted_peak_bytes,predicted_time_ms,overhead,input_bytes\n";
  for (const auto& p : points) {
    csv << p.kind << "," << p.name << "," << p.budget_bytes << "," << p.predicted_peak_bytes << ","
        << p.predicted_time_ms << "," << p.overhead << "," << p.input_bytes << "\n";
  }
  return csv.str();
}

}  // namespace remat
