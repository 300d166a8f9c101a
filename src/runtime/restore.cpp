// StateRestore: a recompute writes no module state, declared or not.
//
// While a StateRestore is alive, a boxed dispatcher fallback on a mode key (included in this thread's
// dispatch key set for the scope only) sees every operator before the kernels run. For each argument the
// operator writes (its schema says `Tensor(a!)`; LibTorch 1.13's batch-norm kernels update the running
// statistics without saying so, and are recognised by name), a tensor whose storage existed before the
// scope and that requires no gradient is copied before the write; the copies are written back, newest
// first, when the scope ends. A storage is "from before the scope" when the region's code passes it to a
// top-level operator (one not called by another operator's kernel) before any operator returned it;
// storages first seen as an operator's output are the recompute's own intermediate results and are left
// alone, as are the region's inputs. Limit: state reached only through a tensor that no top-level operator
// receives (a kernel's private cache) is not seen.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "detail/region.h"
#include "detail/restore.h"

namespace remat::detail {

namespace {
// The mode key the fallback is registered on. LibTorch reserves it for a generic mode that only tests
// use; remat includes it on a thread only inside a recompute.
constexpr c10::DispatchKey kWatchKey = c10::DispatchKey::TESTING_ONLY_GenericMode;
}  // namespace

struct StateRestore::Watch {
  struct Seen {
    bool created_inside = false;
    c10::Storage keep;  // a storage from before the scope, held so that its address is not reused
  };
  std::unordered_map<const c10::StorageImpl*, Seen> storages;
  std::unordered_set<const c10::TensorImpl*> copied;
  std::vector<std::pair<at::Tensor, at::Tensor>> saved;       // (tensor written, its value before)
  std::optional<c10::impl::IncludeDispatchKeyGuard> include;  // the fallback's key, on this thread
  int depth = 0;  // the operator nesting depth on this thread when the scope began
};

namespace {
thread_local std::vector<StateRestore::Watch*> t_watches;
// How many watched operators are running on this thread: an operator called by another's kernel is nested.
thread_local int t_depth = 0;

struct Nest {
  Nest() { ++t_depth; }
  ~Nest() { --t_depth; }
  Nest(const Nest&) = delete;
  Nest& operator=(const Nest&) = delete;
};

// Operators that change a tensor's metadata, not its values: nothing to copy back.
bool metadata_only(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "aten::requires_grad_", "aten::retain_grad", "aten::detach_",     "aten::set_",
      "aten::resize_",        "aten::resize_as_",  "aten::as_strided_", "aten::squeeze_",
      "aten::unsqueeze_",     "aten::transpose_",  "aten::t_",          "aten::swapdims_",
      "aten::swapaxes_",      "aten::rename_",     "aten::_coalesced_"};
  return names.count(name) > 0;
}

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::char_traits<char>::length(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// True when the operator writes argument i.
bool writes(const c10::FunctionSchema& schema, size_t i, c10::ArrayRef<c10::IValue> args) {
  const c10::Argument& a = schema.arguments()[i];
  if (a.alias_info() && a.alias_info()->isWrite()) return true;
  // Batch-norm kernels that update the running statistics in training mode without declaring the write
  // (native_batch_norm and the cuDNN/MIOpen ones in LibTorch 1.13, and the composites that call them).
  if ((a.name() == "running_mean" || a.name() == "running_var") && ends_with(schema.name(), "batch_norm")) {
    const auto training = schema.argumentIndexWithName("training");
    return training && args[*training].isBool() && args[*training].toBool();
  }
  return false;
}

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

void note_storage(StateRestore::Watch& w, const at::Tensor& t, bool created_inside) {
  if (!t.defined() || !t.has_storage()) return;
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  auto [it, fresh] = w.storages.try_emplace(s);
  if (!fresh) return;
  it->second.created_inside = created_inside;
  if (!created_inside) it->second.keep = t.storage();
}

void copy_before_write(StateRestore::Watch& w, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.requires_grad()) return;
  const auto it = w.storages.find(t.storage().unsafeGetStorageImpl());
  if (it == w.storages.end() || it->second.created_inside) return;
  if (!w.copied.insert(t.unsafeGetTensorImpl()).second) return;
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  at::NoGradGuard no_grad;
  w.saved.emplace_back(t, t.variable_data().clone());
}

void watch_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const bool watching = !t_watches.empty();
  if (watching) {
    const c10::ArrayRef<c10::IValue> args = torch::jit::last(*stack, num_args);
    // A storage counts as state only when the region's own code hands it to an operator before any
    // operator made it: kernels allocate their results without the dispatcher and fill them in place
    // (addmm copies the bias into its fresh result), so what nested operators see proves nothing.
    for (StateRestore::Watch* w : t_watches) {
      if (t_depth != w->depth) continue;
      for (const c10::IValue& v : args)
        for_each_tensor(v, [&](const at::Tensor& t) { note_storage(*w, t, /*created_inside=*/false); });
    }
    if (!metadata_only(schema.name())) {
      for (size_t i = 0; i < num_args; ++i) {
        if (!writes(schema, i, args)) continue;
        for (StateRestore::Watch* w : t_watches)
          for_each_tensor(args[i], [&](const at::Tensor& t) { copy_before_write(*w, t); });
      }
    }
  }
  {
    Nest nest;
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kWatchKey), stack);
  }
  if (watching) {
    const size_t num_returns = schema.returns().size();
    for (StateRestore::Watch* w : t_watches) {
      for (const c10::IValue& v : torch::jit::last(*stack, num_returns))
        for_each_tensor(v, [&](const at::Tensor& t) { note_storage(*w, t, /*created_inside=*/true); });
    }
  }
}

// Registers the fallback once per process. False (and a warning, once) when the key is already taken.
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
      TORCH_WARN(
          "remat: cannot watch recomputes for in-place writes to module state (the dispatcher "
          "fallback for ",
          c10::toString(kWatchKey), " is taken: ", e.what_without_backtrace(),
          "). Only the buffers of modules declared with CheckpointOptions().modules(...) or passed "
          "to the module overload are restored after a recompute; undeclared BatchNorm statistics "
          "will be updated twice.");
      return false;
    }
  }();
  return available;
}
}  // namespace

StateRestore::StateRestore(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                           const std::vector<at::Tensor>& inputs) {
  if (!watch_available()) {
    fallback_ = std::make_unique<BufferRestore>(modules);
    return;
  }
  watch_ = std::make_unique<Watch>();
  watch_->depth = t_depth;
  for (const auto& x : inputs)
    note_storage(*watch_, x, /*created_inside=*/true);
  t_watches.push_back(watch_.get());
  watch_->include.emplace(kWatchKey);
}

StateRestore::~StateRestore() {
  if (!watch_) return;
  TORCH_INTERNAL_ASSERT(!t_watches.empty() && t_watches.back() == watch_.get(),
                        "remat: StateRestore scopes must nest");
  watch_->include.reset();
  t_watches.pop_back();
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  at::NoGradGuard no_grad;
  for (auto it = watch_->saved.rbegin(); it != watch_->saved.rend(); ++it) {
    at::Tensor data = it->first.variable_data();
    if (data.sizes() == it->second.sizes()) data.copy_(it->second);
  }
}

size_t StateRestore::restored_count() const {
  return watch_ ? watch_->saved.size() : 0;
}

}  // namespace remat::detail
