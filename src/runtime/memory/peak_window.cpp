// Peak windows over a device's running count of tensor bytes (memory/peak_window.h).

#include "memory/peak_window.h"

namespace remat::detail {
namespace {
void raise_to(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}
}  // namespace

void PeakCounter::add(int64_t delta) {
  const int64_t now = active_.fetch_add(delta, std::memory_order_acq_rel) + delta;
  if (delta <= 0) return;
  for (uint64_t mask = open_.load(std::memory_order_acquire); mask != 0; mask &= mask - 1)
    raise_to(peaks_[__builtin_ctzll(mask)], now);
}

int PeakCounter::open() {
  uint64_t mask = open_.load(std::memory_order_acquire);
  while (true) {
    if (mask == ~uint64_t{0}) return -1;
    const int slot = __builtin_ctzll(~mask);
    // The peak starts at the count now; an allocation racing the opening raises it once the bit is set.
    peaks_[slot].store(active(), std::memory_order_relaxed);
    if (open_.compare_exchange_weak(mask, mask | (uint64_t{1} << slot), std::memory_order_acq_rel)) {
      raise_to(peaks_[slot], active());
      return slot;
    }
  }
}

int64_t PeakCounter::peak(int slot) const {
  return peaks_[slot].load(std::memory_order_acquire);
}

void PeakCounter::close(int slot) {
  open_.fetch_and(~(uint64_t{1} << slot), std::memory_order_acq_rel);
}

}  // namespace remat::detail
