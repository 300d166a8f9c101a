#include "remat/planner/revolve.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "detail/optimal.h"
#include "detail/planner.h"

// Binomial checkpointing (Griewank and Walther's Revolve) for long homogeneous chains.

namespace remat {

using detail::finish;
using detail::infeasible;
using detail::push;
using detail::recompute_from_input_peak;

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
    // matters), so try them all, most first: more snapshots never cost time. None fitting, the least peak
    // among them is the least budget revolve_within plans for (before 2026-12-06, min_feasible_budget(), the
    // optimal planner's least, which revolve may not reach: a budget of that size was refused again).
    int64_t least = std::numeric_limits<int64_t>::max();
    for (int64_t c = n; c >= lo; --c) {
      Plan p = revolve(chain, c);
      if (p.predicted.peak_bytes <= budget_bytes) {
        p.budget_bytes = budget_bytes;
        return p;
      }
      least = std::min(least, p.predicted.peak_bytes);
    }
    infeasible("remat::revolve_within", budget_bytes, least);
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
      // The fewest snapshots it builds: the least peak on a homogeneous chain, and one that revolve_within
      // plans for on any (not min_feasible_budget(), which revolve may not reach).
      infeasible("remat::revolve_within", budget_bytes, revolve(chain, lo).predicted.peak_bytes);
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

}  // namespace remat
