// max_batch: the largest batch that fits a budget under each strategy, predicted from a profile scaled in the
// batch and confirmed by a real step.

#include <algorithm>
#include <cmath>
#include <limits>

#include "harness.h"
#include "remat/planner/planner.h"

namespace remat {
namespace {

// The chain at `batch`, interpolated linearly between profiles at batch_a and batch_b.
Chain scale_chain(const Chain& a, int64_t batch_a, const Chain& b, int64_t batch_b, int64_t batch) {
  auto lerp = [&](double va, double vb) {
    return va + (vb - va) * double(batch - batch_a) / double(batch_b - batch_a);
  };
  auto bytes = [&](int64_t va, int64_t vb) {
    return std::max<int64_t>(0, std::llround(lerp(double(va), double(vb))));
  };
  Chain c = a;
  c.input_bytes = bytes(a.input_bytes, b.input_bytes);
  for (size_t i = 0; i < c.stages.size(); ++i) {
    Stage& s = c.stages[i];
    const Stage& sa = a.stages[i];
    const Stage& sb = b.stages[i];
    s.fwd_ms = std::max(0.0, lerp(sa.fwd_ms, sb.fwd_ms));
    s.bwd_ms = std::max(0.0, lerp(sa.bwd_ms, sb.bwd_ms));
    auto opt_ms = [&](const std::optional<double>& va,
                      const std::optional<double>& vb) -> std::optional<double> {
      if (!va || !vb) return std::nullopt;
      return std::max(0.0, lerp(*va, *vb));
    };
    s.fwd_nosave_ms = opt_ms(sa.fwd_nosave_ms, sb.fwd_nosave_ms);
    s.checkpoint_fwd_ms = opt_ms(sa.checkpoint_fwd_ms, sb.checkpoint_fwd_ms);
    s.checkpoint_bwd_ms = opt_ms(sa.checkpoint_bwd_ms, sb.checkpoint_bwd_ms);
    s.output_bytes = bytes(sa.output_bytes, sb.output_bytes);
    s.saved_bytes = std::max(s.output_bytes, bytes(sa.saved_bytes, sb.saved_bytes));
    s.fwd_tmp_bytes = bytes(sa.fwd_tmp_bytes, sb.fwd_tmp_bytes);
    s.bwd_tmp_bytes = bytes(sa.bwd_tmp_bytes, sb.bwd_tmp_bytes);
    if (sa.has_keep() && sb.has_keep()) {
      s.keep_fwd_ms = opt_ms(sa.keep_fwd_ms, sb.keep_fwd_ms);
      s.keep_bwd_ms = opt_ms(sa.keep_bwd_ms, sb.keep_bwd_ms);
      s.keep_saved_bytes =
          std::clamp(bytes(*sa.keep_saved_bytes, *sb.keep_saved_bytes), s.output_bytes, s.saved_bytes);
    } else {
      s.keep_saved_bytes.reset(), s.keep_fwd_ms.reset(), s.keep_bwd_ms.reset();
    }
  }
  return c;
}

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
    auto fits = [&](int64_t b) {
      return predicted_peak(s, scale_chain(c1, b1, c2, b2, b), budget) <= budget;
    };
    if (fits(1)) {
      int64_t lo = 1, hi = 2;
      while (fits(hi) && hi < (int64_t{1} << 24))
        lo = hi, hi *= 2;
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        (fits(mid) ? lo : hi) = mid;
      }
      r.batch = lo;
    }
    // Confirm with a real step, stepping down while it does not fit.
    for (int attempt = 0; attempt < 6 && r.batch > 0; ++attempt) {
      const Chain chain = scale_chain(c1, b1, c2, b2, r.batch);
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
