#pragma once
/// \file
/// remat::checkpoint: run a region of a model without keeping its activations, and recompute them in the
/// backward pass. The C++ counterpart of Python's torch.utils.checkpoint.checkpoint.
///
///   auto y = remat::checkpoint(block, x);                         // a module: its weights are trained
///   auto z = remat::checkpoint([&](const torch::Tensor& t) { return torch::gelu(fc(t)); }, y);
///   auto outs = remat::checkpoint(two_in_two_out, {a, b}, remat::CheckpointOptions().mode(
///                                                              remat::CheckpointMode::kReentrant));

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace remat {

/// How the backward pass finds the tensors it needs.
enum class CheckpointMode {
  /// Saved-tensor hooks (the default, like use_reentrant=False in PyTorch). The region runs with grad
  /// enabled,
  /// but every tensor its autograd graph would save is dropped; the first time the backward pass needs one,
  /// the region is recomputed once and the recomputed tensors are handed out. Works with backward(),
  /// torch::autograd::grad, retain_graph, create_graph (second order), nested checkpoints and fn calling
  /// torch::autograd::grad itself; parameters need no declaring. Uses remat's own autograd engine
  /// (installed on first use): where another engine is the default (PyTorch's Python engine, in a process
  /// that imported torch) or default saved-tensor hooks are disabled, remat::checkpoint throws c10::Error
  /// rather than keep every activation.
  kNonReentrant,
  /// A custom autograd Function (like use_reentrant=True). The region runs under NoGradGuard; its backward
  /// recomputes it with grad enabled and takes the gradients with an inner torch::autograd::grad, so it
  /// also works under torch::autograd::grad and create_graph. Parameters are trained when their modules are
  /// in CheckpointOptions::modules (automatic in the module overload). fn cannot take gradients of its own
  /// results (it runs without grad in the forward pass): that throws c10::Error naming kNonReentrant.
  kReentrant,
};

/// Options of remat::checkpoint, set with chainable setters: CheckpointOptions().mode(...).modules({...}).
struct CheckpointOptions {
  /// kNonReentrant (default) or kReentrant; see CheckpointMode.
  TORCH_ARG(CheckpointMode, mode) = CheckpointMode::kNonReentrant;
  /// Restore the CPU generator (and the CUDA generators of CUDA inputs) to its state at the forward pass
  /// before recomputing, so dropout draws the same mask; afterwards the generators are put back as they
  /// were, so the program's later random numbers are those of a run without checkpointing. With false, the
  /// recompute draws fresh numbers (masks may differ) and advances the generators.
  TORCH_ARG(bool, preserve_rng_state) = true;
  /// Check that the recompute produces tensors of the same shape, dtype and device as the forward pass
  /// (kReentrant: the outputs; kNonReentrant: every saved tensor) and throw c10::Error naming the mismatch.
  TORCH_ARG(bool, determinism_check) = true;
  /// Modules used inside fn. Their buffers (BatchNorm running statistics, num_batches_tracked) are restored
  /// after each recompute, in both modes, so stateful layers are updated once per step. In kReentrant mode
  /// their parameters also receive gradients through the checkpoint. For a kReentrant checkpoint nested in
  /// a kReentrant lambda, list the inner modules here too (or checkpoint a container module).
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, modules) = {};
};

/// A region with several inputs and outputs.
using TensorsFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;
/// A region with one input and one output.
using TensorFn = std::function<torch::Tensor(const torch::Tensor&)>;

namespace detail {
template <typename T>
using is_module_holder = torch::detail::is_module_holder<T>;

// Callable as a TensorFn / TensorsFn, and not a module holder (checking a holder's call operator against
// std::function fails hard inside torch's pimpl header, so the holder test must short-circuit).
template <typename F>
inline constexpr bool is_tensor_fn_v =
    std::conjunction_v<std::negation<is_module_holder<F>>,
                       std::is_invocable_r<torch::Tensor, std::decay_t<F>&, const torch::Tensor&>>;
template <typename F>
inline constexpr bool is_tensors_fn_v = std::conjunction_v<
    std::negation<is_module_holder<F>>,
    std::is_invocable_r<std::vector<torch::Tensor>, std::decay_t<F>&, const std::vector<torch::Tensor>&>>;

std::vector<torch::Tensor> checkpoint_tensors(const TensorsFn& fn, const std::vector<torch::Tensor>& inputs,
                                              const CheckpointOptions& options);
torch::Tensor checkpoint_tensor(const TensorFn& fn, const torch::Tensor& input,
                                const CheckpointOptions& options);
}  // namespace detail

/// Runs fn(inputs) as a checkpointed region and returns its outputs. Gradients of the inputs and of every
/// parameter used inside equal those of calling fn directly; the tensors fn's autograd graph would keep
/// alive are dropped and recomputed in the backward pass. fn is kept until the backward pass (what it
/// captures by reference must outlive it) and may run twice: once now, once in the backward pass.
/// Under NoGradGuard, or when nothing requires grad in kNonReentrant mode, it simply runs fn. The recompute
/// runs under the RNG state (preserve_rng_state) and the autocast state (CPU and CUDA) of the forward pass.
/// Throws c10::Error naming remat::checkpoint and the value when inputs is empty or holds an undefined
/// tensor (before fn runs), when fn returns no tensor or an undefined one, when kReentrant has nothing that
/// could receive a gradient (no input requires grad and no module in options.modules has a parameter that
/// does), and, in the backward pass, when determinism_check finds a recomputed tensor that differs.
template <typename F, std::enable_if_t<detail::is_tensors_fn_v<F>, int> = 0>
std::vector<torch::Tensor> checkpoint(F&& fn, const std::vector<torch::Tensor>& inputs,
                                      const CheckpointOptions& options = {}) {
  return detail::checkpoint_tensors(TensorsFn(std::forward<F>(fn)), inputs, options);
}

/// One tensor in, one tensor out; otherwise as above.
template <typename F, std::enable_if_t<detail::is_tensor_fn_v<F>, int> = 0>
torch::Tensor checkpoint(F&& fn, const torch::Tensor& input, const CheckpointOptions& options = {}) {
  return detail::checkpoint_tensor(TensorFn(std::forward<F>(fn)), input, options);
}

/// Checkpoints a module holder whose forward takes and returns one tensor (Linear, Sequential, your own
/// TORCH_MODULE). The module is added to options.modules, so its parameters are trained and its buffers
/// restored in both modes. The holder is copied (it shares the module), so it may go out of scope before
/// the backward pass. Throws as the function overloads do, and when the holder is empty.
template <typename ModuleHolder, std::enable_if_t<detail::is_module_holder<ModuleHolder>::value, int> = 0>
torch::Tensor checkpoint(ModuleHolder& module, const torch::Tensor& input, CheckpointOptions options = {}) {
  TORCH_CHECK(!module.is_empty(), "remat::checkpoint: the module holder is empty (nullptr)");
  options.modules().push_back(module.ptr());
  ModuleHolder holder = module;
  return detail::checkpoint_tensor([holder](const torch::Tensor& x) mutable { return holder->forward(x); },
                                   input, options);
}

/// The same for a const or temporary holder: remat::checkpoint(Block(impl_ptr), x).
template <typename ModuleHolder, std::enable_if_t<detail::is_module_holder<ModuleHolder>::value, int> = 0>
torch::Tensor checkpoint(const ModuleHolder& module, const torch::Tensor& input,
                         CheckpointOptions options = {}) {
  ModuleHolder copy = module;
  return checkpoint(copy, input, std::move(options));
}

}  // namespace remat
