#include "remat/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "detail/compat.h"
#include "detail/hooks.h"
#include "detail/nesting.h"
#include "detail/region.h"

namespace remat {
namespace detail {

// ------------------------------------------------------------------------------------------------------------
// RNG, buffers, metadata

namespace {
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
// The last CPU state captured on this thread, held weakly (it must not keep bytes alive for the meter).
thread_local std::optional<WeakImpl> last_cpu_state;

at::Tensor capture_cpu_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  // A chain of checkpoints with no random draw between them shares one state tensor (HeavyChain's 1000
  // checkpoints keep 5 KB, not 5 MB, alive for the backward pass).
  if (last_cpu_state) {
    auto strong = last_cpu_state->lock();
    if (strong) {
      at::Tensor previous(std::move(strong));
      if (previous.nbytes() == state.nbytes() &&
          std::memcmp(previous.data_ptr(), state.data_ptr(), state.nbytes()) == 0) {
        return previous;
      }
    }
  }
  last_cpu_state = WeakImpl(state.getIntrusivePtr());
  return state;
}

// Generators are shared handles: a copy locks and sets the same generator.
void set_generator_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}
}  // namespace

RngState RngState::capture(const std::vector<c10::DeviceIndex>& cuda_devices) {
  RngState s;
  s.cpu = capture_cpu_state();
  for (c10::DeviceIndex index : cuda_devices) {
    at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, index));
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cuda.emplace_back(index, gen.get_state());
  }
  return s;
}

void RngState::restore() const {
  if (cpu.defined()) set_generator_state(at::detail::getDefaultCPUGenerator(), cpu);
  for (const auto& [index, state] : cuda) {
    set_generator_state(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, index)), state);
  }
}

std::vector<c10::DeviceIndex> cuda_devices_of(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::DeviceIndex> devices;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda() &&
        std::find(devices.begin(), devices.end(), t.device().index()) == devices.end()) {
      devices.push_back(t.device().index());
    }
  }
  return devices;
}

namespace {
bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}
at::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
}  // namespace

bool RngState::matches_current() const {
  if (cpu.defined() && !same_bytes(cpu, generator_state(at::detail::getDefaultCPUGenerator()))) return false;
  for (const auto& [index, state] : cuda) {
    if (!same_bytes(state,
                    generator_state(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, index)))))
      return false;
  }
  return true;
}

bool RngState::same_as(const RngState& other) const {
  if (cpu.defined() != other.cpu.defined() || cuda.size() != other.cuda.size()) return false;
  if (cpu.defined() && !cpu.is_same(other.cpu) && !same_bytes(cpu, other.cpu)) return false;
  for (size_t k = 0; k < cuda.size(); ++k) {
    if (cuda[k].first != other.cuda[k].first || !same_bytes(cuda[k].second, other.cuda[k].second))
      return false;
  }
  return true;
}

void check_rng_replayed(const RngState& end, const char* who, const std::string& what) {
  TORCH_CHECK(end.empty() || end.matches_current(), who, ": ", what,
              " drew other random numbers in its recompute than in the forward pass (the generator ended "
              "in another state), so its dropout masks would differ and its gradients would be wrong. "
              "Another thread drew from the same default generator while this region ran forward or was "
              "recomputed, or the region draws a varying amount. Keep other threads from drawing while "
              "checkpointed regions run, or set CheckpointOptions().preserve_rng_state(false) to accept "
              "fresh masks (README: Threads).");
}

RngRollback::RngRollback(const RngState& start) : start_(start), uncaught_(std::uncaught_exceptions()) {}
RngRollback::~RngRollback() {
  if (std::uncaught_exceptions() > uncaught_ && !start_.empty()) start_.restore();
}

RngReplay::RngReplay(const RngState& replay, const std::vector<c10::DeviceIndex>& cuda_devices) {
  if (replay.empty()) return;
  saved_ = RngState::capture(cuda_devices);
  replay.restore();
}

RngReplay::~RngReplay() {
  if (!saved_.empty()) saved_.restore();
}

AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu_enabled = compat::autocast_enabled(c10::DeviceType::CPU);
  s.cuda_enabled = compat::autocast_enabled(c10::DeviceType::CUDA);
  s.cpu_dtype = compat::autocast_dtype(c10::DeviceType::CPU);
  s.cuda_dtype = compat::autocast_dtype(c10::DeviceType::CUDA);
  s.cache_enabled = at::autocast::is_autocast_cache_enabled();
  return s;
}

namespace {
void apply_autocast(const AutocastState& s) {
  compat::set_autocast_enabled(c10::DeviceType::CPU, s.cpu_enabled);
  compat::set_autocast_enabled(c10::DeviceType::CUDA, s.cuda_enabled);
  compat::set_autocast_dtype(c10::DeviceType::CPU, s.cpu_dtype);
  compat::set_autocast_dtype(c10::DeviceType::CUDA, s.cuda_dtype);
  at::autocast::set_autocast_cache_enabled(s.cache_enabled);
}
}  // namespace

AutocastScope::AutocastScope(const AutocastState& state) : saved_(AutocastState::current()) {
  apply_autocast(state);
  if (state.any()) {
    at::autocast::increment_nesting();
    nested_ = true;
  }
}

AutocastScope::~AutocastScope() {
  // Like leaving torch.autocast: the cast cache lives as long as the outermost autocast region.
  if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  apply_autocast(saved_);
}

BufferRestore::BufferRestore(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                             bool only_on_unwind)
    : only_on_unwind_(only_on_unwind), uncaught_(std::uncaught_exceptions()) {
  if (modules.empty()) return;
  at::NoGradGuard no_grad;
  std::unordered_set<c10::TensorImpl*> seen;
  for (const auto& m : modules) {
    if (!m) continue;
    for (const auto& b : m->buffers(/*recurse=*/true)) {
      if (b.defined() && seen.insert(b.unsafeGetTensorImpl()).second) saved_.emplace_back(b, b.clone());
    }
  }
}

BufferRestore::~BufferRestore() {
  if (saved_.empty()) return;
  if (only_on_unwind_ && std::uncaught_exceptions() <= uncaught_) return;
  at::NoGradGuard no_grad;
  for (auto& [buffer, copy] : saved_)
    buffer.variable_data().copy_(copy);
}

TensorMeta TensorMeta::of(const at::Tensor& t) {
  TensorMeta m;
  m.sizes = t.sizes().vec();
  m.dtype = t.scalar_type();
  m.device = t.device();
  return m;
}

std::string TensorMeta::str() const {
  std::ostringstream os;
  os << c10::toString(dtype) << c10::IntArrayRef(sizes) << " on " << device;
  return os.str();
}

// ------------------------------------------------------------------------------------------------------------
// Input and output checks

namespace {

void check_inputs(const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(!inputs.empty(), "remat::checkpoint: inputs is empty; pass at least one tensor");
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), "remat::checkpoint: input ", i, " of ", inputs.size(),
                " is an undefined tensor");
  }
}

void check_outputs(const std::vector<at::Tensor>& outputs) {
  TORCH_CHECK(!outputs.empty(), "remat::checkpoint: fn returned no tensor; it must return at least one");
  for (size_t i = 0; i < outputs.size(); ++i) {
    TORCH_CHECK(outputs[i].defined(), "remat::checkpoint: fn returned an undefined tensor as output ", i,
                " of ", outputs.size());
  }
}

std::vector<bool> requires_grad_flags(const std::vector<at::Tensor>& tensors) {
  std::vector<bool> flags;
  flags.reserve(tensors.size());
  for (const auto& t : tensors)
    flags.push_back(t.requires_grad());
  return flags;
}

// Detached copies of `saved` that require grad where the originals did: what a recompute runs on.
std::vector<at::Tensor> detached_inputs(const std::vector<at::Tensor>& saved,
                                        const std::vector<bool>& flags) {
  std::vector<at::Tensor> out;
  out.reserve(saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    at::Tensor x = saved[i].detach();
    if (flags[i]) x.requires_grad_(true);
    out.push_back(std::move(x));
  }
  return out;
}

// The saved inputs as a recompute under create_graph runs on them: a view of each input that requires grad,
// so that the recomputed graph leads back to the real input and each use of an input is its own target.
std::vector<at::Tensor> attached_inputs(const std::vector<at::Tensor>& saved,
                                        const std::vector<bool>& flags) {
  std::vector<at::Tensor> out;
  out.reserve(saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    if (flags[i] && saved[i].requires_grad()) {
      out.push_back(saved[i].view_as(saved[i]));
    } else {
      out.push_back(flags[i] ? saved[i].detach().requires_grad_(true) : saved[i].detach());
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------------------
// kNonReentrant: saved-tensor hooks

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

void check_keep_inputs(const std::vector<at::Tensor>& inputs) {
  for (size_t i = 0; i < inputs.size(); ++i)
    TORCH_CHECK(inputs[i].defined(), "remat::keep: input ", i, " is an undefined tensor");
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
    if (options.preserve_rng_state()) rng_ = RngState::capture(cuda_devices_);
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
      RngRollback rng(rng_);
      BufferRestore buffers(modules_, /*only_on_unwind=*/true);
      HookScope scope(this);
      outputs = fn_(inputs);
    }
    if (!rng_.empty()) {
      rng_end_ = RngState::capture(cuda_devices_);
      // A region that drew nothing needs no replay: its recompute leaves the generators alone.
      if (rng_end_.same_as(rng_)) rng_ = rng_end_ = rng_last_save_ = RngState();
    }
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
      RngReplay rng(rng_, cuda_devices_);
      StateRestore state(modules_, args);
      AutocastScope autocast(autocast_);
      HookScope scope(&collector);
      at::AutoGradMode grad(true);
      try {
        bool stopped = false;
        try {
          fn_(args);
        } catch (const StopRecompute&) {
          stopped = true;  // every tensor backward needs is back: the rest of fn is not run again
        }
        if (forward_done_) {
          check_rng_replayed(stopped ? rng_last_save_ : rng_end_, "remat::checkpoint",
                             "a checkpointed region");
        }
      } catch (c10::Error& e) {
        e.add_context("remat::checkpoint: while recomputing a checkpointed region in the backward pass");
        throw;
      }
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
  RngState rng_, rng_end_;  // the generators at the start and at the end of the forward pass
  RngState rng_last_save_;  // and at its last save (with early stopping)
  std::vector<TensorMeta> metas_;
  int64_t num_saved_ = 0;
  bool forward_done_ = false;
  std::vector<at::Tensor> recomputed_;
  std::recursive_mutex mutex_;
};

std::vector<at::Tensor> run_non_reentrant(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                          const CheckpointOptions& options) {
  require_engine("remat::checkpoint");
  auto frame = std::make_shared<Frame>(fn, inputs, options);
  return frame->run_forward(inputs);
}

// ------------------------------------------------------------------------------------------------------------
// kReentrant: a custom autograd Function

struct ReentrantState final : torch::CustomClassHolder {
  TensorsFn fn;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  std::vector<at::Tensor> params;  // declared parameters that require grad, in the node's input order
  std::vector<bool> requires_grad;
  std::vector<c10::DeviceIndex> cuda_devices;
  bool check = true;
  RngState rng, rng_end;  // the generators at the start and at the end of the forward pass
  AutocastState autocast;
  std::vector<TensorMeta> output_metas;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                at::TensorList params,
                                                c10::intrusive_ptr<ReentrantState> st) {
    (void)params;  // inputs of the node so that the engine routes their gradients; fn uses them itself
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    std::vector<at::Tensor> outputs;
    try {
      // fn throwing leaves the RNG and the modules' buffers as they were.
      RngRollback rng(st->rng);
      BufferRestore buffers(st->modules, /*only_on_unwind=*/true);
      outputs = st->fn(in);
    } catch (const c10::Error& e) {
      // What torch::autograd::grad says when fn differentiates its own results, which have no graph here.
      const std::string what = e.what_without_backtrace();
      if (what.find("does not require grad and does not have a grad_fn") == std::string::npos) throw;
      TORCH_CHECK(false,
                  "remat::checkpoint: fn takes a gradient of its own results (torch::autograd::grad or "
                  "backward inside fn), which CheckpointMode::kReentrant cannot support: it runs fn under "
                  "NoGradGuard in the forward pass, as PyTorch's use_reentrant=True does. Use "
                  "CheckpointMode::kNonReentrant for such a region. (",
                  what, ")");
    }
    check_outputs(outputs);
    if (!st->rng.empty()) {
      st->rng_end = RngState::capture(st->cuda_devices);
      // A region that drew nothing needs no replay: its recompute leaves the generators alone.
      if (st->rng_end.same_as(st->rng)) st->rng = st->rng_end = RngState();
    }
    if (st->check) {
      for (const auto& o : outputs)
        st->output_metas.push_back(TensorMeta::of(o));
    }
    std::vector<at::Tensor> non_differentiable;
    for (const auto& o : outputs) {
      if (!at::isFloatingType(o.scalar_type()) && !at::isComplexType(o.scalar_type())) {
        non_differentiable.push_back(o);
      }
    }
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward(in);
    ctx->saved_data["state"] = c10::IValue::make_capsule(st);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto st = c10::static_intrusive_pointer_cast<ReentrantState>(ctx->saved_data["state"].toCapsule());
    detail::NestedBackward nested;  // the recompute's own backward pass runs inside this node
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    // Under create_graph (double backward) the recompute is attached to the saved inputs (through a view per
    // input, so that an input passed twice gets each use's gradient once), and the gradients it returns are
    // differentiable with respect to the real inputs; otherwise it runs on detached copies.
    const bool create_graph = at::GradMode::is_enabled();
    std::vector<at::Tensor> args =
        create_graph ? attached_inputs(saved, st->requires_grad) : detached_inputs(saved, st->requires_grad);

    const uint64_t first_sequence_nr = at::sequence_number::peek();
    std::vector<at::Tensor> outputs;
    {
      RngReplay rng(st->rng, st->cuda_devices);
      StateRestore state(st->modules, args);
      AutocastScope autocast(st->autocast);
      at::AutoGradMode grad(true);
      try {
        outputs = st->fn(args);
        check_rng_replayed(st->rng_end, "remat::checkpoint", "a checkpointed region");
      } catch (c10::Error& e) {
        e.add_context("remat::checkpoint: while recomputing a checkpointed region in the backward pass");
        throw;
      }
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "remat::checkpoint: the recompute returned ",
                outputs.size(), " outputs but the forward pass returned ", grad_outputs.size());
    if (st->check) {
      for (size_t i = 0; i < outputs.size(); ++i) {
        const TensorMeta now = TensorMeta::of(outputs[i]);
        TORCH_CHECK(
            now == st->output_metas[i], "remat::checkpoint: determinism check failed: output ", i, " is ",
            now.str(), " in the recompute but was ", st->output_metas[i].str(),
            " in the forward pass (set CheckpointOptions().determinism_check(false) to skip this check)");
      }
    }

    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }

    // What the node returns gradients for: its inputs, then the declared parameters (its TensorList inputs).
    const size_t n_inputs = args.size();
    const std::vector<at::Tensor>& params = st->params;
    torch::autograd::variable_list result(n_inputs + params.size() + 1);
    if (roots.empty()) return result;

    std::vector<at::Tensor> targets;
    std::vector<size_t> slot;  // where each target's gradient goes in `result`
    std::unordered_set<c10::TensorImpl*> declared;
    for (size_t i = 0; i < n_inputs; ++i) {
      declared.insert(args[i].unsafeGetTensorImpl());
      if (args[i].requires_grad() && ctx->needs_input_grad(i)) {
        targets.push_back(args[i]);
        slot.push_back(i);
      }
    }
    for (size_t j = 0; j < params.size(); ++j) {
      declared.insert(params[j].unsafeGetTensorImpl());
      if (ctx->needs_input_grad(n_inputs + j)) {
        targets.push_back(params[j]);
        slot.push_back(n_inputs + j);
      }
    }
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    const bool accumulating = exec_info == nullptr || exec_info->empty();
    // Leaves fn uses without declaring them: trained under backward() (as PyTorch's reentrant checkpoint
    // does); under torch::autograd::grad they cannot be returned, so asking for one is reported.
    std::vector<Leaf> extra = undeclared_leaves(roots, declared, first_sequence_nr);
    if (!accumulating) {
      warn_undeclared_asked(extra,
                            "remat::checkpoint: torch::autograd::grad was asked for a tensor "
                            "that a kReentrant region cannot give a gradient to",
                            "Add their modules to CheckpointOptions().modules({...}), checkpoint the module "
                            "itself, or use CheckpointMode::kNonReentrant.");
      extra.clear();
    }

    if (accumulating && !create_graph) {
      // Under backward(): accumulate into .grad through the parameters' own AccumulateGrad nodes, as each
      // gradient is computed (the region's parameter gradients are never all alive at once); the inputs'
      // gradients are returned.
      for (const Leaf& leaf : extra)
        targets.push_back(leaf.variable);
      if (targets.empty()) return result;
      torch::autograd::backward(roots, root_grads, /*retain_graph=*/false, /*create_graph=*/false, targets);
      for (size_t k = 0; k < slot.size(); ++k) {
        if (slot[k] < n_inputs) result[slot[k]] = targets[k].grad();
      }
      return result;
    }
    // Under torch::autograd::grad, or with create_graph: every gradient is returned through the node (so the
    // engine accumulates parameters as it does without checkpointing); undeclared leaves are accumulated
    // here.
    const size_t n_targets = targets.size();
    for (const Leaf& leaf : extra)
      targets.push_back(leaf.variable);
    if (targets.empty()) return result;
    // Second-order gradients may run through the recomputed graph again: keep it when building one.
    std::vector<at::Tensor> grads = torch::autograd::grad(roots, targets, root_grads,
                                                          /*retain_graph=*/create_graph, create_graph,
                                                          /*allow_unused=*/true);
    for (size_t k = 0; k < n_targets; ++k)
      result[slot[k]] = grads[k];
    for (size_t k = n_targets; k < targets.size(); ++k) {
      if (!grads[k].defined()) continue;
      at::Tensor& g = targets[k].mutable_grad();
      g = g.defined() ? g + grads[k] : grads[k];
    }
    return result;
  }

  // Parameters of the modules that require grad, each once, in a stable order.
  static std::vector<at::Tensor> declared_params(
      const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
    std::vector<at::Tensor> params;
    std::unordered_set<c10::TensorImpl*> seen;
    for (const auto& m : modules) {
      if (!m) continue;
      for (const auto& p : m->parameters(/*recurse=*/true)) {
        if (p.defined() && p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second)
          params.push_back(p);
      }
    }
    return params;
  }
};

std::vector<at::Tensor> run_reentrant(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                      const CheckpointOptions& options) {
  auto st = c10::make_intrusive<ReentrantState>();
  st->fn = fn;
  st->modules = options.modules();
  st->requires_grad = requires_grad_flags(inputs);
  st->cuda_devices = cuda_devices_of(inputs);
  st->check = options.determinism_check();
  st->params = CheckpointFunction::declared_params(st->modules);
  const bool any_input =
      std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.requires_grad(); });
  TORCH_CHECK(
      any_input || !st->params.empty(),
      "remat::checkpoint: kReentrant mode with no input that requires grad and no parameter that does in "
      "options.modules (",
      options.modules().size(),
      " modules): the weights fn uses would never be "
      "trained (PyTorch's reentrant checkpoint silently freezes them). Checkpoint the module itself, list "
      "the modules in CheckpointOptions().modules({...}), or use CheckpointMode::kNonReentrant");
  if (options.preserve_rng_state()) st->rng = RngState::capture(st->cuda_devices);
  st->autocast = AutocastState::current();
  return CheckpointFunction::apply(at::TensorList(inputs), at::TensorList(st->params), st);
}

}  // namespace

// ------------------------------------------------------------------------------------------------------------
// Entry points

std::vector<at::Tensor> checkpoint_tensors(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                           const CheckpointOptions& options) {
  TORCH_CHECK(static_cast<bool>(fn), "remat::checkpoint: fn is empty (a default-constructed std::function)");
  check_inputs(inputs);
  std::vector<at::Tensor> outputs;
  if (!at::GradMode::is_enabled()) {
    outputs = fn(inputs);
  } else if (options.mode() == CheckpointMode::kReentrant) {
    TORCH_CHECK(options.keep().empty(), "remat::checkpoint: CheckpointOptions::keep (", options.keep().size(),
                " tag", options.keep().size() == 1 ? "" : "s", ", the first '", options.keep()[0],
                "') needs CheckpointMode::kNonReentrant; kReentrant recomputes its region whole");
    outputs = run_reentrant(fn, inputs, options);
  } else {
    outputs = run_non_reentrant(fn, inputs, options);
  }
  check_outputs(outputs);
  return outputs;
}

at::Tensor checkpoint_tensor(const TensorFn& fn, const at::Tensor& input, const CheckpointOptions& options) {
  TORCH_CHECK(static_cast<bool>(fn), "remat::checkpoint: fn is empty (a default-constructed std::function)");
  TensorsFn wrapped = [fn](const std::vector<at::Tensor>& xs) { return std::vector<at::Tensor>{fn(xs[0])}; };
  return checkpoint_tensors(wrapped, {input}, options)[0];
}

}  // namespace detail

std::vector<at::Tensor> keep(const std::string& tag, const TensorsFn& fn,
                             const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(static_cast<bool>(fn), "remat::keep('", tag,
              "'): fn is empty (a default-constructed std::function)");
  detail::check_keep_inputs(inputs);
  detail::HookSource* source = detail::current_hook_source();
  if (source == nullptr || !at::GradMode::is_enabled()) return fn(inputs);
  return source->keep(tag, fn, inputs);
}

at::Tensor keep(const std::string& tag, const TensorFn& fn, const at::Tensor& input) {
  TORCH_CHECK(static_cast<bool>(fn), "remat::keep('", tag,
              "'): fn is empty (a default-constructed std::function)");
  TensorsFn wrapped = [&fn](const std::vector<at::Tensor>& xs) { return std::vector<at::Tensor>{fn(xs[0])}; };
  auto outputs = keep(tag, wrapped, {input});
  TORCH_CHECK(outputs.size() == 1, "remat::keep('", tag, "'): expected one output, got ", outputs.size());
  return outputs[0];
}

namespace detail {

// Leaves that the recomputed graph reaches and that the checkpoint did not declare: parameters fn uses from
// modules missing in options.modules. Only nodes created by the recompute are followed, so the walk stays
// inside the region.
std::vector<Leaf> undeclared_leaves(const std::vector<at::Tensor>& outputs,
                                    const std::unordered_set<c10::TensorImpl*>& declared,
                                    uint64_t first_sequence_nr) {
  std::vector<Leaf> leaves;
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const auto& o : outputs) {
    if (auto* fn = o.grad_fn().get(); fn != nullptr && seen.insert(fn).second) stack.push_back(fn);
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const at::Tensor& v = acc->variable;
      if (v.defined() && v.requires_grad() && !declared.count(v.unsafeGetTensorImpl()))
        leaves.push_back({v, acc});
      continue;
    }
    if (node->sequence_nr() < first_sequence_nr) continue;
    for (const auto& edge : node->next_edges()) {
      if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
    }
  }
  return leaves;
}

// Under torch::autograd::grad, an undeclared parameter the caller asked for gets no gradient: say so, once
// per message and shape. A parameter is taken as asked for when its gradient
// accumulator is captured, or when the caller asked for a tensor that had no autograd node at the time
// (the engine then captures an Identity placeholder: a parameter used only inside kReentrant regions,
// whose forward pass builds no graph, is such a tensor).
void warn_undeclared_asked(const std::vector<Leaf>& leaves, const char* what, const char* advice) {
  const auto* info_map = torch::autograd::get_current_graph_task_exec_info();
  if (leaves.empty() || info_map == nullptr) return;
  const auto& exec_info = *info_map;
  bool unreachable_asked = false;
  for (const auto& [node, info] : exec_info) {
    if (info.captures_ && dynamic_cast<torch::autograd::Identity*>(node) != nullptr) unreachable_asked = true;
  }
  static std::mutex mutex;
  static std::unordered_set<std::string> warned;
  std::string shapes;
  for (const Leaf& leaf : leaves) {
    auto it = exec_info.find(leaf.accumulator);
    const bool asked = it != exec_info.end() && it->second.captures_;
    if (!asked && !unreachable_asked) continue;
    std::ostringstream shape;
    shape << leaf.variable.sizes();
    std::lock_guard<std::mutex> lock(mutex);
    if (warned.insert(std::string(what) + shape.str()).second)
      shapes += (shapes.empty() ? "" : ", ") + shape.str();
  }
  if (shapes.empty()) return;
  TORCH_WARN(what, ": the region uses parameters it does not declare (shapes ", shapes,
             "), and those get no gradient through it under torch::autograd::grad. ", advice);
}

}  // namespace detail
}  // namespace remat
