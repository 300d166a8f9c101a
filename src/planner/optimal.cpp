#include "remat/planner/optimal.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "detail/optimal.h"
#include "detail/planner.h"
#include "remat/planner/units.h"

// The persistent dynamic program of Beaumont et al. 2019 (optimal) and its exact least-memory twin
// (min_feasible_budget).

namespace remat {

using detail::finish;
using detail::infeasible;
using detail::kExactMinMemoryStages;
using detail::push;
using detail::recompute_from_input_peak;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------------------------
// The chain as the dynamic programs see it: n + 1 stages, the last being the loss (no time, no memory of its
// own; its backward creates d_n). Index i of x is a_i (i = 0..n+1, a_{n+1} = 0); xb[i + 1] is stage i's abar.
template <typename T>
struct Sizes {
  int64_t n = 0;  // real stages
  std::vector<T> x, xb, ft, nt, bt;
  std::vector<double> f, fn, b;  // forward with saving (Fa), without (Fn, Fc), backward
  // Fk, in variants: 0 keeps the remat::keep calls (the keep_ fields), v >= 1 keeps under the chain's policy
  // v - 1. Per variant: whether stage i has it, what it keeps (xk[v][i + 1], like xb), its forward and its
  // backward (recompute included).
  int64_t variants = 0;
  std::vector<std::vector<char>> hk;
  std::vector<std::vector<T>> xk;
  std::vector<std::vector<double>> fk, bk;
  // A policy's measured backward peak (PolicyCost::bwd_tmp_bytes), where it has one: its backward holds what
  // it keeps plus that, instead of what Fa keeps plus Fa's backward transient.
  std::vector<std::vector<char>> hpb;
  std::vector<std::vector<T>> pb;

  template <typename Convert>
  Sizes(const Chain& chain, Convert convert, const std::vector<char>& allowed)
      : n(chain.size()), variants(1 + static_cast<int64_t>(chain.policies.size())) {
    x.assign(n + 2, 0);
    xb.assign(n + 2, 0);
    ft.assign(n + 1, 0);
    nt.assign(n + 1, 0);
    bt.assign(n + 1, 0);
    f.assign(n + 1, 0);
    fn.assign(n + 1, 0);
    b.assign(n + 1, 0);
    hk.assign(variants, std::vector<char>(n + 1, 0));
    xk.assign(variants, std::vector<T>(n + 2, 0));
    fk.assign(variants, std::vector<double>(n + 1, 0));
    bk.assign(variants, std::vector<double>(n + 1, 0));
    hpb.assign(variants, std::vector<char>(n + 1, 0));
    pb.assign(variants, std::vector<T>(n + 1, 0));
    for (int64_t i = 0; i <= n; ++i)
      x[i] = convert(chain.activation_bytes(i));
    for (int64_t i = 0; i < n; ++i) {
      const Stage& s = chain.stages[i];
      xb[i + 1] = convert(s.saved_bytes);
      ft[i] = convert(s.fwd_tmp_bytes);
      nt[i] = convert(s.nosave_tmp_bytes());
      bt[i] = convert(s.bwd_tmp_bytes);
      f[i] = s.fwd_ms;
      fn[i] = s.nosave_ms();
      b[i] = s.bwd_ms;
      if (s.has_keep() && allowed[0]) {
        hk[0][i] = 1;
        xk[0][i + 1] = convert(*s.keep_saved_bytes);
        fk[0][i] = *s.keep_fwd_ms;
        bk[0][i] = *s.keep_bwd_ms;
      }
      for (size_t p = 0; p < s.policies.size(); ++p) {
        if (!allowed[p + 1]) continue;
        hk[p + 1][i] = 1;
        xk[p + 1][i + 1] = convert(s.policies[p].saved_bytes);
        fk[p + 1][i] = s.policies[p].fwd_ms;
        bk[p + 1][i] = s.policies[p].bwd_ms;
        if (s.policies[p].bwd_tmp_bytes) {
          hpb[p + 1][i] = 1;
          pb[p + 1][i] = convert(*s.policies[p].bwd_tmp_bytes);
        }
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
  // Option K at s with variant v (stage s has it): Fk(s) with d_{t+1} held, and B(s) at the end, which
  // recomputes the rest of abar_{s+1} first (so its peak is option A's or that recompute's, or what the
  // policy's backward was measured to hold beyond what it keeps).
  T keep_some_need(int64_t v, int64_t s, int64_t t) const {
    // (What a policy keeps may exceed what Fa does: then that, and nothing recomputed.) With the keep tags
    // (v = 0), the larger of the backward and the recompute before it, which makes the rest as Fa's forward
    // did (simulate()'s rule).
    const T after = v == 0 ? std::max(x[s] + bt[s], ft[s]) : x[s] + bt[s];
    const T backward = hpb[v][s] ? xk[v][s + 1] + x[s + 1] + x[s] + pb[v][s]
                                 : std::max(xb[s + 1], xk[v][s + 1]) + x[s + 1] + after;
    // Its forward: what it keeps plus Stage::keep_fwd_tmp_bytes(), from the sizes in slots.
    return std::max(
        x[t + 1] + xk[v][s + 1] + std::max(T(0), std::min(nt[s], xb[s + 1] - xk[v][s + 1] + ft[s])),
        backward);
  }
  // The forward k of a sweep that starts at s (a_s is held by the caller, a_k for k > s by the sweep).
  T sweep_step(int64_t s, int64_t k) const { return (k == s ? T(0) : x[k]) + x[k + 1] + nt[k]; }
};

// The choices of the dynamic programs besides a checkpoint at s' > s: keep everything of stage s (Fa), or
// keep with Fk variant v (kKeepSome - v).
constexpr int32_t kKeepAll = -1, kKeepSome = -10;
bool is_keep_some(int32_t choice) {
  return choice <= kKeepSome;
}
int64_t variant_of(int32_t choice) {
  return kKeepSome - choice;
}

// Emits a schedule for subchain [s, t] in the shapes both dynamic programs use: choice -1 is "keep
// everything of stage s" (Fa(s), the rest, B(s)); a keep-some choice is the same with Fk(s); choice s' > s is
// "sweep to a_{s'}, keep it as a checkpoint, do [s', t], then [s, s' - 1]". The loss stage n emits L.
struct Emitter {
  Plan& plan;
  int64_t n;
  void keep_all_open(int64_t s) {
    if (s < n) push(plan, OpKind::kForwardAll, s);
  }
  void keep_some_open(int64_t s, int64_t variant) {
    Op op{OpKind::kForwardKeep, s};
    op.policy = static_cast<int32_t>(variant - 1);
    plan.ops.push_back(op);
  }
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
    if (w == kKeepAll || is_keep_some(w)) {
      const bool all = w == kKeepAll;
      if (all) {
        e.keep_all_open(s);
      } else {
        e.keep_some_open(s, variant_of(w));
      }
      if (s < t) emit(e, s + 1, t, m - (all ? z_.xb[s + 1] : z_.xk[variant_of(w)][s + 1]));
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
        for (int64_t v = 0; v < z_.variants; ++v) {
          if (z_.hk[v][s])
            keep_option(z_.keep_some_need(v, s, t), z_.xk[v][s + 1], z_.fk[v][s] + z_.bk[v][s],
                        static_cast<int32_t>(kKeepSome - v));
        }
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
  MinMemory(const Chain& chain, const std::vector<char>& allowed)
      : z_(
            chain, [](int64_t v) { return v; }, allowed),
        n_(chain.size()) {
    const int64_t pairs = (n_ + 1) * (n_ + 2) / 2;
    need_.assign(static_cast<size_t>(pairs), 0);
    what_.assign(static_cast<size_t>(pairs), -1);
    for (int64_t len = 0; len <= n_; ++len) {
      for (int64_t s = 0; s + len <= n_; ++s) {
        const int64_t t = s + len;
        int64_t best = len == 0 ? z_.base(t) : std::max(z_.keep_all_need(s, t), z_.xb[s + 1] + get(s + 1, t));
        int32_t choice = kKeepAll;
        for (int64_t v = 0; v < z_.variants; ++v) {
          if (!z_.hk[v][s]) continue;
          const int64_t some = len == 0
                                   ? z_.keep_some_need(v, s, t)
                                   : std::max(z_.keep_some_need(v, s, t), z_.xk[v][s + 1] + get(s + 1, t));
          if (some < best) best = some, choice = static_cast<int32_t>(kKeepSome - v);
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
    if (w == kKeepAll || is_keep_some(w)) {
      if (w == kKeepAll) {
        e.keep_all_open(s);
      } else {
        e.keep_some_open(s, variant_of(w));
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

}  // namespace

namespace detail {

// Recompute every stage from the input: the least memory when nothing may be kept but a_0 (O(n)).
int64_t recompute_from_input_peak(const Chain& chain) {
  const Sizes<int64_t> z(
      chain, [](int64_t v) { return v; }, std::vector<char>(1 + chain.policies.size(), 0));
  const int64_t n = chain.size();
  int64_t sweep_peak = 0, worst = z.base(n);
  for (int64_t t = 1; t <= n; ++t) {
    sweep_peak = std::max(sweep_peak, z.sweep_step(0, t - 1));
    worst = std::max({worst, z.x[t + 1] + sweep_peak, z.x[t] + z.base(t)});
  }
  worst = std::max(worst, z.base(0));
  return z.x[0] + worst;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------------------------
// Optimal

int64_t min_feasible_budget(const Chain& chain, const PlannerOptions& options) {
  validate(chain);
  detail::refuse_offload(options, "remat::min_feasible_budget");
  const std::vector<char> allowed = detail::allowed_variants(chain, options, "remat::optimal");
  if (chain.size() > kExactMinMemoryStages) return recompute_from_input_peak(chain);
  return MinMemory(chain, allowed).total();
}

namespace {

// The dynamic program's schedule for `slots` slots, or an empty plan when nothing fits in slots.
Plan dp_plan(const Chain& chain, int64_t budget, int64_t slots, const std::vector<char>& allowed) {
  const int64_t unit = std::max<int64_t>(1, budget / slots);
  const int64_t total = budget / unit;  // >= slots when budget >= slots
  // Rounded up without forming v + unit (budgets up to INT64_MAX are valid).
  const Sizes<int64_t> z(
      chain, [unit](int64_t v) { return v / unit + (v % unit != 0 ? 1 : 0); }, allowed);
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
  detail::refuse_offload(options, "remat::optimal");
  if (options.slots < 1) {
    throw std::invalid_argument("remat::optimal: slots must be >= 1, got " + std::to_string(options.slots));
  }
  if (budget_bytes < 0) {
    throw std::invalid_argument("remat::optimal: negative budget (" + std::to_string(budget_bytes) +
                                " bytes)");
  }
  const std::vector<char> allowed = detail::allowed_variants(chain, options, "remat::optimal");
  const int64_t slots = std::min(options.slots, std::max<int64_t>(budget_bytes, 1));
  check_dp_size(chain, slots);
  Plan best = dp_plan(chain, budget_bytes, slots, allowed);
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
    const int64_t min_bytes = min_feasible_budget(chain, options);
    if (budget_bytes < min_bytes) infeasible("remat::optimal", budget_bytes, min_bytes);
    // Rounding to slots lost the few bytes that separate the budget from the minimum: take the least-memory
    // schedule, computed exactly.
    if (chain.size() > kExactMinMemoryStages) infeasible("remat::optimal", budget_bytes, min_bytes);
    Plan plan;
    plan.num_stages = chain.size();
    Emitter e{plan, chain.size()};
    MinMemory(chain, allowed).emit(e, 0, chain.size());
    best = finish(chain, std::move(plan), "optimal", budget_bytes);
  }
  if (best.predicted.peak_bytes > budget_bytes) {
    throw std::logic_error("remat::optimal: internal error: the schedule's peak exceeds the budget");
  }
  return best;
}

}  // namespace remat
