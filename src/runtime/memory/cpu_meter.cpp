// A CPU allocator that wraps LibTorch's and counts the bytes of every storage it hands out.
//
// Kernels such as gelu call Allocator::raw_allocate(), which asserts that a DataPtr's context equals its data
// pointer, so the wrapper keeps context == data and records sizes in a side table (sharded to keep the lock
// uncontended), and frees through the wrapped allocator's raw deleter.

#include "memory/cpu_meter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include "detail/compat_c10.h"
#include "memory/peak_window.h"

namespace remat::detail {
namespace {

struct Shard {
  std::mutex mutex;
  std::unordered_map<void*, size_t> sizes;
};

struct MeterState {
  std::array<Shard, 64> shards;
  std::atomic<int64_t> active{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> fail_countdown{0};  // > 0: the allocation that brings it to 0 is refused
  std::atomic<int64_t> limit{-1};          // >= 0: allocations above this many active bytes are refused
  std::atomic<int64_t> refused{0};
  PeakCounter windows;  // the same count, for peak windows (remat's own measuring, which resets nothing)
  c10::Allocator* base = nullptr;
  c10::DeleterFnPtr base_deleter = nullptr;

  Shard& shard(void* p) { return shards[(reinterpret_cast<uintptr_t>(p) >> 6) % shards.size()]; }

  void add(void* p, size_t n) {
    {
      Shard& s = shard(p);
      std::lock_guard<std::mutex> lock(s.mutex);
      s.sizes.emplace(p, n);
    }
    allocations.fetch_add(1, std::memory_order_relaxed);
    const int64_t now = active.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    windows.add(static_cast<int64_t>(n));
  }

  void remove(void* p) {
    size_t n = 0;
    {
      Shard& s = shard(p);
      std::lock_guard<std::mutex> lock(s.mutex);
      auto it = s.sizes.find(p);
      if (it == s.sizes.end()) return;
      n = it->second;
      s.sizes.erase(it);
    }
    active.fetch_sub(static_cast<int64_t>(n));
    windows.add(-static_cast<int64_t>(n));
  }
};

// Never destroyed: storages may be freed during static destruction.
MeterState& state() {
  static MeterState* s = new MeterState();
  return *s;
}

void counting_delete(void* p) {
  if (p == nullptr) return;
  MeterState& s = state();
  s.remove(p);
  s.base_deleter(p);
}

class CountingCpuAllocator final : public compat::AllocatorBase {
 public:
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }

 protected:
  c10::DataPtr allocate_bytes(size_t n) const override {
    MeterState& s = state();
    refuse_if_asked(s, n);
    void* p = s.base->raw_allocate(n);
    if (p != nullptr) s.add(p, n);
    return {p, p, &counting_delete, c10::Device(c10::DeviceType::CPU)};
  }

 private:
  static void refuse_if_asked(MeterState& s, size_t n) {
    bool refuse = false;
    if (s.fail_countdown.load(std::memory_order_relaxed) > 0 && s.fail_countdown.fetch_sub(1) == 1)
      refuse = true;
    const int64_t limit = s.limit.load(std::memory_order_relaxed);
    if (limit >= 0 && s.active.load() + static_cast<int64_t>(n) > limit) refuse = true;
    if (!refuse) return;
    s.refused.fetch_add(1);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "remat::memory (test limit): CPU allocation of ", n,
                     " bytes refused (", s.active.load(), " bytes active, limit ", limit, ")");
  }
};

std::once_flag install_once;
std::atomic<bool> installed{false};

}  // namespace

void cpu_meter_install() {
  std::call_once(install_once, [] {
    MeterState& s = state();
    s.base = c10::GetCPUAllocator();
    s.base_deleter = s.base->raw_deleter();
    TORCH_CHECK(
        s.base_deleter != nullptr,
        "remat::memory::track_cpu: the current CPU allocator has no raw deleter, so it cannot be wrapped");
    static CountingCpuAllocator* counting = new CountingCpuAllocator();
    c10::SetCPUAllocator(counting, /*priority=*/100);
    TORCH_CHECK(c10::GetCPUAllocator() == counting,
                "remat::memory::track_cpu: a CPU allocator of higher priority is installed; cannot count");
    installed.store(true);
  });
}

bool cpu_meter_installed() {
  return installed.load();
}
int64_t cpu_meter_active_bytes() {
  return state().active.load();
}
int64_t cpu_meter_peak_bytes() {
  return state().peak.load();
}
void cpu_meter_reset_peak() {
  MeterState& s = state();
  s.peak.store(s.active.load());
}
void cpu_meter_raise_peak(int64_t bytes) {
  MeterState& s = state();
  int64_t seen = s.peak.load();
  while (bytes > seen && !s.peak.compare_exchange_weak(seen, bytes)) {
  }
}
int64_t cpu_meter_allocations() {
  return state().allocations.load();
}
void cpu_meter_fail_at(int64_t n) {
  state().fail_countdown.store(n > 0 ? n : 0);
}
void cpu_meter_limit(int64_t bytes) {
  state().limit.store(bytes < 0 ? -1 : bytes);
}
int64_t cpu_meter_refused() {
  return state().refused.load();
}

PeakCounter& cpu_meter_counter() {
  return state().windows;
}

}  // namespace remat::detail
