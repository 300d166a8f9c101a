// The profiler's measuring of a stage's saved groups (planning/saved_groups.h).

#include "planning/saved_groups.h"

#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "autograd/hooks.h"
#include "autograd/watch.h"
#include "offload/offload.h"
#include "policy/op_policy.h"
#include "remat/measure.h"
#include "remat/memory.h"

namespace remat::detail {
namespace {

int64_t storage_bytes(const at::Tensor& t) {
  return static_cast<int64_t>(t.storage().nbytes());
}

// The storages of `alive` and of `also`: what no group's outputs may be (alive anyway, or the pass's own
// input or output).
std::unordered_set<const void*> storages_of(const std::vector<at::Tensor>& alive, const at::Tensor& also) {
  std::unordered_set<const void*> keys{storage_key(also)};
  for (const at::Tensor& t : alive)
    keys.insert(storage_key(t));
  return keys;
}

// One asked call of the forward pass.
struct Recorded {
  std::string name;  // "aten::linear#0"
  size_t end = 0;    // one past the last asked call made inside it
  double ms = 0;
  std::vector<at::Tensor> outputs;  // detached; dropped once the pass is read
  std::vector<uint32_t> versions;   // the outputs' versions when the call returned
  std::unordered_set<const void*> inputs;
  std::vector<at::Tensor> captured;  // what autograd saved while it ran (detached)
};

// Records the asked calls of one forward pass (as a region's policy is asked about them, OpPolicyRecord) and
// what autograd saves, each saved tensor also given to the asked calls running then.
class Recorder final : public OpInterceptor, public HookSource {
 public:
  explicit Recorder(const std::function<void()>& sync) : sync_(sync) {}

  void call(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& run,
            int /*depth*/) override {
    const c10::FunctionSchema& schema = op.schema();
    if (!askable(schema)) return run();
    const size_t index = calls_.size();
    {
      WatchPause pause;
      Recorded r;
      r.name = call_name(schema, counts_);
      for (const at::Tensor& t : tensors_of(torch::jit::last(*stack, schema.arguments().size())))
        r.inputs.insert(storage_key(t));
      calls_.push_back(std::move(r));
    }
    open_.push_back(index);
    sync_();
    const auto t0 = std::chrono::steady_clock::now();
    run();
    sync_();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    open_.pop_back();
    WatchPause pause;
    Recorded& r = calls_[index];
    r.ms = ms;
    r.end = calls_.size();
    for (const at::Tensor& t : tensors_of(torch::jit::last(*stack, schema.returns().size()))) {
      r.outputs.push_back(t.detach());
      r.versions.push_back(t._version());
    }
  }

  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override {
    return std::make_unique<Hooks>(this);
  }

  std::vector<Recorded>& calls() { return calls_; }
  const std::unordered_set<const void*>& saved() const { return saved_; }
  /// Whether a recompute that stops early, at autograd's last save of this pass, makes asked call `k` (or,
  /// for a call that encloses that save, reaches it: kept, its hand-back makes that save): a call begun
  /// before the innermost call open at that save, or one of the calls enclosing it; where no call was open,
  /// a call begun before it. The innermost open call itself is not made: the save may be of its inputs,
  /// before its work (counted out where it was of its outputs, after: a group missed, never one held in
  /// vain).
  bool reached(size_t k) const {
    if (last_open_.empty()) return static_cast<int64_t>(k) < calls_at_last_save_;
    if (k < last_open_.back()) return true;
    return std::find(last_open_.begin(), last_open_.end() - 1, k) != last_open_.end() - 1;
  }

 private:
  struct Hooks final : torch::autograd::SavedVariableHooks {
    explicit Hooks(Recorder* r) : recorder(r) {}
    void call_pack_hook(const at::Tensor& t) override {
      WatchPause pause;
      // Detached: a saved output held with its grad_fn would hold itself.
      held = t.detach();
      if (recorder == nullptr) return;
      if (const void* k = storage_key(t)) recorder->saved_.insert(k);
      recorder->calls_at_last_save_ = static_cast<int64_t>(recorder->calls_.size());
      recorder->last_open_ = recorder->open_;
      for (size_t i : recorder->open_)
        recorder->calls_[i].captured.push_back(held);
      recorder = nullptr;  // the recorder dies with the measurement; only pack may touch it
    }
    at::Tensor call_unpack_hook() override { return held; }
    Recorder* recorder;
    at::Tensor held;
  };

  const std::function<void()>& sync_;
  std::vector<Recorded> calls_;
  std::vector<size_t> open_;
  std::unordered_map<std::string, int64_t> counts_;
  std::unordered_set<const void*> saved_;
  int64_t calls_at_last_save_ = -1;
  std::vector<size_t> last_open_;  // the calls open at the last save, outermost first
};

// Reads, as each asked call of a plain forward pass begins, the pass's peak so far above the bytes alive
// before it (SavedGroup::fwd_peak_before_bytes), under the name the Recorder gives the call. It holds no
// tensor, so that the pass holds what a plain one does.
class PeaksBefore final : public OpInterceptor {
 public:
  explicit PeaksBefore(const memory::PeakWindow& window) : window_(window) {}

  void call(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/, const std::function<void()>& run,
            int /*depth*/) override {
    const c10::FunctionSchema& schema = op.schema();
    if (askable(schema)) {
      WatchPause pause;
      at_[call_name(schema, counts_)] = std::max<int64_t>(0, window_.peak_over_base());
    }
    run();
  }

  const std::unordered_map<std::string, int64_t>& at() const { return at_; }

 private:
  const memory::PeakWindow& window_;
  std::unordered_map<std::string, int64_t> counts_;
  std::unordered_map<std::string, int64_t> at_;
};

// Reads a forward pass without saving (what autograd saves dropped as it is packed, as a group assignment's
// forward holds none of it): per asked call named in `wanted`, the pass's peak above the bytes alive before
// it from when it lets go of the first of the call's outputs on `device` (not of the `off_limits` storages)
// until it has returned (SavedGroup::fwd_peak_after_bytes), read by finish(). Frees are looked for as each
// asked call begins; the peak is kept per stretch between those starts. It holds only weak references, so
// that the pass holds what one without saving does.
class PeaksAfter final : public OpInterceptor, public HookSource {
 public:
  PeaksAfter(memory::PeakWindow& window, std::unordered_set<std::string> wanted, c10::Device device,
             std::unordered_set<const void*> off_limits)
      : window_(window), wanted_(std::move(wanted)), device_(device), off_limits_(std::move(off_limits)) {}

  void call(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& run,
            int /*depth*/) override {
    const c10::FunctionSchema& schema = op.schema();
    if (!askable(schema)) return run();
    std::string name;
    {
      WatchPause pause;
      name = call_name(schema, counts_);
      settle();
    }
    run();
    if (wanted_.count(name) == 0) return;
    WatchPause pause;
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> refs;
    for (const at::Tensor& t : tensors_of(torch::jit::last(*stack, schema.returns().size()))) {
      const void* key = storage_key(t);
      if (key == nullptr || t.device() != device_ || storage_bytes(t) == 0 || off_limits_.count(key))
        continue;
      refs.push_back(t.storage().getWeakStorageImpl());
    }
    if (!refs.empty()) refs_[name] = std::move(refs);
  }

  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override {
    return std::make_unique<Drop>();
  }

  /// Once the pass has returned (its output held): each call's figure. A call whose outputs are all still
  /// alive (held by something outside the pass) is read as let go of there, less its own `bytes`, which the
  /// count there holds.
  std::unordered_map<std::string, int64_t> finish(const std::unordered_map<std::string, int64_t>& bytes) {
    settle();
    const int64_t end = std::max<int64_t>(0, window_.active_over_base());
    std::unordered_map<std::string, int64_t> out;
    for (const auto& [name, first] : freed_) {
      int64_t peak = end;
      for (size_t k = first; k < stretches_.size(); ++k)
        peak = std::max(peak, stretches_[k]);
      out[name] = peak;
    }
    for (const auto& [name, refs] : refs_) {
      const auto it = bytes.find(name);
      out[name] = std::max<int64_t>(0, end - (it == bytes.end() ? 0 : it->second));
    }
    return out;
  }

 private:
  struct Drop final : torch::autograd::SavedVariableHooks {
    void call_pack_hook(const at::Tensor& /*t*/) override {}
    at::Tensor call_unpack_hook() override { return {}; }
  };

  // Closes the stretch so far, and marks the calls whose outputs the pass has let go of (one of them) since.
  void settle() {
    stretches_.push_back(std::max<int64_t>(0, window_.peak_over_base()));
    window_.restart();
    for (auto it = refs_.begin(); it != refs_.end();) {
      const bool gone =
          std::any_of(it->second.begin(), it->second.end(), [](const auto& r) { return r.expired(); });
      if (gone) {
        freed_[it->first] = stretches_.size();
        it = refs_.erase(it);
      } else {
        ++it;
      }
    }
  }

  memory::PeakWindow& window_;
  std::unordered_set<std::string> wanted_;
  c10::Device device_;
  std::unordered_set<const void*> off_limits_;
  std::unordered_map<std::string, int64_t> counts_;
  std::vector<int64_t> stretches_;  // the peak of each stretch between asked calls' starts
  std::map<std::string, std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>> refs_;
  std::unordered_map<std::string, size_t> freed_;  // per call let go of: the first stretch after it
};

}  // namespace

std::vector<SavedGroup> measure_saved_groups(const std::function<at::Tensor(const at::Tensor&)>& fn,
                                             const at::Tensor& leaf, const std::vector<at::Tensor>& alive,
                                             int64_t offload_min_bytes, int64_t repeats,
                                             const std::function<void()>& sync) {
  std::vector<SavedGroup> found;
  std::unordered_set<std::string> with_captured;  // groups that hold what autograd saved inside their call
  std::map<std::string, std::vector<double>> times;
  for (int64_t r = 0; r < repeats; ++r) {
    Recorder recorder(sync);
    at::Tensor out;
    {
      at::AutoGradMode grad(true);
      const HookScope hooks(&recorder);
      const InterceptScope intercept(&recorder, "remat::profile_chain (saved groups)");
      out = fn(leaf);
    }
    std::vector<Recorded>& calls = recorder.calls();
    for (const Recorded& c : calls)
      times[c.name].push_back(c.ms);
    if (r > 0) continue;
    const std::unordered_set<const void*> off_limits = storages_of(alive, out);
    std::unordered_set<const void*> counted;
    size_t inside_until = 0;  // calls before this index are inside a group found
    for (size_t k = 0; k < calls.size(); ++k) {
      if (k < inside_until) continue;
      // The calls a recompute that stops early does not make: keeping one would save no time.
      if (!recorder.reached(k)) continue;
      const Recorded& c = calls[k];
      // Every call with outputs of its own is a candidate, whether or not autograd saves them (kept or sent,
      // the recompute skips it); outputs that hold no bytes on the leaf's device (a seed on the host, an
      // empty tensor) are left out.
      bool own = false, written = false;
      std::unordered_set<const void*> mine;
      // stays: of bytes, what an Offload would keep on the device, were the group sent
      // (SavedGroup::stays_bytes).
      int64_t bytes = 0, unsaved = 0, stays = 0;
      for (size_t o = 0; o < c.outputs.size(); ++o) {
        const at::Tensor& t = c.outputs[o];
        const void* key = storage_key(t);
        if (key == nullptr || t.device() != leaf.device() || storage_bytes(t) == 0) continue;
        own = true;
        if (off_limits.count(key) || c.inputs.count(key)) {
          own = false;
          break;
        }
        written = written || t._version() != c.versions[o];
        if (mine.insert(key).second) {
          bytes += storage_bytes(t);
          if (!recorder.saved().count(key)) unsaved += storage_bytes(t);
          if (offload_min_bytes >= 0 && !sendable(t, offload_min_bytes)) stays += storage_bytes(t);
        }
      }
      if (!own || written) continue;
      // What it holds besides: what autograd saved inside it, not an input's or an output's storage (those
      // are rebuilt as views), nor a tensor alive anyway.
      bool captured = false;  // of what it holds, something autograd saved inside it
      for (const at::Tensor& t : c.captured) {
        const void* key = storage_key(t);
        if (key == nullptr || off_limits.count(key) || c.inputs.count(key) || mine.count(key)) continue;
        mine.insert(key);
        captured = true;
        bytes += storage_bytes(t);
        if (offload_min_bytes >= 0 && !sendable(t, offload_min_bytes)) stays += storage_bytes(t);
      }
      bool shared = false;  // a storage another group holds already
      for (const void* key : mine)
        shared = shared || counted.count(key);
      if (shared) continue;
      counted.insert(mine.begin(), mine.end());
      if (captured) with_captured.insert(c.name);
      found.push_back(SavedGroup{c.name, bytes, 0.0, unsaved, stays});
      inside_until = c.end;
    }
  }
  for (SavedGroup& g : found)
    g.recompute_ms = median(times[g.name]);
  if (!found.empty()) {
    // One more forward, plain (its graph let go of at once), for the peak before each group's call.
    memory::PeakWindow window(leaf.device());
    PeaksBefore peaks(window);
    {
      at::AutoGradMode grad(true);
      const InterceptScope intercept(&peaks, "remat::profile_chain (saved groups)");
      (void)fn(leaf);
    }
    for (SavedGroup& g : found)
      if (const auto it = peaks.at().find(g.name); it != peaks.at().end())
        g.fwd_peak_before_bytes = it->second;
    // And one without saving, for the peak after each group's outputs are let go of. Not for a group that
    // holds what autograd saved inside its call (a composite's): that forward lets go of those within the
    // call, earlier than of its outputs (left unmeasured: the bound).
    std::unordered_set<std::string> wanted;
    std::unordered_map<std::string, int64_t> bytes;
    for (const SavedGroup& g : found) {
      if (with_captured.count(g.name)) continue;
      wanted.insert(g.name);
      bytes[g.name] = g.bytes;
    }
    if (!wanted.empty()) {
      memory::PeakWindow after_window(leaf.device());
      PeaksAfter after(after_window, wanted, leaf.device(), storages_of(alive, leaf));
      std::unordered_map<std::string, int64_t> read;
      {
        at::AutoGradMode grad(true);
        const HookScope hooks(&after);
        const InterceptScope intercept(&after, "remat::profile_chain (saved groups)");
        const at::Tensor out = fn(leaf);  // held while it is read, as the forward's end holds it
        read = after.finish(bytes);
      }
      for (SavedGroup& g : found)
        if (const auto it = read.find(g.name); it != read.end()) g.fwd_peak_after_bytes = it->second;
    }
  }
  return found;
}

}  // namespace remat::detail
