// remat's per-thread state (autograd/thread_state.h): kept in c10::ThreadLocalDebugInfo under a kind of
// remat's own, so that LibTorch carries it to the threads that run backward passes.

#include "autograd/thread_state.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>

#include "detail/compat.h"

namespace remat::detail {
namespace {

const c10::DebugInfoKind& state_kind() {
  static const c10::DebugInfoKind kind = compat::private_debug_info_kind();
  return kind;
}

}  // namespace

const ThreadState& thread_state() {
  static const ThreadState* const empty = new ThreadState();  // never destroyed: read until exit
  const auto* state = static_cast<const ThreadState*>(c10::ThreadLocalDebugInfo::get(state_kind()));
  return state != nullptr ? *state : *empty;
}

// The scopes open on one thread, in the order they started. A scope holds its thread's registry, so that one
// ended on another thread can take itself out of it (under the lock) without leaving a dangling pointer
// there.
struct ThreadStateScope::Registry {
  std::mutex mu;
  std::vector<ThreadStateScope*> open;
};

namespace {

const std::shared_ptr<ThreadStateScope::Registry>& this_thread_registry() {
  thread_local const auto registry = std::make_shared<ThreadStateScope::Registry>();
  return registry;
}

}  // namespace

ThreadStateScope::ThreadStateScope(Edit edit) : edit_(std::move(edit)), registry_(this_thread_registry()) {
  install();
  std::lock_guard<std::mutex> lock(registry_->mu);
  registry_->open.push_back(this);
}

void ThreadStateScope::install() {
  auto next = std::make_shared<ThreadState>(thread_state());
  edit_(*next);
  prev_ = c10::ThreadLocalDebugInfo::current();
  c10::ThreadLocalDebugInfo::_push(state_kind(), std::move(next));
  node_ = c10::ThreadLocalDebugInfo::current();
}

ThreadStateScope::~ThreadStateScope() {
  std::lock_guard<std::mutex> lock(registry_->mu);
  auto& open = registry_->open;
  const auto it = std::find(open.begin(), open.end(), this);
  if (it == open.end()) return;  // never: a scope leaves its registry only here
  if (registry_ != this_thread_registry()) {
    // Ended on another thread: that thread's state is not ours to change from here. Its hook entries are
    // closed (HookScope), so nothing reaches what this scope installed; the state goes when the scopes around
    // it end.
    open.erase(it);
    TORCH_WARN_ONCE(
        "remat: a scope (remat::Offload) ended on another thread than the one it started on; it is "
        "closed, and its thread's state is restored when the scopes around it end");
    return;
  }
  const size_t i = static_cast<size_t>(it - open.begin());
  if (i + 1 == open.size()) {  // in order: what was before it
    c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(prev_);
    open.pop_back();
    return;
  }
  // Out of order: the scopes started after this one are installed again, each on top of the one before, from
  // what was there before this one, so that this one's edit is gone and theirs stay. That needs this thread's
  // debug info to be theirs alone above this one (nobody else's guard in between); otherwise this scope's
  // hook entries are closed and the state is left to the scopes around it.
  bool ours = c10::ThreadLocalDebugInfo::current() == open.back()->node_;
  for (size_t j = i + 1; j < open.size(); ++j)
    ours = ours && open[j]->prev_ == open[j - 1]->node_;
  open.erase(it);
  if (!ours) return;
  c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(prev_);
  for (size_t j = i; j < open.size(); ++j)
    open[j]->install();
}

}  // namespace remat::detail
