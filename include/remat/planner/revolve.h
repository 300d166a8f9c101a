#pragma once
/// \file
/// Binomial checkpointing (revolve.cpp): Griewank and Walther's Revolve, for long homogeneous chains. No
/// torch headers.

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>

#include <cstdint>
#include <vector>

namespace remat {

/// Binomial checkpointing (Griewank and Walther's Revolve) with at most `snapshots` checkpoints held at once
/// besides the chain's input: the fewest forward recomputations for a homogeneous chain, in O(n log n).
/// For chains of thousands of stages, where optimal() is too slow. Throws std::invalid_argument when
/// snapshots < 0.
Plan revolve(const Chain& chain, int64_t snapshots);

/// revolve() with the most snapshots whose predicted peak fits budget_bytes (every count is tried on chains
/// of up to 512 stages; longer chains, where each snapshot costs one activation, are searched from the
/// estimate budget - peak without snapshots = snapshots x largest activation). Throws InfeasibleBudget when
/// no count fits, naming as the minimum a budget it plans for: on up to 512 stages the least peak of any
/// count (on a chain of unequal stages not always zero snapshots', and possibly above min_feasible_budget(),
/// whose plans revolve does not all make); beyond, the fewest snapshots' it builds.
Plan revolve_within(const Chain& chain, int64_t budget_bytes);

}  // namespace remat
