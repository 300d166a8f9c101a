#pragma once
// The kReentrant checkpoint mode (reentrant.cpp).

#include <remat/checkpoint.h>

#include <vector>

namespace remat::detail {

/// CheckpointMode::kReentrant: a custom autograd Function that runs fn under no-grad and recomputes it in its
/// backward, differentiating it with an inner autograd call.
std::vector<at::Tensor> run_reentrant(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                      const CheckpointOptions& options);

}  // namespace remat::detail
