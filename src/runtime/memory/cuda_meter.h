#pragma once
// The CUDA side of peak windows (memory/peak_window.h): a running count of the bytes tensors request from the
// CUDA caching allocator, per device, fed by the allocator's trace (an AllocatorTraceTracker, attached once
// per process at the first use; it records nothing else and needs no history). Compiled only where LibTorch
// has CUDA (REMAT_WITH_CUDA).

#include "memory/peak_window.h"

namespace remat::detail {

/// The count of CUDA device `index` (0 <= index < 64), attaching the tracker at the first call. Counts the
/// allocations and frees made after that call only: its absolute value is meaningless, its differences exact.
PeakCounter& cuda_meter_counter(int index);

/// Initializes the CUDA caching allocator if nothing has yet (it is made at LibTorch's lazy CUDA
/// initialization, the first allocation; before that its statistics and trackers have no device to answer
/// for). Idempotent.
void cuda_allocator_ready();

}  // namespace remat::detail
