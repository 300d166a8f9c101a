// libremat_meter: the CPU meter behind a C interface, for processes that cannot link C++ (Python via ctypes).
//
//   import ctypes; m = ctypes.CDLL("libremat_meter.so")
//   m.remat_meter_active_bytes.restype = ctypes.c_int64   # likewise peak_bytes and allocations
//   m.remat_meter_install(); m.remat_meter_reset_peak(); ...; m.remat_meter_peak_bytes()
//
// The library must use the same libc10 as the process's torch (Debian's python3-torch and libtorch-dev do).

#include <cstdint>
#include <exception>

#include "memory/cpu_meter.h"
#include "memory/peak_window.h"
#ifdef REMAT_WITH_CUDA
#include "memory/cuda_meter.h"
#endif

namespace {
// The count of a device: -1 the CPU, 0 and up a CUDA device; nullptr where this library has no CUDA.
remat::detail::PeakCounter* counter_of(int device) {
  if (device < 0) return &remat::detail::cpu_meter_counter();
#ifdef REMAT_WITH_CUDA
  try {
    return &remat::detail::cuda_meter_counter(device);
  } catch (const std::exception&) {
    return nullptr;
  }
#else
  return nullptr;
#endif
}
}  // namespace

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

/// Peak windows (remat's measuring that resets no statistic): `device` is -1 for the CPU, else a CUDA device
/// index. 1 when this library can follow CUDA devices (built with the CUDA allocator's headers), else 0.
__attribute__((visibility("default"))) int remat_meter_has_cuda() {
#ifdef REMAT_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}
/// Opens a window; returns its slot, or -1 (no slot free, or no such device in this library).
__attribute__((visibility("default"))) int remat_meter_window_open(int device) {
  auto* c = counter_of(device);
  return c ? c->open() : -1;
}
/// The device's running count (its differences are exact; the CUDA count starts at 0 when first asked).
__attribute__((visibility("default"))) int64_t remat_meter_window_active(int device) {
  auto* c = counter_of(device);
  return c ? c->active() : 0;
}
/// The window's peak of that count.
__attribute__((visibility("default"))) int64_t remat_meter_window_peak(int device, int slot) {
  auto* c = counter_of(device);
  return c && slot >= 0 ? c->peak(slot) : 0;
}
/// Closes the window.
__attribute__((visibility("default"))) void remat_meter_window_close(int device, int slot) {
  auto* c = counter_of(device);
  if (c && slot >= 0) c->close(slot);
}
}
