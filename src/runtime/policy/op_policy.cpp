// An operator-level policy's record of one kNonReentrant region (policy/op_policy.h).

#include "policy/op_policy.h"

#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>

namespace remat::detail {

struct OpPolicyRecord::Call {
  std::string name, overload;
  std::string call{};  // "aten::addmm#2" (OpCall::call); empty for a write made part of a kept call
  int64_t end = 0;     // one past the last asked call made inside it
  int64_t kept = -1;   // its index in kept_, or -1
  // An in-place write to the outputs of the kept call `owner` (an index into calls_), made part of that call:
  // the recompute hands the owner's outputs back as they were after it, and skips it. `kept` then holds what
  // autograd saved inside the write.
  int64_t owner = -1;
};

namespace {

// The graph task running on this thread (its exec_info map identifies it; null outside a backward pass).
const void* current_graph_task() {
  return torch::autograd::get_current_graph_task_exec_info();
}

bool is_tensor_type(const c10::TypePtr& t) {
  return t->kind() == c10::TypeKind::TensorType;
}

bool holds_tensors(const c10::TypePtr& t) {
  if (is_tensor_type(t)) return true;
  if (auto o = t->cast<c10::OptionalType>()) return holds_tensors(o->getElementType());
  if (auto l = t->cast<c10::ListType>()) return holds_tensors(l->getElementType());
  return false;
}

// Counts one more level of a nesting while alive.
class Nested {
 public:
  explicit Nested(int& depth) : depth_(depth) { ++depth_; }
  ~Nested() { --depth_; }
  Nested(const Nested&) = delete;
  Nested& operator=(const Nested&) = delete;

 private:
  int& depth_;
};

void warn_once(const std::string& message) {
  static std::mutex mutex;
  static std::set<std::string> warned;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!warned.insert(message).second) return;
  }
  TORCH_WARN(message);
}

}  // namespace

std::vector<at::Tensor> tensors_of(c10::ArrayRef<c10::IValue> values) {
  std::vector<at::Tensor> out;
  for (const c10::IValue& v : values)
    for_each_tensor(v, [&](const at::Tensor& t) { out.push_back(t); });
  return out;
}

const void* storage_key(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? static_cast<const void*>(t.storage().unsafeGetStorageImpl())
                                        : nullptr;
}

std::string call_name(const c10::FunctionSchema& schema, std::unordered_map<std::string, int64_t>& counts) {
  return schema.name() + "#" + std::to_string(counts[schema.name()]++);
}

// Whether a call of this operator can be kept, and so is asked: every return a tensor that aliases nothing,
// no argument written, at least one tensor argument, and not a factory (empty_like, new_zeros, ...), whose
// fresh result a later in-place operator fills. aten::_unsafe_view returns a view without saying so in its
// schema (matmul uses it on the product it reshapes).
bool askable(const c10::FunctionSchema& schema) {
  if (schema.returns().empty()) return false;
  for (const c10::Argument& r : schema.returns()) {
    if (!is_tensor_type(r.type()) || r.alias_info() != nullptr) return false;
  }
  bool tensor_argument = false;
  for (const c10::Argument& a : schema.arguments()) {
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) return false;
    tensor_argument = tensor_argument || holds_tensors(a.type());
  }
  const std::string& name = schema.name();
  return tensor_argument && !ends_with(name, "_like") && name.rfind("aten::new_", 0) != 0 &&
         name != "aten::_unsafe_view";
}

// The arguments an operator writes.
std::vector<size_t> written_arguments(const c10::FunctionSchema& schema) {
  std::vector<size_t> out;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::AliasInfo* a = schema.arguments()[i].alias_info();
    if (a != nullptr && a->isWrite()) out.push_back(i);
  }
  return out;
}

// For each return of an in-place or out= operator, the argument it returns (the written one with the same
// alias set); nullopt when a return is not one of them.
std::optional<std::vector<size_t>> returned_arguments(const c10::FunctionSchema& schema) {
  std::vector<size_t> out;
  for (const c10::Argument& r : schema.returns()) {
    const c10::AliasInfo* ra = r.alias_info();
    if (ra == nullptr || !ra->isWrite()) return std::nullopt;
    std::optional<size_t> found;
    for (size_t i = 0; i < schema.arguments().size(); ++i) {
      const c10::AliasInfo* a = schema.arguments()[i].alias_info();
      if (a != nullptr && a->isWrite() && a->beforeSets() == ra->beforeSets()) found = i;
    }
    if (!found) return std::nullopt;
    out.push_back(*found);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------------------
// The forward pass

class OpPolicyRecord::Forward final : public OpInterceptor {
 public:
  explicit Forward(OpPolicyRecord& r) : r_(r), task_(current_graph_task()) {}

  void call(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& run,
            int /*depth*/) override {
    // Operators of a backward pass fn runs inside the region, of a kept remat::keep call, or inside a write
    // made part of a kept call, are not asked.
    if (r_.paused_ > 0 || absorbing_ > 0 || r_.forward_done_ || current_graph_task() != task_) return run();
    const c10::FunctionSchema& schema = op.schema();
    const auto args = torch::jit::last(*stack, schema.arguments().size());
    if (!r_.kept_storages_.empty() && write_to_kept(op, run, args)) return;
    if (!askable(schema)) return run();

    const std::vector<at::Tensor> inputs = tensors_of(args);
    const int64_t index = static_cast<int64_t>(r_.calls_.size());
    r_.calls_.push_back(Call{schema.name(), schema.overload_name()});
    r_.calls_.back().call = call_name(schema, r_.counts_);
    const RngState before = rng_now();
    const size_t captured_from = r_.captured_.size();
    Open open(r_, index);
    run();
    Call& call = r_.calls_[static_cast<size_t>(index)];
    call.end = static_cast<int64_t>(r_.calls_.size());

    WatchPause pause;
    const std::vector<at::Tensor> outputs = tensors_of(torch::jit::last(*stack, schema.returns().size()));
    const CheckpointPolicy answer =
        r_.policy_.decide(OpCall{call.name, call.overload, inputs, outputs, call.call});
    if (!keeps(answer)) return;
    TORCH_CHECK(!to_host(answer) || r_.offloading_, "remat::checkpoint: policy '", r_.policy_.name(),
                "' answered ", to_string(answer), " for ", call.name,
                ", and no remat::Offload is open around the checkpoint to send its outputs to the host");
    // This call keeps the work of the calls inside it: they are not kept on their own, and what was released
    // inside it (a product written in place) needs no word.
    for (int64_t j = index + 1; j < call.end; ++j) {
      const int64_t k = r_.calls_[static_cast<size_t>(j)].kept;
      if (k >= 0) release(k);
    }
    auto& pending = r_.pending_warnings_;
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](const auto& w) { return w.first > index && w.first < call.end; }),
                  pending.end());
    KeptCall kept = make_kept_call(call.name, inputs, outputs, captured_since(captured_from));
    if (!before.empty() && !before.matches_current()) {
      kept.rng_after = RngState::capture(r_.cuda_devices_);
      kept.rng_after.hold_as_bytes();  // held to the recompute: not among the device's tensors
    }
    call.kept = static_cast<int64_t>(r_.kept_.size());
    for (const auto& o : kept.outputs)
      if (const void* s = storage_key(o)) r_.kept_storages_[s] = call.kept;
    r_.kept_.push_back(std::move(kept));
    r_.kept_call_.push_back(index);
    r_.must_stay_.push_back(answer == CheckpointPolicy::kMustSave);
  }

 private:
  // Marks an asked call (or a write made part of one) as running: what autograd saves now is its.
  struct Open {
    Open(OpPolicyRecord& r, int64_t index) : r(r) { r.open_.push_back(index); }
    ~Open() {
      r.open_.pop_back();
      if (!r.open_.empty()) return;
      r.captured_.clear();
      for (const auto& w : r.pending_warnings_)
        warn_once(w.second);
      r.pending_warnings_.clear();
    }
    OpPolicyRecord& r;
  };

  RngState rng_now() const {
    if (!r_.preserve_rng_) return RngState();
    WatchPause pause;
    return RngState::capture(r_.cuda_devices_);
  }

  std::vector<at::Tensor> captured_since(size_t from) const {
    return std::vector<at::Tensor>(r_.captured_.begin() + static_cast<std::ptrdiff_t>(from),
                                   r_.captured_.end());
  }

  // An operator about to write a kept output in place (nn::Linear's bias added to its kept product). When it
  // writes only the outputs of one kept call and returns what it writes, it is made part of that call: it
  // runs now, and the recompute hands the outputs back as they are after it and skips it. Otherwise the kept
  // call cannot be handed back (its outputs would not be what the forward pass used after the call): it is
  // recomputed instead, with a warning. True when the write was run here.
  bool write_to_kept(const c10::OperatorHandle& op, const std::function<void()>& run,
                     c10::ArrayRef<c10::IValue> args) {
    const c10::FunctionSchema& schema = op.schema();
    std::vector<int64_t> owners;
    bool writes_other = false;
    for (size_t i : written_arguments(schema)) {
      for_each_tensor(args[i], [&](const at::Tensor& t) {
        const auto it = r_.kept_storages_.find(storage_key(t));
        if (it == r_.kept_storages_.end()) {
          writes_other = true;
        } else if (std::find(owners.begin(), owners.end(), it->second) == owners.end()) {
          owners.push_back(it->second);
        }
      });
    }
    if (owners.empty()) return false;
    // The kept call saved for its backward an output this writes (sigmoid's): its saved values would be the
    // written ones, where plain autograd raises. Not absorbed: recomputed, it gives the values saved, or
    // autograd's error when the recompute runs past the write.
    const bool writes_saved = owners.size() == 1 && saves_written_output(owners.front(), args, schema);
    if (owners.size() == 1 && !writes_other && !writes_saved && returned_arguments(schema)) {
      absorb(schema, run, owners.front(), args);
      return true;
    }
    for (int64_t k : owners) {
      std::string message =
          "remat::checkpoint: policy '" + r_.policy_.name() + "' kept the output of " +
          r_.kept_[static_cast<size_t>(k)].tag + ", which " + schema.name() +
          (writes_saved ? " then writes in place although the call saved it for its backward pass"
                        : " then writes in place together with other tensors") +
          "; that call is recomputed instead";
      release(k);
      if (r_.open_.empty()) {
        warn_once(message);
      } else {  // unless an enclosing call is kept whole
        r_.pending_warnings_.emplace_back(r_.kept_call_[static_cast<size_t>(k)], std::move(message));
      }
    }
    return false;
  }

  // Whether kept call k saved one of its outputs that this call writes.
  bool saves_written_output(int64_t k, c10::ArrayRef<c10::IValue> args,
                            const c10::FunctionSchema& schema) const {
    const KeptCall& kept = r_.kept_[static_cast<size_t>(k)];
    bool found = false;
    for (size_t i : written_arguments(schema)) {
      for_each_tensor(args[i], [&](const at::Tensor& t) {
        for (const auto& sv : kept.saved) {
          if (sv.output >= 0 &&
              storage_key(kept.outputs.at(static_cast<size_t>(sv.output))) == storage_key(t))
            found = true;
        }
      });
    }
    return found;
  }

  void absorb(const c10::FunctionSchema& schema, const std::function<void()>& run, int64_t owner,
              c10::ArrayRef<c10::IValue> args) {
    const std::vector<at::Tensor> inputs = tensors_of(args);
    std::vector<at::Tensor> written;  // `args` lives on the stack, which run() changes
    for (size_t i : written_arguments(schema))
      for_each_tensor(args[i], [&](const at::Tensor& t) { written.push_back(t); });
    const int64_t index = static_cast<int64_t>(r_.calls_.size());
    Call write{schema.name(), schema.overload_name()};
    write.owner = r_.kept_call_[static_cast<size_t>(owner)];
    r_.calls_.push_back(std::move(write));
    const RngState before = rng_now();
    const size_t captured_from = r_.captured_.size();
    {
      Open open(r_, index);
      const Nested nested(absorbing_);
      run();
      r_.calls_[static_cast<size_t>(index)].end = static_cast<int64_t>(r_.calls_.size());
      WatchPause pause;
      KeptCall kept = make_kept_call(schema.name(), inputs, {}, captured_since(captured_from));
      if (!before.empty() && !before.matches_current()) {
        kept.rng_after = RngState::capture(r_.cuda_devices_);
        kept.rng_after.hold_as_bytes();
      }
      r_.calls_[static_cast<size_t>(index)].kept = static_cast<int64_t>(r_.kept_.size());
      r_.absorbed_[owner].push_back(static_cast<int64_t>(r_.kept_.size()));
      r_.kept_.push_back(std::move(kept));
      r_.kept_call_.push_back(index);
      // Part of its owner: it goes where the owner's outputs go.
      r_.must_stay_.push_back(r_.must_stay_[static_cast<size_t>(owner)]);
    }
    // The owner's outputs are handed back as they are now: at their new version, and requiring grad when the
    // write made them (a constant's product with a trained bias added in place).
    KeptCall& o = r_.kept_[static_cast<size_t>(owner)];
    for (size_t i = 0; i < o.outputs.size(); ++i) {
      o.output_versions[i] = version_of(o.outputs[i]);
      for (const at::Tensor& w : written)
        if (w.requires_grad() && storage_key(w) == storage_key(o.outputs[i]))
          o.output_requires_grad[i] = true;
    }
  }

  void release(int64_t k) {
    KeptCall& kept = r_.kept_[static_cast<size_t>(k)];
    for (const auto& o : kept.outputs) {
      const auto it = r_.kept_storages_.find(storage_key(o));
      if (it != r_.kept_storages_.end() && it->second == k) r_.kept_storages_.erase(it);
    }
    kept.release();
    const auto it = r_.absorbed_.find(k);
    if (it == r_.absorbed_.end()) return;
    for (int64_t w : it->second)
      r_.kept_[static_cast<size_t>(w)].release();
    r_.absorbed_.erase(it);
  }

  OpPolicyRecord& r_;
  const void* task_;
  int absorbing_ = 0;
};

// ------------------------------------------------------------------------------------------------------------
// The recompute

class OpPolicyRecord::Replay final : public OpInterceptor {
 public:
  Replay(OpPolicyRecord& r, std::function<void(const at::Tensor&)> save)
      : r_(r), save_(std::move(save)), task_(current_graph_task()) {}

  void call(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& run,
            int /*depth*/) override {
    if (!r_.forward_done_ || r_.paused_ > 0 || writing_ > 0 || current_graph_task() != task_) return run();
    const c10::FunctionSchema& schema = op.schema();
    if (askable(schema)) return asked(schema, stack, run);
    if (cursor_ < static_cast<int64_t>(r_.calls_.size()) &&
        r_.calls_[static_cast<size_t>(cursor_)].owner >= 0 &&
        r_.calls_[static_cast<size_t>(cursor_)].name == schema.name() && writes_owner(schema, stack))
      return write(schema, stack, run);
    run();
  }

 private:
  std::string who(const std::string& name) const {
    return "remat::checkpoint: policy '" + r_.policy_.name() + "' kept " + name;
  }

  void asked(const c10::FunctionSchema& schema, torch::jit::Stack* stack, const std::function<void()>& run) {
    const int64_t index = cursor_++;
    const int64_t num_calls = static_cast<int64_t>(r_.calls_.size());
    TORCH_CHECK(index < num_calls && r_.calls_[static_cast<size_t>(index)].name == schema.name(),
                "remat::checkpoint: operator call ", index, " of the recompute is ", schema.name(),
                ", but was ",
                index < num_calls ? r_.calls_[static_cast<size_t>(index)].name : std::string("none"),
                " in the forward pass (policy '", r_.policy_.name(),
                "'); fn must do the same work each time it runs");
    const Call& call = r_.calls_[static_cast<size_t>(index)];
    const size_t num_args = schema.arguments().size();
    if (call.kept < 0 || !r_.kept_[static_cast<size_t>(call.kept)].held()) {
      run();
      note_outputs(schema, stack, index);
      TORCH_CHECK(cursor_ == call.end, "remat::checkpoint: ", call.name, " made ", cursor_ - index - 1,
                  " operator calls in the recompute but ", call.end - index - 1,
                  " in the forward pass (policy '", r_.policy_.name(),
                  "'); fn must do the same work each time it runs");
      return;
    }
    KeptCall& kept = r_.kept_[static_cast<size_t>(call.kept)];
    std::vector<at::Tensor> outputs;
    {
      WatchPause pause;
      const std::vector<at::Tensor> inputs = tensors_of(torch::jit::last(*stack, num_args));
      TORCH_CHECK(inputs.size() == kept.num_inputs, "remat::checkpoint: ", call.name, " has ", inputs.size(),
                  " tensor inputs in the recompute but had ", kept.num_inputs,
                  " in the forward pass (policy '", r_.policy_.name(),
                  "'); fn must do the same work each time it runs");
      // The call drew random numbers in the forward pass: move the generators on as it did, before what it
      // saved is handed back (a recompute that stops early at its last save checks where they stand there).
      if (!kept.rng_after.empty()) kept.rng_after.restore();
      outputs =
          hand_back(kept, inputs, save_, who(call.name),
                    "remat::checkpoint: fn takes a gradient through the output of " + call.name +
                        ", which policy '" + r_.policy_.name() +
                        "' kept, while the region is recomputed; the call is not run again there, so it has "
                        "no graph. Use a policy that recomputes it for this region");
    }
    torch::jit::drop(*stack, num_args);
    for (auto& o : outputs)
      torch::jit::push(*stack, std::move(o));
    note_outputs(schema, stack, index);
    handed_back_.push_back(index);
    cursor_ = call.end;
    note_handed_back();
  }

  // The storages the asked call `index` returned in this recompute, so that a write the forward pass made
  // part of it is recognised.
  void note_outputs(const c10::FunctionSchema& schema, torch::jit::Stack* stack, int64_t index) {
    for (const c10::IValue& v : torch::jit::last(*stack, schema.returns().size()))
      for_each_tensor(v, [&](const at::Tensor& t) {
        // The first call that returned a storage made it: a call inside it is noted first, and an enclosing
        // call that returns a view of it (matmul of mm's product) returns it too. The weak reference keeps a
        // freed storage's address from being reused by a new one during the recompute.
        if (const void* s = storage_key(t))
          produced_.emplace(s, Producer{index, t.storage().getWeakStorageImpl()});
      });
  }

  bool writes_owner(const c10::FunctionSchema& schema, torch::jit::Stack* stack) const {
    const int64_t owner = r_.calls_[static_cast<size_t>(cursor_)].owner;
    const auto args = torch::jit::last(*stack, schema.arguments().size());
    const int64_t owner_end = r_.calls_[static_cast<size_t>(owner)].end;
    bool all = true, any = false;
    for (size_t i : written_arguments(schema)) {
      for_each_tensor(args[i], [&](const at::Tensor& t) {
        // The owner or a call inside it made the storage (aten::add returns what its inner call made).
        const auto it = produced_.find(storage_key(t));
        const bool mine = it != produced_.end() && it->second.index >= owner && it->second.index < owner_end;
        all = all && mine;
        any = any || mine;
      });
    }
    return any && all;
  }

  // A write the forward pass made part of a kept call: skipped when that call was handed back (its outputs
  // are as they were after the write), run when the call ran again.
  void write(const c10::FunctionSchema& schema, torch::jit::Stack* stack, const std::function<void()>& run) {
    const int64_t index = cursor_++;
    const Call& call = r_.calls_[static_cast<size_t>(index)];
    const bool owner_back =
        std::find(handed_back_.begin(), handed_back_.end(), call.owner) != handed_back_.end();
    if (!owner_back || call.kept < 0) {
      // Run as in the forward pass, where the calls inside the write (autograd's copy of what it overwrites)
      // were not asked.
      const Nested nested(writing_);
      run();
      cursor_ = call.end;
      return;
    }
    const size_t num_args = schema.arguments().size();
    const std::vector<size_t> returned = *returned_arguments(schema);
    std::vector<c10::IValue> results;
    {
      WatchPause pause;
      const auto args = torch::jit::last(*stack, num_args);
      for (size_t i : returned)
        results.push_back(args[i]);
      KeptCall& kept = r_.kept_[static_cast<size_t>(call.kept)];
      if (!kept.rng_after.empty()) kept.rng_after.restore();
      hand_back(kept, tensors_of(args), save_, who(call.name), "");
    }
    torch::jit::drop(*stack, num_args);
    for (auto& v : results)
      torch::jit::push(*stack, std::move(v));
    cursor_ = call.end;
    note_handed_back();
  }

  OpPolicyRecord& r_;
  std::function<void(const at::Tensor&)> save_;
  const void* task_;
  int64_t cursor_ = 0;
  int writing_ = 0;  // inside a write made part of a kept call that ran again: its calls are not asked
  struct Producer {
    int64_t index;                                      // the asked call
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // holds the address
  };
  std::unordered_map<const void*, Producer> produced_;  // a storage -> the asked call that returned it
  std::vector<int64_t> handed_back_;                    // asked calls handed back in this recompute
};

// ------------------------------------------------------------------------------------------------------------

OpPolicyRecord::OpPolicyRecord(Policy policy, bool preserve_rng, std::vector<c10::DeviceIndex> cuda_devices,
                               bool offloading)
    : policy_(std::move(policy)),
      preserve_rng_(preserve_rng),
      cuda_devices_(std::move(cuda_devices)),
      offloading_(offloading) {}

OpPolicyRecord::~OpPolicyRecord() = default;

OpInterceptor* OpPolicyRecord::forward_interceptor() {
  if (!forward_) forward_ = std::make_unique<Forward>(*this);
  return forward_.get();
}

void OpPolicyRecord::saved(const at::Tensor& t) {
  if (!open_.empty() && paused_ == 0) captured_.push_back(t);
}

void OpPolicyRecord::forward_done(HookSource* sink) {
  forward_done_ = true;
  calls_.shrink_to_fit();
  if (sink == nullptr) return;
  for (size_t k = 0; k < kept_.size(); ++k)
    if (!must_stay_[k]) send_away(kept_[k], *sink);
  kept_storages_.clear();  // read by the forward pass only
}

std::unique_ptr<OpInterceptor> OpPolicyRecord::recompute_interceptor(
    std::function<void(const at::Tensor&)> save) {
  return std::make_unique<Replay>(*this, std::move(save));
}

OpPolicyRecord::Pause::Pause(OpPolicyRecord* record) : record_(record) {
  if (record_) ++record_->paused_;
}

OpPolicyRecord::Pause::~Pause() {
  if (record_) --record_->paused_;
}

int64_t OpPolicyRecord::kept_calls() const {
  int64_t n = 0;
  for (const auto& k : kept_)
    n += k.held();
  return n;
}

}  // namespace remat::detail
