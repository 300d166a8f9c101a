#include "remat/planner/baselines.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "detail/planner.h"

// The baselines: keep everything, per-layer checkpointing, segments (count-, memory- or time-balanced),
// sqrt(n).

namespace remat {

using detail::finish;
using detail::push;

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

}  // namespace remat
