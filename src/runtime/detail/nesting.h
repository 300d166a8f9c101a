#pragma once
// remat's own nested backward passes: a kReentrant region's backward and the plan executor's stages run
// backward passes inside the node the user's backward pass is executing. Code that must act once at the end
// of the user's (outermost) backward pass, such as remat::distributed's gradient reduction, needs to know
// whether it is inside one, and to be told when one starts from the outermost pass (where it can still queue
// an engine callback on the user's graph task).

#include <functional>

namespace remat::detail {

/// Depth of remat's nested backward passes on this thread (0: the caller's own pass, or none).
int nested_backward_depth();

/// Marks a nested backward pass for its lifetime. Entering at depth 0 first calls the outer-backward
/// listeners, on this thread, inside the outer graph task.
class NestedBackward {
 public:
  NestedBackward();
  ~NestedBackward();
  NestedBackward(const NestedBackward&) = delete;
  NestedBackward& operator=(const NestedBackward&) = delete;
};

/// Marks the profiler's runs for their lifetime (any thread: a process-wide count): the gradients their
/// backward passes accumulate are put back afterwards, so remat::distributed neither counts nor reduces them.
class ProfilerRunning {
 public:
  ProfilerRunning();
  ~ProfilerRunning();
  ProfilerRunning(const ProfilerRunning&) = delete;
  ProfilerRunning& operator=(const ProfilerRunning&) = delete;
};
/// Whether a ProfilerRunning is alive.
bool profiler_running();

/// Registers `fn` under `key` (replacing one already there); remove it before what it captures dies.
/// Listeners run with no remat lock held and must not register or remove listeners.
void add_outer_backward_listener(const void* key, std::function<void()> fn);
void remove_outer_backward_listener(const void* key);

}  // namespace remat::detail
