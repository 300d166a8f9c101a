#include "remat/planner/strategy.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

#include "detail/planner.h"
#include "remat/planner/units.h"

namespace remat {
namespace {

constexpr const char* kParse = "remat::parse_strategy";
constexpr const char* kPlan = "remat::plan_strategy";

[[noreturn]] void bad(const std::string& text, const std::string& why) {
  throw std::invalid_argument(std::string(kParse) + ": '" + text + "': " + why);
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// The whole number after `prefix`, at least `least`.
int64_t count_after(const std::string& text, const std::string& prefix, int64_t least, const char* what) {
  const std::string rest = text.substr(prefix.size());
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(rest, &used);
  } catch (const std::logic_error&) {
    used = 0;
  }
  if (rest.empty() || used != rest.size() || !std::isdigit(static_cast<unsigned char>(rest[0])))
    bad(text, "expected a whole number after '" + prefix + "' (" + what + ")");
  if (v < least) bad(text, std::string(what) + " must be >= " + std::to_string(least) + ", got " + rest);
  return v;
}

// The non-negative number after `prefix`.
double factor_after(const std::string& text, const std::string& prefix) {
  const std::string rest = text.substr(prefix.size());
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(rest, &used);
  } catch (const std::logic_error&) {
    used = 0;
  }
  if (rest.empty() || used != rest.size() || !std::isfinite(v) || v < 0)
    bad(text, "expected a non-negative number after '" + prefix + "'");
  return v;
}

// A remat::keep tag: letters, digits, '_' and '.'.
bool valid_tag(const std::string& tag) {
  return !tag.empty() && std::all_of(tag.begin(), tag.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
  });
}

// Every stage run as Fk under policy s.policy: the plan of "all-policy-NAME".
Plan policy_every_stage(const Strategy& s, const Chain& chain) {
  const auto it = std::find(chain.policies.begin(), chain.policies.end(), s.policy);
  if (it == chain.policies.end()) {
    throw std::invalid_argument(std::string(kPlan) + ": strategy '" + s.text + "' runs every stage as Fk[" +
                                s.policy + "], which needs a chain profiled under policy '" + s.policy +
                                "' (ProfileOptions::policies, --policy " + s.policy + ")");
  }
  Plan plan;
  plan.num_stages = chain.size();
  for (int64_t i = 0; i < chain.size(); ++i) {
    if (chain.stages[static_cast<size_t>(i)].policies.empty()) {
      throw std::invalid_argument(std::string(kPlan) + ": strategy '" + s.text + "': stage " +
                                  std::to_string(i) + " ('" + chain.stages[static_cast<size_t>(i)].name +
                                  "') was not profiled under the chain's policies, so it cannot run as Fk[" +
                                  s.policy + "]");
    }
    Op op{OpKind::kForwardKeep, i};
    op.policy = static_cast<int32_t>(it - chain.policies.begin());
    plan.ops.push_back(op);
  }
  detail::push(plan, OpKind::kLoss, -1);
  for (int64_t i = chain.size(); i-- > 0;)
    detail::push(plan, OpKind::kBackward, i);
  return detail::finish(chain, std::move(plan), s.text, 0);
}

// Every stage run as Fk, keeping the outputs of its calls tagged `tag`: the plan of "all-keep-TAG".
Plan keep_every_stage(const Strategy& s, const Chain& chain) {
  if (chain.keep != s.keep) {
    std::string has;
    for (const auto& t : chain.keep)
      has += (has.empty() ? "'" : ", '") + t + "'";
    throw std::invalid_argument(std::string(kPlan) + ": strategy '" + s.text + "' runs every stage as Fk, " +
                                "which needs a chain profiled with exactly the keep tag '" + s.keep.front() +
                                "' (ProfileOptions().keep, --keep " + s.keep.front() + "); this chain has " +
                                (has.empty() ? std::string("none") : has));
  }
  Plan plan;
  plan.num_stages = chain.size();
  for (int64_t i = 0; i < chain.size(); ++i) {
    if (!chain.stages[static_cast<size_t>(i)].has_keep()) {
      throw std::invalid_argument(std::string(kPlan) + ": strategy '" + s.text + "': stage " +
                                  std::to_string(i) + " ('" + chain.stages[static_cast<size_t>(i)].name +
                                  "') has no keep_ fields, so it cannot run as Fk");
    }
    detail::push(plan, OpKind::kForwardKeep, i);
  }
  detail::push(plan, OpKind::kLoss, -1);
  for (int64_t i = chain.size(); i-- > 0;)
    detail::push(plan, OpKind::kBackward, i);
  return detail::finish(chain, std::move(plan), s.text, 0);
}

// Megatron's selective recomputation: only the attention cores checkpointed.
Plan selective(const Strategy& s, const Chain& chain) {
  std::vector<int64_t> cores;
  const std::string suffix = ".attention_core";
  for (size_t i = 0; i < chain.stages.size(); ++i) {
    const std::string& name = chain.stages[i].name;
    if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      cores.push_back(static_cast<int64_t>(i));
  }
  if (cores.empty()) {
    throw std::invalid_argument(
        std::string(kPlan) + ": '" + s.text +
        "' recomputes attention cores (stages named '<...>.attention_core'), and this "
        "chain has none (BERT's sub-layer chain has them: --model bert "
        "--granularity sublayer)");
  }
  Plan p = checkpoint_stages(chain.size(), cores);
  return detail::finish(chain, std::move(p), s.text, 0);
}

// "optimal:overhead=F" / "optimal:time=R": the least memory whose predicted time is within the target.
Plan optimal_within_time(const Strategy& s, const Chain& chain, const PlannerOptions& options) {
  const Plan none = no_checkpoint(chain), all = checkpoint_all(chain);
  const double target =
      s.budget == OptimalBudget::kOverhead
          ? none.predicted.time_ms + s.factor * (all.predicted.time_ms - none.predicted.time_ms)
          : s.factor * none.predicted.time_ms;
  int64_t lo = min_feasible_budget(chain, options), hi = none.predicted.peak_bytes;
  if (optimal(chain, lo, options).predicted.time_ms > target) {
    while (hi - lo > std::max<int64_t>(1, hi / 2000)) {
      const int64_t mid = lo + (hi - lo) / 2;
      (optimal(chain, mid, options).predicted.time_ms <= target ? hi : lo) = mid;
    }
  } else {
    hi = lo;
  }
  return optimal(chain, hi, options);
}

Plan resolve(const Strategy& s, const Chain& chain, int64_t budget, const PlannerOptions& given) {
  PlannerOptions options = given;
  options.exclude.insert(options.exclude.end(), s.exclude.begin(), s.exclude.end());
  if (s.needs_budget() && budget < 0) {
    throw std::invalid_argument(std::string(kPlan) + ": strategy '" + s.text +
                                "' plans within a budget, and none was given");
  }
  switch (s.kind) {
    case StrategyKind::kNone:
      return no_checkpoint(chain);
    case StrategyKind::kPerLayer:
      if (!s.keep.empty()) return keep_every_stage(s, chain);
      if (!s.policy.empty()) return policy_every_stage(s, chain);
      return checkpoint_all(chain);
    case StrategyKind::kPlanAll:
      return checkpoint_all(chain);
    case StrategyKind::kSelective:
      return selective(s, chain);
    case StrategyKind::kSqrt:
      return sqrt_n(chain);
    case StrategyKind::kUniform:
      return uniform(chain, s.count);
    case StrategyKind::kBalanced:
      return balanced(chain, s.count, Balance::kMemory);
    case StrategyKind::kBalancedTime:
      return balanced(chain, s.count, Balance::kTime);
    case StrategyKind::kRevolve:
      return s.count < 0 ? revolve_within(chain, budget) : revolve(chain, s.count);
    case StrategyKind::kPerLayerBest: {
      Plan p = per_layer(chain, s.budget == OptimalBudget::kBytes ? s.budget_bytes : budget, options);
      p.planner = s.text;
      return p;
    }
    case StrategyKind::kOptimal:
      break;
  }
  Plan p;
  switch (s.budget) {
    case OptimalBudget::kGiven:
      return optimal(chain, budget, options);
    case OptimalBudget::kBytes:
      p = optimal(chain, s.budget_bytes, options);
      break;
    case OptimalBudget::kAs:
      p = optimal(chain, resolve(*s.as, chain, -1, options).predicted.peak_bytes, options);
      break;
    case OptimalBudget::kOverhead:
    case OptimalBudget::kTime:
      p = optimal_within_time(s, chain, options);
      break;
  }
  p.planner = s.text;
  return p;
}

}  // namespace

namespace {

Strategy parse_base(const std::string& text) {
  Strategy s;
  s.text = text;
  if (text == "none") {
    s.kind = StrategyKind::kNone;
  } else if (starts_with(text, "all-policy-")) {
    s.kind = StrategyKind::kPerLayer;
    s.policy = text.substr(11);
    if (!valid_policy_name(s.policy))
      bad(text, "expected a policy's name after 'all-policy-' (e.g. all-policy-matmuls)");
  } else if (text == "all" || text == "all-reentrant" || text == "all-no-early-stop" ||
             starts_with(text, "all-keep-")) {
    s.kind = StrategyKind::kPerLayer;
    s.reentrant = text == "all-reentrant";
    s.early_stop = text != "all-no-early-stop";
    if (starts_with(text, "all-keep-")) {
      const std::string tag = text.substr(9);
      if (!valid_tag(tag)) bad(text, "expected a remat::keep tag after 'all-keep-' (e.g. all-keep-matmul)");
      s.keep = {tag};
    }
  } else if (text == "plan-all") {
    s.kind = StrategyKind::kPlanAll;
  } else if (text == "selective") {
    s.kind = StrategyKind::kSelective;
  } else if (text == "sqrt") {
    s.kind = StrategyKind::kSqrt;
  } else if (starts_with(text, "uniform:")) {
    s.kind = StrategyKind::kUniform;
    s.count = count_after(text, "uniform:", 1, "the number of segments");
  } else if (starts_with(text, "balanced:")) {
    s.kind = StrategyKind::kBalanced;
    s.count = count_after(text, "balanced:", 1, "the number of segments");
  } else if (starts_with(text, "balanced-time:")) {
    s.kind = StrategyKind::kBalancedTime;
    s.count = count_after(text, "balanced-time:", 1, "the number of segments");
  } else if (text == "revolve") {
    s.kind = StrategyKind::kRevolve;
    s.count = -1;
  } else if (starts_with(text, "revolve:")) {
    s.kind = StrategyKind::kRevolve;
    s.count = count_after(text, "revolve:", 0, "the number of snapshots");
  } else if (text == "per-layer") {
    s.kind = StrategyKind::kPerLayerBest;
  } else if (starts_with(text, "per-layer:")) {
    s.kind = StrategyKind::kPerLayerBest;
    s.budget = OptimalBudget::kBytes;
    try {
      s.budget_bytes = parse_size(text.substr(10));
    } catch (const std::invalid_argument& e) {
      bad(text, std::string("expected a size after 'per-layer:' (") + e.what() + ")");
    }
  } else if (text == "optimal") {
    s.kind = StrategyKind::kOptimal;
  } else if (starts_with(text, "optimal:")) {
    s.kind = StrategyKind::kOptimal;
    const std::string arg = text.substr(8);
    if (starts_with(arg, "as=")) {
      s.budget = OptimalBudget::kAs;
      auto as = std::make_shared<Strategy>(parse_strategy(arg.substr(3)));
      if (as->needs_budget()) bad(text, "the strategy after 'as=' needs a budget of its own");
      s.as = std::move(as);
    } else if (starts_with(arg, "overhead=")) {
      s.budget = OptimalBudget::kOverhead;
      s.factor = factor_after(text, "optimal:overhead=");
    } else if (starts_with(arg, "time=")) {
      s.budget = OptimalBudget::kTime;
      s.factor = factor_after(text, "optimal:time=");
    } else {
      s.budget = OptimalBudget::kBytes;
      try {
        s.budget_bytes = parse_size(arg);
      } catch (const std::invalid_argument& e) {
        bad(text,
            std::string("expected a size, as=P, overhead=F or time=R after 'optimal:' (") + e.what() + ")");
      }
    }
  } else {
    throw std::invalid_argument(std::string(kParse) + ": unknown strategy '" + text + "' (" + kStrategyWords +
                                ")");
  }
  return s;
}

}  // namespace

Strategy parse_strategy(const std::string& full) {
  // "/no-..." modifiers after the strategy itself.
  const size_t slash = full.find('/');
  const std::string text = full.substr(0, slash);
  std::vector<std::string> exclude;
  for (size_t at = slash; at != std::string::npos;) {
    const size_t next = full.find('/', at + 1);
    const std::string m = full.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
    const bool bracketed = m.size() > 7 && m.rfind("no-Fk[", 0) == 0 && m.back() == ']';
    if (m != "no-Fk" && !(bracketed && valid_policy_name(m.substr(6, m.size() - 7))))
      bad(full, "expected /no-Fk or /no-Fk[NAME] after the strategy, got '/" + m + "'");
    exclude.push_back(m.substr(3));
    at = next;
  }
  Strategy s = parse_base(text);
  s.text = full;
  s.exclude = std::move(exclude);
  return s;
}

Plan plan_strategy(const Strategy& s, const Chain& chain, int64_t budget_bytes,
                   const PlannerOptions& options) {
  try {
    return resolve(s, chain, budget_bytes, options);
  } catch (const InfeasibleBudget&) {
    throw;
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    if (starts_with(what, kPlan)) throw;
    throw std::invalid_argument(std::string(kPlan) + ": strategy '" + s.text + "': " + what);
  }
}

}  // namespace remat
