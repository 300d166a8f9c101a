// max_batch: the largest batch that fits a budget under each strategy, predicted from profiles at two batches
// carried to others (remat/planner/batch.h, shared with the Python package) and confirmed by a real step.

#include <algorithm>
#include <limits>

#include "harness.h"
#include "remat/planner/batch.h"
#include "remat/planner/planner.h"

namespace remat {
namespace {

// The peak a strategy predicts on a chain: for "optimal" within a budget, the least memory of any schedule;
// for the others their plan's (the per-layer ones' plan is the schedule the model runs). A strategy whose
// plan does not fit the budget at all ("revolve" within it) predicts no peak that fits.
int64_t predicted_peak(const Strategy& s, const Chain& chain, int64_t budget) {
  if (s.kind == StrategyKind::kOptimal && s.budget == OptimalBudget::kGiven)
    return min_feasible_budget(chain);
  try {
    return plan_strategy(s, chain, budget).predicted.peak_bytes;
  } catch (const InfeasibleBudget&) {
    return std::numeric_limits<int64_t>::max();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "remat::max_batch: ", e.what());
  }
}

}  // namespace

std::vector<MaxBatch> max_batch(const std::function<std::unique_ptr<Workload>(int64_t)>& make, int64_t budget,
                                const std::vector<std::string>& strategies, const Progress& progress,
                                const ProfileOptions* profile) {
  TORCH_CHECK(budget > 0, "remat::max_batch: the budget must be > 0 bytes, got ", budget);
  constexpr int64_t b1 = 2, b2 = 4;
  if (progress) progress("profiling at batch " + std::to_string(b1) + " and " + std::to_string(b2));
  Chain c1, c2;
  {
    auto w = make(b1);
    c1 = profile_workload(*w, profile);
  }
  {
    auto w = make(b2);
    c2 = profile_workload(*w, profile);
  }
  TORCH_CHECK(c2.input_bytes > c1.input_bytes,
              "remat::max_batch: the model's input does not grow with the batch");
  const std::vector<Strategy> parsed = harness::parse_all(strategies);
  std::vector<MaxBatch> out;
  for (const Strategy& s : parsed) {
    MaxBatch r;
    r.strategy = s.text;
    r.batch = largest_batch(
        [&](int64_t b) { return predicted_peak(s, chain_at_batch(c1, b1, c2, b2, b), budget) <= budget; },
        int64_t{1} << 24);
    // Confirm with a real step, stepping down while it does not fit.
    for (int attempt = 0; attempt < 6 && r.batch > 0; ++attempt) {
      const Chain chain = chain_at_batch(c1, b1, c2, b2, r.batch);
      r.predicted_peak_bytes = predicted_peak(s, chain, budget);
      if (progress) progress("'" + s.text + "': confirming batch " + std::to_string(r.batch));
      auto w = make(r.batch);
      // "none" and the per-layer strategies run as users run them (the plain model, the model's per-layer
      // checkpointing), not through the plan executor, which may hold less.
      std::optional<Plan> plan;
      if (s.needs_chain()) plan = plan_strategy(s, chain, budget);
      harness::configure(*w, s, plan);
      harness::Runner runner{*w, plan, plan ? w->stages() : std::vector<StageFn>{}};
      const StepStats st = measure_step(
          w->module(), [&] { return runner.step_loss(); }, MeasureOptions().warmup(1).steps(1));
      r.measured_peak_bytes = st.peak_bytes + static_cast<int64_t>(w->input().nbytes());
      r.confirmed = r.measured_peak_bytes <= budget;
      if (r.confirmed) break;
      r.batch = std::max<int64_t>(0, std::min(r.batch - 1, int64_t(double(r.batch) * double(budget) /
                                                                   double(r.measured_peak_bytes))));
    }
    out.push_back(r);
  }
  return out;
}

}  // namespace remat
