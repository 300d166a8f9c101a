#include "remat/sequential.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "detail/compat.h"
#include "detail/region.h"

namespace remat {
namespace {

using detail::AutocastScope;
using detail::AutocastState;
using detail::BufferRestore;
using detail::check_rng_replayed;
using detail::RngReplay;
using detail::RngRollback;
using detail::RngState;
using detail::TensorMeta;

// What the executor holds between operations, and everything its backward needs.
struct ExecState final : torch::CustomClassHolder {
  std::vector<StageFn> stages;
  Plan plan;
  size_t loss_at = 0;
  bool preserve_rng = true;
  bool check = true;
  bool input_requires_grad = false;
  std::vector<c10::DeviceIndex> cuda_devices;
  AutocastState autocast;  // of the forward pass, re-entered by every recompute
  std::shared_ptr<ExecutionStats> stats;
  std::vector<at::Tensor> params;                     // the node's parameter inputs (require grad, each once)
  std::vector<std::vector<at::Tensor>> stage_params;  // per stage, those that require grad

  // Per stage: the RNG state of its first run and its output's metadata.
  std::vector<RngState> rng, rng_end;  // at the start and at the end of its first run
  std::vector<bool> ran;
  std::vector<TensorMeta> metas;

  // Held activations: plain a_i (values without graph), or abar_{i+1}: stage i's output with its graph from a
  // detached input leaf. Index i in 0..n.
  struct Held {
    at::Tensor plain;
    at::Tensor leaf, output;  // abar
  };
  std::vector<Held> held;
  at::Tensor grad;  // d_j
  int64_t grad_at = -1;
};

// The plan is valid and has `count` stages ("...but <has> <count><unit>" otherwise).
void check_plan_fits(const Plan& plan, size_t count, const char* who, const char* has, const char* unit) {
  TORCH_CHECK(plan.num_stages == static_cast<int64_t>(count), who, ": the plan is for ", plan.num_stages,
              " stages but ", has, count, unit);
  try {
    check_plan(plan);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, who, ": invalid plan: ", e.what());
  }
}

// The executor is one autograd node of its own and takes the stages' modules from StageFn::module: it refuses
// the options it cannot honour rather than ignore them.
void check_executor_options(const CheckpointOptions& options, const char* who) {
  TORCH_CHECK(options.mode() == CheckpointMode::kNonReentrant, who,
              ": CheckpointOptions::mode kReentrant is not a mode of the plan executor, which recomputes "
              "through one autograd node of its own; leave the mode at its default, or use "
              "checkpoint_sequential / checkpoint_segments, which run each segment in the mode asked");
  TORCH_CHECK(
      options.modules().empty(), who, ": CheckpointOptions::modules has ", options.modules().size(),
      " modules, but the plan executor takes each stage's module from StageFn::module; set them there");
}

at::Tensor value_of(const ExecState::Held& h) {
  return h.plain.defined() ? h.plain : h.output.detach();
}

// Runs the forward operation `op` of the plan.
void run_forward(ExecState& st, const Op& op) {
  const int64_t i = op.stage;
  ExecState::Held& in = st.held[i];
  const at::Tensor x = value_of(in).detach();
  const StageFn& stage = st.stages[i];

  // The first run of a stage draws its random numbers; later runs replay them, restore the buffers and run
  // under the forward pass's autocast state.
  std::optional<RngReplay> replay;
  std::optional<BufferRestore> buffers;
  std::optional<AutocastScope> autocast;
  if (!st.ran[i]) {
    if (st.preserve_rng) st.rng[i] = RngState::capture(st.cuda_devices);
  } else {
    replay.emplace(st.rng[i], st.cuda_devices);
    if (stage.module) buffers.emplace(std::vector<std::shared_ptr<torch::nn::Module>>{stage.module});
    autocast.emplace(st.autocast);
  }

  at::Tensor out;
  ExecState::Held& next = st.held[i + 1];
  if (op.kind == OpKind::kForwardAll) {
    at::AutoGradMode grad(true);
    at::Tensor leaf = x;
    const bool floating = at::isFloatingType(x.scalar_type()) || at::isComplexType(x.scalar_type());
    if (floating && (i > 0 || st.input_requires_grad)) leaf = x.detach().requires_grad_(true);
    out = stage.fn(leaf);
    TORCH_CHECK(out.defined(), "remat::run_plan: stage ", i, " ('", stage.name,
                "') returned an undefined tensor");
    next.plain = at::Tensor();
    next.leaf = leaf;
    next.output = out;
  } else {
    at::NoGradGuard no_grad;
    out = stage.fn(x);
    TORCH_CHECK(out.defined(), "remat::run_plan: stage ", i, " ('", stage.name,
                "') returned an undefined tensor");
    next.plain = out;
    if (op.kind == OpKind::kForwardNoSave && i > 0 && in.plain.defined()) in.plain = at::Tensor();
  }
  if (st.ran[i]) {
    check_rng_replayed(st.rng_end[i], "remat::run_plan",
                       "stage " + std::to_string(i) + " ('" + stage.name + "')");
  } else if (st.preserve_rng) {
    st.rng_end[i] = RngState::capture(st.cuda_devices);
    // A stage that drew nothing needs no replay: its recomputes leave the generators alone.
    if (st.rng_end[i].same_as(st.rng[i])) st.rng[i] = st.rng_end[i] = RngState();
  }
  const TensorMeta meta = TensorMeta::of(out);
  if (!st.ran[i]) {
    st.metas[i] = meta;
    st.ran[i] = true;
  } else if (st.check) {
    TORCH_CHECK(meta == st.metas[i], "remat::run_plan: determinism check failed: stage ", i, " ('",
                stage.name, "') returned ", meta.str(), " in a recompute but ", st.metas[i].str(),
                " in its first run");
  }
  if (st.stats) st.stats->forward_calls[i] += 1;
}

void accumulate_into(at::Tensor& sum, const at::Tensor& g) {
  if (!g.defined()) return;
  sum = sum.defined() ? sum + g : g;
}

// Stage i's backward: d_i from d_{i+1} through abar_{i+1}; parameter gradients accumulated into .grad (under
// backward()) or summed into `param_grads` (under torch::autograd::grad, which returns them).
void run_backward(ExecState& st, int64_t i, bool accumulating, bool keep_graph,
                  std::vector<at::Tensor>& param_grads,
                  const std::unordered_map<c10::TensorImpl*, size_t>& param_index) {
  ExecState::Held& abar = st.held[i + 1];
  ExecState::Held& in = st.held[i];
  at::Tensor d_in;
  if (abar.output.requires_grad() && st.grad.defined()) {
    std::vector<at::Tensor> targets;
    const bool leaf_grad = abar.leaf.requires_grad();
    if (leaf_grad) targets.push_back(abar.leaf);
    for (const auto& p : st.stage_params[i])
      targets.push_back(p);
    const bool create_graph = at::GradMode::is_enabled();
    if (!targets.empty()) {
      if (accumulating) {
        // The leaf is the executor's own, but with retain_graph a later backward finds it again (the state is
        // copied, the tensors shared): start its gradient afresh, or the second pass would add the first's.
        if (leaf_grad) abar.leaf.mutable_grad() = at::Tensor();
        torch::autograd::backward({abar.output}, {st.grad}, keep_graph, create_graph, targets);
        if (leaf_grad) d_in = abar.leaf.grad();
      } else {
        auto grads = torch::autograd::grad({abar.output}, targets, {st.grad}, keep_graph, create_graph,
                                           /*allow_unused=*/true);
        size_t k = 0;
        if (leaf_grad) d_in = grads[k++];
        for (; k < grads.size(); ++k)
          accumulate_into(param_grads[param_index.at(targets[k].unsafeGetTensorImpl())], grads[k]);
      }
    }
  }
  if (!d_in.defined() && i > 0) d_in = at::zeros_like(value_of(in));
  abar = ExecState::Held{};
  st.grad = d_in;
  st.grad_at = i;
  if (i > 0 && in.plain.defined()) in.plain = at::Tensor();
}

// The forward operations up to the loss; returns a_n (values, no graph).
at::Tensor run_forward_pass(ExecState& st, const at::Tensor& input) {
  at::AutoGradMode no_grad(false);  // Fa operations turn it on for their stage
  st.held[0].plain = input.detach();
  {
    // A stage that throws leaves the RNG and every stage's buffers as they were.
    const RngState start = st.preserve_rng ? RngState::capture(st.cuda_devices) : RngState();
    RngRollback rng(start);
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    for (const auto& stage : st.stages) {
      if (stage.module) modules.push_back(stage.module);
    }
    BufferRestore buffers(modules, /*only_on_unwind=*/true);
    for (size_t k = 0; k < st.loss_at; ++k)
      run_forward(st, st.plan.ops[k]);
  }
  const int64_t n = st.plan.num_stages;
  // A fresh tensor (never one a stage handed out, which may be its own input or a module's tensor) that the
  // node can own.
  at::Tensor output = value_of(st.held[n]).detach();
  if (st.held[n].plain.defined()) st.held[n].plain = at::Tensor();  // the loss frees a plain a_n
  return output;
}

// The plan's backward pass as one autograd node. It is a plain Node rather than a custom Function because a
// custom Function's backward receives a copy of its gradient, and LibTorch keeps the original alive until the
// node returns: d_n would then stay for the whole backward pass, one activation above what simulate()
// charges. Node::apply receives the engine's own list and takes d_n out of it, so d_n is freed after stage
// n-1's backward, as the plan's model says.
struct ExecNode final : torch::autograd::Node {
  explicit ExecNode(c10::intrusive_ptr<ExecState> state) : state_(std::move(state)) {}

  std::string name() const override { return "remat::RunPlanBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    state_.reset();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(state_, "remat::run_plan: backward through a plan's graph a second time, after its saved ",
                "activations were freed; pass retain_graph=true to the first backward");
    at::Tensor d_n = std::move(grads[0]);
    grads.clear();
    const size_t num_params = state_->params.size();
    torch::autograd::variable_list result(1 + num_params);
    if (!d_n.defined()) return result;
    // With retain_graph, run on a copy so that a later backward finds the state of the loss again.
    c10::intrusive_ptr<ExecState> run = state_;
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    if (keep_graph) run = c10::make_intrusive<ExecState>(*state_);
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    const bool accumulating = exec_info == nullptr || exec_info->empty();

    std::unordered_map<c10::TensorImpl*, size_t> param_index;
    for (size_t k = 0; k < num_params; ++k)
      param_index.emplace(run->params[k].unsafeGetTensorImpl(), k);
    std::vector<at::Tensor> param_grads(num_params);

    run->grad = std::move(d_n);
    run->grad_at = run->plan.num_stages;
    const auto& ops = run->plan.ops;
    for (size_t k = run->loss_at + 1; k < ops.size(); ++k) {
      try {
        if (ops[k].kind == OpKind::kBackward) {
          run_backward(*run, ops[k].stage, accumulating, keep_graph, param_grads, param_index);
        } else {
          run_forward(*run, ops[k]);
        }
      } catch (c10::Error& e) {
        e.add_context("remat::run_plan: while running operation " + std::to_string(k) + " of the plan (" +
                      op_name(ops[k].kind) + (ops[k].stage >= 0 ? std::to_string(ops[k].stage) : "") +
                      ") in the backward pass");
        throw;
      }
    }
    result[0] = run->input_requires_grad ? run->grad : at::Tensor();
    for (size_t k = 0; k < num_params; ++k)
      result[1 + k] = std::move(param_grads[k]);
    run->grad = at::Tensor();
    return result;
  }

 private:
  std::mutex mutex_;
  c10::intrusive_ptr<ExecState> state_;
};

}  // namespace

std::vector<StageFn> stages_of(torch::nn::Sequential& seq) {
  TORCH_CHECK(!seq.is_empty() && seq->size() > 0, "remat::stages_of: the Sequential is empty");
  std::vector<StageFn> stages;
  for (size_t i = 0; i < seq->size(); ++i) {
    auto module = seq->ptr(i);
    std::string type = module->name();
    for (const std::string prefix : {"torch::nn::"}) {
      if (type.rfind(prefix, 0) == 0) type = type.substr(prefix.size());
    }
    if (type.size() > 4 && type.compare(type.size() - 4, 4, "Impl") == 0) type.resize(type.size() - 4);
    torch::nn::Sequential shared = seq;
    stages.push_back(StageFn{
        std::to_string(i) + ":" + type,
        [shared, i](const torch::Tensor& x) mutable { return shared->begin()[i].forward(x); }, module});
  }
  return stages;
}

torch::Tensor run_plan(const std::vector<StageFn>& stages, const Plan& plan, const torch::Tensor& input,
                       const CheckpointOptions& options, std::shared_ptr<ExecutionStats> stats) {
  check_plan_fits(plan, stages.size(), "remat::run_plan", "there are ", "");
  TORCH_CHECK(input.defined(), "remat::run_plan: the input is an undefined tensor");
  check_executor_options(options, "remat::run_plan");
  if (stats) stats->forward_calls.assign(stages.size(), 0);
  if (!at::GradMode::is_enabled()) {
    torch::Tensor h = input;
    for (size_t i = 0; i < stages.size(); ++i) {
      h = stages[i].fn(h);
      if (stats) stats->forward_calls[i] += 1;
    }
    return h;
  }
  auto st = c10::make_intrusive<ExecState>();
  st->stages = stages;
  st->plan = plan;
  for (size_t k = 0; k < plan.ops.size(); ++k) {
    if (plan.ops[k].kind == OpKind::kLoss) st->loss_at = k;
  }
  st->preserve_rng = options.preserve_rng_state();
  st->check = options.determinism_check();
  st->input_requires_grad = input.requires_grad();
  st->cuda_devices = detail::cuda_devices_of({input});
  st->autocast = AutocastState::current();
  st->stats = std::move(stats);
  const size_t n = stages.size();
  st->rng.resize(n);
  st->rng_end.resize(n);
  st->ran.assign(n, false);
  st->metas.resize(n);
  st->held.resize(n + 1);
  st->stage_params.resize(n);
  std::unordered_map<c10::TensorImpl*, size_t> seen;
  for (size_t i = 0; i < n; ++i) {
    if (!stages[i].module) continue;
    // A module registered twice in a stage (a shared layer) lists its parameters twice: take each once.
    std::unordered_set<c10::TensorImpl*> in_stage;
    for (const auto& p : stages[i].module->parameters(/*recurse=*/true)) {
      if (!p.requires_grad() || !in_stage.insert(p.unsafeGetTensorImpl()).second) continue;
      st->stage_params[i].push_back(p);
      if (seen.emplace(p.unsafeGetTensorImpl(), st->params.size()).second) st->params.push_back(p);
    }
  }
  std::vector<at::Tensor> node_inputs{input};
  node_inputs.insert(node_inputs.end(), st->params.begin(), st->params.end());
  at::Tensor output = run_forward_pass(*st, input);
  if (torch::autograd::any_variable_requires_grad(node_inputs) &&
      torch::autograd::isDifferentiableType(output.scalar_type())) {
    auto node = detail::compat::make_node<ExecNode>(st);
    node->set_next_edges(torch::autograd::collect_next_edges(node_inputs));
    torch::autograd::create_gradient_edge(output, std::move(node));
  }
  return output;
}

// -------------------------------------------------------------------------------------------------------------

CheckpointedSequentialImpl::CheckpointedSequentialImpl(torch::nn::Sequential seq, Plan plan,
                                                       CheckpointOptions options)
    : seq_(register_module("seq", std::move(seq))), options_(std::move(options)) {
  check_executor_options(options_, "remat::CheckpointedSequential");
  set_plan(std::move(plan));
}

void CheckpointedSequentialImpl::set_plan(Plan plan) {
  TORCH_CHECK(seq_->size() > 0, "remat::CheckpointedSequential: the Sequential is empty");
  check_plan_fits(plan, seq_->size(), "remat::CheckpointedSequential", "the Sequential has ", " modules");
  plan_ = std::move(plan);
}

void CheckpointedSequentialImpl::replan(const Chain& chain, int64_t budget_bytes,
                                        const PlannerOptions& options) {
  TORCH_CHECK(chain.size() == static_cast<int64_t>(seq_->size()),
              "remat::CheckpointedSequential::replan: the chain has ", chain.size(),
              " stages but the Sequential has ", seq_->size(), " modules");
  set_plan(optimal(chain, budget_bytes, options));
}

torch::Tensor CheckpointedSequentialImpl::forward(const torch::Tensor& input) {
  return run_plan(stages_of(seq_), plan_, input, options_, stats_);
}

// -------------------------------------------------------------------------------------------------------------

torch::Tensor checkpoint_segments(torch::nn::Sequential& seq, const std::vector<int64_t>& starts,
                                  const torch::Tensor& input, const SequentialOptions& options) {
  TORCH_CHECK(!seq.is_empty() && seq->size() > 0,
              "remat::checkpoint_segments: the Sequential is empty (0 modules)");
  const int64_t n = static_cast<int64_t>(seq->size());
  try {
    segmented(n, starts, options.checkpoint_last_segment());  // checks the starts
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "remat::checkpoint_segments: ", e.what(), " (", n, " modules)");
  }
  TORCH_CHECK(input.defined(), "remat::checkpoint_segments: the input is an undefined tensor");
  // Each segment is one remat::checkpoint region in the mode asked, its modules declared (their buffers
  // restored after the recompute; in kReentrant their parameters trained), as PyTorch's checkpoint_sequential
  // does with use_reentrant. The last segment runs plainly unless asked.
  torch::Tensor h = input;
  for (size_t j = 0; j < starts.size(); ++j) {
    const int64_t begin = starts[j];
    const int64_t end = j + 1 < starts.size() ? starts[j + 1] : n;
    const bool last = j + 1 == starts.size();
    CheckpointOptions segment_options = options.checkpoint();
    bool can_get_grad = h.requires_grad();
    for (int64_t i = begin; i < end; ++i) {
      auto module = seq->ptr(static_cast<size_t>(i));
      segment_options.modules().push_back(module);
      for (const auto& p : module->parameters())
        can_get_grad = can_get_grad || p.requires_grad();
    }
    torch::nn::Sequential shared = seq;
    auto run = [shared, begin, end](const torch::Tensor& x) mutable {
      torch::Tensor y = x;
      for (int64_t i = begin; i < end; ++i)
        y = shared->begin()[static_cast<size_t>(i)].forward(y);
      return y;
    };
    // A segment nothing in which can receive a gradient records no graph and keeps nothing: it runs as is.
    if ((last && !options.checkpoint_last_segment()) || !at::GradMode::is_enabled() || !can_get_grad) {
      h = run(h);
    } else {
      h = remat::checkpoint(run, h, segment_options);
    }
  }
  return h;
}

torch::Tensor checkpoint_sequential(torch::nn::Sequential& seq, int64_t segments, const torch::Tensor& input,
                                    const SequentialOptions& options) {
  const int64_t n = seq.is_empty() ? 0 : static_cast<int64_t>(seq->size());
  TORCH_CHECK(n > 0, "remat::checkpoint_sequential: the Sequential is empty (0 modules); segments was ",
              segments);
  TORCH_CHECK(segments >= 1 && segments <= n, "remat::checkpoint_sequential: segments must be in [1, ", n,
              "] (the Sequential has ", n, " modules), got ", segments);
  std::vector<int64_t> starts;
  const int64_t q = n / segments, r = n % segments;
  for (int64_t j = 0, at = 0; j < segments; ++j) {
    starts.push_back(at);
    at += q + (j < r ? 1 : 0);
  }
  return checkpoint_segments(seq, starts, input, options);
}

}  // namespace remat
