#pragma once
// The counting CPU allocator behind remat::memory and the C interface of libremat_meter. Plain C++ over c10.

#include <cstdint>

namespace remat::detail {

void cpu_meter_install();  // idempotent, thread-safe
bool cpu_meter_installed();
int64_t cpu_meter_active_bytes();
int64_t cpu_meter_peak_bytes();
void cpu_meter_reset_peak();
// Raises the peak to at least `bytes`: a measurement nested in a caller's (remat::Planned) gives back the
// caller's peak after resetting it.
void cpu_meter_raise_peak(int64_t bytes);
int64_t cpu_meter_allocations();
// Test hooks: refuse the n-th allocation from now (0: never) / every allocation above `bytes` active (< 0: no
// limit). A refused allocation throws c10::OutOfMemoryError, as LibTorch's allocators do.
void cpu_meter_fail_at(int64_t n);
void cpu_meter_limit(int64_t bytes);
int64_t cpu_meter_refused();
// The meter's count as a PeakCounter: remat's own measurements open windows on it instead of resetting the
// peak.
class PeakCounter;
PeakCounter& cpu_meter_counter();

}  // namespace remat::detail
