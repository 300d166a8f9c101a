// kNonReentrant checkpointing: saved-tensor hooks drop what autograd saves inside the region (a Frame), and
// the first unpack in the backward pass recomputes the region (a Collector gathers what it saves again),
// stopping as soon as every tensor the backward pass needs is back. remat::keep calls listed in
// CheckpointOptions::keep keep their outputs from the forward pass and are handed back in the recompute.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/non_reentrant.h"

#include "autograd/engine.h"
#include "autograd/hooks.h"
#include "autograd/saved.h"
#include "autograd/watch.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/kept.h"
#include "checkpoint/region.h"
#include "detail/compat.h"
#include "policy/op_policy.h"

namespace remat::detail {
namespace {

// Saved-tensor hooks of a recompute: store what autograd saves, in order, and hand the tensor back if the
// recompute's own graph is used (fn calls torch::autograd::grad inside). That graph is thrown away with the
// recompute, and with it the hooks.
// Thrown from a pack hook to end a recompute once every tensor backward needs is back (early stopping);
// caught by the recompute. Not a std::exception, so that fn's own handlers for errors do not take it.
struct StopRecompute {};

class Collector final : public HookSource {
 public:
  // Stores the first `limit` saved tensors (a recompute started before the forward pass finished sees more
  // than the forward pass has saved so far: those beyond `limit` are not kept). `strict`: more than `limit`
  // is an error. `expected`: their metadata in the forward pass, checked when non-null. `stop`: throw
  // StopRecompute as soon as `limit` tensors are stored (and again at any later save, should fn catch it).
  // `replay`: answers remat::keep calls of the recompute (the frame's kept outputs); null runs them.
  using Replay = std::function<std::vector<at::Tensor>(const std::string&, const KeepFn&,
                                                       const std::vector<at::Tensor>&, Collector&)>;
  // `let_go`: per slot, whether autograd has let go of what the forward pass saved there (non-zero): the
  // recompute's tensor for it is not kept (nothing will ask for it).
  Collector(std::vector<at::Tensor>& out, std::vector<SavedAs>& out_as, int64_t limit, bool strict, bool stop,
            const std::vector<TensorMeta>* expected, Replay replay = nullptr,
            const std::vector<char>* let_go = nullptr)
      : out_(out),
        out_as_(out_as),
        limit_(limit),
        strict_(strict),
        stop_(stop),
        expected_(expected),
        replay_(std::move(replay)),
        let_go_(let_go) {}

  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override {
    return std::make_unique<Hooks>(this);
  }

  std::vector<at::Tensor> keep(const std::string& tag, const KeepFn& fn,
                               const std::vector<at::Tensor>& inputs) override {
    return replay_ ? replay_(tag, fn, inputs, *this) : fn(inputs);
  }

  // Saves t as autograd would have inside a call the recompute skips (may throw StopRecompute).
  void save(const at::Tensor& t) { make_hooks()->call_pack_hook(t); }

 private:
  struct Hooks final : torch::autograd::SavedVariableHooks {
    explicit Hooks(Collector* c) : collector(c) {}
    void call_pack_hook(const at::Tensor& t) override {
      WatchPause pause;  // the collector's own tensor work is not the region's
      // As autograd would save it: a tensor that does not require grad is kept as is (a custom Function gets
      // the very tensor it saved back), one that does is detached (unpacking re-attaches its grad_fn).
      saved = t.requires_grad() ? t.detach() : t;
      as = SavedAs::of(t);
      Collector* c = collector;
      collector = nullptr;  // the collector dies with the recompute; only pack may touch it
      if (c->store(saved, as)) throw StopRecompute{};
    }
    at::Tensor call_unpack_hook() override {
      as.check_unmodified(saved, "remat::checkpoint's recompute");
      return saved;
    }
    Collector* collector;
    at::Tensor saved;
    SavedAs as;
  };

  // Stores t; true when the recompute should stop now.
  bool store(const at::Tensor& t, const SavedAs& as) {
    const int64_t i = count_++;
    if (i >= limit_) {
      if (stop_) return true;
      TORCH_CHECK(!strict_, "remat::checkpoint: the recompute saved more tensors for backward than ",
                  "the forward pass (", limit_, "); fn must do the same work each time it runs");
      return false;
    }
    if (expected_ != nullptr) {
      const TensorMeta now = TensorMeta::of(t);
      TORCH_CHECK(
          now == (*expected_)[i], "remat::checkpoint: determinism check failed: saved tensor ", i, " is ",
          now.str(), " in the recompute but was ", (*expected_)[i].str(),
          " in the forward pass (set CheckpointOptions().determinism_check(false) to skip this check)");
    }
    // A slot whose forward save autograd let go of (a branch whose graph the forward pass dropped: a router's
    // scores read only by a top-k) is never asked for: keeping the recompute's tensor would hold it until the
    // region's backward is done, where the plain run and torch.utils.checkpoint hold none.
    const bool gone = let_go_ != nullptr && static_cast<size_t>(i) < let_go_->size() && (*let_go_)[i] != 0;
    out_.push_back(gone ? at::Tensor() : t);
    out_as_.push_back(as);
    return stop_ && count_ == limit_;
  }

  std::vector<at::Tensor>& out_;
  std::vector<SavedAs>& out_as_;
  int64_t limit_;
  bool strict_;
  bool stop_;
  const std::vector<TensorMeta>* expected_;
  Replay replay_;
  const std::vector<char>* let_go_;
  int64_t count_ = 0;
};

class Frame final : public HookSource, public std::enable_shared_from_this<Frame> {
 public:
  Frame(TensorsFn fn, const std::vector<at::Tensor>& inputs, const CheckpointOptions& options)
      : fn_(std::move(fn)),
        requires_grad_(requires_grad_flags(inputs)),
        modules_(options.modules()),
        cuda_devices_(cuda_devices_of(inputs)),
        check_(options.determinism_check()),
        early_stop_(options.early_stop()),
        keep_tags_(options.keep()),
        autocast_(AutocastState::current()) {
    // Where what the region keeps goes once its forward pass is done (an enclosing Offload's hooks), if
    // anywhere: found now, before the region's own hooks are the innermost.
    if (HookSource* outer = current_hook_source()) sink_ = outer->kept_sink();
    // The inputs are saved as autograd saves tensors, so that an enclosing checkpoint drops them too.
    inputs_.reserve(inputs.size());
    for (const auto& x : inputs)
      inputs_.emplace_back(x.detach(), /*is_output=*/false);
    if (options.preserve_rng_state()) rng_.begin(cuda_devices_);
    if (!options.policy().empty())
      op_policy_ =
          std::make_unique<OpPolicyRecord>(options.policy(), options.preserve_rng_state(), cuda_devices_,
                                           /*offloading=*/sink_ != nullptr);
  }

  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override {
    return std::make_unique<Hooks>(shared_from_this());
  }
  // A region nested in this one's forward pass sends what it keeps where this one does.
  HookSource* kept_sink() override { return forward_done_ ? nullptr : sink_; }

  // remat::keep in the forward pass: run fn, keep its outputs and learn how to give back what autograd saved
  // inside it.
  std::vector<at::Tensor> keep(const std::string& tag, const KeepFn& fn,
                               const std::vector<at::Tensor>& inputs) override {
    if (!keeps(tag) || capturing_ || forward_done_) return fn(inputs);
    std::vector<int64_t> versions;
    for (const auto& x : inputs)
      versions.push_back(version_of(x));
    const RngState before = rng_.empty() ? RngState() : RngState::capture(cuda_devices_);
    std::vector<at::Tensor> outputs;
    {
      capturing_ = true;
      struct Reset {
        Frame* f;
        ~Reset() {
          f->capturing_ = false;
          f->captured_.clear();
        }
      } reset{this};
      OpPolicyRecord::Pause pause(op_policy_.get());  // the call's operators belong to the kept call
      outputs = fn(inputs);
      for (size_t i = 0; i < outputs.size(); ++i)
        TORCH_CHECK(outputs[i].defined(), "remat::keep('", tag, "'): fn returned an undefined tensor at ", i);
      for (size_t i = 0; i < inputs.size(); ++i)
        TORCH_CHECK(version_of(inputs[i]) == versions[i], "remat::keep('", tag, "'): fn modified input ", i,
                    " in place; a kept call must leave its inputs as they were");
      TORCH_CHECK(before.empty() || before.matches_current(), "remat::keep('", tag,
                  "'): fn drew random numbers; a kept call must be deterministic (keep dropout outside it)");
      KeptCall call = make_kept_call(tag, inputs, outputs, captured_);
      std::lock_guard<std::recursive_mutex> lock(mutex_);
      kept_.push_back(std::move(call));
    }
    return outputs;
  }

  // remat::keep in a recompute: hand back the kept outputs and what autograd saved inside the call, without
  // running fn; fn runs when the forward pass did not keep this call or its outputs were released.
  std::vector<at::Tensor> replay(const std::string& tag, const KeepFn& fn,
                                 const std::vector<at::Tensor>& inputs, Collector& collector) {
    if (!keeps(tag)) return fn(inputs);
    const size_t k = replayed_++;
    // A recompute during the forward pass (fn takes a gradient of its own results) runs the calls: a gradient
    // through a kept call must reach its inputs.
    if (!forward_done_ || k >= kept_.size() || !kept_[k].held()) {
      OpPolicyRecord::Pause pause(op_policy_.get());  // as in the forward pass, where the call was kept
      return fn(inputs);
    }
    KeptCall& call = kept_[k];
    TORCH_CHECK(call.tag == tag && call.num_inputs == inputs.size(), "remat::keep: call ", k,
                " of the recompute is '", tag, "' with ", inputs.size(), " inputs, but was '", call.tag,
                "' with ", call.num_inputs,
                " in the forward pass; fn must do the same work each time it runs");
    return hand_back(
        call, inputs, [&collector](const at::Tensor& t) { collector.save(t); }, "remat::keep('" + tag + "')",
        "remat::keep('" + tag +
            "'): fn takes a gradient through a kept call's output while the region is recomputed; the call "
            "is "
            "not run again there, so it has no graph. Leave this tag out of CheckpointOptions::keep for this "
            "region");
  }

  std::vector<at::Tensor> run_forward(const std::vector<at::Tensor>& inputs) {
    std::vector<at::Tensor> outputs;
    {
      // fn throwing leaves the RNG and the modules' buffers as they were.
      RngRollback rng(rng_.start);
      BufferRestore buffers(modules_, /*only_on_unwind=*/true);
      // What fn writes in place and reads, copied before the write: its recompute reads what it read.
      ForwardWrites writes(inputs);
      HookScope scope(this);
      const auto intercept = intercept_scope(op_policy_ ? op_policy_->forward_interceptor() : nullptr);
      outputs = fn_(inputs);
      forward_writes_ = writes.take();
    }
    if (op_policy_) op_policy_->forward_done(sink_);
    rng_.finish(cuda_devices_);
    if (rng_.empty()) rng_last_save_ = RngState();
    // The states at the end and at the last save are only compared with (check_rng_replayed): kept as
    // digests, so that the region holds one CPU generator state, its start, to its backward, as the step's
    // model charges it. Before (found 2026-12-05), three on a CPU device where its forward drew between its
    // saves: a C++ BertModel plan of two group assignments held 15,172 bytes above its prediction.
    rng_.end.digest();
    rng_last_save_.digest();
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    forward_done_ = true;
    if (sink_ != nullptr) {
      for (KeptCall& k : kept_)
        send_away(k, *sink_);
    }
    sink_ = nullptr;  // the sink's scope may end once the forward pass has returned
    // What a gradient taken inside fn had recomputed is not kept until the backward pass.
    recomputed_.clear();
    return outputs;
  }

 private:
  struct Hooks final : torch::autograd::SavedVariableHooks {
    explicit Hooks(std::shared_ptr<Frame> f) : frame(std::move(f)) {}
    Hooks(const Hooks&) = delete;
    Hooks& operator=(const Hooks&) = delete;
    // Autograd lets go of the saved tensor (its node ran backward and released it, or the graph holding it
    // was dropped): the slot is not asked for again.
    ~Hooks() override {
      if (index >= 0) frame->let_go(index);
    }
    void call_pack_hook(const at::Tensor& t) override {
      WatchPause pause;  // the frame's own tensor work is not the region's
      index = frame->pack(t);
    }
    at::Tensor call_unpack_hook() override { return frame->unpack(index); }
    std::shared_ptr<Frame> frame;
    int64_t index = -1;
  };

  // The operators fn calls are this region's: its policy's interceptor sees them, or, without a policy, none
  // of an enclosing region's does (kept calls belong to the innermost checkpoint). Nothing is installed when
  // neither applies.
  static std::unique_ptr<InterceptScope> intercept_scope(OpInterceptor* interceptor) {
    if (interceptor == nullptr && !intercepting()) return nullptr;
    return std::make_unique<InterceptScope>(interceptor, "remat::checkpoint");
  }

  bool keeps(const std::string& tag) const {
    return std::find(keep_tags_.begin(), keep_tags_.end(), tag) != keep_tags_.end();
  }

  int64_t pack(const at::Tensor& t) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (capturing_) captured_.push_back(t);
    if (op_policy_) op_policy_->saved(t);
    if (check_) metas_.push_back(TensorMeta::of(t));
    // Where the generators stand at each save: a recompute that stops early at the last one checks that it
    // drew the same numbers up to there.
    if (early_stop_ && !rng_.empty() && !forward_done_) rng_last_save_ = RngState::capture(cuda_devices_);
    let_go_.push_back(0);
    return num_saved_++;
  }

  // Slot `index`'s saved tensor was let go of by autograd: a recompute keeps no tensor for it, and one it
  // made already is dropped. Never throws (called from a destructor).
  void let_go(int64_t index) noexcept {
    try {
      at::Tensor dropped;  // released after the lock, should its storage's deleter take locks of its own
      std::lock_guard<std::recursive_mutex> lock(mutex_);
      const auto i = static_cast<size_t>(index);
      if (i < let_go_.size()) let_go_[i] = 1;
      if (i < recomputed_.size()) dropped = std::move(recomputed_[i]);
    } catch (...) {  // std::system_error from the mutex: the slot is kept (memory held, nothing wrong)
    }
  }

  // Each recomputed tensor is handed out once and then dropped, so memory goes as backward consumes it. A
  // slot asked for again (a second backward with retain_graph, or a partial one) triggers a fresh recompute,
  // which gives the same values. A slot asked for while fn is still running (fn takes a gradient of its own
  // intermediate results) is recomputed too: fn is run again up to where it is now.
  at::Tensor unpack(int64_t index) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(index >= 0 && index < num_saved_, "remat::checkpoint: bad saved-tensor index ",
                          index);
    if (index >= static_cast<int64_t>(recomputed_.size()) || !recomputed_[index].defined()) recompute();
    // Written in place after it was saved (by the recompute itself, when it runs past the write: early
    // stopping off): autograd's error, as the plain run gives, never a gradient of the values written.
    recomputed_as_[index].check_unmodified(recomputed_[index], "remat::checkpoint's recompute");
    return std::move(recomputed_[index]);
  }

  void recompute() {
    std::vector<at::Tensor> saved;
    saved.reserve(inputs_.size());
    for (const auto& sv : inputs_)
      saved.push_back(sv.unpack());
    std::vector<at::Tensor> args = detached_inputs(saved, requires_grad_);
    std::vector<at::Tensor> collected;
    std::vector<SavedAs> collected_as;
    collected.reserve(num_saved_);
    const int64_t limit = num_saved_;
    {
      // Early stopping only once the forward pass is complete: a recompute for a gradient fn takes of its own
      // intermediate results runs fn up to where it is now.
      replayed_ = 0;
      Collector::Replay replay;
      // Also once the kept calls have served (a second recompute, retain_graph): replay() then runs them,
      // paused for the region's policy as in the forward pass, where the region kept them.
      if (!keep_tags_.empty()) {
        replay = [this](const std::string& tag, const KeepFn& fn, const std::vector<at::Tensor>& in,
                        Collector& c) { return this->replay(tag, fn, in, c); };
      }
      Collector collector(collected, collected_as, limit, /*strict=*/forward_done_,
                          /*stop=*/forward_done_ && early_stop_, check_ ? &metas_ : nullptr,
                          std::move(replay), &let_go_);
      RecomputeScope recompute(rng_.start, cuda_devices_, modules_, args, autocast_, &forward_writes_);
      HookScope scope(&collector);
      std::unique_ptr<OpInterceptor> replay_ops;
      if (op_policy_)
        replay_ops =
            op_policy_->recompute_interceptor([&collector](const at::Tensor& t) { collector.save(t); });
      const auto intercept = intercept_scope(replay_ops.get());
      at::AutoGradMode grad(true);
      with_recompute_context([&] {
        bool stopped = false;
        try {
          fn_(args);
        } catch (const StopRecompute&) {
          stopped = true;  // every tensor backward needs is back: the rest of fn is not run again
        }
        if (forward_done_) {
          check_rng_replayed(stopped ? rng_last_save_ : rng_.end, "remat::checkpoint",
                             "a checkpointed region");
        }
      });
    }
    TORCH_CHECK(static_cast<int64_t>(collected.size()) == limit, "remat::checkpoint: the recompute saved ",
                collected.size(), " tensors for backward but the forward pass saved ", limit,
                "; fn must do the same work each time it runs");
    recomputed_ = std::move(collected);
    recomputed_as_ = std::move(collected_as);
    // The kept outputs have served: a later recompute of this region (retain_graph) runs the calls again.
    if (forward_done_) kept_.clear();
  }

  TensorsFn fn_;
  std::vector<torch::autograd::SavedVariable> inputs_;
  std::vector<bool> requires_grad_;
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  std::vector<c10::DeviceIndex> cuda_devices_;
  bool check_;
  bool early_stop_;
  std::vector<std::string> keep_tags_;
  std::vector<KeptCall> kept_;        // the forward pass's kept calls, in order
  size_t replayed_ = 0;               // kept calls the running recompute has reached
  bool capturing_ = false;            // inside a kept call of the forward pass
  std::vector<at::Tensor> captured_;  // what autograd saved inside it, until the call returns
  AutocastState autocast_;
  RngRecord rng_;           // the generators at the start and at the end of the forward pass
  RngState rng_last_save_;  // and at its last save (with early stopping)
  std::vector<TensorMeta> metas_;
  int64_t num_saved_ = 0;
  bool forward_done_ = false;
  std::vector<at::Tensor> recomputed_;
  std::vector<SavedAs> recomputed_as_;         // what each was when saved
  std::vector<char> let_go_;                   // per slot: autograd has let go of its saved tensor
  std::vector<ForwardWrite> forward_writes_;   // what the forward pass wrote and read, as it found it
  std::unique_ptr<OpPolicyRecord> op_policy_;  // CheckpointOptions::policy's record, when there is one
  HookSource* sink_ = nullptr;                 // see kept_sink(); only during the forward pass
  std::recursive_mutex mutex_;
};

}  // namespace

std::vector<at::Tensor> run_non_reentrant(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                          const CheckpointOptions& options) {
  require_engine("remat::checkpoint");
  // Autocast's cache off for the forward pass and, recorded in its autocast state, the recompute
  // (AutocastCacheOff): the region's casts go with what saves them.
  const AutocastCacheOff cache_off;
  auto frame = std::make_shared<Frame>(fn, inputs, options);
  return frame->run_forward(inputs);
}

}  // namespace remat::detail
