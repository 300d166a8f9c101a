#include <torch/csrc/autograd/engine.h>

#include <ATen/SavedTensorHooks.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <map>
#include <mutex>
#include <typeinfo>
#include <vector>

#include "detail/hooks.h"
#include "detail/nesting.h"

namespace remat::detail {
namespace {

thread_local std::vector<HookSource*> hook_stack;

struct RematEngine final : torch::autograd::Engine {
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (hook_stack.empty() || !at::SavedTensorDefaultHooks::is_enabled()) return nullptr;
    return hook_stack.back()->make_hooks();
  }
};

torch::autograd::Engine& remat_engine() {
  // Never destroyed: its worker threads may still hold it at exit (Python's engine does the same).
  static RematEngine* engine = new RematEngine();
  return *engine;
}

}  // namespace

void require_engine(const char* who) {
  static std::mutex mutex;
  {
    std::lock_guard<std::mutex> lock(mutex);
    // Only LibTorch's own engine is replaced: another one (PyTorch's Python engine) serves its own hooks.
    if (typeid(torch::autograd::Engine::get_default_engine()) == typeid(torch::autograd::Engine)) {
      torch::autograd::set_default_engine_stub(&remat_engine);
    }
  }
  torch::autograd::Engine& engine = torch::autograd::Engine::get_default_engine();
  TORCH_CHECK(&engine == &remat_engine(), who,
              ": CheckpointMode::kNonReentrant needs remat's autograd engine, but another engine (",
              typeid(engine).name(),
              ") is LibTorch's default in this process, typically PyTorch's Python engine installed by "
              "`import torch` (an embedded interpreter or a Python extension). Its saved-tensor hooks would "
              "not reach remat and every activation would be kept. Use CheckpointMode::kReentrant in such a "
              "process.");
  TORCH_CHECK(
      at::SavedTensorDefaultHooks::is_enabled(), who,
      ": default saved-tensor hooks are disabled on this thread (at::SavedTensorDefaultHooks::disable: '",
      at::SavedTensorDefaultHooks::get_disabled_error_message().value_or(""),
      "'), so CheckpointMode::kNonReentrant would keep every activation. Enable them "
      "(at::SavedTensorDefaultHooks::enable()) or use CheckpointMode::kReentrant.");
}

HookSource* current_hook_source() {
  return hook_stack.empty() ? nullptr : hook_stack.back();
}

HookScope::HookScope(HookSource* source) {
  hook_stack.push_back(source);
}
HookScope::~HookScope() {
  hook_stack.pop_back();
}

namespace {
thread_local int t_nested_depth = 0;
std::mutex listeners_mutex;
std::atomic<int> listener_count{0};
std::map<const void*, std::function<void()>>& listeners() {
  static auto* map = new std::map<const void*, std::function<void()>>();  // outlives static destructors
  return *map;
}
}  // namespace

int nested_backward_depth() {
  return t_nested_depth;
}

NestedBackward::NestedBackward() {
  if (t_nested_depth == 0 && listener_count.load(std::memory_order_acquire) > 0) {
    std::vector<std::function<void()>> calls;
    {
      std::lock_guard<std::mutex> lock(listeners_mutex);
      for (const auto& entry : listeners())
        calls.push_back(entry.second);
    }
    for (const auto& call : calls)
      call();
  }
  ++t_nested_depth;
}

NestedBackward::~NestedBackward() {
  --t_nested_depth;
}

namespace {
std::atomic<int> profiler_count{0};
}
ProfilerRunning::ProfilerRunning() {
  profiler_count.fetch_add(1, std::memory_order_acq_rel);
}
ProfilerRunning::~ProfilerRunning() {
  profiler_count.fetch_sub(1, std::memory_order_acq_rel);
}
bool profiler_running() {
  return profiler_count.load(std::memory_order_acquire) > 0;
}

void add_outer_backward_listener(const void* key, std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(listeners_mutex);
  listeners()[key] = std::move(fn);
  listener_count.store(static_cast<int>(listeners().size()), std::memory_order_release);
}

void remove_outer_backward_listener(const void* key) {
  std::lock_guard<std::mutex> lock(listeners_mutex);
  listeners().erase(key);
  listener_count.store(static_cast<int>(listeners().size()), std::memory_order_release);
}

}  // namespace remat::detail
