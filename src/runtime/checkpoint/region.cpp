// The region helpers of checkpoint/region.h: what both checkpoint modes and the plan executor share about
// running a region again.

#include "checkpoint/region.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_set>

#include "detail/compat.h"

namespace remat::detail {

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

void unshare_next_cpu_state() {
  last_cpu_state.reset();
}

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
  if (!cpu_bytes.empty()) {
    // A tensor over the bytes (no allocation): the generator copies from it.
    auto* data = const_cast<uint8_t*>(cpu_bytes.data());
    set_generator_state(at::detail::getDefaultCPUGenerator(),
                        at::from_blob(data, {static_cast<int64_t>(cpu_bytes.size())}, at::kByte));
  }
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

namespace {
uint64_t fnv1a(const at::Tensor& t) {
  uint64_t h = 1469598103934665603ULL;
  const auto* p = static_cast<const unsigned char*>(t.data_ptr());
  for (size_t k = 0; k < t.nbytes(); ++k)
    h = (h ^ p[k]) * 1099511628211ULL;
  return h;
}
}  // namespace

void RngState::digest() {
  if (!cpu.defined()) return;
  cpu_digest = fnv1a(cpu);
  digested = true;
  cpu = at::Tensor();
}

void RngState::hold_as_bytes() {
  if (!cpu.defined()) return;
  const auto* p = static_cast<const uint8_t*>(cpu.data_ptr());
  cpu_bytes.assign(p, p + cpu.nbytes());
  cpu = at::Tensor();
}

bool RngState::matches_current() const {
  if (!cpu_bytes.empty()) {
    const at::Tensor now = generator_state(at::detail::getDefaultCPUGenerator());
    if (now.nbytes() != cpu_bytes.size() ||
        std::memcmp(now.data_ptr(), cpu_bytes.data(), cpu_bytes.size()) != 0)
      return false;
  }
  if (digested && fnv1a(generator_state(at::detail::getDefaultCPUGenerator())) != cpu_digest) return false;
  if (cpu.defined() && !same_bytes(cpu, generator_state(at::detail::getDefaultCPUGenerator()))) return false;
  for (const auto& [index, state] : cuda) {
    if (!same_bytes(state,
                    generator_state(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, index)))))
      return false;
  }
  return true;
}

bool RngState::same_as(const RngState& other) const {
  if (cpu.defined() != other.cpu.defined() || cuda.size() != other.cuda.size() ||
      cpu_bytes != other.cpu_bytes)
    return false;
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
              "fresh masks (docs/checkpointing.md: Threads).");
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

AutocastCacheOff::AutocastCacheOff() : was_(at::autocast::is_autocast_cache_enabled()) {
  at::autocast::set_autocast_cache_enabled(false);
}

AutocastCacheOff::~AutocastCacheOff() {
  at::autocast::set_autocast_cache_enabled(was_);
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

void RngRecord::begin(const std::vector<c10::DeviceIndex>& cuda_devices) {
  start = RngState::capture(cuda_devices);
}

void RngRecord::finish(const std::vector<c10::DeviceIndex>& cuda_devices) {
  if (start.empty()) return;
  end = RngState::capture(cuda_devices);
  // A region that drew nothing needs no replay: its recompute leaves the generators alone.
  if (end.same_as(start)) start = end = RngState();
}

RecomputeScope::RecomputeScope(const RngState& replay, const std::vector<c10::DeviceIndex>& cuda_devices,
                               const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                               const std::vector<at::Tensor>& inputs, const AutocastState& autocast,
                               const std::vector<ForwardWrite>* forward_writes)
    : rng_(replay, cuda_devices),
      forward_values_(forward_writes),
      state_(modules, inputs, &forward_values_.set()),
      autocast_(autocast) {}

// ------------------------------------------------------------------------------------------------------------
// The leaves a recomputed graph reaches

// Leaves that the recomputed graph reaches and that the checkpoint did not declare: parameters fn uses from
// modules missing in options.modules. Only nodes created by the recompute are followed, so the walk stays
// inside the region.
NodeMark NodeMark::now() {
  NodeMark mark;
  mark.thread = at::RecordFunction::currentThreadId();
  mark.first_sequence_nr = at::sequence_number::peek();
  return mark;
}

NodeMark::Origin NodeMark::origin(const torch::autograd::Node& node) const {
  if (node.thread_id() != thread) return Origin::kOtherThread;
  return node.sequence_nr() >= first_sequence_nr ? Origin::kSince : Origin::kBefore;
}

namespace {
std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i)
    out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}
}  // namespace

RegionReach region_reach(const std::vector<at::Tensor>& outputs,
                         const std::unordered_set<c10::TensorImpl*>& declared, const NodeMark* mark,
                         const std::unordered_set<const torch::autograd::Node*>& stops) {
  RegionReach reach;
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  auto visit = [&](torch::autograd::Node* node, uint32_t input_nr) {
    if (node == nullptr || !seen.insert(node).second || stops.count(node)) return;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const at::Tensor& v = acc->variable;
      if (v.defined() && v.requires_grad() && !declared.count(v.unsafeGetTensorImpl()))
        reach.undeclared.push_back({v, acc});
      return;
    }
    const auto origin = mark ? mark->origin(*node) : NodeMark::Origin::kSince;
    if (origin == NodeMark::Origin::kOtherThread) return;
    if (origin == NodeMark::Origin::kBefore) {
      // A tensor computed before the region ran, used inside without being an input.
      reach.captured.push_back("shape " +
                               shape_string(compat::input_shape(node->input_metadata(input_nr), 0)) +
                               " (from " + node->name() + ")");
      return;
    }
    stack.push_back(node);
  };
  for (const auto& o : outputs)
    visit(o.grad_fn().get(), o.output_nr());
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges())
      visit(edge.function.get(), edge.input_nr);
  }
  return reach;
}

void refuse_captured(const RegionReach& reach, const char* who, const char* advice) {
  if (reach.captured.empty()) return;
  std::string list;
  for (const auto& c : reach.captured)
    list += (list.empty() ? "" : ", ") + c;
  const bool one = reach.captured.size() == 1;
  TORCH_CHECK(
      false, who, ": the region uses ", one ? "a tensor" : "tensors", " (", list, ") that ",
      one ? "requires" : "require", " grad and ", one ? "was" : "were",
      " computed outside it without being passed as ", one ? "an input" : "inputs",
      "; its gradient cannot flow back through the region's nested backward pass, and would be lost. ",
      advice);
}

// A parameter is taken as asked for when its gradient accumulator is captured by the user's pass, or when
// the user asked for a tensor that had no autograd node at the time (the engine then captures an Identity
// placeholder: a parameter used only inside kReentrant regions, whose forward pass builds no graph, is such
// a tensor).
void refuse_undeclared_asked(const std::vector<Leaf>& leaves, const UserPass& pass, const char* what,
                             const char* advice) {
  if (leaves.empty() || pass.accumulate || pass.exec_info == nullptr) return;
  const auto& exec_info = *pass.exec_info;
  bool placeholder_asked = false;
  for (const auto& [node, info] : exec_info) {
    if (info.captures_ && dynamic_cast<torch::autograd::Identity*>(node) != nullptr) placeholder_asked = true;
  }
  std::string asked;
  for (const Leaf& leaf : leaves) {
    auto it = exec_info.find(leaf.accumulator);
    if (!(it != exec_info.end() && it->second.captures_) && !placeholder_asked) continue;
    std::ostringstream shape;
    shape << leaf.variable.sizes();
    asked += (asked.empty() ? "" : ", ") + shape.str();
  }
  TORCH_CHECK(asked.empty(), what, ": the region uses tensors it does not declare (shapes ", asked, ")",
              placeholder_asked
                  ? ", and the call asked for a tensor that had no autograd graph when it began, "
                    "which may be one of them"
                  : "",
              "; under torch::autograd::grad their gradients cannot be returned through the region, and "
              "would be missing. ",
              advice);
}

// ------------------------------------------------------------------------------------------------------------
// Backward from one stage's output

namespace {
// The root of one stage's backward pass: hands the engine d_{i+1} by move, so that the engine holds it
// alone and frees it once the stage's first backward node has consumed it, as one backward pass through
// per-stage checkpoints does. (torch::autograd::backward keeps the gradient it is given alive for the whole
// call: one activation more at every stage's backward, which kept the executor above per-block
// kNonReentrant checkpointing.)
struct GradSource final : torch::autograd::Node {
  GradSource(at::Tensor grad, torch::autograd::Edge next, const at::Tensor& token) : grad_(std::move(grad)) {
    add_next_edge(std::move(next));
    add_input_metadata(token);
  }
  std::string name() const override { return "remat::StageGradient"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*token*/) override {
    return {std::move(grad_)};
  }
  at::Tensor grad_;
};

}  // namespace

// Backpropagates `grad` (taken by move) from `output` to the leaves `targets`: accumulated into their .grad
// (accumulate), or returned (undefined for a target the graph does not reach).
torch::autograd::variable_list backward_from(at::Tensor output, at::Tensor grad,
                                             const std::vector<at::Tensor>& targets, bool keep_graph,
                                             bool create_graph, bool accumulate) {
  // The root's input, which GradSource ignores: a tensor of no elements, so that it holds no bytes through
  // the backward pass it starts (a 0-dim one held 4 bytes there: found 2026-12-05, a C++ BertModel step 4
  // bytes above its prediction where a stage's backward was the peak).
  const at::Tensor token = at::empty({0}, output.options().dtype(at::kFloat).device(at::kCPU));
  auto source =
      compat::make_node<GradSource>(std::move(grad), torch::autograd::impl::gradient_edge(output), token);
  output.reset();  // the edge holds the graph; the values may go once the nodes that saved them are done
  torch::autograd::edge_list outputs;
  outputs.reserve(targets.size());
  for (const auto& t : targets) {
    auto fn = t.grad_fn() ? t.grad_fn() : torch::autograd::impl::try_get_grad_accumulator(t);
    if (fn) {
      outputs.emplace_back(std::move(fn), t.grad_fn() ? t.output_nr() : 0);
    } else {  // a leaf no node uses: nothing reaches it (LibTorch's run_backward does the same)
      outputs.emplace_back(compat::make_node<torch::autograd::Identity>(), 0);
    }
  }
  torch::autograd::edge_list roots;
  roots.emplace_back(std::move(source), 0);
  return torch::autograd::Engine::get_default_engine().execute(roots, {token}, keep_graph, create_graph,
                                                               accumulate, outputs);
}

}  // namespace remat::detail
