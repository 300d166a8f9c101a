#pragma once
// The two checkpoint modes (non_reentrant.cpp, reentrant.cpp), and the helpers of checkpoint.cpp they share.

#include <remat/checkpoint.h>

#include <vector>

namespace remat::detail {

/// CheckpointMode::kNonReentrant: saved-tensor hooks drop what autograd saves inside fn, and the first
/// unpack in the backward pass recomputes fn (stopping early when options.early_stop()).
std::vector<at::Tensor> run_non_reentrant(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                          const CheckpointOptions& options);

/// CheckpointMode::kReentrant: a custom autograd Function that runs fn under no-grad and recomputes it in its
/// backward, differentiating it with an inner autograd call.
std::vector<at::Tensor> run_reentrant(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                      const CheckpointOptions& options);

/// Throws c10::Error naming remat::checkpoint when fn returned no tensor, or an undefined one.
void check_outputs(const std::vector<at::Tensor>& outputs);

/// Whether each tensor requires grad.
std::vector<bool> requires_grad_flags(const std::vector<at::Tensor>& tensors);

/// Detached copies of `saved` that require grad where `flags` says the originals did: what a recompute runs
/// on.
std::vector<at::Tensor> detached_inputs(const std::vector<at::Tensor>& saved, const std::vector<bool>& flags);

}  // namespace remat::detail
