// remat's nested backward passes (autograd/nesting.h): their depth, the listeners told when one starts from
// the user's pass, and which user pass each serves.

#include "autograd/nesting.h"

#include <torch/csrc/autograd/graph_task.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "autograd/engine.h"
#include "autograd/hooks.h"

namespace remat::detail {
namespace {

std::mutex listeners_mutex;
std::atomic<int> listener_count{0};
std::map<const void*, std::function<void()>>& listeners() {
  static auto* map = new std::map<const void*, std::function<void()>>();  // outlives static destructors
  return *map;
}

// Calls the listeners when a nested pass starts from the user's pass (before the scope is installed).
int enter_nested() {
  const int depth = thread_state().nested_backward_depth;
  if (depth == 0 && listener_count.load(std::memory_order_acquire) > 0) {
    std::vector<std::function<void()>> calls;
    {
      std::lock_guard<std::mutex> lock(listeners_mutex);
      for (const auto& entry : listeners())
        calls.push_back(entry.second);
    }
    for (const auto& call : calls)
      call();
  }
  return depth;
}

}  // namespace

int nested_backward_depth() {
  return thread_state().nested_backward_depth;
}

NestedBackward::NestedBackward()
    : scope_([depth = enter_nested()](ThreadState& s) { s.nested_backward_depth = depth + 1; }) {}

UserPass user_pass() {
  const ThreadState& s = thread_state();
  if (s.pass) return *s.pass;
  // Under another default engine (remat's never saw the pass start), a pending pass is the best knowledge.
  if (s.pending_pass && !install_engine()) return *s.pending_pass;
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  UserPass pass;
  pass.accumulate = info == nullptr || info->empty();
  pass.exec_info = pass.accumulate ? nullptr : info;
  return pass;
}

ServePass::ServePass(const UserPass& pass)
    : scope_([p = std::make_shared<const UserPass>(pass)](ThreadState& s) { s.pending_pass = p; }) {}

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
