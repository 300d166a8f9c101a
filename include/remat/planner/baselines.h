#pragma once
/// \file
/// The baseline planners (baselines.cpp): keep everything, checkpoint every stage, uniform and balanced
/// segments like checkpoint_sequential, and Chen et al.'s sqrt(n). Each takes a chain and returns a Plan with
/// its prediction, as every planner does. No torch headers.

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>

#include <cstdint>
#include <vector>

namespace remat {

/// Keep every activation: Fa(0) .. Fa(n-1), L, B(n-1) .. B(0). Throws std::invalid_argument for an invalid
/// chain (as remat::validate), as do all planners.
Plan no_checkpoint(const Chain& chain);

/// Every stage is a checkpoint (per-layer checkpointing): Fc(0) .. Fc(n-1), L, then Fa(i), B(i) for each i.
Plan checkpoint_all(const Chain& chain);

/// What checkpoint_sequential does: `segments` contiguous runs whose lengths differ by at most one (the
/// longer ones first), each run but the last checkpointed (the last too when checkpoint_last_segment). Throws
/// std::invalid_argument when segments < 1 or > the number of stages.
Plan uniform(const Chain& chain, int64_t segments, bool checkpoint_last_segment = false);

/// Any segmentation of n stages: segments start at `starts` (strictly increasing, starts[0] == 0, all < n).
/// Each segment but the last is checkpointed (the last too when checkpoint_last_segment). Needs no chain.
/// Throws std::invalid_argument naming the bad start.
Plan segmented(int64_t num_stages, const std::vector<int64_t>& starts, bool checkpoint_last_segment = false);

/// Starts of `segments` contiguous runs of num_stages stages whose lengths differ by at most one, the longer
/// ones first (the split of uniform() and checkpoint_sequential). Throws std::invalid_argument when
/// segments < 1 or > num_stages.
std::vector<int64_t> even_starts(int64_t num_stages, int64_t segments);

/// What balanced_starts() balances.
enum class Balance {
  kCount,   ///< stages per segment (even_starts)
  kMemory,  ///< the bytes a segment's stages keep for backward (sum of saved_bytes): what its recompute holds
  kTime,    ///< a segment's forward time (sum of fwd_ms): what its recompute costs
};

/// Starts of `segments` contiguous segments of the chain (starts[0] == 0) that make the largest segment's
/// cost (see Balance) as small as possible; among equal splits, the earliest cut points. On chains of
/// unequal stages (a ResNet's full-resolution blocks beside its downsampled ones) kMemory evens out what
/// each segment's recompute holds, where kCount lets the largest stages pile up in one segment. Exact
/// (a dynamic program, O(segments * n^2)). Throws std::invalid_argument for an invalid chain or segments
/// < 1 or > the stage count.
std::vector<int64_t> balanced_starts(const Chain& chain, int64_t segments, Balance by);

/// segmented() at balanced_starts(chain, segments, by), named "balanced:K" (kMemory), "balanced-time:K"
/// (kTime) or "uniform:K" (kCount).
Plan balanced(const Chain& chain, int64_t segments, Balance by, bool checkpoint_last_segment = false);

/// Chen et al. 2016: ceil(sqrt(n)) uniform segments, the last one kept.
Plan sqrt_n(const Chain& chain);

}  // namespace remat
