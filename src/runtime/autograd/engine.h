#pragma once
// remat's autograd engine (engine.cpp): LibTorch's default engine, answering
// get_default_saved_variable_hooks() from the hook sources of autograd/hooks.h.

namespace remat::detail {

/// Installs remat's engine as LibTorch's default autograd engine (idempotent, thread-safe) when the default
/// is still LibTorch's own; true when remat's engine is the default afterwards. Every remat entry point that
/// builds a graph calls it (both checkpoint modes, the executor), so the moment is the first such call.
bool install_engine();

/// install_engine(), then checks that saved-tensor hooks will reach remat on this thread. Throws
/// c10::Error naming `who` when another engine is the default (PyTorch's Python engine, installed by `import
/// torch` in this process: remat does not replace it) or when default saved-tensor hooks are disabled
/// (at::SavedTensorDefaultHooks::disable): either way every activation would be kept, silently.
void require_engine(const char* who);

}  // namespace remat::detail
