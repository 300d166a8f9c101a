#pragma once
/// \file
/// remat::checkpoint: run a region of a model without keeping its activations, and recompute them in the
/// backward pass. The C++ counterpart of Python's torch.utils.checkpoint.checkpoint.
///
///   auto y = remat::checkpoint(block, x);                         // a module: its weights are trained
///   auto z = remat::checkpoint([&](const torch::Tensor& t) { return torch::gelu(fc(t)); }, y);
///   auto outs = remat::checkpoint(two_in_two_out, {a, b}, remat::CheckpointOptions().mode(
///                                                              remat::CheckpointMode::kReentrant));

#include <remat/policy.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <torch/nn/modules/container/any.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
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
  /// kNonReentrant: end a recompute as soon as every tensor the backward pass needs from the region has been
  /// recomputed (PyTorch 2.x's early stopping, on by default there too): what fn does after its last saved
  /// tensor (a residual add, a reshape, side effects) is not run again. Gradients are unchanged. Set false
  /// when fn must run to its end in every recompute. fn must not swallow all exceptions (catch (...))
  /// around its operators, or the recompute runs on and ignores the rest. kReentrant always runs fn whole.
  TORCH_ARG(bool, early_stop) = true;
  /// Check that the recompute produces tensors of the same shape, dtype and device as the forward pass
  /// (kReentrant: the outputs; kNonReentrant: every saved tensor) and throw c10::Error naming the mismatch.
  TORCH_ARG(bool, determinism_check) = true;
  /// Modules used inside fn. In kReentrant mode their parameters receive gradients through the checkpoint
  /// under torch::autograd::grad too, and when fn throws in the forward pass their buffers are put back.
  /// For a kReentrant checkpoint nested in a kReentrant lambda, list the inner modules here too (or
  /// checkpoint a container module). Buffers need no declaring to be updated once: every recompute, in
  /// both modes and in the plan executor, writes back any tensor from before it that it updated in place
  /// (BatchNorm running statistics, num_batches_tracked, a captured counter), declared or not.
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, modules) = {};
  /// kNonReentrant: selective checkpointing at the level of operations (PyTorch's
  /// create_selective_checkpoint_contexts with a policy that saves chosen ops). The outputs of every
  /// remat::keep call inside fn whose tag is listed here are kept from the forward pass, and the recompute
  /// hands them back instead of running the call again; everything else is recomputed as usual. remat's
  /// models tag their matrix multiplications remat::kMatmul, so {remat::kMatmul} keeps the expensive
  /// operations and recomputes the cheap ones between them (softmax, dropout, GELU, LayerNorm, residual
  /// adds). Gradients are unchanged. Empty (the default): every call is recomputed. kReentrant throws
  /// c10::Error when this is not empty.
  TORCH_ARG(std::vector<std::string>, keep) = {};
  /// kNonReentrant: selective checkpointing by an operator-level policy (remat/policy.h), with no edit to
  /// fn: for each operator call inside fn the policy says whether its outputs are kept from the forward pass
  /// (true) or recomputed, or with a CheckpointPolicy also whether they go to the host (through the
  /// remat::Offload open around the checkpoint; none open: the forward pass throws c10::Error naming the
  /// operator); remat::policy::matmuls() keeps the matrix multiplications and convolutions. Kept
  /// calls are handed back by the recompute as remat::keep's are, and combine with `keep` tags. Gradients
  /// are unchanged. Empty (the default): every call is recomputed. kReentrant throws c10::Error when a policy
  /// is set, and so does a process where another library holds remat's dispatcher key.
  TORCH_ARG(Policy, policy) = {};
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

/// The tag remat's models give their matrix multiplications (linear projections, attention scores and
/// context): CheckpointOptions().keep({remat::kMatmul}) keeps their outputs, like PyTorch's selective
/// checkpointing with a policy that saves mm, addmm and bmm.
inline constexpr char kMatmul[] = "matmul";
/// The tag remat's models give their convolutions (ResNet's 3x3 convolutions): CheckpointOptions().keep(
/// {remat::kConv}) keeps their outputs and recomputes only BatchNorm and ReLU.
inline constexpr char kConv[] = "conv";

/// Marks a call inside a checkpointed function as one whose outputs a checkpoint may keep: returns
/// fn(inputs). Inside remat::checkpoint (kNonReentrant) whose CheckpointOptions::keep lists `tag`, the
/// forward pass keeps the outputs and the recompute returns them without running fn again. Anywhere else
/// (outside a checkpoint, under NoGradGuard, a tag not listed, kReentrant, the plan executor) it just runs
/// fn. fn must compute its outputs from `inputs` (and parameters) without drawing random numbers and
/// without modifying its inputs in place: the tensors autograd saves inside fn are recomputed as views of
/// `inputs` where they are views of them (a linear layer's input, a transposed operand), and kept where
/// they are not (a parameter costs nothing; a copy fn makes costs its bytes, so pass operands in the
/// layout fn uses). Each kept output is freed once the region's first recompute has used it; a second
/// recompute of the region (retain_graph) runs fn again, and so does a recompute during the forward pass
/// (the region takes a gradient of its own results). A gradient the region takes of its own results through
/// a kept output while it is recomputed in the backward pass throws c10::Error (the call did not run, so it
/// has no graph): leave that tag out for such a region. Throws c10::Error naming remat::keep when fn is
/// empty, inputs holds an undefined tensor, fn returns an undefined tensor, draws random numbers or writes to
/// an input in place (while keeping), or when the recompute's calls do not match the forward pass's (tag,
/// count).
std::vector<torch::Tensor> keep(const std::string& tag, const TensorsFn& fn,
                                const std::vector<torch::Tensor>& inputs);
/// One tensor in, one tensor out; otherwise as above.
torch::Tensor keep(const std::string& tag, const TensorFn& fn, const torch::Tensor& input);

/// Runs fn(inputs) as a checkpointed region and returns its outputs. Gradients of the inputs and of every
/// parameter used inside equal those of calling fn directly; the tensors fn's autograd graph would keep
/// alive are dropped and recomputed in the backward pass. fn is kept until the backward pass (what it
/// captures by reference must outlive it) and may run twice: once now, once in the backward pass.
/// Under NoGradGuard, or when nothing requires grad in kNonReentrant mode, it simply runs fn. The recompute
/// runs under the RNG state (preserve_rng_state) and the autocast state (CPU and CUDA) of the forward pass.
/// Both run with autocast's cache off (as the Python package's remat.checkpoint): the region's casts of its
/// weights go with what saves them rather than stay until the caller's autocast region ends, and in
/// kReentrant mode a cast made by the no-grad forward pass, which has no history, is never handed to the
/// recompute (on LibTorch 1.13, with the backward inside the region, the weight's gradient was lost).
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

namespace detail {
// Module-like arguments: a module holder (Linear, your TORCH_MODULE), a std::shared_ptr to a module type, a
// torch::nn::AnyModule. module_ptr gives the module to declare; call_forward runs its forward.
template <typename T>
struct is_module_ptr : std::false_type {};
template <typename M>
struct is_module_ptr<std::shared_ptr<M>> : std::is_base_of<torch::nn::Module, M> {};
template <typename T>
inline constexpr bool is_module_like_v =
    is_module_holder<std::decay_t<T>>::value || is_module_ptr<std::decay_t<T>>::value ||
    std::is_same_v<std::decay_t<T>, torch::nn::AnyModule>;

// A module's Impl given by raw pointer (`(*list)[i]->as<BlockImpl>()`) or by reference (`*block`):
// checkpointed through the std::shared_ptr that owns it, as every registered module is owned.
template <typename T>
inline constexpr bool is_module_impl_ptr_v = std::is_pointer_v<std::decay_t<T>>&&
    std::is_base_of_v<torch::nn::Module, std::remove_cv_t<std::remove_pointer_t<std::decay_t<T>>>>;
template <typename T>
inline constexpr bool is_module_impl_ref_v =
    std::is_class_v<std::decay_t<T>>&& std::is_base_of_v<torch::nn::Module, std::decay_t<T>> &&
    !is_module_holder<std::decay_t<T>>::value;
template <typename T>
using impl_of_t = std::remove_cv_t<std::remove_pointer_t<std::decay_t<T>>>;
// The std::shared_ptr that owns `impl`. Throws c10::Error naming remat::checkpoint when none does.
template <typename Impl>
std::shared_ptr<Impl> owner_of(Impl* impl) {
  TORCH_CHECK(impl != nullptr, "remat::checkpoint: the module is a null pointer");
  std::shared_ptr<torch::nn::Module> owner;
  try {
    owner = impl->shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    TORCH_CHECK(
        false, "remat::checkpoint: the ", impl->name(),
        " given by pointer or reference is not owned by a std::shared_ptr (a module on the stack, or "
        "a member that is not a registered submodule); remat keeps the module until the backward pass "
        "through its owning pointer, so create it with std::make_shared or register it");
  }
  return std::shared_ptr<Impl>(owner, impl);
}

template <typename T>
std::shared_ptr<torch::nn::Module> module_ptr(const T& m) {
  if constexpr (is_module_ptr<T>::value) {
    return m;
  } else if constexpr (is_module_holder<T>::value) {
    return m.is_empty() ? nullptr : m.ptr();
  } else {
    return m.is_empty() ? nullptr : m.ptr();
  }
}

template <typename T, typename... Args>
auto call_forward(T& m, Args&&... args) {
  if constexpr (std::is_same_v<T, torch::nn::AnyModule>) {
    return m.template forward<torch::Tensor>(std::forward<Args>(args)...);
  } else {
    return m->forward(std::forward<Args>(args)...);
  }
}

// What forward returns when called with `count` tensors; void when it cannot be called so.
template <typename T, typename Seq, typename = void>
struct forward_result {
  using type = void;
};
template <size_t I>
using tensor_arg = const torch::Tensor&;
template <typename T, size_t... I>
struct forward_result<T, std::index_sequence<I...>,
                      std::void_t<decltype(std::declval<T&>()->forward(std::declval<tensor_arg<I>>()...))>> {
  using type = decltype(std::declval<T&>()->forward(std::declval<tensor_arg<I>>()...));
};
template <size_t... I>
struct forward_result<torch::nn::AnyModule, std::index_sequence<I...>, void> {
  using type = torch::Tensor;  // forward<torch::Tensor>; the argument types are checked when it runs
};

// The results a checkpointed module may return: a tensor, a vector of tensors, a tuple of tensors.
template <typename R>
struct is_tensors_result : std::false_type {};
template <>
struct is_tensors_result<torch::Tensor> : std::true_type {};
template <>
struct is_tensors_result<std::vector<torch::Tensor>> : std::true_type {};
template <typename... T>
struct is_tensors_result<std::tuple<T...>> : std::conjunction<std::is_same<T, torch::Tensor>...> {};

inline std::vector<torch::Tensor> to_tensors(torch::Tensor t) {
  return {std::move(t)};
}
inline std::vector<torch::Tensor> to_tensors(std::vector<torch::Tensor> v) {
  return v;
}
template <typename... T>
std::vector<torch::Tensor> to_tensors(std::tuple<T...> t) {
  return std::apply([](auto&&... x) { return std::vector<torch::Tensor>{std::move(x)...}; }, std::move(t));
}
template <typename R, size_t... I>
R tuple_from_tensors(std::vector<torch::Tensor>& v, std::index_sequence<I...>) {
  return R{std::move(v.at(I))...};
}
template <typename R>
R from_tensors(std::vector<torch::Tensor>&& v) {
  if constexpr (std::is_same_v<R, torch::Tensor>) {
    return std::move(v.at(0));
  } else if constexpr (std::is_same_v<R, std::vector<torch::Tensor>>) {
    return std::move(v);
  } else {
    return tuple_from_tensors<R>(v, std::make_index_sequence<std::tuple_size_v<R>>{});
  }
}

// The arguments after the module: tensors, then optionally a CheckpointOptions.
template <typename... Args>
struct last_is_options : std::false_type {};
template <typename A, typename... Rest>
struct last_is_options<A, Rest...>
    : std::is_same<std::decay_t<std::tuple_element_t<sizeof...(Rest), std::tuple<A, Rest...>>>,
                   CheckpointOptions> {};

template <typename... Args>
struct module_call_args {
  static constexpr size_t count = sizeof...(Args);
  static constexpr bool last_is_options = detail::last_is_options<Args...>::value;
  static constexpr size_t tensors = count - (last_is_options ? 1 : 0);
  template <size_t... I>
  static constexpr bool all_tensors(std::index_sequence<I...>) {
    return (std::is_same_v<std::decay_t<std::tuple_element_t<I, std::tuple<Args...>>>, torch::Tensor> && ...);
  }
  static constexpr bool ok = tensors > 0 && all_tensors(std::make_index_sequence<tensors>{});
};

template <typename M, typename... Args>
constexpr bool module_call_ok() {
  using A = module_call_args<Args...>;
  if constexpr (is_module_impl_ptr_v<M> || is_module_impl_ref_v<M>) {
    return module_call_ok<std::shared_ptr<impl_of_t<M>>, Args...>();
  } else if constexpr (!is_module_like_v<M> || !A::ok) {
    return false;
  } else {
    using R = typename forward_result<std::decay_t<M>, std::make_index_sequence<A::tensors>>::type;
    return is_tensors_result<R>::value;
  }
}

template <typename M, typename Tuple, size_t... I>
auto checkpoint_module(const M& module, const Tuple& args, std::index_sequence<I...>) {
  using R = typename forward_result<M, std::index_sequence<I...>>::type;
  CheckpointOptions options;
  if constexpr (std::tuple_size_v < Tuple >> sizeof...(I)) options = std::get<sizeof...(I)>(args);
  std::shared_ptr<torch::nn::Module> declared = module_ptr(module);
  TORCH_CHECK(declared != nullptr, "remat::checkpoint: the module is empty (nullptr)");
  options.modules().push_back(std::move(declared));
  if constexpr (sizeof...(I) == 1 && std::is_same_v<R, torch::Tensor>) {
    return checkpoint_tensor(
        [copy = module](const torch::Tensor& x) mutable { return call_forward(copy, x); }, std::get<0>(args),
        options);
  } else {
    std::vector<torch::Tensor> outputs = checkpoint_tensors(
        [copy = module](const std::vector<torch::Tensor>& in) mutable {
          return to_tensors(call_forward(copy, in[I]...));
        },
        {std::get<I>(args)...}, options);
    return from_tensors<R>(std::move(outputs));
  }
}

template <typename F, typename... Args>
constexpr bool checkpoint_call_ok() {
  if constexpr (module_call_ok<F, Args...>()) {
    return true;
  } else if constexpr (sizeof...(Args) < 1 || sizeof...(Args) > 2) {
    return false;
  } else {
    return is_tensor_fn_v<F> || is_tensors_fn_v<F>;
  }
}

template <typename T>
inline constexpr bool always_false_v = false;
// What the refused call "returns": converts to a tensor (declared, never defined), so that `x = ...` adds no
// error of its own after the static_assert.
struct Refused {
  operator torch::Tensor() const;  // NOLINT(google-explicit-constructor)
};
}  // namespace detail

/// Checkpoints a module's forward, for the modules containers hand out: a module holder (Linear,
/// Sequential, your TORCH_MODULE), a std::shared_ptr to a module type (`seq->ptr<BlockImpl>(i)`,
/// `std::make_shared<BlockImpl>()`), a torch::nn::AnyModule (`for (auto& m : *seq)`; called through
/// forward<torch::Tensor>), or a module's Impl by pointer or reference (`(*list)[i]->as<BlockImpl>()` for a
/// torch::nn::ModuleList, `*block`), which must be owned by a std::shared_ptr as every registered module is.
/// The arguments after the module are the tensors forward takes (one or several), optionally followed by
/// CheckpointOptions. Returns what forward returns: a torch::Tensor, a std::vector<torch::Tensor> or a
/// std::tuple of tensors.
///
///   auto y = remat::checkpoint(block, x);                          // holder
///   auto z = remat::checkpoint(seq->ptr<BlockImpl>(0), x);        // shared_ptr<BlockImpl>
///   for (auto& m : *list) x = remat::checkpoint(m->as<BlockImpl>(), x);   // a ModuleList's elements
///   auto [h, attn] = remat::checkpoint(layer, x, mask, remat::CheckpointOptions().mode(
///                                                          remat::CheckpointMode::kReentrant));
///
/// The module is added to options.modules, so its parameters are trained and its buffers restored in both
/// modes. The module is held by a copy of its handle (it shares the module), so the caller's handle may go
/// out of scope before the backward pass. A std::shared_ptr<torch::nn::Module> (what Sequential's
/// operator[] and ptr(i) return, and what a ModuleList holds) has no forward to call: pass
/// seq->ptr<BlockImpl>(i), the AnyModule, or list[i]->as<BlockImpl>(). Throws as the function overloads do,
/// and c10::Error when the module is empty (nullptr) or, given by pointer or reference, owned by no
/// std::shared_ptr.
template <typename M, typename... Args,
          std::enable_if_t<detail::module_call_ok<std::decay_t<M>, Args...>(), int> = 0>
auto checkpoint(M&& module, Args&&... args) {
  using A = detail::module_call_args<Args...>;
  if constexpr (detail::is_module_impl_ptr_v<M>) {
    const auto handle = detail::owner_of(module);
    return detail::checkpoint_module(handle, std::forward_as_tuple(args...),
                                     std::make_index_sequence<A::tensors>{});
  } else if constexpr (detail::is_module_impl_ref_v<M>) {
    const auto handle = detail::owner_of(&module);
    return detail::checkpoint_module(handle, std::forward_as_tuple(args...),
                                     std::make_index_sequence<A::tensors>{});
  } else {
    const std::decay_t<M> handle = module;
    return detail::checkpoint_module(handle, std::forward_as_tuple(args...),
                                     std::make_index_sequence<A::tensors>{});
  }
}

/// Any other call: one error that says what remat::checkpoint accepts. Its return type is deduced, so the
/// static_assert fires where the call is written, before any error the caller's use of the result would add.
template <typename F, typename... Args,
          std::enable_if_t<!detail::checkpoint_call_ok<std::decay_t<F>, Args...>(), int> = 0>
auto checkpoint(F&&, Args&&...) {
  static_assert(
      detail::always_false_v<F>,
      "remat::checkpoint accepts (1) a function (const torch::Tensor&) -> torch::Tensor and one tensor; "
      "(2) a function (const std::vector<torch::Tensor>&) -> std::vector<torch::Tensor> and a vector of "
      "tensors; (3) a module: a holder (Linear, TORCH_MODULE), a std::shared_ptr<SomeModuleImpl>, a "
      "torch::nn::AnyModule, or a SomeModuleImpl* or SomeModuleImpl& (a ModuleList's element: "
      "list[i]->as<SomeModuleImpl>()), then the tensors its forward takes, its forward returning a tensor, a "
      "std::vector<torch::Tensor> or a std::tuple of tensors; each optionally followed by "
      "remat::CheckpointOptions. A std::shared_ptr<torch::nn::Module> (what a Sequential's or a ModuleList's "
      "operator[] and ptr(i) return) has no forward: use ptr<SomeModuleImpl>(i), "
      "list[i]->as<SomeModuleImpl>() "
      "or the Sequential's AnyModules.");
  return detail::Refused{};
}

}  // namespace remat
