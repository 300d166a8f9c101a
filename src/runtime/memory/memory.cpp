#include "remat/memory.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "memory/cpu_meter.h"
#include "memory/peak_window.h"

#ifdef REMAT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "memory/cuda_meter.h"
#endif

namespace remat::memory {
namespace {

#ifdef REMAT_WITH_CUDA
int cuda_index(c10::Device device) {
  TORCH_CHECK(c10::cuda::device_count() > 0, "remat::memory: no CUDA device is available (asked for ", device,
              ")");
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  TORCH_CHECK(index >= 0 && index < c10::cuda::device_count(), "remat::memory: CUDA device index ", index,
              " out of range (", c10::cuda::device_count(), " devices)");
  detail::cuda_allocator_ready();  // before any allocation its statistics have no devices
  return index;
}
auto cuda_stats(c10::Device device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device));
}
// StatType::AGGREGATE, which is index 0 in every LibTorch (the enum moved namespaces across 2.x releases).
constexpr size_t kAggregate = 0;
#endif

void check_device(c10::Device device) {
  if (device.is_cpu()) return;
#ifdef REMAT_WITH_CUDA
  if (device.is_cuda()) return;
  TORCH_CHECK(false, "remat::memory: unsupported device ", device, " (cpu and cuda are metered)");
#else
  TORCH_CHECK(false, "remat::memory: unsupported device ", device,
              " (this remat was built against a LibTorch without CUDA; only cpu is metered)");
#endif
}

}  // namespace

void track_cpu() {
  detail::cpu_meter_install();
}
bool is_tracking_cpu() {
  return detail::cpu_meter_installed();
}
int64_t cpu_allocation_count() {
  return detail::cpu_meter_allocations();
}

namespace testing {
void fail_cpu_allocation_at(int64_t n) {
  TORCH_CHECK(detail::cpu_meter_installed(),
              "remat::memory::testing::fail_cpu_allocation_at: call remat::memory::track_cpu() first");
  TORCH_CHECK(n >= 0, "remat::memory::testing::fail_cpu_allocation_at: n must be >= 0, got ", n);
  detail::cpu_meter_fail_at(n);
}
void limit_cpu_bytes(int64_t bytes) {
  TORCH_CHECK(detail::cpu_meter_installed(),
              "remat::memory::testing::limit_cpu_bytes: call remat::memory::track_cpu() first");
  detail::cpu_meter_limit(bytes);
}
int64_t refused_cpu_allocations() {
  return detail::cpu_meter_refused();
}
}  // namespace testing

DeviceMemory device_memory(c10::Device device) {
#ifdef REMAT_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "remat::memory::device_memory: ", device,
              " is not a CUDA device; a CPU has no capacity of its own to fill");
  const int index = cuda_index(device);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  size_t free = 0, total = 0;
  {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  }
  DeviceMemory m;
  m.free_bytes = static_cast<int64_t>(free);
  m.total_bytes = static_cast<int64_t>(total);
  m.reserved_bytes = stats.reserved_bytes[kAggregate].current;
  m.allocated_bytes = stats.allocated_bytes[kAggregate].current;
  return m;
#else
  TORCH_CHECK(false, "remat::memory::device_memory: ", device,
              (device.is_cpu() ? " is not a CUDA device; a CPU has no capacity of its own to fill"
                               : " is not readable: this remat was built against a LibTorch without CUDA"));
  return DeviceMemory{};
#endif
}

int64_t active_bytes(c10::Device device) {
  check_device(device);
  if (device.is_cpu()) return detail::cpu_meter_active_bytes();
#ifdef REMAT_WITH_CUDA
  return cuda_stats(device).allocated_bytes[kAggregate].current;
#else
  return 0;
#endif
}

int64_t peak_bytes(c10::Device device) {
  check_device(device);
  if (device.is_cpu()) return detail::cpu_meter_peak_bytes();
#ifdef REMAT_WITH_CUDA
  return cuda_stats(device).allocated_bytes[kAggregate].peak;
#else
  return 0;
#endif
}

void reset_peak(c10::Device device) {
  check_device(device);
  if (device.is_cpu()) {
    detail::cpu_meter_reset_peak();
    return;
  }
#ifdef REMAT_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(cuda_index(device));
#endif
}

namespace {
detail::PeakCounter& counter_of(c10::Device device) {
  check_device(device);
#ifdef REMAT_WITH_CUDA
  if (device.is_cuda()) return detail::cuda_meter_counter(cuda_index(device));
#endif
  return detail::cpu_meter_counter();
}
}  // namespace

PeakWindow::PeakWindow(c10::Device device) {
  detail::PeakCounter& counter = counter_of(device);
  slot_ = counter.open();
  TORCH_CHECK(slot_ >= 0, "remat::memory::PeakWindow: ", detail::PeakCounter::kWindows,
              " windows are open on ", device, " already");
  counter_ = &counter;
  base_ = counter.active();
}

PeakWindow::~PeakWindow() {
  static_cast<detail::PeakCounter*>(counter_)->close(slot_);
}

int64_t PeakWindow::peak_over_base() const {
  return std::max<int64_t>(0, static_cast<detail::PeakCounter*>(counter_)->peak(slot_) - base_);
}

int64_t PeakWindow::active_over_base() const {
  return static_cast<detail::PeakCounter*>(counter_)->active() - base_;
}

void PeakWindow::restart() {
  auto* counter = static_cast<detail::PeakCounter*>(counter_);
  counter->close(slot_);
  slot_ = counter->open();
  TORCH_INTERNAL_ASSERT(slot_ >= 0, "remat::memory::PeakWindow::restart: no window slot");
}

PeakScope::PeakScope(c10::Device device) : device_(device), base_(0) {
  reset_peak(device_);
  base_ = active_bytes(device_);
}

int64_t PeakScope::peak_over_base() const {
  return std::max<int64_t>(0, peak_bytes(device_) - base_);
}
int64_t PeakScope::active_over_base() const {
  return active_bytes(device_) - base_;
}

}  // namespace remat::memory
