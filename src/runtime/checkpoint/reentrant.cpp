// kReentrant checkpointing: the region runs under no-grad in the forward pass, watched (remat's dispatcher
// fallback) for the tensors it uses that require grad without being its inputs: parameters it does not
// declare, tensors computed outside it. Those and the declared parameters become inputs of a custom autograd
// Function's node, so that each gets its gradient through the node however deep regions nest, under
// backward() and torch::autograd::grad alike. Its backward recomputes the region with grad and differentiates
// it with an inner autograd call (the gradients returned through the node, or, for leaves under backward(),
// accumulated as they are computed).

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <string>
#include <unordered_set>
#include <vector>

#include "checkpoint/reentrant.h"

#include "autograd/engine.h"
#include "autograd/hooks.h"
#include "autograd/nesting.h"
#include "autograd/watch.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/region.h"

namespace remat::detail {
namespace {

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

struct ReentrantState final : torch::CustomClassHolder {
  TensorsFn fn;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  // The node's inputs besides the region's: declared parameters that require grad, then the tensors fn used
  // that require grad (found by watching its forward pass), each once.
  std::vector<at::Tensor> params;
  bool any_non_leaf = false;        // among params: a tensor computed outside the region
  bool watched = false;             // the forward pass was watched: params hold every tensor fn used
  std::vector<at::Tensor> outputs;  // the forward pass's, handed to the Function (then released)
  std::vector<bool> requires_grad;
  std::vector<c10::DeviceIndex> cuda_devices;
  bool check = true;
  RngRecord rng;  // the generators at the start and at the end of the forward pass
  AutocastState autocast;
  std::vector<TensorMeta> output_metas;
  std::vector<ForwardWrite> forward_writes;  // what the forward pass wrote and read, as it found it
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                at::TensorList params,
                                                c10::intrusive_ptr<ReentrantState> st) {
    (void)params;  // inputs of the node so that the engine routes their gradients; fn uses them itself
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    std::vector<at::Tensor> outputs = std::move(st->outputs);  // fn ran in run_reentrant
    st->outputs.clear();
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
    // The user's pass this node serves: this very pass, or the one a nested pass of remat's was started for
    // (inside another region, whose pass asks the engine for its own targets only).
    const UserPass outer = user_pass();
    detail::NestedBackward nested;  // the recompute's own backward pass runs inside this node
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    // Under create_graph (double backward) the recompute is attached to the saved inputs (through a view per
    // input, so that an input passed twice gets each use's gradient once), and the gradients it returns are
    // differentiable with respect to the real inputs; otherwise it runs on detached copies.
    const bool create_graph = at::GradMode::is_enabled();
    std::vector<at::Tensor> args =
        create_graph ? attached_inputs(saved, st->requires_grad) : detached_inputs(saved, st->requires_grad);

    const NodeMark mark = NodeMark::now();
    std::vector<at::Tensor> outputs;
    {
      RecomputeScope recompute(st->rng.start, st->cuda_devices, st->modules, args, st->autocast,
                               &st->forward_writes);
      at::AutoGradMode grad(true);
      with_recompute_context([&] {
        outputs = st->fn(args);
        check_rng_replayed(st->rng.end, "remat::checkpoint", "a checkpointed region");
      });
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
    std::unordered_set<const torch::autograd::Node*> stops;  // the views that lead to the real inputs
    for (size_t i = 0; i < n_inputs; ++i) {
      declared.insert(args[i].unsafeGetTensorImpl());
      if (args[i].grad_fn()) stops.insert(args[i].grad_fn().get());
      if (args[i].requires_grad() && ctx->needs_input_grad(i)) {
        targets.push_back(args[i]);
        slot.push_back(i);
      }
    }
    for (size_t j = 0; j < params.size(); ++j) {
      declared.insert(params[j].unsafeGetTensorImpl());
      if (params[j].grad_fn()) stops.insert(params[j].grad_fn().get());  // a tensor captured from outside
      if (ctx->needs_input_grad(n_inputs + j)) {
        targets.push_back(params[j]);
        slot.push_back(n_inputs + j);
      }
    }
    const bool accumulating = outer.accumulate;
    // Leaves fn uses without declaring them: trained under backward() (as PyTorch's reentrant checkpoint
    // does), however deep the region is nested; under torch::autograd::grad they cannot be returned, so
    // asking for one is an error. A tensor captured from outside the region cannot get its gradient at all.
    // Found in the forward pass (st->watched), every tensor fn uses from outside is one of the node's inputs,
    // where the walk stops; otherwise it stays inside the recompute by the mark.
    RegionReach reach = region_reach(roots, declared, st->watched ? nullptr : &mark, stops);
    refuse_captured(reach, "remat::checkpoint (kReentrant)",
                    "Pass them to remat::checkpoint as inputs, or use CheckpointMode::kNonReentrant.");
    std::vector<Leaf> extra = std::move(reach.undeclared);
    if (!accumulating) {
      refuse_undeclared_asked(extra, outer,
                              "remat::checkpoint (kReentrant): torch::autograd::grad was asked for a tensor "
                              "that a kReentrant region cannot give a gradient to",
                              "Add their modules to CheckpointOptions().modules({...}), pass them as inputs, "
                              "checkpoint the module itself, or use CheckpointMode::kNonReentrant.");
      extra.clear();
    }
    // The passes run below serve the user's pass: regions nested in this one accumulate or refuse as it asks.
    ServePass serve(outer);

    if (accumulating && !create_graph && !st->any_non_leaf) {
      // Under backward(): accumulate into .grad through the parameters' own AccumulateGrad nodes, as each
      // gradient is computed (the region's parameter gradients are never all alive at once); the inputs'
      // gradients are returned. (A captured non-leaf's gradient must be returned: the branch below.)
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

}  // namespace

namespace {

// Sees the tensors a region's forward pass hands to operators, and keeps those that require grad and are not
// already the node's inputs, each once, in order.
class CaptureWatcher final : public OpWatcher {
 public:
  CaptureWatcher(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params) {
    for (const auto& t : inputs)
      known_.insert(t.unsafeGetTensorImpl());
    for (const auto& t : params)
      known_.insert(t.unsafeGetTensorImpl());
  }
  void before(const c10::OperatorHandle&, c10::ArrayRef<c10::IValue> args, int) override {
    for (const auto& v : args) {
      for_each_tensor(v, [&](const at::Tensor& t) {
        if (t.defined() && t.requires_grad() && known_.insert(t.unsafeGetTensorImpl()).second)
          captured.push_back(t);
      });
    }
  }
  void after(const c10::OperatorHandle&, c10::ArrayRef<c10::IValue>, int, bool) override {}
  std::vector<at::Tensor> captured;

 private:
  std::unordered_set<c10::TensorImpl*> known_;
};

}  // namespace

std::vector<at::Tensor> run_reentrant(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                      const CheckpointOptions& options) {
  install_engine();  // marks the nested passes it runs (autograd/nesting.h)
  auto st = c10::make_intrusive<ReentrantState>();
  st->fn = fn;
  st->modules = options.modules();
  st->requires_grad = requires_grad_flags(inputs);
  st->cuda_devices = cuda_devices_of(inputs);
  st->check = options.determinism_check();
  st->params = CheckpointFunction::declared_params(st->modules);
  if (options.preserve_rng_state()) st->rng.begin(st->cuda_devices);
  // Autocast's cache off for the forward pass and, recorded in its autocast state, the recompute
  // (AutocastCacheOff): a cast the cache kept from this no-grad forward has no history, and on LibTorch 1.13
  // a recompute inside the same autocast region took it from the cache, its weight's gradient lost.
  const AutocastCacheOff cache_off;
  st->autocast = AutocastState::current();

  // The forward pass: fn under no-grad (as PyTorch's use_reentrant=True), watched for the tensors it uses.
  // fn throwing, or a refusal below, leaves the RNG and the modules' buffers as they were. (Not the node's
  // creation after it: an enclosing recompute may stop early when it saves the inputs, with nothing to undo.)
  CaptureWatcher watcher(inputs, st->params);
  bool watched = false;
  bool any_input = false;
  {
    RngRollback rng(st->rng.start);
    BufferRestore buffers(st->modules, /*only_on_unwind=*/true);
    try {
      at::NoGradGuard no_grad;
      WatchScope watch(&watcher, "remat::checkpoint", /*required=*/false);
      watched = watch.active();
      st->watched = watched;
      ForwardWrites writes(inputs);  // what fn writes in place and reads: its recompute reads what it read
      st->outputs = fn(inputs);
      st->forward_writes = writes.take();
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
    check_outputs(st->outputs);
    for (auto& t : watcher.captured) {
      st->any_non_leaf = st->any_non_leaf || !t.is_leaf();
      st->params.push_back(std::move(t));
    }
    any_input =
        std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.requires_grad(); });
    // Without the watch (another library holds remat's dispatcher key), undeclared parameters are found in
    // the backward pass only: with nothing to reach them through, they would never be trained.
    TORCH_CHECK(
        watched || any_input || !st->params.empty(),
        "remat::checkpoint: kReentrant mode with no input that requires grad and no parameter that does in "
        "options.modules (",
        options.modules().size(),
        " modules), and remat cannot watch the region's operators in this process: the weights fn uses would "
        "never be trained (PyTorch's reentrant checkpoint silently freezes them). Checkpoint the module "
        "itself, "
        "list the modules in CheckpointOptions().modules({...}), or use CheckpointMode::kNonReentrant");
    st->rng.finish(st->cuda_devices);
    st->rng.end.digest();  // only compared with (check_rng_replayed): one CPU state held, its start
  }
  if (!any_input && st->params.empty()) return std::move(st->outputs);  // nothing to differentiate
  return CheckpointFunction::apply(at::TensorList(inputs), at::TensorList(st->params), st);
}

}  // namespace remat::detail
