// remat's autograd engine: LibTorch's default engine answers get_default_saved_variable_hooks(), and remat's
// answers it from remat's thread state (autograd/hooks.h). It executes nothing itself: every backward pass is
// forwarded to LibTorch's base engine, so that one engine owns the worker threads, the device queues and the
// pool for deeply nested passes, whichever ran a backward pass first. It also marks the passes remat starts
// (ServePass, autograd/nesting.h) on the thread state those passes carry.

#include "autograd/engine.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/input_buffer.h>

#include <ATen/SavedTensorHooks.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <optional>
#include <typeinfo>
#include <utility>

#include "autograd/hooks.h"
#include "autograd/thread_state.h"

namespace remat::detail {
namespace {

using torch::autograd::Engine;
using NodePtr = std::decay_t<decltype(std::declval<torch::autograd::Edge>().function)>;

struct RematEngine final : Engine {
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (!at::SavedTensorDefaultHooks::is_enabled()) return nullptr;
    HookSource* source = current_hook_source();
    return source != nullptr ? source->make_hooks() : nullptr;
  }

  torch::autograd::variable_list execute(const torch::autograd::edge_list& roots,
                                         const torch::autograd::variable_list& inputs, bool keep_graph,
                                         bool create_graph, bool accumulate_grad,
                                         const torch::autograd::edge_list& outputs) override {
    // The graph task the base engine creates captures the thread state, and with it which user pass this
    // one serves: the one ServePass set, or none (a pass started by anyone else is a user pass of its own).
    const ThreadState& now = thread_state();
    std::optional<ThreadStateScope> scope;
    if (now.pass || now.pending_pass) {
      scope.emplace([](ThreadState& s) {
        s.pass = std::move(s.pending_pass);
        s.pending_pass = nullptr;
      });
    }
    return Engine::get_base_engine().execute(roots, inputs, keep_graph, create_graph, accumulate_grad,
                                             outputs);
  }

  c10::intrusive_ptr<at::ivalue::Future> execute_with_graph_task(
      const std::shared_ptr<torch::autograd::GraphTask>& graph_task, NodePtr graph_root,
      torch::autograd::InputBuffer&& input_buffer) override {
    return Engine::get_base_engine().execute_with_graph_task(graph_task, std::move(graph_root),
                                                             std::move(input_buffer));
  }
};

Engine& remat_engine() {
  // Never destroyed (an Engine must not be destroyed while LibTorch may still call it at exit). It starts
  // no thread: execution goes to the base engine.
  static RematEngine* engine = new RematEngine();
  return *engine;
}

}  // namespace

bool install_engine() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  // Only LibTorch's own engine is replaced: another one (PyTorch's Python engine) serves its own hooks.
  if (typeid(Engine::get_default_engine()) == typeid(Engine)) {
    torch::autograd::set_default_engine_stub(&remat_engine);
  }
  return &Engine::get_default_engine() == &remat_engine();
}

void require_engine(const char* who) {
  if (!install_engine()) {
    Engine& engine = Engine::get_default_engine();
    TORCH_CHECK(
        false, who, ": CheckpointMode::kNonReentrant needs remat's autograd engine, but another engine (",
        typeid(engine).name(),
        ") is LibTorch's default in this process, typically PyTorch's Python engine installed by "
        "`import torch` (an embedded interpreter or a Python extension). Its saved-tensor hooks would "
        "not reach remat and every activation would be kept. Use CheckpointMode::kReentrant in such a "
        "process.");
  }
  TORCH_CHECK(
      at::SavedTensorDefaultHooks::is_enabled(), who,
      ": default saved-tensor hooks are disabled on this thread (at::SavedTensorDefaultHooks::disable: '",
      at::SavedTensorDefaultHooks::get_disabled_error_message().value_or(""),
      "'), so CheckpointMode::kNonReentrant would keep every activation. Enable them "
      "(at::SavedTensorDefaultHooks::enable()) or use CheckpointMode::kReentrant.");
}

}  // namespace remat::detail
