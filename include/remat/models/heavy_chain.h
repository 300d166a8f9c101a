#pragma once
/// \file
/// HeavyChain: the model of the "PyTorch Tip: Checkpoints" article: one scalar parameter `a`, and `calls`
/// calls of a function that adds `a` to its input `adds` times: 100,000 tiny operations by default. Enabling
/// checkpointing checkpoints each call. The stress case for the per-call overhead of checkpointing.
///
///   remat::models::HeavyChain model(remat::models::HeavyChainOptions().calls(1000).adds(100));
///   model->gradient_checkpointing_enable(remat::CheckpointOptions().mode(remat::CheckpointMode::kReentrant));
///   auto y = model->forward(torch::zeros({}, torch::requires_grad()));   // 100000
///
/// What it saves: an addition keeps no tensor for its backward, so the plain graph keeps 100,000 autograd
/// nodes but no activation bytes. kReentrant checkpointing keeps one node per call (1,000); kNonReentrant
/// builds the same graph as the plain run (it only drops saved tensors, and there are none).

#include <remat/models/checkpointable.h>

namespace remat::models {

struct HeavyChainOptions {
  /// Calls of the heavy function (>= 1).
  TORCH_ARG(int64_t, calls) = 1000;
  /// Additions per call (>= 1).
  TORCH_ARG(int64_t, adds) = 100;
};

/// x + a, `adds` times.
torch::Tensor heavy_function(const torch::Tensor& x, const torch::Tensor& a, int64_t adds);

class HeavyChainImpl : public torch::nn::Module, public Checkpointable {
 public:
  /// Throws c10::Error naming the field and value when calls or adds < 1.
  explicit HeavyChainImpl(const HeavyChainOptions& options = {});
  /// x after calls * adds additions of a. With checkpointing on, each call is a checkpoint region.
  torch::Tensor forward(const torch::Tensor& x);
  const HeavyChainOptions& options() const { return options_; }

  torch::Tensor a;

 private:
  HeavyChainOptions options_;
};
TORCH_MODULE(HeavyChain);

}  // namespace remat::models
