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

#include "detail/checkpoint_modes.h"
#include "detail/compat.h"
#include "detail/hooks.h"
#include "detail/region.h"

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
  Collector(std::vector<at::Tensor>& out, int64_t limit, bool strict, bool stop,
            const std::vector<TensorMeta>* expected, Replay replay = nullptr)
      : out_(out),
        limit_(limit),
        strict_(strict),
        stop_(stop),
        expected_(expected),
        replay_(std::move(replay)) {}

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
      // As autograd would save it: a tensor that does not require grad is kept as is (a custom Function gets
      // the very tensor it saved back), one that does is detached (unpacking re-attaches its grad_fn).
      saved = t.requires_grad() ? t.detach() : t;
      Collector* c = collector;
      collector = nullptr;  // the collector dies with the recompute; only pack may touch it
      if (c->store(saved)) throw StopRecompute{};
    }
    at::Tensor call_unpack_hook() override { return saved; }
    Collector* collector;
    at::Tensor saved;
  };

  // Stores t; true when the recompute should stop now.
  bool store(const at::Tensor& t) {
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
    out_.push_back(t);
    return stop_ && count_ == limit_;
  }

  std::vector<at::Tensor>& out_;
  int64_t limit_;
  bool strict_;
  bool stop_;
  const std::vector<TensorMeta>* expected_;
  Replay replay_;
  int64_t count_ = 0;
};

// The grad_fn of a kept output handed back by a recompute: the call did not run, so there is no graph to
// differentiate; running it throws c10::Error with `msg`.
struct NoGraph final : torch::autograd::Node {
  NoGraph(std::string msg, torch::autograd::edge_list&& next) : Node(std::move(next)), msg(std::move(msg)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*grads*/) override {
    TORCH_CHECK(false, msg);
  }
  std::string msg;
};

// One remat::keep call of a checkpoint's forward pass whose outputs are kept: the outputs, and how to give
// back in the recompute each tensor autograd saved inside the call.
struct KeptCall {
  struct Saved {
    // A view of input `input` (>= 0) or of output `output` (>= 0) with these sizes, strides and storage
    // offset relative to it; otherwise `held` itself.
    int64_t input = -1, output = -1;
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
    at::Tensor held;
  };
  std::string tag;
  size_t num_inputs = 0;
  std::vector<at::Tensor> outputs;  // detached; empty once released
  std::vector<bool> output_requires_grad;
  std::vector<int64_t> output_versions;
  std::vector<Saved> saved;
};

int64_t version_of(const at::Tensor& t) {
  return t.is_inference() ? 0 : static_cast<int64_t>(t._version());
}

KeptCall::Saved recipe_of(const at::Tensor& t, const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& outputs) {
  KeptCall::Saved s;
  auto alias = [&](const std::vector<at::Tensor>& of, int64_t& index) {
    if (!t.has_storage()) return false;
    for (size_t i = 0; i < of.size(); ++i) {
      if (of[i].has_storage() && t.is_alias_of(of[i]) && !t.is_sparse()) {
        index = static_cast<int64_t>(i);
        s.sizes = t.sizes().vec();
        s.strides = t.strides().vec();
        s.offset = t.storage_offset() - of[i].storage_offset();
        return true;
      }
    }
    return false;
  };
  if (!alias(outputs, s.output) && !alias(inputs, s.input)) s.held = t.detach();
  return s;
}

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
    // The inputs are saved as autograd saves tensors, so that an enclosing checkpoint drops them too.
    inputs_.reserve(inputs.size());
    for (const auto& x : inputs)
      inputs_.emplace_back(x.detach(), /*is_output=*/false);
    if (options.preserve_rng_state()) rng_.begin(cuda_devices_);
  }

  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override {
    return std::make_unique<Hooks>(shared_from_this());
  }

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
      outputs = fn(inputs);
      for (size_t i = 0; i < outputs.size(); ++i)
        TORCH_CHECK(outputs[i].defined(), "remat::keep('", tag, "'): fn returned an undefined tensor at ", i);
      for (size_t i = 0; i < inputs.size(); ++i)
        TORCH_CHECK(version_of(inputs[i]) == versions[i], "remat::keep('", tag, "'): fn modified input ", i,
                    " in place; a kept call must leave its inputs as they were");
      TORCH_CHECK(before.empty() || before.matches_current(), "remat::keep('", tag,
                  "'): fn drew random numbers; a kept call must be deterministic (keep dropout outside it)");
      KeptCall call;
      call.tag = tag;
      call.num_inputs = inputs.size();
      for (const auto& t : captured_)
        call.saved.push_back(recipe_of(t, inputs, outputs));
      for (const auto& o : outputs) {
        call.outputs.push_back(o.detach());
        call.output_requires_grad.push_back(o.requires_grad());
        call.output_versions.push_back(version_of(o));
      }
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
    if (!forward_done_ || k >= kept_.size() || kept_[k].outputs.empty()) return fn(inputs);
    KeptCall& call = kept_[k];
    TORCH_CHECK(call.tag == tag && call.num_inputs == inputs.size(), "remat::keep: call ", k,
                " of the recompute is '", tag, "' with ", inputs.size(), " inputs, but was '", call.tag,
                "' with ", call.num_inputs,
                " in the forward pass; fn must do the same work each time it runs");
    for (size_t o = 0; o < call.outputs.size(); ++o)
      TORCH_CHECK(version_of(call.outputs[o]) == call.output_versions[o], "remat::keep('", tag, "'): output ",
                  o, " was modified in place after the call; a kept output must not be written to");
    {
      at::NoGradGuard no_grad;
      for (const auto& sv : call.saved) {
        if (sv.held.defined()) {
          collector.save(sv.held);
          continue;
        }
        // Detached: a view of the recompute's own tensor would hold its graph (and through it every leaf the
        // graph reaches, such as a kept output only read by a copy) for as long as backward holds the view.
        const at::Tensor base = (sv.input >= 0 ? inputs[sv.input] : call.outputs[sv.output]).detach();
        TORCH_CHECK(base.has_storage(), "remat::keep('", tag, "'): input ", sv.input,
                    " has no storage in the recompute");
        collector.save(base.as_strided(sv.sizes, sv.strides, base.storage_offset() + sv.offset));
      }
    }
    // Outputs that required grad get a grad_fn that holds nothing, so that the operations after the call
    // record their graph and save what they save. Not requires_grad_() on a leaf: its gradient accumulator
    // would hold the output until the recompute's graph dies (a projection that only feeds a copy, kept
    // through the rest of the layer's recompute). The recompute's graph is not run, unless fn takes a
    // gradient in it, and one through a kept output is an error (the call did not run to record its graph).
    std::vector<at::Tensor> outputs;
    decltype(compat::make_node<NoGraph>(std::string(), torch::autograd::edge_list())) no_graph;
    for (size_t o = 0; o < call.outputs.size(); ++o) {
      at::Tensor out = call.outputs[o].detach();
      if (call.output_requires_grad[o]) {
        // Edges to the call's inputs, so that a gradient towards them reaches this node and its message.
        if (!no_graph) {
          no_graph = compat::make_node<NoGraph>(
              "remat::keep('" + tag +
                  "'): fn takes a gradient through a kept call's output while the region is recomputed; the "
                  "call is not run again there, so it has no graph. Leave this tag out of "
                  "CheckpointOptions::keep for this region",
              torch::autograd::collect_next_edges(inputs));
        }
        const uint32_t nr = no_graph->add_input_metadata(out);
        torch::autograd::impl::set_gradient_edge(out, torch::autograd::Edge(no_graph, nr));
      }
      outputs.push_back(std::move(out));
    }
    // The frame lets go of them here: an output the recompute only reads (a projection the next operation
    // copies) is freed as soon as the recompute is done with it. A later recompute (retain_graph) runs the
    // call again.
    call.outputs.clear(), call.saved.clear();
    return outputs;
  }

  std::vector<at::Tensor> run_forward(const std::vector<at::Tensor>& inputs) {
    std::vector<at::Tensor> outputs;
    {
      // fn throwing leaves the RNG and the modules' buffers as they were.
      RngRollback rng(rng_.start);
      BufferRestore buffers(modules_, /*only_on_unwind=*/true);
      HookScope scope(this);
      outputs = fn_(inputs);
    }
    rng_.finish(cuda_devices_);
    if (rng_.empty()) rng_last_save_ = RngState();
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    forward_done_ = true;
    // What a gradient taken inside fn had recomputed is not kept until the backward pass.
    recomputed_.clear();
    return outputs;
  }

 private:
  struct Hooks final : torch::autograd::SavedVariableHooks {
    explicit Hooks(std::shared_ptr<Frame> f) : frame(std::move(f)) {}
    void call_pack_hook(const at::Tensor& t) override { index = frame->pack(t); }
    at::Tensor call_unpack_hook() override { return frame->unpack(index); }
    std::shared_ptr<Frame> frame;
    int64_t index = -1;
  };

  bool keeps(const std::string& tag) const {
    return std::find(keep_tags_.begin(), keep_tags_.end(), tag) != keep_tags_.end();
  }

  int64_t pack(const at::Tensor& t) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (capturing_) captured_.push_back(t);
    if (check_) metas_.push_back(TensorMeta::of(t));
    // Where the generators stand at each save: a recompute that stops early at the last one checks that it
    // drew the same numbers up to there.
    if (early_stop_ && !rng_.empty() && !forward_done_) rng_last_save_ = RngState::capture(cuda_devices_);
    return num_saved_++;
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
    return std::move(recomputed_[index]);
  }

  void recompute() {
    std::vector<at::Tensor> saved;
    saved.reserve(inputs_.size());
    for (const auto& sv : inputs_)
      saved.push_back(sv.unpack());
    std::vector<at::Tensor> args = detached_inputs(saved, requires_grad_);
    std::vector<at::Tensor> collected;
    collected.reserve(num_saved_);
    const int64_t limit = num_saved_;
    {
      // Early stopping only once the forward pass is complete: a recompute for a gradient fn takes of its own
      // intermediate results runs fn up to where it is now.
      replayed_ = 0;
      Collector::Replay replay;
      if (!kept_.empty()) {
        replay = [this](const std::string& tag, const KeepFn& fn, const std::vector<at::Tensor>& in,
                        Collector& c) { return this->replay(tag, fn, in, c); };
      }
      Collector collector(collected, limit, /*strict=*/forward_done_, /*stop=*/forward_done_ && early_stop_,
                          check_ ? &metas_ : nullptr, std::move(replay));
      RecomputeScope recompute(rng_.start, cuda_devices_, modules_, args, autocast_);
      HookScope scope(&collector);
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
  std::recursive_mutex mutex_;
};

}  // namespace

std::vector<at::Tensor> run_non_reentrant(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                          const CheckpointOptions& options) {
  require_engine("remat::checkpoint");
  auto frame = std::make_shared<Frame>(fn, inputs, options);
  return frame->run_forward(inputs);
}

}  // namespace remat::detail
