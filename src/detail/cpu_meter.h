#pragma once
// The counting CPU allocator behind remat::memory and the C interface of libremat_meter. Plain C++ over c10.

#include <cstdint>

namespace remat::detail {

void cpu_meter_install();  // idempotent, thread-safe
bool cpu_meter_installed();
int64_t cpu_meter_active_bytes();
int64_t cpu_meter_peak_bytes();
void cpu_meter_reset_peak();
int64_t cpu_meter_allocations();

}  // namespace remat::detail
