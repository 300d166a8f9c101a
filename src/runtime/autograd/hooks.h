#pragma once
// Pure-C++ default saved-tensor hooks: the stack of hook sources (hooks.cpp); remat's engine (engine.h)
// serves them.
//
// LibTorch wires default saved-tensor hooks only to Python. Every SavedVariable asks
// Engine::get_default_engine().get_default_saved_variable_hooks() for hooks when it is created, and that call
// is virtual; torch::autograd::set_default_engine_stub is exported. remat installs a small Engine subclass
// (engine.cpp) that answers from a stack of HookSources in remat's thread state (thread_state.h, carried to
// autograd's worker threads): the innermost source where the tensor is saved packs it. It runs no backward
// pass itself: execution is forwarded to LibTorch's base engine, which owns the worker threads and device
// queues whatever ran first. A process holds one default engine, so this cannot coexist with Python's
// (torch._C installs its own).

#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autograd/thread_state.h"

namespace remat::detail {

/// Makes the hooks of every tensor autograd saves while it is the innermost source on this thread.
class HookSource {
 public:
  using KeepFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
  virtual ~HookSource() = default;
  virtual std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() = 0;
  /// remat::keep(tag, fn, inputs) while this source is the innermost: a checkpoint's forward pass keeps the
  /// outputs of the calls its options name, its recompute hands them back. By default fn simply runs.
  virtual std::vector<at::Tensor> keep(const std::string& tag, const KeepFn& fn,
                                       const std::vector<at::Tensor>& inputs) {
    (void)tag;
    return fn(inputs);
  }
  /// Where a checkpoint region opened while this source is the innermost sends the tensors it keeps to the
  /// backward pass (its kept calls' outputs, and what autograd saved inside them), once its forward pass is
  /// done: an Offload's source is itself; a region's frame, the sink it found when it opened. nullptr (the
  /// default, a recompute's): the region holds them itself.
  virtual HookSource* kept_sink() { return nullptr; }
};

/// The innermost source on this thread, or nullptr.
HookSource* current_hook_source();

/// Pushes `source` on this thread's stack (and on the stack of the backward passes started inside) for the
/// lifetime of the scope; its entry is closed when the scope ends, wherever a state still holds it.
class HookScope {
 public:
  explicit HookScope(HookSource* source);
  ~HookScope();
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;

 private:
  std::shared_ptr<std::atomic<bool>> open_;
  ThreadStateScope scope_;
};

}  // namespace remat::detail
