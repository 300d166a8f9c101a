#include "remat/models/heavy_chain.h"

namespace remat::models {

torch::Tensor heavy_function(const torch::Tensor& x, const torch::Tensor& a, int64_t adds) {
  torch::Tensor y = x;
  for (int64_t i = 0; i < adds; ++i)
    y = y + a;
  return y;
}

HeavyChainImpl::HeavyChainImpl(const HeavyChainOptions& options) : options_(options) {
  TORCH_CHECK(options.calls() >= 1, "remat::models::HeavyChain: calls must be >= 1, got ", options.calls());
  TORCH_CHECK(options.adds() >= 1, "remat::models::HeavyChain: adds must be >= 1, got ", options.adds());
  a = register_parameter("a", torch::tensor(1.0));
}

torch::Tensor HeavyChainImpl::forward(const torch::Tensor& x) {
  const int64_t adds = options_.adds();
  torch::Tensor h = x;
  if (!checkpointing_enabled_) {
    for (int64_t c = 0; c < options_.calls(); ++c)
      h = heavy_function(h, a, adds);
    return h;
  }
  CheckpointOptions opts = checkpoint_options_;
  opts.modules().push_back(shared_from_this());
  const torch::Tensor param = a;
  const TensorFn call = [param, adds](const torch::Tensor& t) { return heavy_function(t, param, adds); };
  for (int64_t c = 0; c < options_.calls(); ++c)
    h = remat::checkpoint(call, h, opts);
  return h;
}

}  // namespace remat::models
