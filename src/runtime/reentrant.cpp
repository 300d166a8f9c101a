// kReentrant checkpointing: a custom autograd Function runs the region under no-grad in the forward pass, and
// its backward recomputes the region with grad and differentiates it with an inner autograd call (the inputs'
// gradients returned through the node, the declared parameters' accumulated or returned).

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <string>
#include <unordered_set>
#include <vector>

#include "detail/checkpoint_modes.h"
#include "detail/nesting.h"
#include "detail/region.h"

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
  std::vector<at::Tensor> params;  // declared parameters that require grad, in the node's input order
  std::vector<bool> requires_grad;
  std::vector<c10::DeviceIndex> cuda_devices;
  bool check = true;
  RngRecord rng;  // the generators at the start and at the end of the forward pass
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
      RngRollback rng(st->rng.start);
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
    st->rng.finish(st->cuda_devices);
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
      RecomputeScope recompute(st->rng.start, st->cuda_devices, st->modules, args, st->autocast);
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

}  // namespace

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
  if (options.preserve_rng_state()) st->rng.begin(st->cuda_devices);
  st->autocast = AutocastState::current();
  return CheckpointFunction::apply(at::TensorList(inputs), at::TensorList(st->params), st);
}

}  // namespace remat::detail
