// remat's per-thread state (detail/thread_state.h): kept in c10::ThreadLocalDebugInfo under a kind of
// remat's own, so that LibTorch carries it to the threads that run backward passes.

#include "detail/thread_state.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "detail/compat.h"
#include "detail/hooks.h"

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

// The scopes open on this thread, in the order they started.
std::vector<ThreadStateScope*>& open_scopes() {
  thread_local std::vector<ThreadStateScope*> open;
  return open;
}

ThreadStateScope::ThreadStateScope(Edit edit) : edit_(std::move(edit)) {
  install();
  open_scopes().push_back(this);
}

void ThreadStateScope::install() {
  auto next = std::make_shared<ThreadState>(thread_state());
  edit_(*next);
  prev_ = c10::ThreadLocalDebugInfo::current();
  c10::ThreadLocalDebugInfo::_push(state_kind(), std::move(next));
  node_ = c10::ThreadLocalDebugInfo::current();
}

ThreadStateScope::~ThreadStateScope() {
  auto& open = open_scopes();
  const auto it = std::find(open.begin(), open.end(), this);
  if (it == open.end()) {
    // Ended on another thread: that thread's state is not ours to change from here. Its hook entries are
    // closed (HookScope), so nothing reaches what this scope installed.
    TORCH_WARN_ONCE(
        "remat: a scope (remat::Offload or a checkpoint region) ended on another thread than the "
        "one it started on; it is closed, and its thread's state is restored when the scopes "
        "around it end");
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

// ------------------------------------------------------------------------------------------------------------
// The hook stack (detail/hooks.h)

HookSource* current_hook_source() {
  const auto& hooks = thread_state().hooks;
  for (auto it = hooks.rbegin(); it != hooks.rend(); ++it) {
    if (it->open->load(std::memory_order_acquire)) return it->source;
  }
  return nullptr;
}

HookScope::HookScope(HookSource* source)
    : open_(std::make_shared<std::atomic<bool>>(true)),
      scope_([source, open = std::shared_ptr<const std::atomic<bool>>(open_)](ThreadState& s) {
        s.hooks.push_back({source, open});
      }) {}

HookScope::~HookScope() {
  open_->store(false, std::memory_order_release);
}

}  // namespace remat::detail
