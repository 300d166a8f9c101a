// remat::checkpoint's entry points and remat::keep: the checks every call gets, then the mode asked
// (non_reentrant.cpp, reentrant.cpp).

#include "remat/checkpoint.h"

#include <string>
#include <vector>

#include "autograd/hooks.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/non_reentrant.h"
#include "checkpoint/reentrant.h"

namespace remat {
namespace detail {

namespace {

void check_inputs(const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(!inputs.empty(), "remat::checkpoint: inputs is empty; pass at least one tensor");
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), "remat::checkpoint: input ", i, " of ", inputs.size(),
                " is an undefined tensor");
  }
}

void check_keep_inputs(const std::vector<at::Tensor>& inputs) {
  for (size_t i = 0; i < inputs.size(); ++i)
    TORCH_CHECK(inputs[i].defined(), "remat::keep: input ", i, " is an undefined tensor");
}

}  // namespace

// ------------------------------------------------------------------------------------------------------------
// Shared by both modes (checkpoint/checkpoint.h)

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
    TORCH_CHECK(options.policy().empty(), "remat::checkpoint: CheckpointOptions::policy ('",
                options.policy().name(),
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

}  // namespace remat
