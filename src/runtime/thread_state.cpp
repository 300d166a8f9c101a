// remat's per-thread state (detail/thread_state.h): kept in c10::ThreadLocalDebugInfo under a kind of
// remat's own, so that LibTorch carries it to the threads that run backward passes.

#include "detail/thread_state.h"

#include <c10/util/Exception.h>

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

void ThreadStateScope::install(std::shared_ptr<ThreadState> next) {
  mine_ = next.get();
  guard_.emplace(state_kind(), std::move(next));
}

ThreadStateScope::~ThreadStateScope() {
  // A scope that ends out of order would take the ones started after it with it: a bug of remat's.
  TORCH_INTERNAL_ASSERT(c10::ThreadLocalDebugInfo::get(state_kind()) == mine_,
                        "remat: thread-state scopes must end in the reverse order of their start");
  guard_.reset();
}

// ------------------------------------------------------------------------------------------------------------
// The hook stack (detail/hooks.h)

HookSource* current_hook_source() {
  const auto& hooks = thread_state().hooks;
  return hooks.empty() ? nullptr : hooks.back();
}

HookScope::HookScope(HookSource* source) : scope_([source](ThreadState& s) { s.hooks.push_back(source); }) {}

}  // namespace remat::detail
