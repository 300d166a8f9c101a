#include <algorithm>
#include <limits>
#include <stdexcept>

#include "planning.h"
#include "remat/planner.h"

// The per-layer planner: for each stage on its own, keep it (Fa), keep it under an Fk variant, or checkpoint
// it (Fc, recomputed right before its backward): the choices per-layer torch.utils.checkpoint (with or
// without a selective policy) and remat::checkpoint per layer offer, chosen for the least time within a
// budget by an exact dynamic program over Pareto frontiers.
//
// The peak of such a plan, in the model of remat/plan.h, with R_j = a_0 + the bytes held by stages 0..j-1
// (abar, what an Fk variant keeps, or a plain a_{j+1} for a checkpointed stage), is the largest of
//   R_j + held_j + fwd_tmp_j                                         stage j's forward
//   R_j + a_{j+1} + abar_{j+1} + max(a_j + bwd_tmp_j, fwd_tmp_j if j is checkpointed, else 0)
//                                                                    its recompute and backward (d_{j+1}
//                                                                    held)
//   R_n + a_n                                                        the loss (d_n created)
// so a stage's choice matters to the stages after it only through R: the frontier of (R, time) pairs, each
// with the largest peak so far within the budget, is all the program carries from one stage to the next.
// per_layer_min_budget() runs the same program on (R, peak) pairs.

namespace remat {
namespace {

using detail::push;

// One choice for a stage: keep everything, checkpoint it, or an Fk variant (0: the keep tags; v >= 1: the
// chain's policy v - 1).
struct Choice {
  OpKind kind = OpKind::kForwardAll;
  int64_t variant = -1;
  int64_t held = 0;  // bytes held after its forward
  double ms = 0;     // its forward and backward, as run per call
};

std::vector<Choice> choices_of(const Chain& chain, int64_t j, const std::vector<char>& allowed) {
  const Stage& s = chain.stages[static_cast<size_t>(j)];
  std::vector<Choice> out;
  out.push_back({OpKind::kForwardAll, -1, s.saved_bytes, s.fwd_ms + s.bwd_ms});
  out.push_back({OpKind::kForwardCheckpoint, -1, s.output_bytes, s.per_call_fwd_ms() + s.per_call_bwd_ms()});
  if (s.has_keep() && allowed[0])
    out.push_back({OpKind::kForwardKeep, 0, *s.keep_saved_bytes, *s.keep_fwd_ms + *s.keep_bwd_ms});
  for (size_t p = 0; p < s.policies.size(); ++p) {
    if (!allowed[p + 1]) continue;
    const PolicyCost& c = s.policies[p];
    out.push_back({OpKind::kForwardKeep, static_cast<int64_t>(p) + 1, c.saved_bytes, c.fwd_ms + c.bwd_ms});
  }
  return out;
}

// The peak of stage j run as `c` above R_j (the bytes held before it).
int64_t stage_need(const Chain& chain, int64_t j, const Choice& c) {
  const Stage& s = chain.stages[static_cast<size_t>(j)];
  const int64_t a_in = chain.activation_bytes(j), a_out = s.output_bytes;
  const int64_t fwd = c.held + s.fwd_tmp_bytes;
  const int64_t bwd =
      a_out + s.saved_bytes +
      std::max(a_in + s.bwd_tmp_bytes, c.kind == OpKind::kForwardCheckpoint ? s.fwd_tmp_bytes : int64_t{0});
  return std::max(fwd, bwd);
}

// A point of a frontier: R (bytes held), the peak so far, the time so far, and how it was reached.
struct Point {
  int64_t held = 0;
  int64_t peak = 0;
  double ms = 0;
  int64_t parent = -1;  // index in the previous stage's frontier
  int64_t choice = -1;  // index in choices_of()
};

// Frontiers larger than this are thinned (see thin()).
constexpr size_t kMaxFrontier = size_t{1} << 15;

// Keeps the points no other point beats on both R and `key` (time when planning for a budget, peak when
// looking for the least memory). Ties keep the first point.
template <typename Key>
std::vector<Point> pareto(std::vector<Point> points, Key key) {
  std::stable_sort(points.begin(), points.end(), [&](const Point& a, const Point& b) {
    return a.held != b.held ? a.held < b.held : key(a) < key(b);
  });
  std::vector<Point> out;
  for (const Point& p : points)
    if (out.empty() || key(p) < key(out.back())) out.push_back(p);
  return out;
}

// A frontier past kMaxFrontier points keeps one point per band of R (the best key in it), its R raised to
// the band's top: the program stays exact about feasibility (R only grows) and loses at most a band's worth
// of memory. Never reached by chains of equal layers, whose R takes few values.
template <typename Key>
std::vector<Point> thin(std::vector<Point> points, Key key) {
  if (points.size() <= kMaxFrontier) return points;
  const int64_t lo = points.front().held, hi = points.back().held;
  const int64_t band = std::max<int64_t>(1, (hi - lo) / static_cast<int64_t>(kMaxFrontier / 2) + 1);
  std::vector<Point> out;
  for (const Point& p : points) {
    const int64_t top = lo + ((p.held - lo) / band + 1) * band - 1;
    if (!out.empty() && out.back().held == top) {
      if (key(p) < key(out.back())) {
        out.back() = p;
        out.back().held = top;
      }
    } else {
      out.push_back(p);
      out.back().held = top;
    }
  }
  return pareto(std::move(out), key);
}

struct Solution {
  std::vector<std::vector<Point>> frontiers;  // per stage boundary 0..n
  std::vector<std::vector<Choice>> choices;   // per stage
  int64_t best = -1;                          // index in frontiers[n], or -1
  int64_t best_peak = 0;
};

// by_time: the fastest within `budget`; otherwise the least peak (budget ignored).
Solution solve(const Chain& chain, const std::vector<char>& allowed, bool by_time, int64_t budget) {
  const int64_t n = chain.size();
  Solution sol;
  sol.choices.resize(static_cast<size_t>(n));
  sol.frontiers.resize(static_cast<size_t>(n) + 1);
  sol.frontiers[0].push_back({chain.input_bytes, chain.input_bytes, 0.0, -1, -1});
  auto time_key = [](const Point& p) { return p.ms; };
  auto peak_key = [](const Point& p) { return p.peak; };
  for (int64_t j = 0; j < n; ++j) {
    sol.choices[static_cast<size_t>(j)] = choices_of(chain, j, allowed);
    const auto& cs = sol.choices[static_cast<size_t>(j)];
    std::vector<Point> next;
    const auto& cur = sol.frontiers[static_cast<size_t>(j)];
    for (size_t k = 0; k < cur.size(); ++k) {
      for (size_t c = 0; c < cs.size(); ++c) {
        const int64_t peak = std::max(cur[k].peak, cur[k].held + stage_need(chain, j, cs[c]));
        if (by_time && peak > budget) continue;
        next.push_back({cur[k].held + cs[c].held, peak, cur[k].ms + cs[c].ms, static_cast<int64_t>(k),
                        static_cast<int64_t>(c)});
      }
    }
    next = by_time ? thin(pareto(std::move(next), time_key), time_key)
                   : thin(pareto(std::move(next), peak_key), peak_key);
    sol.frontiers[static_cast<size_t>(j) + 1] = std::move(next);
  }
  const auto& last = sol.frontiers[static_cast<size_t>(n)];
  const int64_t a_n = chain.activation_bytes(n);
  for (size_t k = 0; k < last.size(); ++k) {
    const int64_t peak = std::max(last[k].peak, last[k].held + a_n);
    if (by_time && peak > budget) continue;
    const bool better = sol.best < 0 || (by_time ? last[k].ms < last[static_cast<size_t>(sol.best)].ms
                                                 : peak < sol.best_peak);
    if (better) {
      sol.best = static_cast<int64_t>(k);
      sol.best_peak = peak;
    }
  }
  return sol;
}

// The plan of a solution: forwards in order, the loss, then each stage's backward (a checkpointed stage's
// recompute first).
Plan emit(const Chain& chain, const Solution& sol, double* ms) {
  const int64_t n = chain.size();
  std::vector<const Choice*> picked(static_cast<size_t>(n));
  int64_t k = sol.best;
  *ms = sol.frontiers[static_cast<size_t>(n)][static_cast<size_t>(k)].ms;
  for (int64_t j = n; j-- > 0;) {
    const Point& p = sol.frontiers[static_cast<size_t>(j) + 1][static_cast<size_t>(k)];
    picked[static_cast<size_t>(j)] = &sol.choices[static_cast<size_t>(j)][static_cast<size_t>(p.choice)];
    k = p.parent;
  }
  Plan plan;
  plan.num_stages = n;
  for (int64_t j = 0; j < n; ++j) {
    const Choice& c = *picked[static_cast<size_t>(j)];
    Op op{c.kind, j};
    if (c.kind == OpKind::kForwardKeep) op.policy = static_cast<int32_t>(c.variant - 1);
    plan.ops.push_back(op);
  }
  push(plan, OpKind::kLoss, -1);
  for (int64_t j = n; j-- > 0;) {
    if (picked[static_cast<size_t>(j)]->kind == OpKind::kForwardCheckpoint)
      push(plan, OpKind::kForwardAll, j);
    push(plan, OpKind::kBackward, j);
  }
  return plan;
}

}  // namespace

int64_t per_layer_min_budget(const Chain& chain, const PlannerOptions& options) {
  validate(chain);
  const Solution sol = solve(chain, detail::allowed_variants(chain, options, "remat::per_layer"), false, 0);
  return sol.best_peak;
}

Plan per_layer(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options) {
  validate(chain);
  if (budget_bytes < 0) {
    throw std::invalid_argument("remat::per_layer: negative budget (" + std::to_string(budget_bytes) +
                                " bytes)");
  }
  const std::vector<char> allowed = detail::allowed_variants(chain, options, "remat::per_layer");
  const Solution sol = solve(chain, allowed, true, budget_bytes);
  if (sol.best < 0) {
    detail::infeasible("remat::per_layer", budget_bytes, solve(chain, allowed, false, 0).best_peak);
  }
  double ms = 0;
  Plan plan = detail::finish(chain, emit(chain, sol, &ms), "per-layer", budget_bytes);
  // The program's peak is simulate()'s, or above it where a frontier was thinned.
  if (plan.predicted.peak_bytes > sol.best_peak) {
    throw std::logic_error("remat::per_layer: internal error: simulate()'s peak (" +
                           std::to_string(plan.predicted.peak_bytes) + ") exceeds the program's (" +
                           std::to_string(sol.best_peak) + ")");
  }
  plan.predicted.time_ms = ms;  // checkpointed stages as run per call (recompute with early stopping)
  return plan;
}

}  // namespace remat
