#pragma once
// The helpers of checkpoint.cpp that both checkpoint modes (non_reentrant.h, reentrant.h) share.

#include <remat/checkpoint.h>

#include <vector>

namespace remat::detail {

/// Throws c10::Error naming remat::checkpoint when fn returned no tensor, or an undefined one.
void check_outputs(const std::vector<at::Tensor>& outputs);

/// Whether each tensor requires grad.
std::vector<bool> requires_grad_flags(const std::vector<at::Tensor>& tensors);

/// Detached copies of `saved` that require grad where `flags` says the originals did: what a recompute runs
/// on.
std::vector<at::Tensor> detached_inputs(const std::vector<at::Tensor>& saved, const std::vector<bool>& flags);

}  // namespace remat::detail
