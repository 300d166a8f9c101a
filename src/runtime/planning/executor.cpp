// The plan executor: runs a Plan (remat/planner/plan.h) over a chain of stages as one autograd node of its
// own. Its forward runs the plan's operations up to the loss; its backward replays the rest, each stage's
// backward a nested autograd call from the stage's output.

#include "remat/executor.h"

#include "remat/sequential.h"

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "autograd/engine.h"
#include "autograd/hooks.h"
#include "autograd/nesting.h"
#include "checkpoint/region.h"
#include "detail/compat.h"
#include "offload/stage_offload.h"
#include "planning/out_of_memory.h"

namespace remat {

namespace {

using detail::AutocastCacheOff;
using detail::AutocastState;
using detail::backward_from;
using detail::BufferRestore;
using detail::check_rng_replayed;
using detail::Leaf;
using detail::NodeMark;
using detail::RecomputeScope;
using detail::region_reach;
using detail::RegionReach;
using detail::RngRecord;
using detail::RngRollback;
using detail::RngState;
using detail::TensorMeta;
using detail::UserPass;

// What the executor holds between operations, and everything its backward needs.
struct ExecState final : torch::CustomClassHolder {
  std::vector<StageFn> stages;
  Plan plan;
  std::vector<Policy> policies;  // plan.policies, resolved (Fk[name] runs under them)
  size_t loss_at = 0;
  bool preserve_rng = true;
  bool check = true;
  bool input_requires_grad = false;
  std::vector<c10::DeviceIndex> cuda_devices;
  AutocastState autocast;  // of the forward pass, re-entered by every recompute
  std::shared_ptr<ExecutionStats> stats;
  // remat::Planned's words for an out-of-memory error in the backward pass (empty outside Planned).
  detail::OutOfMemoryWords out_of_memory;
  std::vector<at::Tensor> params;                     // the node's parameter inputs (require grad, each once)
  std::vector<std::vector<at::Tensor>> stage_params;  // per stage, those that require grad

  // Per stage: the RNG states of its first run (at its start and its end) and its output's metadata.
  std::vector<RngRecord> rng;
  std::vector<bool> ran;
  // Runs of the stage's forward the plan has still to make (above 1 at its first run: its draws are
  // replayed).
  std::vector<int> forwards_left;
  // Per stage that runs again: what its first run wrote in place and read, as that run found it (its later
  // runs read the same: detail::ForwardWrites).
  std::vector<std::vector<detail::ForwardWrite>> forward_writes;
  std::vector<TensorMeta> metas;

  // Held activations: plain a_i (values without graph), or abar_{i+1}: stage i's output with its graph from a
  // detached input leaf. Index i in 0..n.
  struct Held {
    at::Tensor plain;
    at::Tensor leaf, output;  // abar
    NodeMark mark;            // where the stage's run with grad began creating autograd nodes
    // a_i on the host (Fc@host: the checkpointed stage's input), saved as autograd saves a tensor under the
    // stage's Offload, so that its hooks copy it and bring it back; read when neither of the above holds a_i.
    std::shared_ptr<torch::autograd::SavedVariable> host;
  };
  std::vector<Held> held;
  at::Tensor grad;  // d_j
  int64_t grad_at = -1;

  // Offloading (Fa@host, Fk@host, Fc@host, Fk{...h...}): per stage its Offload while what it saved is on the
  // host; when its copies are waited for and brought back (the plan's offload schedule, which simulate()
  // charges and the Python package follows too).
  OffloadOptions offload;
  std::vector<std::shared_ptr<Offload>> offloads;
  OffloadSchedule schedule;
};

// Carries out the schedule's points at one operation.
void carry_out(ExecState& st, const std::vector<OffloadPoint>& points) {
  for (const OffloadPoint& p : points) {
    const auto& o = st.offloads.at(static_cast<size_t>(p.stage));
    if (!o) continue;
    if (p.action == OffloadPoint::Action::kWaitToHost) {
      o->finish_copies();
    } else {
      o->prefetch();
    }
  }
}

// The plan is valid and has `count` stages ("...but <has> <count><unit>" otherwise).
void check_plan_fits(const Plan& plan, size_t count, const char* who, const char* has, const char* unit) {
  TORCH_CHECK(plan.num_stages == static_cast<int64_t>(count), who, ": the plan is for ", plan.num_stages,
              " stages but ", has, count, unit);
  try {
    check_plan(plan);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, who, ": invalid plan: ", e.what());
  }
  int64_t tag_fk = 0;
  for (const Op& op : plan.ops) {
    TORCH_CHECK(
        op.groups.empty() || !plan.group_names.empty(), who, ": the plan runs stage ", op.stage,
        " under a group assignment (", op_text(plan, op),
        ") but does not name the stage's saved groups (Plan::group_names, which the planners fill from "
        "a chain profiled with ProfileOptions::groups; a plan parsed from text has none)");
    TORCH_CHECK(!op.stream || !plan.stream_windows.empty(), who, ": the plan streams stage ", op.stage, " (",
                op_text(plan, op),
                ") but gives no window for it (Plan::stream_windows, which the planners fill from a chain "
                "profiled with offloading; a plan parsed from text has none)");
    tag_fk += op.kind == OpKind::kForwardKeep && op.policy < 0 && op.groups.empty();
  }
  TORCH_CHECK(tag_fk == 0 || !plan.keep.empty(), who, ": the plan has ", tag_fk,
              " Fk operations but no remat::keep tags to run them with (Plan::keep is empty)");
}

// The policies of the plan's Fk[name] operations, by index into Plan::policies: CheckpointOptions::policy
// when it has that name, else the preset of that name. A name no operation uses stays an empty Policy.
std::vector<Policy> resolve_policies(const Plan& plan, const CheckpointOptions& options, const char* who) {
  std::vector<bool> used(plan.policies.size(), false);
  for (const Op& op : plan.ops)
    if (op.policy >= 0) used.at(static_cast<size_t>(op.policy)) = true;
  std::vector<Policy> out;
  for (size_t k = 0; k < plan.policies.size(); ++k) {
    const std::string& name = plan.policies[k];
    if (!used[k]) {
      out.emplace_back();
      continue;
    }
    if (!options.policy().empty() && options.policy().name() == name) {
      out.push_back(options.policy());
      continue;
    }
    TORCH_CHECK(policy::is_preset(name), who, ": the plan keeps with policy '", name,
                "', which is not one of remat's presets (", policy::kPresetNames,
                "): pass it as CheckpointOptions().policy(...) named '", name, "'");
    out.push_back(policy::preset(name));
  }
  return out;
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
  if (h.plain.defined()) return h.plain;
  if (h.output.defined() || !h.host) return h.output.detach();
  return h.host->unpack();  // brought back from the host (prefetched when the backward pass came near)
}

// The Offload of an offloaded forward of `stage` (open from here until close()), with `also` (tensors the
// executor holds anyway) kept on the device.
std::shared_ptr<Offload> open_offload(const ExecState& st, const StageFn& stage, std::vector<at::Tensor> also,
                                      int64_t window = -1) {
  // On the CPU each copy's source is held until the plan's schedule waits for it, as on a GPU.
  return std::make_shared<Offload>(detail::stage_offload_options(st.offload, stage, std::move(also))
                                       .window(window)
                                       .hold_until_waited(true));
}

// Runs the forward operation `op` of the plan.
void run_forward(ExecState& st, const Op& op) {
  const int64_t i = op.stage;
  ExecState::Held& in = st.held[i];
  const at::Tensor x = value_of(in).detach();
  const StageFn& stage = st.stages[i];

  // The first run of a stage draws its random numbers; later runs replay them, restore the buffers and run
  // under the forward pass's autocast state.
  std::optional<RecomputeScope> recompute;
  std::optional<detail::ForwardWrites> writes;
  if (!st.ran[i]) {
    if (st.preserve_rng && st.forwards_left[static_cast<size_t>(i)] > 1) st.rng[i].begin(st.cuda_devices);
    if (st.forwards_left[static_cast<size_t>(i)] > 1) writes.emplace(std::vector<at::Tensor>{x});
  } else {
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    if (stage.module) modules.push_back(stage.module);
    recompute.emplace(st.rng[i].start, st.cuda_devices, modules, std::vector<at::Tensor>{x}, st.autocast,
                      &st.forward_writes[static_cast<size_t>(i)]);
  }
  // Autocast's cache off, kept or not (the Python package's rule: detail::AutocastCacheOff).
  const AutocastCacheOff cache_off;

  at::Tensor out;
  ExecState::Held& next = st.held[i + 1];
  if (op.kind == OpKind::kForwardAll || op.kind == OpKind::kForwardKeep) {
    at::AutoGradMode grad(true);
    at::Tensor leaf = x;
    const bool floating = at::isFloatingType(x.scalar_type()) || at::isComplexType(x.scalar_type());
    if (floating && (i > 0 || st.input_requires_grad)) leaf = x.detach().requires_grad_(true);
    const NodeMark mark = NodeMark::now();
    // Offloaded: what the stage's operators save (Fa@host), or what its checkpoint keeps (Fk@host: the kept
    // calls' outputs go through the Offload's hooks; its input, held by the executor, stays).
    // Fk{...}: its sent groups (answered kMustCpuOffload) go the same way, its kept ones (kMustSave) stay.
    std::shared_ptr<Offload> offload;
    // Fa@stream: the same, its copies within the plan's window each way, each tensor back ahead of its use.
    if (op.offloads())
      offload =
          open_offload(st, stage, {leaf}, op.stream ? st.plan.stream_windows.at(static_cast<size_t>(i)) : -1);
    if (op.kind == OpKind::kForwardKeep) {
      // Fk: the stage as a checkpoint that keeps its kept calls' outputs; B recomputes the rest through it.
      auto options = CheckpointOptions().preserve_rng_state(st.preserve_rng).determinism_check(st.check);
      if (!op.groups.empty()) {
        options.policy(group_policy(st.plan.group_names.at(static_cast<size_t>(i)), op.groups));  // Fk{khr}
      } else if (op.policy < 0) {
        options.keep(st.plan.keep);
      } else {
        options.policy(st.policies[static_cast<size_t>(op.policy)]);  // Fk[name]
      }
      if (stage.module) options.modules({stage.module});
      out = checkpoint(stage.fn, leaf, options);
    } else {
      out = stage.fn(leaf);
    }
    if (offload) {
      offload->close();
      st.offloads[i] = std::move(offload);
    }
    TORCH_CHECK(out.defined(), "remat::run_plan: stage ", i, " ('", stage.name,
                "') returned an undefined tensor");
    next.mark = mark;
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
    if (op.offload) {
      // Fc@host: the input it holds for its recompute goes to the host (and leaves the device unless another
      // holder keeps it there: the stage before holding it as its output, or the caller's input a_0).
      auto offload = open_offload(st, stage, {});
      in.host = std::make_shared<torch::autograd::SavedVariable>(x, /*is_output=*/false);
      offload->close();
      in.plain = at::Tensor();
      st.offloads[i] = std::move(offload);
    }
  }
  if (writes) {
    st.forward_writes[static_cast<size_t>(i)] = writes->take();
    if (st.stats) {
      int64_t bytes = 0;
      for (const auto& w : st.forward_writes[static_cast<size_t>(i)])
        bytes += static_cast<int64_t>(w.second.nbytes());
      st.stats->forward_write_bytes[static_cast<size_t>(i)] = bytes;
    }
  }
  if (st.ran[i]) {
    check_rng_replayed(st.rng[i].end, "remat::run_plan",
                       "stage " + std::to_string(i) + " ('" + stage.name + "')");
  } else {
    st.rng[i].finish(st.cuda_devices);
    // The end state is only compared with (check_rng_replayed): kept as a digest, so that a stage that runs
    // again holds one state (its start), as Planned's model charges.
    st.rng[i].end.digest();
  }
  // After its last run the stage replays nothing: its generators' states go (a retain_graph backward runs on
  // a copy of the state, which keeps them for the next pass).
  if (--st.forwards_left[static_cast<size_t>(i)] == 0) {
    st.rng[i] = RngRecord();
    st.forward_writes[static_cast<size_t>(i)].clear();  // (the recompute's scope holds what it puts back)
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
// backward()) or summed into `param_grads` (under torch::autograd::grad, which returns them). `needed`: per
// parameter, whether the user's pass needs its gradient; `input_needed`: whether it needs d_i (a stage below,
// or the chain's input).
void run_backward(ExecState& st, int64_t i, const UserPass& outer, bool keep_graph,
                  std::vector<at::Tensor>& param_grads,
                  const std::unordered_map<c10::TensorImpl*, size_t>& param_index,
                  const std::vector<bool>& needed, bool input_needed) {
  const bool accumulating = outer.accumulate;
  ExecState::Held& abar = st.held[i + 1];
  ExecState::Held& in = st.held[i];
  at::Tensor d_in;
  if (abar.output.requires_grad() && st.grad.defined()) {
    std::vector<at::Tensor> targets;
    const bool leaf_grad = abar.leaf.requires_grad() && input_needed;
    if (leaf_grad) targets.push_back(abar.leaf);
    for (const auto& p : st.stage_params[i]) {
      // Only what the user's pass asks for (torch::autograd::grad over part of the graph): the rest of the
      // stage's backward is neither run nor able to fail (a saved tensor the asked gradients do not read).
      if (needed[param_index.at(p.unsafeGetTensorImpl())]) targets.push_back(p);
    }
    const bool create_graph = at::GradMode::is_enabled();
    // Parameters a stage's function uses without its StageFn::module declaring them: trained under
    // backward() like the declared ones; under torch::autograd::grad the node cannot return them, and a
    // caller asking for one is refused. A tensor captured from outside the stage cannot get its gradient.
    std::unordered_set<c10::TensorImpl*> declared;
    for (const auto& t : targets)
      declared.insert(t.unsafeGetTensorImpl());
    // (A parameter another stage declares is one of the node's inputs: its gradient is returned too.)
    RegionReach reach = region_reach({abar.output}, declared, &abar.mark);
    const std::string who = "remat::run_plan: stage " + std::to_string(i) + " ('" + st.stages[i].name + "')";
    detail::refuse_captured(reach, who.c_str(),
                            "Make them the stage's input, or compute them inside the stage function.");
    std::vector<Leaf> unreturnable;
    for (Leaf& leaf : reach.undeclared) {
      if (accumulating || param_index.count(leaf.variable.unsafeGetTensorImpl()))
        targets.push_back(leaf.variable);
      else
        unreturnable.push_back(std::move(leaf));
    }
    if (!accumulating) {
      detail::refuse_undeclared_asked(unreturnable, outer,
                                      (who + ": torch::autograd::grad was asked for a tensor that the stage "
                                             "cannot give a gradient to")
                                          .c_str(),
                                      "Give the stage the module that owns them (StageFn::module).");
    }
    // The stage's pass serves the user's: regions nested in the stage accumulate or refuse as it asks.
    detail::ServePass serve(outer);
    if (!targets.empty()) {
      if (accumulating) {
        // The leaf is the executor's own, but with retain_graph a later backward finds it again (the state is
        // copied, the tensors shared): start its gradient afresh, or the second pass would add the first's.
        if (leaf_grad) abar.leaf.mutable_grad() = at::Tensor();
        backward_from(std::move(abar.output), std::move(st.grad), targets, keep_graph, create_graph,
                      /*accumulate=*/true);
        if (leaf_grad) d_in = abar.leaf.grad();
      } else {
        auto grads =
            backward_from(std::move(abar.output), std::move(st.grad), targets, keep_graph, create_graph,
                          /*accumulate=*/false);
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
  in.host = nullptr;  // a_i on the host served its recompute
}

// The forward operations up to the loss; returns a_n (values, no graph).
at::Tensor run_forward_pass(ExecState& st, const at::Tensor& input) {
  at::AutoGradMode no_grad(false);  // Fa operations turn it on for their stage
  st.held[0].plain = input.detach();
  {
    // A stage that throws leaves the RNG and every stage's buffers as they were. The state is kept as plain
    // bytes (RngState::hold_as_bytes), not among the device's tensors: the step's model charges the states
    // the stages keep, not this one. Before (2026-12-03 to 2026-12-05) it was a tensor, charged through the
    // forward pass, and one the first stage's own state shared where that stage kept one (charged apart: the
    // model one state high there).
    RngState start = st.preserve_rng ? RngState::capture(st.cuda_devices) : RngState();
    start.hold_as_bytes();
    RngRollback rng(start);
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    for (const auto& stage : st.stages) {
      if (stage.module) modules.push_back(stage.module);
    }
    BufferRestore buffers(modules, /*only_on_unwind=*/true);
    for (size_t k = 0; k < st.loss_at; ++k) {
      run_forward(st, st.plan.ops[k]);
      carry_out(st, st.schedule.after[k]);
    }
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
    const UserPass outer = detail::user_pass();

    std::unordered_map<c10::TensorImpl*, size_t> param_index;
    for (size_t k = 0; k < num_params; ++k)
      param_index.emplace(run->params[k].unsafeGetTensorImpl(), k);
    std::vector<at::Tensor> param_grads(num_params);
    // What the pass needs (all of it under backward(); under torch::autograd::grad, what it asked for): per
    // parameter, and per stage whether d_i is needed below it. Stages below the lowest one needed run
    // nothing.
    std::vector<bool> needed(num_params);
    for (size_t k = 0; k < num_params; ++k)
      needed[k] = task_should_compute_output(1 + k);
    const int64_t n = run->plan.num_stages;
    std::vector<bool> input_needed(static_cast<size_t>(n) + 1);  // input_needed[i]: d_i is needed
    input_needed[0] = task_should_compute_output(0);
    int64_t lowest = input_needed[0] ? 0 : n;  // the lowest stage whose backward is needed
    for (int64_t i = 0; i < n; ++i) {
      bool own = false;
      for (const auto& p : run->stage_params[static_cast<size_t>(i)])
        own = own || needed[param_index.at(p.unsafeGetTensorImpl())];
      if (own || input_needed[static_cast<size_t>(i)]) lowest = std::min(lowest, i);
      input_needed[static_cast<size_t>(i) + 1] = input_needed[static_cast<size_t>(i)] || own;
    }

    detail::NestedBackward nested;  // the stages' backward passes run inside this node
    run->grad = std::move(d_n);
    run->grad_at = run->plan.num_stages;
    const auto& ops = run->plan.ops;
    for (size_t k = run->loss_at + 1; k < ops.size(); ++k) {
      try {
        carry_out(*run, run->schedule.before[k]);  // the backward pass reaching a stage brings one back
        if (ops[k].kind == OpKind::kBackward) {
          const int64_t s = ops[k].stage;
          run_backward(*run, s, outer, keep_graph, param_grads, param_index, needed,
                       input_needed[static_cast<size_t>(s)]);
          if (!keep_graph) run->offloads[static_cast<size_t>(s)] = nullptr;
          if (s <= lowest) break;  // nothing below is needed
        } else {
          run_forward(*run, ops[k]);
          carry_out(*run, run->schedule.after[k]);
        }
      } catch (c10::Error& e) {
        const std::string op =
            op_name(ops[k].kind) + (ops[k].stage >= 0 ? std::to_string(ops[k].stage) : std::string());
        e.add_context("remat::run_plan: while running operation " + std::to_string(k) + " of the plan (" +
                      op + ") in the backward pass");
        if (run->out_of_memory && detail::is_out_of_memory(e))
          run->out_of_memory(e, "in the backward pass (the plan's operation " + op + ")");
        throw;
      }
    }
    result[0] = run->input_requires_grad && input_needed[0] ? run->grad : at::Tensor();
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

torch::Tensor run_plan(const std::vector<StageFn>& stages, const Plan& plan, const torch::Tensor& input,
                       const CheckpointOptions& options, std::shared_ptr<ExecutionStats> stats,
                       const OffloadOptions& offload) {
  check_plan_fits(plan, stages.size(), "remat::run_plan", "there are ", "");
  TORCH_CHECK(input.defined(), "remat::run_plan: the input is an undefined tensor");
  check_executor_options(options, "remat::run_plan");
  if (stats) {
    stats->forward_calls.assign(stages.size(), 0);
    stats->forward_write_bytes.assign(stages.size(), 0);
  }
  if (!at::GradMode::is_enabled()) {
    torch::Tensor h = input;
    for (size_t i = 0; i < stages.size(); ++i) {
      h = stages[i].fn(h);
      if (stats) stats->forward_calls[i] += 1;
    }
    return h;
  }
  detail::install_engine();  // marks the stages' nested passes (autograd/nesting.h)
  auto st = c10::make_intrusive<ExecState>();
  st->stages = stages;
  st->plan = plan;
  st->policies = resolve_policies(plan, options, "remat::run_plan");
  for (size_t k = 0; k < plan.ops.size(); ++k) {
    if (plan.ops[k].kind == OpKind::kLoss) st->loss_at = k;
  }
  st->preserve_rng = options.preserve_rng_state();
  st->check = options.determinism_check();
  st->input_requires_grad = input.requires_grad();
  st->cuda_devices = detail::cuda_devices_of({input});
  st->autocast = AutocastState::current();
  st->stats = std::move(stats);
  st->out_of_memory = detail::current_out_of_memory_words();
  const size_t n = stages.size();
  st->rng.resize(n);
  st->ran.assign(n, false);
  // Only a stage whose forward runs again needs its generators' states (a record held to its last run).
  st->forwards_left.assign(n, 0);
  st->forward_writes.assign(n, {});
  for (const Op& op : plan.ops)
    if (op.kind != OpKind::kBackward && op.kind != OpKind::kLoss && op.stage >= 0 &&
        static_cast<size_t>(op.stage) < n)
      ++st->forwards_left[static_cast<size_t>(op.stage)];
  st->metas.resize(n);
  st->held.resize(n + 1);
  st->stage_params.resize(n);
  st->offload = offload;
  if (!st->offload.pool()) st->offload.pool(std::make_shared<HostPool>());  // one pool for the step's stages
  st->offloads.resize(n);
  st->schedule = offload_schedule(plan);
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
  resolve_policies(plan, options_, "remat::CheckpointedSequential");  // refused now rather than at forward()
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

}  // namespace remat
