#include <torch/csrc/autograd/engine.h>

#include <mutex>
#include <vector>

#include "detail/hooks.h"

namespace remat::detail {
namespace {

thread_local std::vector<HookSource*> hook_stack;

struct RematEngine final : torch::autograd::Engine {
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (hook_stack.empty()) return nullptr;
    return hook_stack.back()->make_hooks();
  }
};

torch::autograd::Engine& remat_engine() {
  // Never destroyed: its worker threads may still hold it at exit (Python's engine does the same).
  static RematEngine* engine = new RematEngine();
  return *engine;
}

}  // namespace

void install_engine() {
  static std::once_flag once;
  std::call_once(once, [] { torch::autograd::set_default_engine_stub(&remat_engine); });
}

HookScope::HookScope(HookSource* source) {
  hook_stack.push_back(source);
}
HookScope::~HookScope() {
  hook_stack.pop_back();
}

}  // namespace remat::detail
