// The benchmark harness: strategies resolved through the one grammar (remat/planner/strategy.h), the
// measuring loop (strategies interleaved step by step, gradients compared with "none"), and the rows as JSON
// and CSV.

#include <algorithm>
#include <cmath>
#include <sstream>

#include <nlohmann/json.hpp>

#include "harness.h"
#include "remat/memory.h"
#include "remat/planner/planner.h"

namespace remat {
namespace {

constexpr const char* kWho = "remat::bench";

std::vector<torch::Tensor> grads_after_step(Workload& w, harness::Runner& r, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for (auto& p : w.module().parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  torch::manual_seed(seed);
  {
    at::AutoGradMode grad(true);
    r.step_loss().backward();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : w.module().parameters())
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

}  // namespace

namespace harness {

void configure(Workload& w, const Strategy& strategy, const std::optional<Plan>& plan) {
  w.set_per_layer(plan ? std::nullopt : per_layer_options(strategy));
}

void allocate_grads(Workload& w) {
  torch::NoGradGuard no_grad;
  for (auto& p : w.module().parameters()) {
    if (p.requires_grad() && !p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
  }
}

std::vector<Strategy> parse_all(const std::vector<std::string>& strategies) {
  std::vector<Strategy> out;
  for (const auto& s : strategies)
    out.push_back(bench_strategy(s));
  return out;
}

std::vector<std::optional<Plan>> plans_for(Workload& w, const std::vector<Strategy>& strategies,
                                           const ProfileOptions* profile, const Progress& progress,
                                           const Chain* given, std::optional<Chain>* chain_used) {
  std::optional<Chain> chain;
  if (given) chain = *given;
  std::vector<std::optional<Plan>> plans;
  for (const auto& s : strategies) {
    if (s.needs_chain() && !chain) {
      if (progress) progress("profiling " + w.description());
      chain = profile_workload(w, profile);
    }
    plans.push_back(s.needs_chain() ? plan_for(s.text, *chain) : std::nullopt);
  }
  if (chain_used) *chain_used = std::move(chain);
  return plans;
}

}  // namespace harness

Strategy bench_strategy(const std::string& strategy) {
  try {
    return parse_strategy(strategy);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, kWho, ": ", e.what());
  }
}

std::optional<CheckpointOptions> per_layer_options(const Strategy& s) {
  if (!s.per_layer()) return std::nullopt;
  CheckpointOptions options;
  if (s.reentrant) options.mode(CheckpointMode::kReentrant);
  if (!s.early_stop) options.early_stop(false);
  if (!s.keep.empty()) options.keep(s.keep);
  if (!s.policy.empty()) options.policy(policy::preset(s.policy));
  return options;
}

std::optional<CheckpointOptions> per_layer_options(const std::string& strategy) {
  return per_layer_options(bench_strategy(strategy));
}

std::optional<Plan> plan_for(const std::string& strategy, const Chain& chain) {
  const Strategy s = bench_strategy(strategy);
  if (!s.needs_chain()) return std::nullopt;
  try {
    return plan_strategy(s, chain);
  } catch (const InfeasibleBudget&) {
    throw;
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, kWho, ": ", e.what());
  }
}

Chain profile_workload(Workload& w, const ProfileOptions* profile) {
  w.set_per_layer(std::nullopt);
  return profile_chain(w.stages(), w.input(), profile ? *profile : ProfileOptions());
}

std::vector<BenchRow> bench(Workload& w, const std::vector<std::string>& strategies,
                            const MeasureOptions& measure, const ProfileOptions* profile,
                            const Progress& progress, const Chain* given, const CountedProgress& steps) {
  TORCH_CHECK(!strategies.empty(), kWho, ": no strategies");
  std::vector<std::string> order = strategies;
  if (std::find(order.begin(), order.end(), "none") == order.end()) order.insert(order.begin(), "none");
  std::stable_partition(order.begin(), order.end(), [](const std::string& s) { return s == "none"; });
  const std::vector<Strategy> parsed = harness::parse_all(order);

  std::optional<Chain> chain;
  const std::vector<std::optional<Plan>> plans =
      harness::plans_for(w, parsed, profile, progress, given, &chain);

  // Steps of the strategies are interleaved (one step of each in turn), so that a shared machine's drift
  // affects every strategy alike and the ratios to "none" hold.
  std::vector<BenchRow> rows(order.size());
  std::vector<harness::Runner> runners;
  const std::vector<int64_t> per_layer = w.per_layer_stages();
  for (size_t k = 0; k < order.size(); ++k) {
    rows[k].strategy = order[k];
    rows[k].plan = plans[k];
    runners.push_back(harness::Runner{w, plans[k], plans[k] ? w.stages() : std::vector<StageFn>{}});
    if (!chain) continue;
    const Strategy& s = parsed[k];
    // Per-layer checkpointing is predicted for "all" itself, whose recomputes stop early as the profiler
    // measured them; its variants run otherwise.
    const bool plain_all =
        s.per_layer() && !s.reentrant && s.early_stop && s.keep.empty() && s.policy.empty();
    if (plans[k]) {
      rows[k].predicted_time_ms = simulate(*chain, *plans[k]).time_ms;
      rows[k].predicted_peak_bytes = plans[k]->predicted.peak_bytes - chain->input_bytes;
    } else if (s.kind == StrategyKind::kNone) {
      rows[k].predicted_time_ms = simulate(*chain, no_checkpoint(*chain)).time_ms;
    } else if (plain_all && !per_layer.empty()) {
      rows[k].predicted_time_ms = per_call_time_ms(*chain, per_layer);
    }
  }
  const int64_t total_steps = static_cast<int64_t>(order.size()) * (measure.warmup() + measure.steps());
  int64_t steps_done = 0;
  auto one_step = [&](size_t k, const MeasureOptions& m) {
    harness::configure(w, parsed[k], plans[k]);
    StepStats s = measure_step(
        w.module(), [&] { return runners[k].step_loss(); }, m);
    steps_done += m.steps() + m.warmup();
    if (steps) steps(steps_done, total_steps, "strategy " + order[k]);
    return s;
  };
  harness::allocate_grads(w);
  if (progress) progress("warming up " + std::to_string(order.size()) + " strategies");
  for (size_t k = 0; k < order.size(); ++k) {
    if (measure.warmup() > 0) one_step(k, MeasureOptions(measure).steps(measure.warmup()).warmup(0));
  }
  for (int64_t i = 0; i < measure.steps(); ++i) {
    if (progress && !steps)
      progress("step " + std::to_string(i + 1) + "/" + std::to_string(measure.steps()) +
               " of every strategy");
    for (size_t k = 0; k < order.size(); ++k) {
      const StepStats s = one_step(k, MeasureOptions(measure).steps(1).warmup(0));
      StepStats& acc = rows[k].stats;
      acc.base_bytes = s.base_bytes;
      acc.peak_bytes = std::max(acc.peak_bytes, s.peak_bytes);
      acc.after_forward_bytes = std::max(acc.after_forward_bytes, s.after_forward_bytes);
      acc.after_backward_bytes = s.after_backward_bytes;
      acc.step_ms.push_back(s.median_ms);
      acc.forward_ms.push_back(s.median_forward_ms);
    }
  }
  for (auto& r : rows) {
    r.stats.median_ms = median(r.stats.step_ms);
    r.stats.median_forward_ms = median(r.stats.forward_ms);
  }

  if (progress) progress("comparing gradients with 'none'");
  std::vector<torch::Tensor> reference;
  const uint64_t seed = 1234;
  for (size_t k = 0; k < order.size(); ++k) {
    harness::configure(w, parsed[k], plans[k]);
    auto grads = grads_after_step(w, runners[k], seed);
    BenchRow& row = rows[k];
    if (k == 0) {
      reference = grads;
      continue;
    }
    double scale = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!reference[i].defined() || !grads[i].defined()) {
        if (reference[i].defined() != grads[i].defined()) row.max_grad_diff = INFINITY;
        continue;
      }
      scale = std::max(scale, reference[i].abs().max().item<double>());
      row.max_grad_diff = std::max(
          row.max_grad_diff,
          (grads[i].to(torch::kDouble) - reference[i].to(torch::kDouble)).abs().max().item<double>());
    }
    // Relative 1e-4: recomputation changes the order in which float gradient contributions are summed
    // (HeavyChain sums 100,000 of them into one parameter); a missing or wrong contribution is O(1).
    row.max_grad_diff_relative = row.max_grad_diff / std::max(scale, 1e-30);
    row.grads_equal = row.max_grad_diff <= 1e-4 * (1 + scale);
  }
  w.set_per_layer(std::nullopt);
  return rows;
}

std::string bench_json(const std::string& description, const std::vector<BenchRow>& rows) {
  TORCH_CHECK(!rows.empty(), "remat::bench_json: no rows");
  const StepStats& none = rows.front().stats;
  const std::optional<double> none_predicted = rows.front().predicted_time_ms;
  nlohmann::ordered_json j;
  j["model"] = description;
  j["base_bytes"] = none.base_bytes;
  j["rows"] = nlohmann::ordered_json::array();
  for (const auto& r : rows) {
    nlohmann::ordered_json row;
    row["strategy"] = r.strategy;
    row["peak_bytes"] = r.stats.peak_bytes;
    row["after_forward_bytes"] = r.stats.after_forward_bytes;
    row["median_ms"] = r.stats.median_ms;
    row["step_ms"] = r.stats.step_ms;
    row["forward_ms"] = r.stats.median_forward_ms;
    row["peak_ratio"] = double(r.stats.peak_bytes) / double(none.peak_bytes);
    row["time_ratio"] = r.stats.median_ms / none.median_ms;
    row["grads_equal"] = r.grads_equal;
    row["max_grad_diff"] = r.max_grad_diff;
    row["max_grad_diff_relative"] = r.max_grad_diff_relative;
    if (r.plan) {
      if (r.predicted_peak_bytes) row["predicted_peak_bytes"] = *r.predicted_peak_bytes;
      row["plan"] = r.plan->to_string();
    }
    if (r.predicted_time_ms) {
      row["predicted_ms"] = *r.predicted_time_ms;
      if (none_predicted && *none_predicted > 0)
        row["predicted_time_ratio"] = *r.predicted_time_ms / *none_predicted;
    }
    j["rows"].push_back(row);
  }
  return j.dump(2) + "\n";
}

std::string bench_csv(const std::vector<BenchRow>& rows) {
  TORCH_CHECK(!rows.empty(), "remat::bench_csv: no rows");
  const StepStats& none = rows.front().stats;
  std::ostringstream csv;
  csv << "strategy,peak_bytes,after_forward_bytes,median_ms,peak_ratio,time_ratio,grads_equal,max_grad_diff,"
         "predicted_peak_bytes\n";
  for (const auto& r : rows) {
    csv << r.strategy << "," << r.stats.peak_bytes << "," << r.stats.after_forward_bytes << ","
        << r.stats.median_ms << "," << double(r.stats.peak_bytes) / double(none.peak_bytes) << ","
        << r.stats.median_ms / none.median_ms << "," << (r.grads_equal ? 1 : 0) << "," << r.max_grad_diff
        << "," << r.predicted_peak_bytes.value_or(0) << "\n";
  }
  return csv.str();
}

}  // namespace remat
