#pragma once
// remat's per-thread state, carried to every thread autograd runs a backward pass on.
//
// Autograd runs backward passes on threads of its own (one per device, and a pool for passes nested past
// LibTorch's per-thread depth of 60). A recompute runs on whichever thread executes the node that needs it,
// and what it needs (the saved-tensor hook sources, the operator watchers and interceptors, remat's nesting
// depth, which user pass a nested pass serves) must be there. LibTorch copies one extensible piece of thread
// state to those threads: c10::ThreadLocalDebugInfo, captured with the rest of at::ThreadLocalState when a
// graph task is created and set on the worker thread while it runs that task's nodes. remat keeps its state
// there, as an immutable value replaced by scopes (ThreadStateScope), so that a backward pass started
// inside a region sees the region on whichever thread runs it, exactly as it would on the starting thread.

#include <torch/csrc/autograd/graph_task.h>

#include <c10/util/ThreadLocalDebugInfo.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace remat::detail {

class HookSource;
class OpWatcher;
class OpInterceptor;

/// The exec_info of a graph task: the nodes a torch::autograd::grad call (or backward with inputs) needs,
/// and those whose gradients it captures. Empty under a plain backward().
using ExecInfoMap = std::unordered_map<torch::autograd::Node*, torch::autograd::GraphTask::ExecInfo>;

/// The backward pass the user started (the outermost one not started by remat), as a region inside a nested
/// pass of remat's sees it.
struct UserPass {
  /// The user's pass accumulates into .grad (backward() without inputs) rather than returning gradients
  /// (torch::autograd::grad, or backward with inputs).
  bool accumulate = true;
  /// Its exec_info when not accumulating (what it asked for; alive while it runs); null otherwise.
  const ExecInfoMap* exec_info = nullptr;
};

/// One entry of the hook stack: a source, and whether its scope is still open. A scope that could not take
/// itself out of every state that holds it (it ended on another thread than the one it started on) closes its
/// entry, so that no state still installed there reaches a source that may be gone.
struct HookEntry {
  HookSource* source = nullptr;
  std::shared_ptr<const std::atomic<bool>> open;
};

/// remat's state on one thread. Immutable once installed: scopes install an edited copy.
struct ThreadState final : c10::DebugInfoBase {
  std::vector<HookEntry> hooks;              // innermost last: packs what autograd saves
  std::vector<OpWatcher*> watchers;          // see every operator call (watch.cpp)
  std::vector<OpInterceptor*> interceptors;  // innermost last: runs each operator call (watch.cpp)
  int nested_backward_depth = 0;             // remat's nested backward passes around this point
  /// The user pass that the backward pass running here serves, when remat started it (null: the running
  /// pass is the user's own, or none runs).
  std::shared_ptr<const UserPass> pass;
  /// The user pass that the next backward pass this thread starts will serve (set by ServePass, consumed by
  /// remat's engine when the pass starts).
  std::shared_ptr<const UserPass> pending_pass;
};

/// The state in force on this thread: set by remat's scopes here, or carried from the thread that started
/// the backward pass this thread is running. An empty state when there is none.
const ThreadState& thread_state();

/// Installs a copy of the current state, changed by `edit`, for the lifetime of the scope, on the thread that
/// constructs it. Scopes may end in any order: one that ends while scopes started after it on this thread are
/// still open (a remat::Offload replaced by the next step's before it is destroyed) takes its edit out, and
/// those scopes are installed again, each on top of the one before, as if it had never been opened. A scope
/// that ends on another thread closes its hook entries (HookEntry::open) and leaves its thread's state as it
/// is. Never throws from its destructor.
class ThreadStateScope {
 public:
  using Edit = std::function<void(ThreadState&)>;
  explicit ThreadStateScope(Edit edit);
  ~ThreadStateScope();
  ThreadStateScope(const ThreadStateScope&) = delete;
  ThreadStateScope& operator=(const ThreadStateScope&) = delete;

  struct Registry;  // the scopes open on one thread (thread_state.cpp)

 private:
  void install();  // pushes the current state, edited, on this thread's debug info
  Edit edit_;
  std::shared_ptr<Registry> registry_;               // the thread it started on
  std::shared_ptr<c10::ThreadLocalDebugInfo> prev_;  // this thread's debug info before the push
  std::shared_ptr<c10::ThreadLocalDebugInfo> node_;  // and after it
};

}  // namespace remat::detail
