#pragma once
/// \file
/// ResidualMlp: a chain of residual MLP blocks, x + fc2(gelu(fc1(x))), the plain case for planners and
/// scaling curves. Its blocks are a torch::nn::Sequential, so checkpoint_sequential, the profiler and the
/// plan executor take it as it is.
///
///   remat::models::ResidualMlp mlp(remat::models::ResidualMlpOptions().depth(16).width(256));
///   mlp->gradient_checkpointing_enable();   // every block checkpointed
///   auto y = mlp->forward(torch::randn({32, 256}));

#include <remat/models/checkpointable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

namespace remat::models {

/// Options of ResidualMlp.
struct ResidualMlpOptions {
  /// Number of residual blocks (>= 1).
  TORCH_ARG(int64_t, depth) = 12;
  /// Features in and out of every block (>= 1).
  TORCH_ARG(int64_t, width) = 256;
  /// Hidden features of a block's MLP; 0 means 4 * width.
  TORCH_ARG(int64_t, hidden) = 0;
  /// Dropout after the MLP, in [0, 1).
  TORCH_ARG(double, dropout) = 0.0;
};

/// One block: x + dropout(fc2(gelu(fc1(x)))).
class ResidualBlockImpl : public torch::nn::Module {
 public:
  /// fc1: width -> hidden, fc2: hidden -> width, dropout probability `dropout`.
  ResidualBlockImpl(int64_t width, int64_t hidden, double dropout);
  /// Same shape as x ([batch, width]).
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(ResidualBlock);

/// The chain. forward(x) takes [batch, width] and returns the same shape.
class ResidualMlpImpl : public torch::nn::Module, public Checkpointable {
 public:
  /// Throws c10::Error naming the field and value when depth < 1, width < 1, hidden < 0 or dropout not in
  /// [0,1).
  explicit ResidualMlpImpl(const ResidualMlpOptions& options = {});
  /// Runs the blocks in order; with checkpointing on, each block is a remat::checkpoint region.
  /// Throws c10::Error when x is not [batch, width].
  torch::Tensor forward(const torch::Tensor& x);
  /// The blocks, as a Sequential (shared with this module).
  torch::nn::Sequential& blocks() { return blocks_; }
  const ResidualMlpOptions& options() const { return options_; }

 private:
  ResidualMlpOptions options_;
  torch::nn::Sequential blocks_{nullptr};
};
TORCH_MODULE(ResidualMlp);

}  // namespace remat::models
