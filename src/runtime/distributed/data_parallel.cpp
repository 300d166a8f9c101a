// DataParallel: bucketed gradient all-reduce on a ProcessGroup, driven by hooks on the parameters' gradient
// accumulators, finished at the end of the user's outermost backward pass.
#include "remat/distributed/data_parallel.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_set>
#include <utility>

#include "autograd/nesting.h"
#include "planning/profile.h"

namespace remat::distributed {

namespace {
using Clock = std::chrono::steady_clock;
// A parameter's gradient accumulator, as this LibTorch hands it out (shared_ptr on 1.13, intrusive_ptr
// on 2.x).
using AccumulatorRef = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string describe(const std::string& name, const at::Tensor& t) {
  std::ostringstream out;
  out << name << " " << t.scalar_type() << " " << t.sizes();
  return out.str();
}
}  // namespace

struct DataParallel::State : std::enable_shared_from_this<DataParallel::State> {
  struct Param {
    at::Tensor variable;
    std::string name;
    size_t bucket = 0;
    int64_t offset = 0;  // elements into the bucket
    bool fired = false;  // has its gradient for this step
    AccumulatorRef accumulator;
    uintptr_t hook_key = 0;
  };
  struct Bucket {
    std::vector<size_t> params;
    int64_t numel = 0;
    at::ScalarType dtype = at::kFloat;
    at::Device device = at::kCPU;
    size_t pending = 0;  // parameters still without their gradient
    bool launched = false;
    at::Tensor buffer;
    std::shared_ptr<ProcessGroup::Work> work;
  };

  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<ProcessGroup> group;
  DataParallelOptions options;
  std::vector<Param> params;
  std::vector<Bucket> buckets;

  std::mutex mutex;
  bool sync = true;
  bool in_step = false;          // a synced step has started (some hook fired) and is not finished
  bool finalize_queued = false;  // its end is queued on the outermost graph task
  size_t fired = 0;
  size_t next_bucket = 0;       // buckets launch in index order, the same on every rank
  std::vector<size_t> arrival;  // parameters in the order their gradients arrived (first synced step)
  bool rebuilt = false;         // buckets follow the arrival order
  DataParallelStats stats;

  // Buckets over the parameters in `order`, each up to bucket_bytes of one dtype and device; the gradients
  // that lived in the old buckets move to the new ones.
  void assign_buckets(const std::vector<size_t>& order) {
    std::vector<at::Tensor> kept(params.size());
    for (size_t i = 0; i < params.size(); ++i)
      if (!buckets.empty() && lives_in_bucket(params[i], params[i].variable.grad()))
        kept[i] = params[i].variable.grad();
    buckets.clear();
    for (size_t i : order) {
      Param& p = params[i];
      const at::Tensor& v = p.variable;
      const int64_t bytes = v.numel() * static_cast<int64_t>(v.element_size());
      Bucket* b = buckets.empty() ? nullptr : &buckets.back();
      if (b == nullptr || b->dtype != v.scalar_type() || b->device != v.device() ||
          (b->numel * static_cast<int64_t>(c10::elementSize(b->dtype)) + bytes > options.bucket_bytes() &&
           !b->params.empty())) {
        buckets.emplace_back();
        b = &buckets.back();
        b->dtype = v.scalar_type();
        b->device = v.device();
      }
      p.bucket = buckets.size() - 1;
      p.offset = b->numel;
      b->numel += v.numel();
      b->params.push_back(i);
    }
    // The buckets live as long as the DataParallel (and the gradients that come to live in them).
    at::NoGradGuard no_grad;
    for (auto& b : buckets)
      b.buffer = at::zeros({b.numel}, at::TensorOptions().dtype(b.dtype).device(b.device));
    for (size_t i = 0; i < params.size(); ++i) {
      if (!kept[i].defined()) continue;
      Param& p = params[i];
      buckets[p.bucket].buffer.narrow(0, p.offset, p.variable.numel()).copy_(kept[i].reshape({-1}));
      p.variable.mutable_grad() = bucket_grad(p);
    }
    stats.buckets = static_cast<int64_t>(buckets.size());
    stats.bytes_per_step = 0;
    for (const auto& b : buckets)
      stats.bytes_per_step += b.numel * static_cast<int64_t>(c10::elementSize(b.dtype));
  }

  // After the first synced step, as DDP does: buckets in the order the gradients arrived (rank 0's order, so
  // that every rank's buckets match), the parameters that got none last. Buckets then fill, and leave, in
  // the order backward produces them, whatever the registration order and whichever parameters go unused.
  void rebuild_buckets() {
    std::vector<char> seen(params.size(), 0);
    std::vector<int64_t> order;
    for (size_t i : arrival)
      if (!seen[i]) seen[i] = 1, order.push_back(static_cast<int64_t>(i));
    for (size_t i = 0; i < params.size(); ++i)
      if (!seen[i]) order.push_back(static_cast<int64_t>(i));
    std::vector<at::Tensor> t{at::tensor(order, at::kLong)};
    group->broadcast(t, 0);
    std::vector<size_t> rank0(params.size());
    for (size_t k = 0; k < rank0.size(); ++k)
      rank0[k] = static_cast<size_t>(t[0][static_cast<int64_t>(k)].item<int64_t>());
    assign_buckets(rank0);
    rebuilt = true;
  }

  // The step begins (first hook of a synced backward pass): nothing to do but remember it.
  void begin_step() {
    if (in_step) return;
    in_step = true;
    finalize_queued = false;
    fired = 0;
    next_bucket = 0;
    arrival.clear();
    for (auto& p : params)
      p.fired = false;
    for (auto& b : buckets) {
      b.pending = b.params.size();
      b.launched = false;
    }
  }

  // Queues the end of the step on the current graph task: called only at nesting depth 0, that is in the
  // user's own backward pass (a hook there, or remat entering one of its nested passes from there).
  void queue_finalize() {
    if (finalize_queued) return;
    finalize_queued = true;
    std::weak_ptr<State> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto self = weak.lock()) self->finalize();
    });
  }

  // The gradient of `p` as it lives in its bucket: a tensor sharing the bucket's storage (not an autograd
  // view, so that optimizers may detach_() it), contiguous, of the parameter's shape.
  at::Tensor bucket_grad(const Param& p) const {
    const Bucket& b = buckets[p.bucket];
    std::vector<int64_t> strides(static_cast<size_t>(p.variable.dim()), 1);
    for (int64_t d = p.variable.dim() - 2; d >= 0; --d)
      strides[d] = strides[d + 1] * std::max<int64_t>(p.variable.size(d + 1), 1);
    at::Tensor t = at::empty({0}, b.buffer.options());
    t.set_(b.buffer.storage(), b.buffer.storage_offset() + p.offset, p.variable.sizes(), strides);
    return t;
  }

  bool lives_in_bucket(const Param& p, const at::Tensor& grad) const {
    const Bucket& b = buckets[p.bucket];
    return grad.defined() && grad.is_contiguous() && grad.scalar_type() == b.dtype &&
           grad.sizes() == p.variable.sizes() &&
           grad.data_ptr() == static_cast<char*>(b.buffer.data_ptr()) + p.offset * b.buffer.element_size();
  }

  // Moves the bucket's gradients into it (once a gradient lives there, backward accumulates in place and
  // nothing is copied) and starts its all-reduce.
  void launch(Bucket& b) {
    at::NoGradGuard no_grad;
    for (size_t i : b.params) {
      Param& p = params[i];
      at::Tensor& grad = p.variable.mutable_grad();
      if (lives_in_bucket(p, grad)) continue;
      at::Tensor slice = b.buffer.narrow(0, p.offset, p.variable.numel());
      if (grad.defined()) {
        slice.copy_(grad.reshape({-1}));
        grad = bucket_grad(p);
      } else {
        slice.zero_();  // no gradient here (yet): this rank adds nothing
      }
    }
    b.work = group->all_reduce_async({b.buffer});
    b.launched = true;
  }

  // Launches the buckets that are complete, in order.
  void launch_ready() {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      launch(buckets[next_bucket]);
      ++next_bucket;
      ++stats.buckets_early;
    }
  }

  void on_gradient(size_t index, bool defined) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!sync) return;
    if (detail::profiler_running()) return;  // the profiler's gradients, put back when it is done
    const bool outermost = detail::nested_backward_depth() == 0;
    if (!defined) {
      // AccumulateGrad runs with no gradient, e.g. for a parameter a kReentrant region returns nothing for
      // in the outer pass: not ready, but this is the user's pass, where the step must end.
      if (in_step && outermost) queue_finalize();
      return;
    }
    begin_step();
    if (outermost) queue_finalize();
    Param& p = params[index];
    if (p.fired) {
      if (buckets[p.bucket].launched) reset_step();  // the step is lost; let the next one start clean
      TORCH_CHECK(
          !buckets[p.bucket].launched, "remat::distributed::DataParallel: parameter '", p.name,
          "' received a second gradient in one step after its bucket's all-reduce had started. Either "
          "it is used by two nested backward passes (two kReentrant regions or two plan stages: "
          "checkpoint them with CheckpointMode::kNonReentrant, or keep its uses in one region), or an "
          "earlier backward pass left parameters without a gradient and never ended its step");
      return;  // accumulated before its bucket left: the bucket takes the sum
    }
    p.fired = true;
    ++fired;
    if (!rebuilt) arrival.push_back(index);
    Bucket& b = buckets[p.bucket];
    if (--b.pending == 0) launch_ready();
  }

  void on_outer_backward() {
    std::lock_guard<std::mutex> lock(mutex);
    if (!sync) return;
    // remat starts a nested backward pass from the user's pass: the step (if this module takes part) ends
    // with the user's pass. Start it now so that the end is queued even if no hook fires at depth 0.
    begin_step();
    queue_finalize();
  }

  void finalize() {
    std::unique_lock<std::mutex> lock(mutex);
    if (!in_step) return;
    const auto start = Clock::now();
    if (fired == 0) {  // a backward pass of something else: this module took no part
      in_step = false;
      return;
    }
    for (; next_bucket < buckets.size(); ++next_bucket)
      launch(buckets[next_bucket]);
    at::Tensor used;
    if (options.find_unused_parameters()) {
      used = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
      auto* u = used.data_ptr<int>();
      for (size_t i = 0; i < params.size(); ++i)
        u[i] = params[i].fired ? 1 : 0;
    }
    std::vector<std::string> unused;
    try {
      const auto wait_start = Clock::now();
      for (auto& b : buckets)
        b.work->wait();
      if (used.defined()) {
        std::vector<at::Tensor> t{used};
        group->all_reduce(t);
      }
      stats.wait_seconds += seconds_since(wait_start);
      at::NoGradGuard no_grad;
      const double world = static_cast<double>(group->size());
      for (auto& b : buckets) {
        b.buffer.div_(world);  // the gradients living in the bucket are now the group's averages
        for (size_t i : b.params) {
          Param& p = params[i];
          if (!used.defined() && !p.fired) unused.push_back(p.name);
          at::Tensor& grad = p.variable.mutable_grad();
          if (lives_in_bucket(p, grad)) continue;
          if (used.defined() && used.data_ptr<int>()[i] == 0) continue;  // no rank used it: keeps no gradient
          if (grad.defined()) {
            grad.copy_(b.buffer.narrow(0, p.offset, p.variable.numel()).view(p.variable.sizes()));
          } else {
            grad = bucket_grad(p);  // another rank used it
          }
        }
        b.work.reset();
      }
    } catch (...) {
      reset_step();
      throw;
    }
    reset_step();
    ++stats.steps;
    if (!rebuilt) rebuild_buckets();
    stats.finalize_seconds += seconds_since(start);
    if (!unused.empty()) {
      std::string names;
      for (size_t i = 0; i < unused.size() && i < 10; ++i)
        names += (i ? ", " : "") + unused[i];
      if (unused.size() > 10) names += ", ... (" + std::to_string(unused.size()) + " in all)";
      TORCH_CHECK(
          false, "remat::distributed::DataParallel: ", unused.size(),
          " parameter(s) got no gradient in this backward pass on rank ", group->rank(), ": ", names,
          ". They were reduced as zero so that the ranks stay in step; construct the DataParallel with "
          "DataParallelOptions().find_unused_parameters(true) if the model leaves parameters unused");
    }
  }

  void reset_step() {
    in_step = false;
    finalize_queued = false;
    for (auto& b : buckets)
      b.work.reset();
  }
};

namespace {

struct ReadyHook final : torch::autograd::FunctionPostHook {
  ReadyHook(std::weak_ptr<DataParallel::State> state, size_t index)
      : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    if (auto state = state_.lock()) state->on_gradient(index_, !inputs.empty() && inputs[0].defined());
    return outputs;
  }

 private:
  std::weak_ptr<DataParallel::State> state_;
  size_t index_;
};

// "name dtype [shape]" of every parameter and buffer, one per line: what must agree across ranks.
std::string signature(torch::nn::Module& module) {
  std::string out;
  for (const auto& item : module.named_parameters())
    out += "parameter " + describe(item.key(), item.value()) +
           (item.value().requires_grad() ? "" : " frozen") + "\n";
  for (const auto& item : module.named_buffers())
    out += "buffer " + describe(item.key(), item.value()) + "\n";
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  return lines;
}

// Every rank learns whether the modules agree; on disagreement every rank throws, naming what differs from
// rank 0 here (or that another rank differs).
void check_same_model(ProcessGroup& group, torch::nn::Module& module) {
  const std::string mine = signature(module);
  // Rank 0's description, for the message: its length, then its bytes.
  std::vector<at::Tensor> length{at::full({1}, static_cast<int64_t>(mine.size()), at::kLong)};
  group.broadcast(length, 0);
  const int64_t n0 = length[0].item<int64_t>();
  std::vector<at::Tensor> text{at::zeros({std::max<int64_t>(n0, 1)}, at::kByte)};
  if (group.rank() == 0) std::memcpy(text[0].data_ptr(), mine.data(), mine.size());
  group.broadcast(text, 0);
  const std::string theirs(static_cast<const char*>(text[0].data_ptr()), static_cast<size_t>(n0));
  // Which ranks differ from rank 0 (each sets its own slot; a sum tells everyone).
  std::vector<at::Tensor> differs{at::zeros({group.size()}, at::kLong)};
  differs[0].data_ptr<int64_t>()[group.rank()] = theirs == mine ? 0 : 1;
  group.all_reduce(differs);
  std::string bad;
  for (int r = 0; r < group.size(); ++r)
    if (differs[0].data_ptr<int64_t>()[r] != 0) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
  if (bad.empty()) return;
  std::string detail;
  if (theirs != mine) {
    const auto a = lines_of(mine), b = lines_of(theirs);
    size_t k = 0;
    while (k < a.size() && k < b.size() && a[k] == b[k])
      ++k;
    detail = "this rank has " + std::to_string(a.size()) + " parameters and buffers, rank 0 has " +
             std::to_string(b.size()) + "; the first difference, entry " + std::to_string(k) + ": here '" +
             (k < a.size() ? a[k] : std::string("(none)")) + "', on rank 0 '" +
             (k < b.size() ? b[k] : std::string("(none)")) + "'";
  } else {
    detail = "this rank's model matches rank 0's";
  }
  TORCH_CHECK(false, "remat::distributed::DataParallel: the ranks' models differ (rank(s) ", bad,
              " differ from rank 0 in their parameters or buffers: names, dtypes or shapes); on rank ",
              group.rank(), ": ", detail);
}

}  // namespace

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
                           DataParallelOptions options) {
  TORCH_CHECK(module != nullptr, "remat::distributed::DataParallel: the module is null");
  TORCH_CHECK(group != nullptr, "remat::distributed::DataParallel: the process group is null");
  TORCH_CHECK(options.bucket_bytes() > 0, "remat::distributed::DataParallel: bucket_bytes must be > 0, got ",
              options.bucket_bytes());
  auto state = std::make_shared<State>();
  state->module = std::move(module);
  state->group = std::move(group);
  state->options = options;

  // Parameters that train, each once (a shared tensor appears under several names), in reverse registration
  // order: roughly the order in which backward produces their gradients.
  std::unordered_set<c10::TensorImpl*> seen;
  for (const auto& item : state->module->named_parameters()) {
    const at::Tensor& v = item.value();
    if (!v.requires_grad() || !seen.insert(v.unsafeGetTensorImpl()).second) continue;
    TORCH_CHECK(v.layout() == at::kStrided, "remat::distributed::DataParallel: parameter '", item.key(),
                "' is not dense (", v.layout(), "); only dense gradients are reduced");
    TORCH_CHECK(state->group->backend() != "nccl" || v.is_cuda(),
                "remat::distributed::DataParallel: parameter '", item.key(), "' is on ", v.device(),
                ", but the group's backend is NCCL, which reduces CUDA tensors (use \"gloo\" for a model on "
                "the CPU)");
    State::Param p;
    p.variable = v;
    p.name = item.key();
    state->params.push_back(std::move(p));
  }
  TORCH_CHECK(!state->params.empty(),
              "remat::distributed::DataParallel: the module has no parameter that requires grad");

  check_same_model(*state->group, *state->module);
  if (options.broadcast_parameters()) {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> tensors;
    for (const auto& t : state->module->parameters())
      tensors.push_back(t.detach());
    for (const auto& t : state->module->buffers())
      tensors.push_back(t);
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      state->group->broadcast(one, 0);
    }
  }

  std::reverse(state->params.begin(), state->params.end());
  std::vector<size_t> order(state->params.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  state->assign_buckets(order);

  std::weak_ptr<State> weak = state;
  for (size_t i = 0; i < state->params.size(); ++i) {
    State::Param& p = state->params[i];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.variable);
    TORCH_CHECK(p.accumulator, "remat::distributed::DataParallel: parameter '", p.name,
                "' has no gradient accumulator");
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<ReadyHook>(weak, i));
  }
  detail::add_outer_backward_listener(state.get(), [weak] {
    if (auto self = weak.lock()) self->on_outer_backward();
  });
  state_ = std::move(state);
}

DataParallel::~DataParallel() {
  if (!state_) return;
  detail::remove_outer_backward_listener(state_.get());
  for (auto& p : state_->params)
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
}

struct DataParallel::NoSync::State {
  std::weak_ptr<DataParallel::State> dp;
};

DataParallel::NoSync::NoSync(std::shared_ptr<State> state, bool previous)
    : state_(std::move(state)), previous_(previous) {}

DataParallel::NoSync::NoSync(NoSync&& other) noexcept
    : state_(std::move(other.state_)), previous_(other.previous_) {}

DataParallel::NoSync::~NoSync() {
  if (!state_) return;
  if (auto dp = state_->dp.lock()) {
    std::lock_guard<std::mutex> lock(dp->mutex);
    dp->sync = previous_;
  }
}

DataParallel::NoSync DataParallel::no_sync() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const bool previous = state_->sync;
  state_->sync = false;
  auto s = std::make_shared<NoSync::State>();
  s->dp = state_;
  return NoSync(std::move(s), previous);
}

torch::nn::Module& DataParallel::module() {
  return *state_->module;
}
const std::shared_ptr<ProcessGroup>& DataParallel::group() const {
  return state_->group;
}
const DataParallelOptions& DataParallel::options() const {
  return state_->options;
}

std::vector<std::vector<std::string>> DataParallel::buckets() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : state_->buckets) {
    out.emplace_back();
    for (size_t i : b.params)
      out.back().push_back(state_->params[i].name);
  }
  return out;
}

DataParallelStats DataParallel::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

void DataParallel::reset_stats() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const int64_t buckets = state_->stats.buckets, bytes = state_->stats.bytes_per_step;
  state_->stats = DataParallelStats();
  state_->stats.buckets = buckets;
  state_->stats.bytes_per_step = bytes;
}

double DataParallel::time_all_reduce(int64_t repeats) {
  TORCH_CHECK(repeats >= 1, "remat::distributed::DataParallel::time_all_reduce: repeats must be >= 1, got ",
              repeats);
  std::vector<at::Tensor> buffers;
  for (const auto& b : state_->buckets)
    buffers.push_back(at::zeros({b.numel}, at::TensorOptions().dtype(b.dtype).device(b.device)));
  std::vector<double> ms;
  state_->group->barrier();
  for (int64_t r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    std::vector<std::shared_ptr<ProcessGroup::Work>> works;
    for (auto& buffer : buffers)
      works.push_back(state_->group->all_reduce_async({buffer}));
    for (auto& w : works)
      w->wait();
    ms.push_back(seconds_since(start) * 1e3);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace remat::distributed
