#pragma once
// The optimal planner's least-memory bound that revolve shares (optimal.cpp; private to the planner library).

#include <remat/planner/chain.h>

#include <cstdint>

namespace remat::detail {

/// The peak of recomputing every stage from the chain's input (nothing else kept): the least memory when only
/// a_0 may be held (O(n)); an upper bound of min_feasible_budget().
int64_t recompute_from_input_peak(const Chain& chain);

/// Chains longer than this get min_feasible_budget() from recompute_from_input_peak() (the exact dynamic
/// program is quadratic in memory).
constexpr int64_t kExactMinMemoryStages = 1500;

}  // namespace remat::detail
