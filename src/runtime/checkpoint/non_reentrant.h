#pragma once
// The kNonReentrant checkpoint mode (non_reentrant.cpp).

#include <remat/checkpoint.h>

#include <vector>

namespace remat::detail {

/// CheckpointMode::kNonReentrant: saved-tensor hooks drop what autograd saves inside fn, and the first
/// unpack in the backward pass recomputes fn (stopping early when options.early_stop()).
std::vector<at::Tensor> run_non_reentrant(const TensorsFn& fn, const std::vector<at::Tensor>& inputs,
                                          const CheckpointOptions& options);

}  // namespace remat::detail
