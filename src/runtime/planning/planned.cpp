// remat::Planned (remat/planned.h): profiling in place, planning for the step's budget, running the plan.
#include "remat/planned.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "remat/memory.h"
#include "remat/planner/chain.h"
#include "remat/planner/device.h"
#include "remat/planner/step.h"
#include "remat/profile.h"

#include "checkpoint/region.h"
#include "detail/compat.h"
#include "planning/out_of_memory.h"

namespace remat {

namespace {

constexpr const char* kWho = "remat::Planned";

using Clock = std::chrono::steady_clock;

// The bytes of the CPU generator's state (what a replay of a stage's draws keeps of it).
size_t cpu_generator_state_bytes() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state().nbytes();
}

// A training call of forward(), open from it until a backward pass reaches its output, or until its graph is
// freed without one (the output dropped). A backward pass that reached it and raised leaves it closed.
struct CallState {
  bool reached = false;                        // a backward pass has reached the call's output
  detail::compat::WeakNode graph;              // the output's node: alive as long as the graph is
  std::vector<std::function<void()>> waiting;  // run at the end of the backward pass that reached it
  // The calls that ran inside this call's step (began while it was open): the step ends once they have.
  std::vector<std::weak_ptr<CallState>> inside;
  bool open() const { return !reached && graph.alive(); }
};

// Marks `call` as open while the graph of `out` is, until a backward pass reaches `out`; what waits for the
// call runs at the end of that pass.
void mark(const std::shared_ptr<CallState>& call, const torch::Tensor& out) {
  if (!out.requires_grad() || !out.grad_fn()) return;
  call->graph = detail::compat::WeakNode(out.grad_fn());
  out.register_hook([call](const torch::Tensor& g) {
    if (!call->reached) {
      call->reached = true;
      torch::autograd::Engine::get_default_engine().queue_callback([call] {
        std::vector<std::function<void()>> waiting = std::move(call->waiting);
        call->waiting.clear();
        for (const auto& fn : waiting)
          fn();
      });
    }
    return g;
  });
}

// The first call that ran inside `call`'s step and is still open, or null.
std::shared_ptr<CallState> open_inside(const CallState& call) {
  for (const auto& weak : call.inside) {
    std::shared_ptr<CallState> c = weak.lock();
    if (c && c->open()) return c;
  }
  return nullptr;
}

// Runs fn once a backward pass has reached every call that ran inside `call`'s step, at the end of that pass:
// now, or at the end of the pass that reaches the last of them. A call whose graph was freed without one
// holds nothing, and is not waited for.
void after_inside(const std::shared_ptr<CallState>& call, const std::function<void()>& fn) {
  if (const std::shared_ptr<CallState> c = open_inside(*call)) {
    c->waiting.push_back([call, fn] { after_inside(call, fn); });
  } else {
    fn();
  }
}

std::vector<ArgsStageFn> taking_args(std::vector<StageFn> stages) {
  std::vector<ArgsStageFn> out;
  out.reserve(stages.size());
  for (StageFn& s : stages) {
    TensorFn fn = std::move(s.fn);
    ArgsStageFn a{std::move(s.name), nullptr, std::move(s.module)};
    if (fn) a.fn = [fn](const torch::Tensor& x, const std::vector<torch::Tensor>&) { return fn(x); };
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace

struct PlannedImpl::Call : CallState {};

PlannedImpl::PlannedImpl(std::vector<StageFn> stages, PlannedOptions options)
    : PlannedImpl(taking_args(std::move(stages)), std::move(options)) {
  takes_args_ = false;
}

PlannedImpl::PlannedImpl(std::vector<ArgsStageFn> stages, PlannedOptions options)
    : stages_(std::move(stages)), takes_args_(true), options_(std::move(options)) {
  TORCH_CHECK(!stages_.empty(), kWho, ": no stages");
  for (size_t i = 0; i < stages_.size(); ++i)
    TORCH_CHECK(stages_[i].fn, kWho, ": stage ", i, " ('", stages_[i].name, "') has no function");
  const bool fit = options_.fit_device() != 0;
  TORCH_CHECK(!fit || (options_.fit_device() > 0 && options_.fit_device() <= 1), kWho,
              ": fit_device must be a share in (0, 1] of what the device has, got ", options_.fit_device());
  TORCH_CHECK(fit || options_.budget() > 0, kWho, ": the budget must be a positive number of bytes, got ",
              options_.budget(), " (or fit the device: PlannedOptions::fit_device)");
  TORCH_CHECK(!fit || options_.budget() == 0, kWho,
              ": give a budget in bytes or fit_device, not both (budget ", options_.budget(), ", fit_device ",
              options_.fit_device(), ")");
  TORCH_CHECK(options_.profile_repeats() >= 1, kWho, ": profile_repeats must be >= 1, got ",
              options_.profile_repeats());
  TORCH_CHECK(options_.offload_min_bytes() >= 0, kWho, ": offload_min_bytes must be >= 0 (bytes), got ",
              options_.offload_min_bytes());
  TORCH_CHECK(
      !(options_.replan_on_overshoot() && options_.agree()), kWho,
      ": replan_on_overshoot plans again from one rank's measured peak, and ranks that agree must run one "
      "plan: not both");
  TORCH_CHECK(options_.planner().max_host_bytes >= -1, kWho,
              ": PlannerOptions::max_host_bytes must be >= 0, or -1 for no bound, got ",
              options_.planner().max_host_bytes);
  // At construction, not at the first plan (before 2026-12-07: at the end of the profiling step, the model's
  // gradients already made).
  try {
    check_exclude(options_.planner().exclude, kWho);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

bool PlannedImpl::training_now() const {
  if (!is_training() || !at::GradMode::is_enabled()) return false;
  for (const ArgsStageFn& s : stages_)
    if (s.module && !s.module->is_training()) return false;
  return true;
}

std::vector<StageFn> PlannedImpl::bind(const std::vector<torch::Tensor>& args) const {
  std::vector<StageFn> out;
  out.reserve(stages_.size());
  for (const ArgsStageFn& s : stages_) {
    auto fn = s.fn;
    out.push_back(StageFn{s.name, [fn, args](const torch::Tensor& x) { return fn(x, args); }, s.module});
  }
  return out;
}

void PlannedImpl::use_profile(const std::vector<std::vector<int64_t>>& input_shape, Chain chain) {
  TORCH_CHECK(chain.size() == static_cast<int64_t>(stages_.size()), kWho, ": use_profile got a chain of ",
              chain.size(), " stages for ", stages_.size(), " stages");
  try {
    validate(chain);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, kWho, ": use_profile: ", e.what());
  }
  for (const auto& [key, shape] : shapes_)
    TORCH_CHECK(key.sizes != input_shape || !shape.plan || shape.borrowed, kWho,
                ": use_profile: a plan is already in force for this input shape (", describe_key(key), ")");
  // The shapes of these sizes seen before (borrowing a plan, or not yet planned) give way to the profile: the
  // next call of these sizes takes it.
  for (auto it = shapes_.begin(); it != shapes_.end();) {
    if (it->first.sizes != input_shape) {
      ++it;
      continue;
    }
    if (last_ == &it->second) last_ = nullptr;
    it = shapes_.erase(it);
  }
  given_profiles_[input_shape] = std::move(chain);
}

PlannedImpl::Key PlannedImpl::key_of(const torch::Tensor& x, const std::vector<torch::Tensor>& args) const {
  Key key;
  key.sizes.push_back(x.sizes().vec());
  key.form.push_back(static_cast<int64_t>(x.scalar_type()));
  for (size_t i = 0; i < args.size(); ++i) {
    TORCH_CHECK(args[i].defined(), kWho, ": extra argument ", i, " is an undefined tensor");
    key.sizes.push_back(args[i].sizes().vec());
    key.form.push_back(static_cast<int64_t>(args[i].scalar_type()));
  }
  for (const c10::DeviceType d : {c10::DeviceType::CPU, c10::DeviceType::CUDA})
    key.form.push_back(
        detail::compat::autocast_enabled(d) ? static_cast<int64_t>(detail::compat::autocast_dtype(d)) : -1);
  // The stages' parameters as they are now (the Python package's step key reads its model's alike): frozen or
  // not, cast, resized (a stage without a module has none to read).
  for (const ArgsStageFn& s : stages_) {
    if (!s.module) continue;
    for (const torch::Tensor& q : s.module->parameters()) {
      key.form.push_back(q.requires_grad() ? 1 : 0);
      key.form.push_back(static_cast<int64_t>(q.scalar_type()));
      key.form.push_back(q.dim());
      key.form.insert(key.form.end(), q.sizes().begin(), q.sizes().end());
    }
  }
  return key;
}

std::string PlannedImpl::describe_key(const Key& key) {
  std::ostringstream out;
  for (size_t j = 0; j < key.sizes.size(); ++j) {
    out << (j ? ", " : "") << c10::IntArrayRef(key.sizes[j]);
    if (j < key.form.size() && key.form[j] != static_cast<int64_t>(c10::ScalarType::Float))
      out << " " << static_cast<c10::ScalarType>(key.form[j]);  // float32, the usual one, unsaid
  }
  const char* devices[] = {"cpu", "cuda"};
  for (size_t d = 0; d < 2; ++d) {
    const size_t at = key.sizes.size() + d;
    if (at < key.form.size() && key.form[at] >= 0)
      out << " under " << devices[d] << " autocast to " << static_cast<c10::ScalarType>(key.form[at]);
  }
  return out.str();
}

torch::Tensor PlannedImpl::forward(const torch::Tensor& x, const std::vector<torch::Tensor>& args) {
  TORCH_CHECK(x.defined(), kWho, ": the input is an undefined tensor");
  TORCH_CHECK(takes_args_ || args.empty(), kWho, ": got ", args.size(),
              " extra arguments for stages that take none (make ArgsStageFns to pass them)");
  const Key key = key_of(x, args);
  const std::vector<StageFn> stages = bind(args);
  if (!training_now()) {
    torch::Tensor h = x;
    for (const StageFn& s : stages)
      h = s.fn(h);
    return h;
  }
  const c10::Device device = x.device();
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), kWho, ": inputs on cpu or cuda are planned, got one on ",
              device);
  for (size_t i = 0; i < args.size(); ++i)
    TORCH_CHECK(args[i].device() == device, kWho, ": extra argument ", i, " is on ", args[i].device(),
                " but the input is on ", device);
  std::vector<std::shared_ptr<Call>> earlier;
  for (const auto& c : calls_)
    if (c->open()) earlier.push_back(c);
  const auto call = std::make_shared<Call>();
  calls_ = earlier;
  calls_.push_back(call);
  if (!earlier.empty()) {
    // Inside an earlier call's step (two forwards before one backward pass): every stage checkpointed,
    // nothing measured; that step holds this call's run, and ends once this call's backward pass has.
    for (const auto& c : earlier)
      c->inside.push_back(call);
    if (!inside_said_) {
      inside_said_ = true;
      TORCH_WARN(
          kWho, ": forward() was called for training while the graph of an earlier training call was ",
          "alive (its backward pass had not run); such a call runs inside the earlier call's step: its ",
          "stages run checkpointed, and the earlier call's plan is made for, and its peak measured over, ",
          "the step with this call in it, so that the budget holds for both together (remat/planned.h)");
    }
    torch::Tensor h = checkpoint_sequential(stages, static_cast<int64_t>(stages.size()), x,
                                            SequentialOptions().checkpoint_last_segment(true));
    mark(call, h);
    return h;
  }
  if (options_.agree()) plan_in_lockstep();
  if (shapes_.count(key) == 0) {
    auto given = given_profiles_.find(key.sizes);
    if (given != given_profiles_.end()) {
      Shape& shape = shapes_[key];
      shape.chain = std::move(given->second);
      shape.profile_loaded = true;
      given_profiles_.erase(given);
    } else if (options_.borrow_plans()) {
      borrow(key);
    }
  }
  Shape& shape = shapes_[key];
  last_ = &shape;
  check_measured(key, shape);
  if (shape.plan_error) std::rethrow_exception(shape.plan_error);
  if (options_.agree()) profile_in_lockstep(shape);
  if (shape.profile_loaded && !*shape.rest)
    TORCH_CHECK(shape.chain->input_bytes == static_cast<int64_t>(x.nbytes()), kWho,
                ": the profile given to use_profile has input_bytes ", shape.chain->input_bytes,
                " but the input of that shape has ", x.nbytes(), " bytes");
  if (!shape.plan && shape.chain && *shape.readings)
    make_plan(shape);
  else if (shape.plan && !options_.agree())
    plan_for_grads(shape, grads_to_make(), false);
  if (!shape.chain) new_shape(key);
  if (!shape.plan) {
    if (options_.fit_device() != 0) {
      // What the device has, read before anything of the step runs (a CPU has nothing to read: an error that
      // leaves the model as it was).
      TORCH_CHECK(options_.read_device() || device.is_cuda(), kWho, ": fit_device fits the step to a CUDA ",
                  "device's free memory, but this input is on ", device,
                  ", which has no capacity of its own to fill; give PlannedOptions::budget in bytes instead");
      shape.at_start = read_device(device);
      shape.device = device;
      shape.whole =
          std::make_shared<memory::PeakWindow>(device);  // the step's peak, profiling's runs included
    }
    ++shape.steps_before_plan;
    torch::Tensor out = profiling_step(shape, stages, x, call);
    mark(call, out);
    return out;
  }
  // The plan, and the step's peak above the base, measured to the end of its backward pass (in a window: the
  // statistics the caller reads are left alone).
  auto window = std::make_shared<memory::PeakWindow>(device);
  const detail::OutOfMemoryWords words = out_of_memory_words(shape, window, device);
  torch::Tensor out;
  try {
    detail::OutOfMemoryScope scope(words);  // the plan's backward pass carries the words too
    out = run_plan(stages, *shape.plan, x, {}, nullptr,
                   OffloadOptions().min_bytes(options_.offload_min_bytes()).pool(host_pool_));
  } catch (c10::Error& e) {
    if (detail::is_out_of_memory(e)) words(e, "in the forward pass");
    throw;
  }
  if (out.requires_grad()) {
    std::shared_ptr<int64_t> last = shape.last_peak;
    std::shared_ptr<CallState> self = call;
    out.register_hook([last, window, self](const torch::Tensor& g) {
      // At the end of the user's backward pass (what runs before the stages included), or later, where a call
      // inside this step has its own after it.
      torch::autograd::Engine::get_default_engine().queue_callback(
          [last, window, self] { after_inside(self, [last, window] { *last = window->peak_over_base(); }); });
      return g;
    });
  }
  mark(call, out);
  return out;
}

torch::Tensor PlannedImpl::profiling_step(Shape& shape, const std::vector<StageFn>& stages,
                                          const torch::Tensor& x, const std::shared_ptr<Call>& call) {
  const c10::Device device = x.device();
  // Device work runs asynchronously: the rest of the step is timed from the moment the stages' work is
  // done to the moment the backward pass's work up to their output is.
  auto sync = [device] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  if (!shape.chain) {
    // The profiler puts gradients, buffers and the generators back, so the step below is the plain run's.
    // Autocast's cache off while it profiles (the Python package's rule too): its inputs are leaves that
    // require grad, whose casts the cache would hold until the caller's autocast region ends.
    const detail::AutocastCacheOff cache_off;
    const auto t0 = Clock::now();
    shape.chain =
        profile_chain(stages, x,
                      ProfileOptions()
                          .warmup(0)
                          .repeats(options_.profile_repeats())
                          .policies(options_.policies())
                          .offload_min_bytes(options_.planner().offload ? options_.offload_min_bytes() : -1)
                          .groups(options_.groups()));
    shape.profile_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  // Every stage checkpointed (the profiler's own memory bound), read at the points remat/planner/step.h
  // names: StepReadings, which step_context() turns into the step's model, as the Python package does. The
  // base is the count here, the stages' input alive (the budget counts from forward()).
  auto step = std::make_shared<memory::PeakWindow>(device);
  auto readings = std::make_shared<StepReadings>();
  readings->input_in_base = true;
  readings->input_bytes = static_cast<int64_t>(x.nbytes());
  readings->stage_grads_bytes = grads_to_make();  // the gradients the state this step began in makes
  // What a stage that runs again holds to its backward's end beside its tensors: the generators' states its
  // replay needs (remat::run_plan), host tensors, so only where the device is the CPU: the CPU generator's.
  if (device.is_cpu()) readings->checkpoint_state_bytes = static_cast<int64_t>(cpu_generator_state_bytes());
  // And, on the device, the copies of what its first run read and wrote in place (an EMA buffer): the largest
  // stage's, charged on every checkpointed stage (the Python package's rule for what a layer keeps so).
  auto stats = std::make_shared<ExecutionStats>();
  torch::Tensor out = run_plan(stages, checkpoint_all(*shape.chain), x, {}, stats);
  int64_t most = 0;
  for (const int64_t b : stats->forward_write_bytes)
    most = std::max(most, b);
  readings->checkpoint_state_bytes += most;
  if (!out.requires_grad()) return out;
  sync();
  readings->at_return = step->active_over_base();
  auto rest = std::make_shared<memory::PeakWindow>(device);
  const auto t0 = Clock::now();
  std::shared_ptr<std::optional<RestOfStep>> measured = shape.rest;
  std::shared_ptr<std::optional<StepReadings>> done = shape.readings;
  auto after = std::make_shared<std::unique_ptr<memory::PeakWindow>>();  // from the stages' input gradient on
  // The stages' output, read when the rest hands it its gradient: freed there where the rest saved it and
  // nothing else (the caller) held it (StepReadings::output_freed_bytes).
  const c10::weak_intrusive_ptr<c10::StorageImpl> out_storage = out.storage().getWeakStorageImpl();
  const int64_t out_bytes = static_cast<int64_t>(out.storage().nbytes());
  const size_t stages_n = stages.size();
  // The stages' input, read once the first stage's backward is done (or at the step's end where the part
  // before the stages has no backward): whether anything but the stages held it through their backward pass
  // (StepReadings::input_held_in_backward; the caller, or what the part before saved). Where the caller let
  // go of it once forward() returned (BertModel's embeddings' output), a first stage that sends it to the
  // host takes it off the device. And whether it was freed by the time the rest handed the stages' output its
  // gradient (input_freed_in_rest: no stage held it, the rest's readings without it already).
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> in_storage;
  if (x.has_storage()) in_storage.emplace(x.storage().getWeakStorageImpl());
  const bool prefix_backward = x.requires_grad() && x.grad_fn();
  out.register_hook([=](const torch::Tensor& g) {
    sync();
    readings->rest_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    readings->rest_peak = readings->at_return + rest->peak_over_base();
    readings->at_output_grad = step->active_over_base();
    readings->output_grad_bytes = static_cast<int64_t>(g.nbytes());
    if (g.has_storage()) readings->output_grad_storage_bytes = static_cast<int64_t>(g.storage().nbytes());
    readings->output_freed_bytes = out_storage.expired() ? out_bytes : 0;
    readings->input_freed_in_rest = in_storage && in_storage->expired();
    *measured = RestOfStep{rest->peak_over_base(), readings->rest_ms};
    // At the end of the user's backward pass: the step's peak, and that of what ran before the stages.
    std::shared_ptr<CallState> self = call;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [readings, step, after, done, self, device, out_storage, stages_n, in_storage, prefix_backward] {
          auto finish = [readings, step, after, done, out_storage, stages_n, in_storage, prefix_backward] {
            readings->step_peak = step->peak_over_base();
            if (in_storage && !prefix_backward) readings->input_held_in_backward = !in_storage->expired();
            // Whether the caller still holds the stages' output at the step's end (StepReadings::
            // outputs_held_to_end, its last entry; the runtime holds no other stage's output past its
            // backward): a C++ temporary does, `model->forward(x).square().mean().backward()` keeping the
            // forward's result until the full expression ends. Before (found 2026-12-03), it was not read:
            // such a step held that output above its prediction from the last stage's backward on (one hidden
            // state, 1.5%, on a small BertModel whose peak was a recompute).
            readings->outputs_held_to_end.assign(stages_n, false);
            readings->outputs_held_to_end.back() = !out_storage.expired();
            if (*after)
              readings->peak_after_chain_backward =
                  step->active_over_base() + (*after)->peak_over_base() - (*after)->active_over_base();
            *done = *readings;
          };
          // A call inside this step has its backward pass still to come: its peak, after the stages' backward
          // pass, is this step's too (charged as the peak after the chain's backward pass).
          if (open_inside(*self) && !*after) *after = std::make_unique<memory::PeakWindow>(device);
          after_inside(self, finish);
        });
    return g;
  });
  if (prefix_backward) {
    x.register_hook([after, device, readings, in_storage](const torch::Tensor& g) {
      *after = std::make_unique<memory::PeakWindow>(device);
      if (in_storage) readings->input_held_in_backward = !in_storage->expired();
      return g;
    });
  }
  return out;
}

StepPlan PlannedImpl::chosen_plan(const Chain& chain, const StepContext& context, int64_t budget) const {
  StepPlan out;
  try {
    out.plan = options_.choose_plan()(chain, context, budget);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, kWho, ": PlannedOptions::choose_plan threw: ", e.what());
  }
  try {
    out.plan.predicted = simulate(chain, out.plan);
    out.step_peak_bytes = step_peak_bytes(chain, context, out.plan);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, kWho, ": PlannedOptions::choose_plan's plan ", out.plan.to_string(),
                " is not one for the profiled stages: ", e.what());
  }
  TORCH_CHECK(out.step_peak_bytes <= budget, kWho, ": PlannedOptions::choose_plan's plan ",
              out.plan.to_string(), " is predicted to peak at ", out.step_peak_bytes,
              " bytes, above the budget of ", budget, " bytes");
  out.step_time_ms = out.plan.predicted.time_ms + context.rest_ms;
  return out;
}

void PlannedImpl::make_plan(Shape& shape) {
  // What surrounds the stages: the base is taken with their input alive; the rest of the step as measured;
  // the parameter gradients the backward pass will allocate (those none now: zero_grad setting them to none,
  // or gradient accumulation's first micro-batch), charged per stage from that stage's backward operation on
  // (a parameter shared by two stages at the first); the profiling step's measured peak raised by those its
  // state did not make (context_for_grads: the profiling step may be the first, before any gradient exists,
  // or a later micro-batch, after they do).
  const StepReadings& readings = **shape.readings;
  const std::vector<int64_t> grads = grads_to_make();
  StepContext context = context_for_grads(step_context(readings), grads);
  Chain chain = *shape.chain;
  if (options_.agree()) {
    // Every rank plans from the maximum over the ranks of every figure (PlanFigures' encoding: the smallest
    // bandwidth), and so makes the same plan.
    PlanFigures figures = plan_figures(chain, context);
    const size_t n_ints = figures.ints.size(), n_reals = figures.reals.size();
    std::vector<torch::Tensor> numbers{torch::tensor(figures.ints, torch::kInt64),
                                       torch::tensor(figures.reals, torch::kFloat64)};
    options_.agree()(numbers);
    TORCH_CHECK(numbers.size() == 2 && numbers[0].numel() == static_cast<int64_t>(n_ints) &&
                    numbers[1].numel() == static_cast<int64_t>(n_reals),
                kWho, ": PlannedOptions::agree changed the number of values");
    const torch::Tensor ints = numbers[0].to(torch::kInt64).contiguous();
    const torch::Tensor reals = numbers[1].to(torch::kFloat64).contiguous();
    figures.ints.assign(ints.data_ptr<int64_t>(), ints.data_ptr<int64_t>() + n_ints);
    figures.reals.assign(reals.data_ptr<double>(), reals.data_ptr<double>() + n_reals);
    try {
      set_plan_figures(chain, context, figures);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, kWho, ": the figures the ranks agreed on make no valid chain: ", e.what());
    }
    *shape.chain = chain;
    (*shape.rest)->peak_bytes = context.rest_peak_bytes;
    (*shape.rest)->ms = context.rest_ms;
  }
  int64_t budget = options_.budget();
  std::string fitted;  // how fit_device's budget was made, for the message
  if (options_.fit_device() != 0) {
    const memory::DeviceMemory& s = *shape.at_start;
    if (shape.whole) {
      // Read once, at the first planning after the step (the profiler's runs in the step's peak).
      shape.lost = lost_to_fragmentation(s.reserved_bytes, s.allocated_bytes, shape.whole->peak_over_base(),
                                         read_device(shape.device).reserved_bytes);
      shape.whole.reset();
    }
    DeviceRoom room;
    room.free_bytes = s.free_bytes;
    room.cached_bytes = std::max<int64_t>(0, s.reserved_bytes - s.allocated_bytes);
    room.total_bytes = s.total_bytes;
    room.lost_bytes = shape.lost;
    if (options_.agree()) {
      // One plan for the tightest rank's device: agree's maximum of the negated room is the least.
      std::vector<torch::Tensor> numbers{torch::tensor(
          std::vector<int64_t>{-room.free_bytes, -room.cached_bytes, -room.total_bytes, room.lost_bytes},
          torch::kInt64)};
      options_.agree()(numbers);
      TORCH_CHECK(numbers.size() == 1 && numbers[0].numel() == 4, kWho,
                  ": PlannedOptions::agree changed the number of values");
      const torch::Tensor r = numbers[0].to(torch::kInt64).contiguous();
      room.free_bytes = -r[0].item<int64_t>();
      room.cached_bytes = -r[1].item<int64_t>();
      room.total_bytes = -r[2].item<int64_t>();
      room.lost_bytes = r[3].item<int64_t>();
    }
    try {
      budget = shape.budget = device_budget(room, options_.fit_device());
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, kWho, ": ", e.what());
    }
    fitted = c10::str(" (fit_device ", options_.fit_device(), " of ", describe_room(room), ")");
  }
  if (shape.lowered > 0) {
    // replan_on_overshoot: below the budget by what a planned step held above its prediction.
    budget -= shape.lowered;
    fitted += c10::str(" (lowered by ", shape.lowered, " bytes: replan_on_overshoot)");
  }
  try {
    // Offloading and group assignments are planned by the per-layer planner; otherwise the optimal one
    // (recomputation across stages).
    const bool per_layer = options_.planner().offload || options_.groups();
    StepPlan planned = options_.choose_plan()
                           ? chosen_plan(chain, context, budget)
                           : plan_step(chain, context, std::max<int64_t>(budget, 1),
                                       per_layer ? "per-layer" : "optimal", options_.planner());
    shape.plan = std::move(planned.plan);
    shape.predicted = planned.step_peak_bytes;
    shape.grads_charged = grads;
    auto words = std::make_shared<OutOfMemory>();
    words->who = kWho;
    words->plan = shape.plan->to_string();
    words->budget_bytes = budget;
    words->budget_words = fitted;
    words->predicted_peak_bytes = shape.predicted;
    shape.out_of_memory = std::move(words);
  } catch (const InfeasibleBudget& e) {
    TORCH_CHECK(
        false, kWho, ": the budget of ", budget, " bytes", fitted, " is below the least feasible one, ",
        e.min_bytes(),
        " bytes (the step's peak above the bytes alive when forward() is called, with the rest of the "
        "step measured at ",
        context.rest_peak_bytes, " bytes)");
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, kWho, ": ", e.what());
  }
}

std::vector<int64_t> PlannedImpl::grads_to_make() const {
  std::vector<int64_t> bytes(stages_.size(), 0);
  std::unordered_set<const c10::TensorImpl*> seen;
  for (size_t i = stages_.size(); i-- > 0;) {  // the backward pass meets the last stage first
    if (!stages_[i].module) continue;
    for (const auto& p : stages_[i].module->parameters())
      if (p.requires_grad() && !p.grad().defined() && seen.insert(p.unsafeGetTensorImpl()).second)
        bytes[i] += static_cast<int64_t>(p.nbytes());
  }
  return bytes;
}

namespace {
// The plan `shape` keeps for a step that begins with `grads` to make (PlannedImpl::grads_to_make) besides the
// plan in force, or nullptr.
template <typename Shape>
auto kept_for(Shape& shape, const std::vector<int64_t>& grads) -> decltype(&shape.other_plans.front()) {
  for (auto& other : shape.other_plans)
    if (other.grads_charged == grads) return &other;
  return nullptr;
}
int64_t sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}
}  // namespace

void PlannedImpl::plan_for_grads(Shape& shape, const std::vector<int64_t>& grads, bool lockstep) {
  auto meet = [&] {
    // Under agree, some rank makes a plan at this call: agree's collectives met with a plan not kept.
    Shape spare = shape;
    make_plan(spare);
  };
  if (shape.grads_charged == grads) {
    if (lockstep) meet();
    return;
  }
  Shape::ForGrads in_force{shape.grads_charged, *shape.plan, shape.predicted, shape.out_of_memory};
  if (Shape::ForGrads* kept = kept_for(shape, grads)) {
    if (lockstep) meet();
    shape.grads_charged = kept->grads_charged;
    shape.plan = kept->plan;
    shape.predicted = kept->predicted;
    shape.out_of_memory = kept->out_of_memory;
    *kept = std::move(in_force);
    return;
  }
  try {
    make_plan(shape);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.msg(), ". This step began with ", sum(grads),
                " bytes of the stages' parameter gradients none, which its backward pass makes; the plan in ",
                "force, ", in_force.plan.to_string(), ", was made for steps that began with ",
                sum(in_force.grads_charged), " bytes of them none, and is kept for such steps");
  }
  shape.other_plans.push_back(std::move(in_force));
  // A few states at most (gradient accumulation has two); the oldest made again if it comes back.
  if (shape.other_plans.size() > 3) shape.other_plans.erase(shape.other_plans.begin());
}

void PlannedImpl::plan_in_lockstep() {
  // Under agree every rank profiled at the same step (profile_in_lockstep), each its own shape: each plans it
  // here, at the next call, whatever that call's shape, so that agree's collectives meet. A budget no plan
  // fits is that shape's error, raised at its calls (the ranks agreed on the figures, so each refuses alike).
  for (auto& [key, shape] : shapes_) {
    if (shape.plan || !shape.chain || !*shape.readings || shape.plan_error) continue;
    try {
      make_plan(shape);
    } catch (const c10::Error&) {
      shape.plan_error = std::current_exception();
    }
  }
}

void PlannedImpl::profile_in_lockstep(Shape& shape) {
  // One collective of one number per training call: whether this rank's shape has no plan (new to it, or a
  // borrowed plan that held more than its prediction). Where any rank's has none, every rank profiles this
  // step, one whose shape is planned measuring its step again (its profile kept), so that all plan together
  // at the next call. Without it, a rank that profiled alone reached agree's collective while the others
  // reached their next one (DataParallel's all-reduce): Gloo aborted, NCCL would hang.
  const bool alone = !shape.plan;
  const std::vector<int64_t> grads = grads_to_make();
  const bool new_plan = !alone && shape.grads_charged != grads && !kept_for(shape, grads);
  std::vector<torch::Tensor> numbers{torch::tensor(std::vector<int64_t>{alone      ? 2
                                                                        : new_plan ? 1
                                                                                   : 0},
                                                   torch::kInt64)};
  options_.agree()(numbers);
  TORCH_CHECK(numbers.size() == 1 && numbers[0].numel() == 1, kWho,
              ": PlannedOptions::agree changed the number of values");
  const int64_t most = numbers[0].to(torch::kInt64).item<int64_t>();
  if (alone) return;
  if (most < 2) {
    // Every rank's shape has a plan: the one for the gradients this step begins with, made at this call by
    // every rank where any rank has none for its state.
    plan_for_grads(shape, grads, most == 1);
    return;
  }
  if (shape.borrowed) {
    shape = Shape();  // profiled on its own
    return;
  }
  Shape again;
  again.chain = std::move(shape.chain);
  again.profile_loaded = shape.profile_loaded;
  again.profile_seconds = shape.profile_seconds;
  again.steps_before_plan = shape.steps_before_plan;
  shape = std::move(again);
}

bool PlannedImpl::is_planned() const {
  return last_ && last_->plan.has_value();
}
const Plan* PlannedImpl::plan() const {
  return last_ && last_->plan ? &*last_->plan : nullptr;
}
const Chain* PlannedImpl::chain() const {
  return last_ && last_->chain ? &*last_->chain : nullptr;
}
detail::OutOfMemoryWords PlannedImpl::out_of_memory_words(const Shape& shape,
                                                          std::shared_ptr<memory::PeakWindow> window,
                                                          c10::Device device) const {
  // Everything by value: the backward pass may run after this module is gone.
  std::shared_ptr<const OutOfMemory> known = shape.out_of_memory;
  std::function<memory::DeviceMemory(c10::Device)> reader;
  if (options_.read_device())
    reader = options_.read_device();
  else if (device.is_cuda())
    reader = memory::device_memory;
  return [known = std::move(known), window = std::move(window), device, reader](c10::Error& e,
                                                                                const std::string& where) {
    OutOfMemory o = *known;
    o.where = where;
    o.held_bytes = std::max<int64_t>(0, window->active_over_base());
    if (reader) {
      const memory::DeviceMemory m = reader(device);
      o.free_bytes = m.free_bytes;
      o.reserved_bytes = m.reserved_bytes;
      o.allocated_bytes = m.allocated_bytes;
    }
    const int64_t fits = budget_that_would_fit(o);
    e.add_context(describe_out_of_memory(o, fits > 0 ? "a Planned made with PlannedOptions().budget(" +
                                                           std::to_string(fits) +
                                                           ") plans for it (its first step profiles)"
                                                     : std::string()));
  };
}

memory::DeviceMemory PlannedImpl::read_device(c10::Device device) const {
  return options_.read_device() ? options_.read_device()(device) : memory::device_memory(device);
}
int64_t PlannedImpl::budget_bytes() const {
  if (options_.fit_device() == 0) return options_.budget();
  return last_ ? last_->budget : -1;
}
int64_t PlannedImpl::predicted_peak_bytes() const {
  return last_ ? last_->predicted : -1;
}
int64_t PlannedImpl::last_peak_bytes() const {
  return last_ ? *last_->last_peak : -1;
}
std::optional<double> PlannedImpl::prediction_error() const {
  if (!last_ || last_->predicted <= 0 || *last_->last_peak < 0) return std::nullopt;
  return check_prediction(last_->predicted, *last_->last_peak, std::max<int64_t>(1, budget_bytes())).error;
}
int64_t PlannedImpl::budget_lowered_bytes() const {
  return last_ ? last_->lowered : 0;
}
int64_t PlannedImpl::profiling_steps() const {
  return last_ ? last_->steps_before_plan : 0;
}
int64_t PlannedImpl::profiled_shapes() const {
  int64_t n = 0;
  for (const auto& [key, shape] : shapes_)
    n += shape.profiled();
  return n;
}

int64_t PlannedImpl::borrowed_shapes() const {
  int64_t n = 0;
  for (const auto& [key, shape] : shapes_)
    n += shape.borrowed;
  return n;
}
bool PlannedImpl::plan_borrowed() const {
  return last_ && last_->borrowed;
}

void PlannedImpl::borrow(const Key& key) {
  std::vector<InputShape> planned;
  std::vector<const Shape*> donors;
  for (const auto& [k, shape] : shapes_)
    if (shape.plan && !shape.borrowed && k.form == key.form) {
      planned.push_back(k.sizes);
      donors.push_back(&shape);
    }
  const int64_t j = covering_shape(planned, key.sizes);
  if (j < 0) return;
  // The covering shape's plan with what it was made from (its profile and readings, shared: never written
  // again), measured on its own.
  Shape shape = *donors[static_cast<size_t>(j)];
  shape.borrowed = true;
  shape.last_peak = std::make_shared<int64_t>(-1);
  shape.steps_before_plan = 0;
  shape.profile_seconds = 0;
  shape.whole.reset();
  shapes_.emplace(key, std::move(shape));
}

void PlannedImpl::check_measured(const Key& key, Shape& shape) {
  if (!shape.plan || *shape.last_peak < 0 || shape.predicted <= 0) return;
  const int64_t budget = budget_bytes();
  const PredictionCheck check =
      check_prediction(shape.predicted, *shape.last_peak, std::max<int64_t>(1, budget));
  std::ostringstream off;  // the share off the prediction, in percent
  off << std::fixed << std::setprecision(1) << 100 * std::abs(check.error);
  if (shape.borrowed) {
    // A larger shape's plan: below its prediction is what was expected. Above it (a model whose memory does
    // not only grow with its inputs' sizes), this step profiles the shape.
    if (!check.beyond || check.error <= 0) return;
    TORCH_WARN(
        kWho, ": a step of the input shape ", describe_key(key),
        " ran the plan of a larger shape (PlannedOptions::borrow_plans) and held ", *shape.last_peak,
        " bytes above its base, ", off.str(), "% above that plan's prediction of ", shape.predicted,
        " bytes (this model's memory does not only grow with its inputs' sizes): this step profiles the ",
        "shape, which is planned on its own from now on");
    shape = Shape();
    return;
  }
  if (!check.beyond) return;
  // Said (and, above, planned again) once per input shape and direction: it cannot loop. Before (found
  // 2026-12-07), once per shape: a step below its prediction silenced a later one above it (gradient
  // accumulation's two states run two plans of one shape).
  bool& said = check.error > 0 ? shape.overshoot_checked : shape.undershoot_said;
  if (said) return;
  said = true;
  std::ostringstream words;
  words << kWho << ": a planned step of the input shape " << describe_key(key) << " held " << *shape.last_peak
        << " bytes above its base, " << off.str() << "% " << (check.error > 0 ? "above" : "below")
        << " the plan's prediction of " << shape.predicted << " bytes (tolerance " << std::fixed
        << std::setprecision(0) << 100 * kPredictionTolerance << "%; plan " << shape.plan->to_string() << ")";
  if (check.error < 0) {
    words
        << "; the plan recomputes more than the budget needs (a step that held less is not planned again for "
           "more: nothing measured says a faster plan would fit)";
  } else if (!options_.replan_on_overshoot()) {
    words << ", budget " << budget
          << " bytes; PlannedOptions::replan_on_overshoot plans again for the budget less the overshoot";
  } else {
    // Planned again below the budget by the overshoot; where no plan fits there, the plan in force is kept.
    std::optional<Plan> plan = shape.plan;
    const int64_t predicted = shape.predicted;
    std::shared_ptr<const OutOfMemory> out_of_memory = shape.out_of_memory;
    shape.lowered = budget - check.replan_budget_bytes;
    try {
      make_plan(shape);
      shape.other_plans.clear();  // made for the budget before it was lowered
      *shape.last_peak = -1;      // the plan in force has not been measured yet
      words << "; replan_on_overshoot: planned again below the budget by " << shape.lowered
            << " bytes: the next step runs the plan " << shape.plan->to_string() << ", predicted "
            << shape.predicted << " bytes";
    } catch (const c10::Error&) {
      words << "; replan_on_overshoot: no plan fits below the budget by " << shape.lowered
            << " bytes; the plan is unchanged";
      shape.plan = std::move(plan);
      shape.predicted = predicted;
      shape.out_of_memory = std::move(out_of_memory);
      shape.lowered = 0;
    }
  }
  TORCH_WARN(words.str());
}

void PlannedImpl::new_shape(const Key& key) {
  if (many_shapes_said_) return;
  std::vector<const Key*> keys;
  double seconds = 0;
  for (const auto& [k, shape] : shapes_)
    if (shape.profiled()) {
      keys.push_back(&k);
      seconds += shape.profile_seconds;
    }
  keys.push_back(&key);
  if (static_cast<int64_t>(keys.size()) < kProfiledShapesWarnedAt) return;
  many_shapes_said_ = true;
  // The shapes, by the first tensor whose shape differs between them (the input's, or an extra argument's);
  // where none does, the keys differ in their dtypes or autocast state.
  std::string which = "shapes of the input and the extra arguments, their dtypes or the autocast state";
  std::ostringstream shapes;
  for (size_t j = 0; j < key.sizes.size(); ++j) {
    bool differ = false;
    for (const Key* k : keys)
      differ = differ || k->sizes.size() != key.sizes.size() || k->sizes[j] != key.sizes[j];
    if (!differ) continue;
    which = j == 0 ? "the input's shapes" : "extra argument " + std::to_string(j - 1) + "'s shapes";
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i]->sizes.size() != key.sizes.size()) continue;
      shapes << (shapes.tellp() > 0 ? ", " : ": ") << c10::IntArrayRef(keys[i]->sizes[j]);
    }
    break;
  }
  std::ostringstream took;
  took << std::fixed << std::setprecision(1) << seconds;
  TORCH_WARN(
      kWho, ": this training step's input shape is new, so its step profiles the stages, as the first step ",
      "of each new shape does: ", keys.size(), " shapes so far (", which, shapes.str(), "), ", took.str(),
      " s of profiling besides those steps' own runs. ",
      "Inputs padded to a few lengths are profiled once per length; profiled_shapes() counts the shapes ",
      "(remat/planned.h). Said once");
}
const RestOfStep* PlannedImpl::rest_of_step() const {
  return last_ && *last_->rest ? &**last_->rest : nullptr;
}

const StepReadings* PlannedImpl::step_readings() const {
  return last_ && *last_->readings ? &**last_->readings : nullptr;
}

}  // namespace remat
