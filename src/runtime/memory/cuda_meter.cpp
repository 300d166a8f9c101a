// The CUDA count behind peak windows (memory/cuda_meter.h). The caching allocator reports each allocation
// (ALLOC) and each free a tensor asks for (FREE_REQUESTED) to its trace trackers with the bytes requested:
// the moments at which its own allocated-bytes statistic moves (by the block's rounded size). The tracker is
// called under the allocator's per-device lock and must call no LibTorch function: it only adds to atomics.

#include "memory/cuda_meter.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <type_traits>

namespace remat::detail {
namespace {

constexpr int kMaxDevices = 64;

PeakCounter* counters() {
  static PeakCounter* all = new PeakCounter[kMaxDevices];  // never destroyed: the allocator outlives statics
  return all;
}

}  // namespace

void cuda_allocator_ready() {
  auto* allocator = c10::cuda::CUDACachingAllocator::get();
  if (allocator != nullptr && !allocator->initialized()) allocator->init(c10::cuda::device_count());
}

PeakCounter& cuda_meter_counter(int index) {
  TORCH_CHECK(index >= 0 && index < kMaxDevices, "remat::memory: CUDA device index ", index,
              " out of range for remat's meter (0 to ", kMaxDevices - 1, ")");
  static std::once_flag attach;
  std::call_once(attach, [] {
    cuda_allocator_ready();  // trackers are handed to the device allocators that exist
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker([](const auto& entry) {
      using Entry = std::decay_t<decltype(entry)>;
      const int device = static_cast<int>(entry.device_);
      if (device < 0 || device >= kMaxDevices) return;
      if (entry.action_ == Entry::ALLOC) {
        counters()[device].add(static_cast<int64_t>(entry.size_));
      } else if (entry.action_ == Entry::FREE_REQUESTED) {
        counters()[device].add(-static_cast<int64_t>(entry.size_));
      }
    });
  });
  return counters()[index];
}

}  // namespace remat::detail
