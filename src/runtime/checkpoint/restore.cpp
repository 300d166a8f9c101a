// StateRestore: a recompute writes no module state, declared or not.
//
// While a StateRestore is alive, it watches every operator of this thread before the kernels run (remat's
// dispatcher fallback, autograd/watch.h). For each argument the
// operator writes (its schema says `Tensor(a!)`; LibTorch 1.13's batch-norm kernels update the running
// statistics without saying so, and are recognised by name), a tensor whose storage existed before the
// scope and that requires no gradient is copied before the write; the copies are written back, newest
// first, when the scope ends. A storage is "from before the scope" when the region's code passes it to a
// top-level operator (one not called by another operator's kernel) before any operator returned it;
// storages first seen as an operator's output are the recompute's own intermediate results and are left
// alone, as are the region's inputs. Limit: state reached only through a tensor that no top-level operator
// receives (a kernel's private cache) is not seen.

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "autograd/watch.h"
#include "checkpoint/region.h"
#include "checkpoint/restore.h"

namespace remat::detail {

struct StateRestore::Watch final : OpWatcher {
  struct Seen {
    bool created_inside = false;
    c10::Storage keep;  // a storage from before the scope, held so that its address is not reused
  };
  std::unordered_map<const c10::StorageImpl*, Seen> storages;
  std::unordered_set<const c10::TensorImpl*> copied;
  std::vector<std::pair<at::Tensor, at::Tensor>> saved;  // (tensor written, its value before)
  // With track_reads (ForwardWrites): the storages from before the scope that a top-level operator took as an
  // argument it does not write.
  bool track_reads = false;
  std::unordered_set<const c10::StorageImpl*> read;
  int depth = 0;  // the operator nesting depth on this thread when the scope began
  std::optional<WatchScope> scope;

  void before(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int at_depth) override;
  void after(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> returns, int at_depth,
             bool ran) override;
};

namespace {
// Operators that change a tensor's metadata, not its values: nothing to copy back.
bool metadata_only(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "aten::requires_grad_", "aten::retain_grad", "aten::detach_",     "aten::set_",
      "aten::resize_",        "aten::resize_as_",  "aten::as_strided_", "aten::squeeze_",
      "aten::unsqueeze_",     "aten::transpose_",  "aten::t_",          "aten::swapdims_",
      "aten::swapaxes_",      "aten::rename_",     "aten::_coalesced_"};
  return names.count(name) > 0;
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
  WatchPause pause;
  at::NoGradGuard no_grad;
  w.saved.emplace_back(t, t.variable_data().clone());
}

}  // namespace

void StateRestore::Watch::before(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                 int at_depth) {
  const c10::FunctionSchema& schema = op.schema();
  // A storage counts as state only when the region's own code hands it to an operator before any operator
  // made it: kernels allocate their results without the dispatcher and fill them in place (addmm copies the
  // bias into its fresh result), so what nested operators see proves nothing.
  if (at_depth == depth) {
    for (const c10::IValue& v : args)
      for_each_tensor(v, [&](const at::Tensor& t) { note_storage(*this, t, /*created_inside=*/false); });
  }
  if (metadata_only(schema.name())) return;
  if (track_reads && at_depth == depth) {
    for (size_t i = 0; i < args.size(); ++i) {
      if (writes(schema, i, args)) continue;
      for_each_tensor(args[i], [&](const at::Tensor& t) {
        if (!t.defined() || !t.has_storage() || t.requires_grad()) return;
        const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
        const auto it = storages.find(s);
        if (it != storages.end() && !it->second.created_inside) read.insert(s);
      });
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    if (writes(schema, i, args))
      for_each_tensor(args[i], [&](const at::Tensor& t) { copy_before_write(*this, t); });
  }
}

void StateRestore::Watch::after(const c10::OperatorHandle& /*op*/, c10::ArrayRef<c10::IValue> returns,
                                int /*at_depth*/, bool /*ran*/) {
  for (const c10::IValue& v : returns)
    for_each_tensor(v, [&](const at::Tensor& t) { note_storage(*this, t, /*created_inside=*/true); });
}

namespace {
// A watch of this thread's operators from now on (StateRestore's and ForwardWrites'), the region's inputs
// noted as its own (in-place work on them is the region's). Call where watch_available().
std::unique_ptr<StateRestore::Watch> begin_watch(const std::vector<at::Tensor>& inputs, bool track_reads,
                                                 const char* who, bool required) {
  auto watch = std::make_unique<StateRestore::Watch>();
  watch->track_reads = track_reads;
  watch->depth = watch_depth();
  for (const auto& x : inputs)
    note_storage(*watch, x, /*created_inside=*/true);
  watch->scope.emplace(watch.get(), who, required);
  return watch;
}
}  // namespace

StateRestore::StateRestore(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                           const std::vector<at::Tensor>& inputs, const std::vector<ForwardWrite>* left) {
  if (!watch_available()) {
    fallback_ = std::make_unique<BufferRestore>(modules);
    return;
  }
  watch_ = begin_watch(inputs, /*track_reads=*/false, "remat::StateRestore", /*required=*/true);
  if (left != nullptr)
    for (const auto& w : *left)
      watch_->copied.insert(w.first.unsafeGetTensorImpl());  // (as if copied: no copy is made)
}

StateRestore::~StateRestore() {
  if (!watch_) return;
  watch_->scope.reset();
  WatchPause pause;
  at::NoGradGuard no_grad;
  for (auto it = watch_->saved.rbegin(); it != watch_->saved.rend(); ++it) {
    at::Tensor data = it->first.variable_data();
    if (data.sizes() == it->second.sizes()) data.copy_(it->second);
  }
}

size_t StateRestore::restored_count() const {
  return watch_ ? watch_->saved.size() : 0;
}

ForwardWrites::ForwardWrites(const std::vector<at::Tensor>& inputs) {
  if (watch_available())
    watch_ = begin_watch(inputs, /*track_reads=*/true, "remat::checkpoint", /*required=*/false);
}

ForwardWrites::~ForwardWrites() = default;

std::vector<ForwardWrite> ForwardWrites::take() {
  std::vector<ForwardWrite> out;
  if (!watch_) return out;
  watch_->scope.reset();
  for (auto& w : watch_->saved) {
    // (read through any tensor of its storage: a view the forward pass read)
    if (watch_->read.count(w.first.storage().unsafeGetStorageImpl()) > 0) out.push_back(std::move(w));
  }
  watch_.reset();
  return out;
}

ForwardValues::ForwardValues(const std::vector<ForwardWrite>* writes) {
  if (writes == nullptr || writes->empty()) return;
  WatchPause pause;
  at::NoGradGuard no_grad;
  now_.reserve(writes->size());
  for (const auto& [t, before] : *writes) {
    at::Tensor data = t.variable_data();
    if (data.sizes() != before.sizes()) continue;  // resized since: left as it is
    now_.emplace_back(t, data.clone());
    data.copy_(before);
  }
}

ForwardValues::~ForwardValues() {
  if (now_.empty()) return;
  WatchPause pause;
  at::NoGradGuard no_grad;
  for (auto it = now_.rbegin(); it != now_.rend(); ++it) {
    at::Tensor data = it->first.variable_data();
    if (data.sizes() == it->second.sizes())
      data.copy_(it->second);  // (resized by the recompute: as StateRestore)
  }
}

}  // namespace remat::detail
