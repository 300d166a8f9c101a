#pragma once
// Peak windows: the highest bytes alive on a device between a window's opening and now, measured without
// resetting or lowering any statistic someone else reads (the CPU meter's peak, the CUDA caching
// allocator's). A device's running count of tensor bytes (a Counter) is fed by whatever sees its allocations
// and frees: the counting CPU allocator, or the CUDA caching allocator's trace (cuda_meter.cpp); each open
// window keeps its own peak of that count. Up to 64 windows may be open per device at once (nested
// measurements: the profiler inside Planned inside the user's). Plain C++ over c10, so that the meter library
// (Python) compiles it too.

#include <atomic>
#include <cstdint>

namespace remat::detail {

class PeakCounter {
 public:
  static constexpr int kWindows = 64;
  /// Adds `delta` bytes (negative for a free) and raises the open windows' peaks. Lock-free.
  void add(int64_t delta);
  /// Bytes counted now.
  int64_t active() const { return active_.load(std::memory_order_acquire); }
  /// Opens a window whose peak starts at the bytes counted now; returns its slot, or -1 when all are open.
  int open();
  /// The window's peak (in the counter's bytes, absolute).
  int64_t peak(int slot) const;
  /// Closes the window.
  void close(int slot);

 private:
  std::atomic<int64_t> active_{0};
  std::atomic<uint64_t> open_{0};
  std::atomic<int64_t> peaks_[kWindows] = {};
};

}  // namespace remat::detail
