#pragma once
// remat's own nested backward passes: a kReentrant region's backward and the plan executor's stages run
// backward passes inside the node the user's backward pass is executing. Two things need to know about them:
// - code that must act once at the end of the user's (outermost) pass, such as remat::distributed's gradient
//   reduction: whether it runs inside one, and a call when one starts from the outermost pass (where it can
//   still queue an engine callback on the user's graph task);
// - a region inside a nested pass, which must act as the user's pass asks (accumulate into .grad under
//   backward(), return gradients under torch::autograd::grad) although the nested pass itself, restricted
//   to the region's targets, looks like a torch::autograd::grad call.
// Both are kept in remat's thread state, so they hold on whichever thread autograd runs the nested pass.

#include <functional>

#include "autograd/thread_state.h"

namespace remat::detail {

/// Depth of remat's nested backward passes around this point (0: the caller's own pass, or none), on
/// whichever thread runs it.
int nested_backward_depth();

/// Marks a nested backward pass for its lifetime. Entering at depth 0 first calls the outer-backward
/// listeners, on this thread, inside the outer graph task.
class NestedBackward {
 public:
  NestedBackward();

 private:
  ThreadStateScope scope_;
};

/// The user's pass that the node running now serves: the one a nested pass of remat's was started for, or,
/// when the running pass is not remat's, that pass itself (read from the current graph task).
UserPass user_pass();

/// While alive, the next backward passes this thread starts through the engine (torch::autograd::backward,
/// grad, Engine::execute) serve `pass`: a region inside them sees it through user_pass(). Passes started from
/// inside those (by other code) are user passes of their own. Needs remat's engine as the default; when
/// another engine is, the passes started inside are taken to serve `pass` too.
class ServePass {
 public:
  explicit ServePass(const UserPass& pass);

 private:
  ThreadStateScope scope_;
};

/// Registers `fn` under `key` (replacing one already there); remove it before what it captures dies.
/// Listeners run with no remat lock held and must not register or remove listeners.
void add_outer_backward_listener(const void* key, std::function<void()> fn);
void remove_outer_backward_listener(const void* key);

}  // namespace remat::detail
