#pragma once
/// \file
/// ForumCnn: both models of the "Gradient Checkpointing does not reduce memory usage" forum thread, with the
/// checkpoint placements the thread tried, selectable by name.
///
///   remat::models::ForumCnn net(remat::models::ForumCnnOptions().placement("all-convs"));
///   net->gradient_checkpointing_enable();
///   auto y = net->forward(torch::randn({100, 20, 19, 22}));    // [100, 3258]
///
/// Variants:
/// - "small" (default): input [batch, 20, 19, 22]; conv 20->50, 50->25, 25->10 (3x3, ReLU); flatten; a linear
///   layer to 3258 outputs.
/// - "full": input [batch, 20, 45, 43]; the same convolutions; three linear heads 19350 -> 29913 (the first
///   through a sigmoid), concatenated: 89739 outputs and 6.9 GB of weights.
/// Placements (what gradient_checkpointing_enable() checkpoints):
/// - "each-op": every operation alone (conv2, relu, conv3, relu, flatten, the linear layers; in the full
/// variant
///   conv1 and its relu too), as in the thread's first post. It saves nothing: each checkpoint keeps its
///   input, which is the previous checkpoint's output, so it keeps more than no checkpointing.
/// - "conv-relu": relu(conv2), relu(conv3) and the linear head, each as a block. ReLU keeps its output, so
///   this keeps exactly what no checkpointing keeps ("the memory usage is exactly the same").
/// - "all-convs": conv2, relu, conv3, relu together: drops one small activation.
/// - "heads" (full variant): the three linear heads and the concatenation together, as the reply suggested.
/// The weights dominate either model; `remat profile --model forum-cnn` says it in numbers.

#include <remat/models/checkpointable.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

namespace remat::models {

struct ForumCnnOptions {
  /// "small" or "full".
  TORCH_ARG(std::string, variant) = "small";
  /// "each-op", "conv-relu", "all-convs" or "heads" (heads: full variant only).
  TORCH_ARG(std::string, placement) = "each-op";
  /// Width of each linear head; 0 means the thread's (3258 small, 29913 full). Smaller values keep the full
  /// variant's structure without its 6.9 GB of weights (for tests).
  TORCH_ARG(int64_t, head_features) = 0;
};

class ForumCnnImpl : public torch::nn::Module, public Checkpointable {
 public:
  /// Throws c10::Error naming the value and the valid names for an unknown variant or placement, or "heads"
  /// with the small variant, or head_features < 0.
  explicit ForumCnnImpl(const ForumCnnOptions& options = {});
  /// Throws c10::Error naming the expected and given shape.
  torch::Tensor forward(const torch::Tensor& x);
  /// The input shape of one sample: {20, 19, 22} or {20, 45, 43}.
  std::vector<int64_t> sample_shape() const;
  const ForumCnnOptions& options() const { return options_; }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  std::vector<torch::nn::Linear> heads;  // fc1 (small) or param1..param3 (full)

 private:
  torch::Tensor run(const TensorFn& fn, const torch::Tensor& x, bool checkpointed);
  ForumCnnOptions options_;
  bool full_ = false;
  int64_t height_ = 19, width_ = 22;
};
TORCH_MODULE(ForumCnn);

}  // namespace remat::models
