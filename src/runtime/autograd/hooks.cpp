// The stack of hook sources (autograd/hooks.h), kept in remat's thread state so that autograd's worker
// threads see the sources of the pass that started them.

#include "autograd/hooks.h"

#include <atomic>
#include <memory>

#include "autograd/thread_state.h"

namespace remat::detail {

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
