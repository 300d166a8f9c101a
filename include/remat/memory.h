#pragma once
/// \file
/// An exact memory meter: the bytes of tensor storage alive now and at the peak, per device.
///
///   remat::memory::track_cpu();                 // once, before the tensors you want to count
///   remat::memory::reset_peak();
///   train_step();
///   int64_t peak = remat::memory::peak_bytes(); // bytes, exact
///
/// CPU: track_cpu() wraps LibTorch's CPU allocator with a counting one. It counts the bytes requested for
/// every tensor storage allocated through c10::GetCPUAllocator() after the call, and frees of those. It
/// does not count storages allocated before track_cpu() (they are freed uncounted), the allocator's
/// alignment padding, scratch memory that oneDNN, BLAS or OpenMP take from malloc directly, autograd graph
/// nodes and other C++ objects, or the framework's own caches.
/// CUDA: the caching allocator's statistics (allocated bytes: blocks handed to tensors, not the memory the
/// cache reserves from the driver), available when remat was built against a CUDA LibTorch.

#include <c10/core/Device.h>

#include <cstdint>

namespace remat::memory {

/// Installs the counting CPU allocator (idempotent; thread-safe). Until it is called, the CPU figures are 0.
void track_cpu();

/// True once track_cpu() has run.
bool is_tracking_cpu();

/// Bytes of tensor storage alive now on `device`.
/// Throws c10::Error for a CUDA device when remat was built without CUDA or CUDA is not available, and for
/// any other device type.
int64_t active_bytes(c10::Device device = c10::kCPU);

/// Highest active_bytes(device) since the last reset_peak(device) (or since tracking started).
/// Throws as active_bytes.
int64_t peak_bytes(c10::Device device = c10::kCPU);

/// Sets the peak of `device` to its current active bytes. Throws as active_bytes.
void reset_peak(c10::Device device = c10::kCPU);

/// Number of storage allocations counted on the CPU since tracking started (a cheap op counter).
int64_t cpu_allocation_count();

/// Test hooks: make the counting CPU allocator fail, to test what a program does when memory runs out.
/// A refused allocation throws c10::OutOfMemoryError (a c10::Error), as LibTorch's allocators do. Both
/// throw c10::Error naming the function when track_cpu() has not run.
namespace testing {
/// Refuses the n-th CPU allocation from now (1: the next one), once; 0 disarms.
void fail_cpu_allocation_at(int64_t n);
/// Refuses every CPU allocation that would take the active bytes above `bytes`; a negative value removes
/// the limit.
void limit_cpu_bytes(int64_t bytes);
/// Allocations refused by the two hooks above since tracking started.
int64_t refused_cpu_allocations();
}  // namespace testing

/// The highest bytes alive on `device` from the window's start to now, measured without resetting or lowering
/// any statistic that another reader sees: neither peak_bytes() (reset_peak's) nor the CUDA caching
/// allocator's own peak (torch.cuda.max_memory_allocated, c10::cuda::CUDACachingAllocator::getDeviceStats),
/// so that a user's own figures are, after remat measured inside them, what they would have been without it.
/// remat's profiler, measure_step and Planned measure with it.
///
///   remat::memory::PeakWindow window(device);  step();  int64_t over = window.peak_over_base();
///
/// CPU: the counting allocator's bytes (track_cpu() first; 0 before). CUDA: the bytes tensors request from
/// the caching allocator, followed through its trace of allocations and frees (a tracker attached at the
/// first CUDA window of the process; the native caching allocator only). The allocator rounds each block up
/// (to 512 bytes and more), and its allocated-bytes statistic, which active_bytes() reads, counts the rounded
/// sizes: the two differ by that rounding. Windows nest (up to 64 open per device at once) and may be used
/// from any thread. Throws c10::Error for an unsupported device (as active_bytes), or when 64 windows are
/// open.
class PeakWindow {
 public:
  explicit PeakWindow(c10::Device device = c10::kCPU);
  ~PeakWindow();
  PeakWindow(const PeakWindow&) = delete;
  PeakWindow& operator=(const PeakWindow&) = delete;
  /// Peak since the start (or the last restart()) minus the bytes alive at the start (>= 0).
  int64_t peak_over_base() const;
  /// Bytes alive now minus the bytes alive at the start (may be negative).
  int64_t active_over_base() const;
  /// Starts the peak again from the bytes alive now; the base stays.
  void restart();

 private:
  void* counter_;  // detail::PeakCounter
  int slot_;
  int64_t base_;
};

/// A device's memory as a whole (bytes): what fitting a budget to the device reads
/// (PlannedOptions::fit_device, remat::device_budget).
struct DeviceMemory {
  int64_t free_bytes = 0;       ///< free on the device: held by no caching allocator of any process
  int64_t total_bytes = 0;      ///< the device's capacity
  int64_t reserved_bytes = 0;   ///< held by this process's caching allocator
  int64_t allocated_bytes = 0;  ///< of those, occupied by tensors
};

/// Reads a CUDA device's memory (cudaMemGetInfo, and the caching allocator's reserved and allocated
/// bytes; reading resets no statistic). Throws c10::Error naming remat::memory::device_memory for any other
/// device (a CPU has no capacity of its own to fill) and on a build without CUDA.
DeviceMemory device_memory(c10::Device device);

/// Scope that resets the peak on entry and reports the peak above the bytes alive on entry (resetting the
/// device's statistic: what the caller asked for. To measure inside someone else's measurement, PeakWindow):
///   remat::memory::PeakScope scope;  step();  int64_t over = scope.peak_over_base();
class PeakScope {
 public:
  /// Resets the peak of `device` and records its active bytes as the base. Throws as active_bytes.
  explicit PeakScope(c10::Device device = c10::kCPU);
  /// Bytes alive on entry.
  int64_t base_bytes() const { return base_; }
  /// Peak since entry minus the bytes alive on entry (>= 0).
  int64_t peak_over_base() const;
  /// Bytes alive now minus the bytes alive on entry (may be negative).
  int64_t active_over_base() const;

 private:
  c10::Device device_;
  int64_t base_;
};

}  // namespace remat::memory
