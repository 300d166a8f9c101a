#include "remat/planner.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "remat/units.h"

namespace remat {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

void push(Plan& plan, OpKind kind, int64_t stage) {
  plan.ops.push_back(Op{kind, stage});
}

Plan finish(const Chain& chain, Plan plan, const std::string& name, int64_t budget) {
  plan.planner = name;
  plan.budget_bytes = budget;
  if (plan.count(OpKind::kForwardKeep) > 0) plan.keep = chain.keep;
  plan.predicted = simulate(chain, plan);
  return plan;
}

// ---------------------------------------------------------------------------------------------------------------
// The chain as the dynamic programs see it: n + 1 stages, the last being the loss (no time, no memory of its
// own; its backward creates d_n). Index i of x is a_i (i = 0..n+1, a_{n+1} = 0); xb[i + 1] is stage i's abar.
template <typename T>
struct Sizes {
  int64_t n = 0;  // real stages
  std::vector<T> x, xb, ft, bt;
  std::vector<double> f, fn, b;  // forward with saving (Fa), without (Fn, Fc), backward
  // Fk: whether stage i has it, what it keeps (xk[i + 1], like xb), its forward and its backward (recompute
  // included).
  std::vector<char> hk;
  std::vector<T> xk;
  std::vector<double> fk, bk;

  template <typename Convert>
  Sizes(const Chain& chain, Convert convert) : n(chain.size()) {
    x.assign(n + 2, 0);
    xb.assign(n + 2, 0);
    ft.assign(n + 1, 0);
    bt.assign(n + 1, 0);
    f.assign(n + 1, 0);
    fn.assign(n + 1, 0);
    b.assign(n + 1, 0);
    hk.assign(n + 1, 0);
    xk.assign(n + 2, 0);
    fk.assign(n + 1, 0);
    bk.assign(n + 1, 0);
    for (int64_t i = 0; i <= n; ++i)
      x[i] = convert(chain.activation_bytes(i));
    for (int64_t i = 0; i < n; ++i) {
      const Stage& s = chain.stages[i];
      xb[i + 1] = convert(s.saved_bytes);
      ft[i] = convert(s.fwd_tmp_bytes);
      bt[i] = convert(s.bwd_tmp_bytes);
      f[i] = s.fwd_ms;
      fn[i] = s.nosave_ms();
      b[i] = s.bwd_ms;
      if (s.has_keep()) {
        hk[i] = 1;
        xk[i + 1] = convert(*s.keep_saved_bytes);
        fk[i] = *s.keep_fwd_ms;
        bk[i] = *s.keep_bwd_ms;
      }
    }
  }
  // Memory to run the last stage t of a subchain alone: Fa(t) then B(t), d_{t+1} held.
  T base(int64_t t) const {
    return std::max(x[t + 1] + xb[t + 1] + ft[t], xb[t + 1] + x[t + 1] + x[t] + bt[t]);
  }
  // Option A at s: Fa(s) with d_{t+1} held, and B(s) at the end.
  T keep_all_need(int64_t s, int64_t t) const {
    return std::max(x[t + 1] + xb[s + 1] + ft[s], xb[s + 1] + x[s + 1] + x[s] + bt[s]);
  }
  // Option K at s (stage s has Fk): Fk(s) with d_{t+1} held, and B(s) at the end, which recomputes the rest
  // of abar_{s+1} first (so its peak is option A's).
  T keep_some_need(int64_t s, int64_t t) const {
    return std::max(x[t + 1] + xk[s + 1] + ft[s], xb[s + 1] + x[s + 1] + x[s] + bt[s]);
  }
  // The forward k of a sweep that starts at s (a_s is held by the caller, a_k for k > s by the sweep).
  T sweep_step(int64_t s, int64_t k) const { return (k == s ? T(0) : x[k]) + x[k + 1] + ft[k]; }
};

// The choices of the dynamic programs besides a checkpoint at s' > s.
constexpr int32_t kKeepAll = -1, kKeepSome = -3;

// Emits a schedule for subchain [s, t] in the shapes both dynamic programs use: choice -1 is "keep
// everything of stage s" (Fa(s), the rest, B(s)); choice s' > s is "sweep to a_{s'}, keep it as a checkpoint,
// do [s', t], then [s, s' - 1]". The loss stage n emits L.
struct Emitter {
  Plan& plan;
  int64_t n;
  void keep_all_open(int64_t s) {
    if (s < n) push(plan, OpKind::kForwardAll, s);
  }
  void keep_some_open(int64_t s) { push(plan, OpKind::kForwardKeep, s); }
  void keep_all_close(int64_t s) {
    if (s < n) {
      push(plan, OpKind::kBackward, s);
    } else {
      push(plan, OpKind::kLoss, -1);
    }
  }
  void sweep(int64_t s, int64_t to) {
    push(plan, OpKind::kForwardCheckpoint, s);
    for (int64_t k = s + 1; k < to; ++k)
      push(plan, OpKind::kForwardNoSave, k);
  }
};

// ---------------------------------------------------------------------------------------------------------------
// The persistent dynamic program in slots.
class Table {
 public:
  Table(const Sizes<int64_t>& z, int64_t slots) : z_(z), n_(z.n), m_(slots) {
    const int64_t pairs = (n_ + 1) * (n_ + 2) / 2;
    cost_.assign(static_cast<size_t>(pairs * (m_ + 1)), kInf);
    what_.assign(static_cast<size_t>(pairs * (m_ + 1)), -2);
    fill();
  }
  double at(int64_t s, int64_t t, int64_t m) const { return m < 0 ? kInf : row(s, t)[m]; }
  void emit(Emitter& e, int64_t s, int64_t t, int64_t m) const {
    const int32_t w = what(s, t)[m];
    if (w == kKeepAll || w == kKeepSome) {
      const bool all = w == kKeepAll;
      if (all) {
        e.keep_all_open(s);
      } else {
        e.keep_some_open(s);
      }
      if (s < t) emit(e, s + 1, t, m - (all ? z_.xb[s + 1] : z_.xk[s + 1]));
      e.keep_all_close(s);
    } else {
      const int64_t sp = w;
      e.sweep(s, sp);
      emit(e, sp, t, m - z_.x[sp]);
      emit(e, s, sp - 1, m);
    }
  }

 private:
  size_t index(int64_t s, int64_t t) const {
    // rows of s = 0..n, each with t = s..n
    return static_cast<size_t>(s * (n_ + 1) - s * (s - 1) / 2 + (t - s));
  }
  const double* row(int64_t s, int64_t t) const { return &cost_[index(s, t) * (m_ + 1)]; }
  double* row(int64_t s, int64_t t) { return &cost_[index(s, t) * (m_ + 1)]; }
  const int32_t* what(int64_t s, int64_t t) const { return &what_[index(s, t) * (m_ + 1)]; }
  int32_t* what(int64_t s, int64_t t) { return &what_[index(s, t) * (m_ + 1)]; }

  void fill() {
    for (int64_t len = 0; len <= n_; ++len) {
      for (int64_t s = 0; s + len <= n_; ++s) {
        const int64_t t = s + len;
        double* c = row(s, t);
        int32_t* w = what(s, t);
        // Keep everything of stage s (Fa), or only its kept calls' outputs (Fk).
        auto keep_option = [&](int64_t need, int64_t keep, double ms, int32_t choice) {
          if (len == 0) {
            for (int64_t m = std::max<int64_t>(need, 0); m <= m_; ++m) {
              if (ms < c[m]) c[m] = ms, w[m] = choice;
            }
          } else {
            const double* sub = row(s + 1, t);
            for (int64_t m = std::max(need, keep); m <= m_; ++m) {
              const double v = ms + sub[m - keep];
              if (v < c[m]) c[m] = v, w[m] = choice;
            }
          }
        };
        keep_option(z_.keep_all_need(s, t), z_.xb[s + 1], z_.f[s] + z_.b[s], kKeepAll);
        if (z_.hk[s]) keep_option(z_.keep_some_need(s, t), z_.xk[s + 1], z_.fk[s] + z_.bk[s], kKeepSome);
        // Sweep to a checkpoint at sp.
        double sweep_ms = 0;
        int64_t sweep_peak = 0;
        for (int64_t sp = s + 1; sp <= t; ++sp) {
          sweep_ms += z_.fn[sp - 1];
          sweep_peak = std::max(sweep_peak, z_.sweep_step(s, sp - 1));
          const int64_t hold = z_.x[sp];
          const int64_t from = std::max(z_.x[t + 1] + sweep_peak, hold);
          const double* later = row(sp, t);
          const double* first = row(s, sp - 1);
          for (int64_t m = from; m <= m_; ++m) {
            const double v = sweep_ms + later[m - hold] + first[m];
            if (v < c[m]) c[m] = v, w[m] = static_cast<int32_t>(sp);
          }
        }
      }
    }
  }

  const Sizes<int64_t>& z_;
  int64_t n_, m_;
  std::vector<double> cost_;
  std::vector<int32_t> what_;
};

// ---------------------------------------------------------------------------------------------------------------
// The least memory of the same family of schedules, exactly in bytes (no time, no slots).
class MinMemory {
 public:
  explicit MinMemory(const Chain& chain) : z_(chain, [](int64_t v) { return v; }), n_(chain.size()) {
    const int64_t pairs = (n_ + 1) * (n_ + 2) / 2;
    need_.assign(static_cast<size_t>(pairs), 0);
    what_.assign(static_cast<size_t>(pairs), -1);
    for (int64_t len = 0; len <= n_; ++len) {
      for (int64_t s = 0; s + len <= n_; ++s) {
        const int64_t t = s + len;
        int64_t best = len == 0 ? z_.base(t) : std::max(z_.keep_all_need(s, t), z_.xb[s + 1] + get(s + 1, t));
        int32_t choice = kKeepAll;
        if (z_.hk[s]) {
          const int64_t some = len == 0 ? z_.keep_some_need(s, t)
                                        : std::max(z_.keep_some_need(s, t), z_.xk[s + 1] + get(s + 1, t));
          if (some < best) best = some, choice = kKeepSome;
        }
        int64_t sweep_peak = 0;
        for (int64_t sp = s + 1; sp <= t; ++sp) {
          sweep_peak = std::max(sweep_peak, z_.sweep_step(s, sp - 1));
          const int64_t v = std::max({z_.x[t + 1] + sweep_peak, z_.x[sp] + get(sp, t), get(s, sp - 1)});
          if (v < best) best = v, choice = static_cast<int32_t>(sp);
        }
        need_[index(s, t)] = best;
        what_[index(s, t)] = choice;
      }
    }
  }
  int64_t total() const { return z_.x[0] + get(0, n_); }
  void emit(Emitter& e, int64_t s, int64_t t) const {
    const int32_t w = what_[index(s, t)];
    if (w == kKeepAll || w == kKeepSome) {
      if (w == kKeepAll) {
        e.keep_all_open(s);
      } else {
        e.keep_some_open(s);
      }
      if (s < t) emit(e, s + 1, t);
      e.keep_all_close(s);
    } else {
      e.sweep(s, w);
      emit(e, w, t);
      emit(e, s, w - 1);
    }
  }

 private:
  size_t index(int64_t s, int64_t t) const {
    return static_cast<size_t>(s * (n_ + 1) - s * (s - 1) / 2 + (t - s));
  }
  int64_t get(int64_t s, int64_t t) const { return need_[index(s, t)]; }
  Sizes<int64_t> z_;
  int64_t n_;
  std::vector<int64_t> need_;
  std::vector<int32_t> what_;
};

constexpr int64_t kExactMinMemoryStages = 1500;

// Recompute every stage from the input: the least memory when nothing may be kept but a_0 (O(n)).
int64_t recompute_from_input_peak(const Chain& chain) {
  const Sizes<int64_t> z(chain, [](int64_t v) { return v; });
  const int64_t n = chain.size();
  int64_t sweep_peak = 0, worst = z.base(n);
  for (int64_t t = 1; t <= n; ++t) {
    sweep_peak = std::max(sweep_peak, z.sweep_step(0, t - 1));
    worst = std::max({worst, z.x[t + 1] + sweep_peak, z.x[t] + z.base(t)});
  }
  worst = std::max(worst, z.base(0));
  return z.x[0] + worst;
}

std::string bytes_text(int64_t b) {
  return format_bytes(b) + " (" + std::to_string(b) + " bytes)";
}

[[noreturn]] void infeasible(const char* who, int64_t budget, int64_t min_bytes) {
  throw InfeasibleBudget(std::string(who) + ": no schedule fits a budget of " + bytes_text(budget) +
                             "; the minimum for this chain is " + bytes_text(min_bytes),
                         budget, min_bytes);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Baselines

Plan segmented(int64_t n, const std::vector<int64_t>& starts, bool checkpoint_last_segment) {
  if (n < 1)
    throw std::invalid_argument("remat::segmented: num_stages must be >= 1, got " + std::to_string(n));
  if (starts.empty() || starts[0] != 0) {
    throw std::invalid_argument("remat::segmented: the first segment must start at stage 0");
  }
  for (size_t j = 1; j < starts.size(); ++j) {
    if (starts[j] <= starts[j - 1] || starts[j] >= n) {
      throw std::invalid_argument("remat::segmented: segment start " + std::to_string(starts[j]) +
                                  " (segment " + std::to_string(j) + ") must be after " +
                                  std::to_string(starts[j - 1]) + " and below " + std::to_string(n));
    }
  }
  Plan plan;
  plan.num_stages = n;
  const size_t k = starts.size();
  auto end_of = [&](size_t j) { return j + 1 < k ? starts[j + 1] : n; };
  auto checkpointed = [&](size_t j) { return j + 1 < k || checkpoint_last_segment; };
  for (size_t j = 0; j < k; ++j) {
    if (checkpointed(j)) {
      push(plan, OpKind::kForwardCheckpoint, starts[j]);
      for (int64_t i = starts[j] + 1; i < end_of(j); ++i)
        push(plan, OpKind::kForwardNoSave, i);
    } else {
      for (int64_t i = starts[j]; i < end_of(j); ++i)
        push(plan, OpKind::kForwardAll, i);
    }
  }
  push(plan, OpKind::kLoss, -1);
  for (size_t j = k; j-- > 0;) {
    if (checkpointed(j)) {
      for (int64_t i = starts[j]; i < end_of(j); ++i)
        push(plan, OpKind::kForwardAll, i);
    }
    for (int64_t i = end_of(j) - 1; i >= starts[j]; --i)
      push(plan, OpKind::kBackward, i);
  }
  plan.planner = "segmented";
  check_plan(plan);
  return plan;
}

Plan no_checkpoint(const Chain& chain) {
  validate(chain);
  return finish(chain, segmented(chain.size(), {0}), "none", 0);
}

Plan checkpoint_all(const Chain& chain) {
  validate(chain);
  std::vector<int64_t> every(static_cast<size_t>(chain.size()));
  for (int64_t i = 0; i < chain.size(); ++i)
    every[i] = i;  // every stage its own checkpointed segment
  return finish(chain, segmented(chain.size(), every, /*checkpoint_last_segment=*/true), "all", 0);
}

std::vector<int64_t> even_starts(int64_t num_stages, int64_t segments) {
  if (segments < 1 || segments > num_stages) {
    throw std::invalid_argument("remat::even_starts: segments must be in [1, " + std::to_string(num_stages) +
                                "] (the chain has " + std::to_string(num_stages) + " stages), got " +
                                std::to_string(segments));
  }
  std::vector<int64_t> starts;
  const int64_t q = num_stages / segments, r = num_stages % segments;
  for (int64_t j = 0, at = 0; j < segments; ++j) {
    starts.push_back(at);
    at += q + (j < r ? 1 : 0);
  }
  return starts;
}

Plan uniform(const Chain& chain, int64_t segments, bool checkpoint_last_segment) {
  validate(chain);
  if (segments < 1 || segments > chain.size()) {
    throw std::invalid_argument("remat::uniform: segments must be in [1, " + std::to_string(chain.size()) +
                                "] (the chain has " + std::to_string(chain.size()) + " stages), got " +
                                std::to_string(segments));
  }
  return balanced(chain, segments, Balance::kCount, checkpoint_last_segment);
}

std::vector<int64_t> balanced_starts(const Chain& chain, int64_t segments, Balance by) {
  validate(chain);
  const int64_t n = chain.size();
  if (segments < 1 || segments > n) {
    throw std::invalid_argument("remat::balanced_starts: segments must be in [1, " + std::to_string(n) +
                                "] (the chain has " + std::to_string(n) + " stages), got " +
                                std::to_string(segments));
  }
  if (by == Balance::kCount) return even_starts(n, segments);
  // prefix[i]: the cost of stages [0, i). Sizes are < 2^60 and times < 1e12 ms per stage, so a long double
  // sum is exact enough to compare splits.
  std::vector<long double> prefix(static_cast<size_t>(n) + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const Stage& s = chain.stages[static_cast<size_t>(i)];
    prefix[i + 1] = prefix[i] + (by == Balance::kMemory ? static_cast<long double>(s.saved_bytes) : s.fwd_ms);
  }
  // best[j][i]: the least largest cost of splitting stages [0, i) into j segments; cut[j][i]: where the last
  // of them starts.
  const long double inf = std::numeric_limits<long double>::infinity();
  std::vector<std::vector<long double>> best(segments + 1, std::vector<long double>(n + 1, inf));
  std::vector<std::vector<int64_t>> cut(segments + 1, std::vector<int64_t>(n + 1, -1));
  best[0][0] = 0;
  for (int64_t j = 1; j <= segments; ++j) {
    for (int64_t i = j; i <= n; ++i) {
      for (int64_t k = j - 1; k < i; ++k) {
        if (best[j - 1][k] == inf) continue;
        const long double cost = std::max(best[j - 1][k], prefix[i] - prefix[k]);
        if (cost < best[j][i]) best[j][i] = cost, cut[j][i] = k;
      }
    }
  }
  std::vector<int64_t> starts(static_cast<size_t>(segments));
  for (int64_t j = segments, i = n; j >= 1; --j) {
    starts[static_cast<size_t>(j - 1)] = cut[j][i];
    i = cut[j][i];
  }
  return starts;
}

Plan balanced(const Chain& chain, int64_t segments, Balance by, bool checkpoint_last_segment) {
  const std::vector<int64_t> starts = balanced_starts(chain, segments, by);
  const std::string name = by == Balance::kCount    ? "uniform:"
                           : by == Balance::kMemory ? "balanced:"
                                                    : "balanced-time:";
  return finish(chain, segmented(chain.size(), starts, checkpoint_last_segment),
                name + std::to_string(segments), 0);
}

Plan sqrt_n(const Chain& chain) {
  validate(chain);
  const auto k = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(chain.size()))));
  return finish(chain, uniform(chain, std::min(k, chain.size())), "sqrt", 0);
}

// ---------------------------------------------------------------------------------------------------------------
// Optimal

int64_t min_feasible_budget(const Chain& chain) {
  validate(chain);
  if (chain.size() > kExactMinMemoryStages) return recompute_from_input_peak(chain);
  return MinMemory(chain).total();
}

namespace {

// The dynamic program's schedule for `slots` slots, or an empty plan when nothing fits in slots.
Plan dp_plan(const Chain& chain, int64_t budget, int64_t slots) {
  const int64_t unit = std::max<int64_t>(1, budget / slots);
  const int64_t total = budget / unit;  // >= slots when budget >= slots
  // Rounded up without forming v + unit (budgets up to INT64_MAX are valid).
  const Sizes<int64_t> z(chain, [unit](int64_t v) { return v / unit + (v % unit != 0 ? 1 : 0); });
  Plan plan;
  plan.num_stages = chain.size();
  const int64_t m = total - z.x[0];
  if (m < 0) return plan;
  const Table table(z, total);
  if (!std::isfinite(table.at(0, z.n, m))) return plan;
  Emitter e{plan, z.n};
  table.emit(e, 0, z.n, m);
  return plan;
}

void check_dp_size(const Chain& chain, int64_t slots) {
  const double n = static_cast<double>(chain.size()) + 1;
  const double cells = n * (n + 1) / 2 * (static_cast<double>(slots) + 1);
  const double work = n * n * n / 6 * static_cast<double>(slots);
  if (cells * 12 > 1.5e9 || work > 2e10) {
    std::ostringstream os;
    os << "remat::optimal: a chain of " << chain.size() << " stages with " << slots << " slots needs about "
       << format_bytes(static_cast<int64_t>(cells * 12)) << " of tables and " << work
       << " steps; use fewer slots, or remat::revolve for long homogeneous chains";
    throw std::invalid_argument(os.str());
  }
}

}  // namespace

Plan optimal(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options) {
  validate(chain);
  if (options.slots < 1) {
    throw std::invalid_argument("remat::optimal: slots must be >= 1, got " + std::to_string(options.slots));
  }
  if (budget_bytes < 0) {
    throw std::invalid_argument("remat::optimal: negative budget (" + std::to_string(budget_bytes) +
                                " bytes)");
  }
  const int64_t slots = std::min(options.slots, std::max<int64_t>(budget_bytes, 1));
  check_dp_size(chain, slots);
  Plan best = dp_plan(chain, budget_bytes, slots);
  if (!best.ops.empty()) best = finish(chain, std::move(best), "optimal", budget_bytes);

  if (options.compare_baselines) {
    std::vector<Plan> candidates{no_checkpoint(chain), checkpoint_all(chain)};
    for (int64_t k = 1; k <= chain.size(); ++k)
      candidates.push_back(uniform(chain, k));
    for (Plan& c : candidates) {
      if (c.predicted.peak_bytes <= budget_bytes &&
          (best.ops.empty() || c.predicted.time_ms < best.predicted.time_ms)) {
        c.planner = "optimal";
        c.budget_bytes = budget_bytes;
        best = std::move(c);
      }
    }
  }
  if (best.ops.empty()) {
    const int64_t min_bytes = min_feasible_budget(chain);
    if (budget_bytes < min_bytes) infeasible("remat::optimal", budget_bytes, min_bytes);
    // Rounding to slots lost the few bytes that separate the budget from the minimum: take the least-memory
    // schedule, computed exactly.
    if (chain.size() > kExactMinMemoryStages) infeasible("remat::optimal", budget_bytes, min_bytes);
    Plan plan;
    plan.num_stages = chain.size();
    Emitter e{plan, chain.size()};
    MinMemory(chain).emit(e, 0, chain.size());
    best = finish(chain, std::move(plan), "optimal", budget_bytes);
  }
  if (best.predicted.peak_bytes > budget_bytes) {
    throw std::logic_error("remat::optimal: internal error: the schedule's peak exceeds the budget");
  }
  return best;
}

// ---------------------------------------------------------------------------------------------------------------
// Revolve

namespace {

// How far to advance from the current checkpoint when reversing `steps` steps with `s` snapshots counting the
// current one (s >= 2): Griewank and Walther's binomial rule (Algorithm 799).
int64_t revolve_advance(int64_t steps, int64_t s) {
  int64_t reps = 0, range = 1;
  while (range < steps) {
    ++reps;
    range = range * (reps + s) / reps;
  }
  const int64_t bino1 = range * reps / (s + reps);
  const int64_t bino2 = s > 1 ? bino1 * s / (s + reps - 1) : 1;
  const int64_t bino3 = s == 1 ? 0 : (s > 2 ? bino2 * (s - 1) / (s + reps - 2) : 1);
  const int64_t bino4 = bino2 * (reps - 1) / s;
  const int64_t bino5 = s < 3 ? 0 : (s > 3 ? bino3 * (s - 2) / reps : 1);
  int64_t advance;
  if (steps <= bino1 + bino3) {
    advance = bino4;
  } else if (steps >= range - bino5) {
    advance = bino1;
  } else {
    advance = steps - bino2 - bino3;
  }
  return std::clamp<int64_t>(advance, 1, steps - 1);
}

struct RevolveEmitter {
  Plan& plan;
  int64_t n;
  void tape_and_reverse(int64_t i) {
    push(plan, OpKind::kForwardAll, i);
    if (i == n - 1) push(plan, OpKind::kLoss, -1);  // the loss needs a_n: right after its first taping
    push(plan, OpKind::kBackward, i);
  }
  void sweep(int64_t from, int64_t to) {
    push(plan, OpKind::kForwardCheckpoint, from);
    for (int64_t k = from + 1; k < to; ++k)
      push(plan, OpKind::kForwardNoSave, k);
  }
  // Reverses stages [l, r) with a_l held and c free snapshots.
  void reverse(int64_t l, int64_t r, int64_t c) {
    while (r - l > 1 && c == 0) {
      sweep(l, r - 1);
      tape_and_reverse(r - 1);
      --r;
    }
    if (r - l == 1) {
      tape_and_reverse(l);
      return;
    }
    const int64_t m = l + revolve_advance(r - l, c + 1);
    sweep(l, m);
    reverse(m, r, c - 1);
    reverse(l, m, c);
  }
};

// Forward steps of revolve on n steps with c free snapshots, without building it (t * n bound), to avoid
// materialising quadratic schedules.
double revolve_forward_estimate(int64_t n, int64_t c) {
  const int64_t s = c + 1;
  double range = 1;
  int64_t reps = 0;
  while (range < static_cast<double>(n)) {
    ++reps;
    range = range * static_cast<double>(reps + s) / static_cast<double>(reps);
  }
  return static_cast<double>(reps + 1) * static_cast<double>(n);
}

}  // namespace

Plan revolve(const Chain& chain, int64_t snapshots) {
  validate(chain);
  if (snapshots < 0) {
    throw std::invalid_argument("remat::revolve: snapshots must be >= 0, got " + std::to_string(snapshots));
  }
  Plan plan;
  plan.num_stages = chain.size();
  RevolveEmitter e{plan, chain.size()};
  e.reverse(0, chain.size(), std::min(snapshots, chain.size()));
  return finish(chain, std::move(plan), "revolve:" + std::to_string(snapshots), 0);
}

Plan revolve_within(const Chain& chain, int64_t budget_bytes) {
  validate(chain);
  const int64_t n = chain.size();
  constexpr double kMaxForwards = 5e7;
  int64_t lo = 0;  // fewer snapshots than this make schedules too long to build
  while (lo < n && revolve_forward_estimate(n, lo) > kMaxForwards)
    ++lo;
  if (n <= 512) {
    // On a heterogeneous chain the peak need not grow with the snapshots (which activations they hold
    // matters), so try them all, most first: more snapshots never cost time.
    for (int64_t c = n; c >= lo; --c) {
      Plan p = revolve(chain, c);
      if (p.predicted.peak_bytes <= budget_bytes) {
        p.budget_bytes = budget_bytes;
        return p;
      }
    }
    infeasible("remat::revolve_within", budget_bytes, min_feasible_budget(chain));
  }
  // Each snapshot holds one activation on top of recomputing from the input (revolve with none), so this many
  // snapshots fit; usually it is the answer, and only it and its neighbour need building.
  int64_t largest = 0;
  for (int64_t i = 1; i <= n; ++i)
    largest = std::max(largest, chain.activation_bytes(i));
  const int64_t spare = budget_bytes - recompute_from_input_peak(chain);
  int64_t guess = spare > 0 && largest > 0 ? std::min<int64_t>(n, spare / largest) : 0;
  guess = std::max(guess, lo);
  Plan fits = revolve(chain, guess);
  int64_t ok = guess, bad = n + 1;  // revolve(ok) fits; revolve(bad) does not (n + 1: none known)
  auto bisect = [&] {               // narrows (ok, bad) to neighbours, keeping the plan of ok in `fits`
    while (bad - ok > 1 && bad <= n) {
      const int64_t mid = ok + (bad - ok) / 2;
      Plan p = revolve(chain, mid);
      if (p.predicted.peak_bytes <= budget_bytes) {
        ok = mid, fits = std::move(p);
      } else {
        bad = mid;
      }
    }
  };
  if (fits.predicted.peak_bytes > budget_bytes) {
    bad = guess;
    ok = lo - 1;
    bisect();
    if (ok < lo) {
      infeasible("remat::revolve_within", budget_bytes,
                 std::min(revolve(chain, lo).predicted.peak_bytes, min_feasible_budget(chain)));
    }
  } else {
    for (int64_t step = 1; ok < n; step *= 2) {  // more snapshots while they fit
      const int64_t next = std::min(n, ok + step);
      Plan p = revolve(chain, next);
      if (p.predicted.peak_bytes > budget_bytes) {
        bad = next;
        break;
      }
      ok = next, fits = std::move(p);
    }
    bisect();
  }
  fits.budget_bytes = budget_bytes;
  return fits;
}

// ---------------------------------------------------------------------------------------------------------------

Plan make_plan(const Chain& chain, const std::string& planner, int64_t budget_bytes,
               const PlannerOptions& options) {
  auto number_after = [&](const std::string& prefix) -> int64_t {
    const std::string rest = planner.substr(prefix.size());
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(rest, &used);
    } catch (const std::logic_error&) {
      used = 0;
    }
    if (rest.empty() || used != rest.size()) {
      throw std::invalid_argument("remat::make_plan: '" + planner + "' needs a whole number after '" +
                                  prefix + "'");
    }
    return v;
  };
  if (planner == "none") return no_checkpoint(chain);
  if (planner == "all") return checkpoint_all(chain);
  if (planner == "sqrt") return sqrt_n(chain);
  if (planner.rfind("uniform:", 0) == 0) return uniform(chain, number_after("uniform:"));
  if (planner.rfind("balanced:", 0) == 0) return balanced(chain, number_after("balanced:"), Balance::kMemory);
  if (planner.rfind("balanced-time:", 0) == 0)
    return balanced(chain, number_after("balanced-time:"), Balance::kTime);
  if (planner == "optimal") return optimal(chain, budget_bytes, options);
  if (planner == "revolve") return revolve_within(chain, budget_bytes);
  if (planner.rfind("revolve:", 0) == 0) return revolve(chain, number_after("revolve:"));
  throw std::invalid_argument(
      "remat::make_plan: unknown planner '" + planner +
      "' (none, all, sqrt, uniform:K, balanced:K, balanced-time:K, optimal, revolve, revolve:S)");
}

}  // namespace remat
