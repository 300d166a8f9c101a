// remat's dispatcher fallback (autograd/watch.h): one boxed fallback on a mode key above autograd, which
// calls the watchers installed on this thread before and after each operator, and lets the innermost
// interceptor run it. The key is in a thread's dispatch key set only while a WatchScope or an InterceptScope
// is alive on it (or on the thread that started the backward pass it runs), so other threads and other code
// pay nothing. The watchers and interceptors are kept in remat's thread state, which autograd carries to the
// threads that run backward passes: a pass started inside a scope is watched wherever it runs, as on the
// starting thread.

#include "autograd/watch.h"

#include "autograd/thread_state.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace remat::detail {
namespace {

// How many watched operators are running on this thread: an operator called by another's kernel is nested.
thread_local int t_depth = 0;
// Set by an interceptor that handed the current call back instead of running it.
thread_local bool t_handed_back = false;

struct Nest {
  Nest() { ++t_depth; }
  ~Nest() { --t_depth; }
  Nest(const Nest&) = delete;
  Nest& operator=(const Nest&) = delete;
};

void watch_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const int depth = t_depth;
  // Copies: a watcher may install or remove others (a recompute that starts inside a call).
  const ThreadState& state = thread_state();
  const std::vector<OpWatcher*> watchers = state.watchers;
  for (OpWatcher* w : watchers)
    w->before(op, torch::jit::last(*stack, schema.arguments().size()), depth);
  auto run = [&] {
    Nest nest;
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kWatchKey), stack);
  };
  OpInterceptor* interceptor = state.interceptors.empty() ? nullptr : state.interceptors.back();
  t_handed_back = false;
  if (interceptor != nullptr) {
    interceptor->call(op, stack, run, depth);
  } else {
    run();
  }
  const bool ran = !t_handed_back;
  t_handed_back = false;
  for (OpWatcher* w : watchers)
    w->after(op, torch::jit::last(*stack, schema.returns().size()), depth, ran);
}

}  // namespace

bool watch_available() {
  static const bool available = [] {
    try {
      // Deregistered at exit, after everything constructed later (LibTorch's dispatcher was constructed
      // earlier, so it outlives this).
      static std::optional<torch::Library> lib;
      lib.emplace(torch::Library::IMPL, "_", kWatchKey, __FILE__, __LINE__);
      lib->fallback(torch::CppFunction::makeFromBoxedFunction<&watch_fallback>());
      return true;
    } catch (const c10::Error& e) {
      TORCH_WARN("remat: cannot watch operators: the dispatcher fallback for ", c10::toString(kWatchKey),
                 " is taken (", e.what_without_backtrace(),
                 "). Undeclared module state written by a recompute is not restored (only the buffers of "
                 "declared modules are), and operator-level policies cannot run.");
      return false;
    }
  }();
  return available;
}

WatchScope::WatchScope(OpWatcher* watcher, const char* who, bool required) : watcher_(watcher) {
  if (!watch_available()) {
    TORCH_CHECK(!required, who, ": remat's dispatcher fallback (", c10::toString(kWatchKey),
                ") is held by another library, so operators cannot be watched");
    return;
  }
  active_ = true;
  scope_.emplace([watcher](ThreadState& s) { s.watchers.push_back(watcher); });
  include_.emplace(kWatchKey);
}

WatchScope::~WatchScope() {
  include_.reset();
  scope_.reset();
}

InterceptScope::InterceptScope(OpInterceptor* interceptor, const char* who) {
  TORCH_CHECK(
      watch_available(), who, ": an operator-level policy needs remat's dispatcher fallback (",
      c10::toString(kWatchKey),
      "), which another library in this process holds; use remat::keep tags (CheckpointOptions::keep) "
      "instead");
  scope_.emplace([interceptor](ThreadState& s) { s.interceptors.push_back(interceptor); });
  include_.emplace(kWatchKey);
}

InterceptScope::~InterceptScope() {
  include_.reset();
  scope_.reset();
}

bool intercepting() {
  const auto& interceptors = thread_state().interceptors;
  return std::any_of(interceptors.begin(), interceptors.end(), [](OpInterceptor* i) { return i != nullptr; });
}

void note_handed_back() {
  t_handed_back = true;
}

int watch_depth() {
  return t_depth;
}

}  // namespace remat::detail
