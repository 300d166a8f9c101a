#pragma once
// remat's view of the operators a thread calls: one boxed dispatcher fallback on a mode key above autograd,
// included in a thread's dispatch key set only while something of remat's watches that thread (watch.cpp).
// Two kinds of clients: watchers see every call before and after it runs (StateRestore, which copies the
// state a recompute writes); the innermost interceptor runs each call itself, or hands back outputs instead
// (an operator-level policy's kept calls, policy.cpp and non_reentrant.cpp).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <functional>
#include <optional>
#include <string>

#include "autograd/thread_state.h"

namespace remat::detail {

/// The key of remat's fallback: LibTorch's TESTING_ONLY_GenericMode, a mode key above autograd that only
/// LibTorch's own tests use.
inline constexpr c10::DispatchKey kWatchKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

/// Calls f on each tensor of a boxed argument or return: the tensor itself, or the tensors of a list.
template <class F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isList()) {
    const c10::List<c10::IValue> list = v.toList();
    for (size_t k = 0; k < list.size(); ++k) {
      const c10::IValue e = list.get(k);
      if (e.isTensor()) f(e.toTensor());
    }
  }
}

/// Whether an operator's name ends with `suffix` ("_like", "batch_norm").
inline bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::char_traits<char>::length(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

/// Registers the fallback once per process (thread-safe); false when another library holds the key.
bool watch_available();

/// Sees every operator call on the thread that installed it, and in the backward passes started there, while
/// installed (WatchScope).
class OpWatcher {
 public:
  virtual ~OpWatcher() = default;
  /// Before the call runs: its arguments. `depth` is the operator nesting on this thread: 0 for a call the
  /// user's code makes, more for calls an operator's kernel makes.
  virtual void before(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int depth) = 0;
  /// After it ran, or was handed back by an interceptor (`ran` false): its returns.
  virtual void after(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> returns, int depth,
                     bool ran) = 0;
};

/// Decides how each operator call runs on the thread that installed it, while installed and innermost
/// (InterceptScope).
class OpInterceptor {
 public:
  virtual ~OpInterceptor() = default;
  /// The call's arguments are on top of `stack`; `run` runs it (below remat's key), leaving its returns in
  /// their place. Must leave the returns there, by running it or by replacing the arguments with outputs of
  /// the operator's return types.
  virtual void call(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& run,
                    int depth) = 0;
};

/// While alive: `watcher` sees this thread's operator calls. Throws c10::Error naming `who` when the key is
/// taken and `required`; otherwise, when it is taken, watches nothing (check active()).
class WatchScope {
 public:
  WatchScope(OpWatcher* watcher, const char* who, bool required);
  ~WatchScope();
  WatchScope(const WatchScope&) = delete;
  WatchScope& operator=(const WatchScope&) = delete;
  bool active() const { return active_; }

 private:
  OpWatcher* watcher_;
  bool active_ = false;
  std::optional<ThreadStateScope> scope_;
  std::optional<c10::impl::IncludeDispatchKeyGuard> include_;
};

/// While alive: `interceptor` runs this thread's operator calls (the innermost scope's interceptor does; a
/// null interceptor lets calls run as they come, hiding the ones outside from what runs inside). Throws
/// c10::Error naming `who` when the key is taken by another library.
class InterceptScope {
 public:
  InterceptScope(OpInterceptor* interceptor, const char* who);
  ~InterceptScope();
  InterceptScope(const InterceptScope&) = delete;
  InterceptScope& operator=(const InterceptScope&) = delete;

 private:
  std::optional<ThreadStateScope> scope_;
  std::optional<c10::impl::IncludeDispatchKeyGuard> include_;
};

/// Whether an interceptor is installed on this thread (an enclosing policy region).
bool intercepting();

/// Called by an interceptor that handed a call's outputs back instead of running it (watchers are told).
void note_handed_back();

/// While alive: remat's fallback is off on this thread (remat's own tensor work inside a watcher or an
/// interceptor, and inside saved-tensor hooks).
class WatchPause {
 public:
  WatchPause() : exclude_(kWatchKey) {}

 private:
  c10::impl::ExcludeDispatchKeyGuard exclude_;
};

/// The current operator nesting depth on this thread (see OpWatcher::before).
int watch_depth();

}  // namespace remat::detail
