// libremat_meter: the CPU meter behind a C interface, for processes that cannot link C++ (Python via ctypes).
//
//   import ctypes; m = ctypes.CDLL("libremat_meter.so")
//   m.remat_meter_active_bytes.restype = ctypes.c_int64   # likewise peak_bytes and allocations
//   m.remat_meter_install(); m.remat_meter_reset_peak(); ...; m.remat_meter_peak_bytes()
//
// The library must use the same libc10 as the process's torch (Debian's python3-torch and libtorch-dev do).

#include <cstdint>
#include <exception>

#include "detail/cpu_meter.h"

extern "C" {

/// Installs the counting CPU allocator. Returns 0 on success, -1 if it could not be installed.
__attribute__((visibility("default"))) int remat_meter_install() {
  try {
    remat::detail::cpu_meter_install();
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}
/// Bytes of CPU tensor storage alive now (0 before remat_meter_install).
__attribute__((visibility("default"))) int64_t remat_meter_active_bytes() {
  return remat::detail::cpu_meter_active_bytes();
}
/// Highest active bytes since the last reset.
__attribute__((visibility("default"))) int64_t remat_meter_peak_bytes() {
  return remat::detail::cpu_meter_peak_bytes();
}
/// Sets the peak to the active bytes.
__attribute__((visibility("default"))) void remat_meter_reset_peak() {
  remat::detail::cpu_meter_reset_peak();
}
/// Raises the peak to `bytes` if it is below (puts back a peak a measurement reset).
__attribute__((visibility("default"))) void remat_meter_raise_peak(int64_t bytes) {
  remat::detail::cpu_meter_raise_peak(bytes);
}
/// Number of storage allocations counted so far.
__attribute__((visibility("default"))) int64_t remat_meter_allocations() {
  return remat::detail::cpu_meter_allocations();
}
}
