#pragma once
/// \file
/// ResNet: a CIFAR-style residual network in the shape the LibTorch tutorials give it: BasicBlocks of two
/// 3x3 convolutions with a BatchNorm each, a 1x1 convolution and BatchNorm as the downsample Sequential where
/// the shape changes, the blocks held in the Sequentials layer1..layer3 (16, 32 and 64 channels; the last two
/// halve the resolution), a stem before them and a pooling head after. Its stages are unequal: a block of
/// layer1 keeps four times the activations of a block of layer3. examples/resnet checkpoints it the ways
/// users do; the benchmarks (`--model resnet`) plan over its blocks.
///
///   remat::models::ResNet net(3);                 // 3 blocks per layer: 9 blocks
///   net->gradient_checkpointing_enable();         // every block checkpointed (its BatchNorms declared)
///   auto logits = net->forward(torch::randn({64, 3, 32, 32}));
///   auto blocks = remat::stages_at(*net, {"layer1", "layer2", "layer3"});   // the chain of the 9 blocks

#include <remat/models/checkpointable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

namespace remat::models {

/// relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)); the shortcut is `downsample` (1x1 convolution with
/// the stride, and a BatchNorm) when the stride or the channels change, x otherwise.
struct BasicBlockImpl : torch::nn::Module {
  /// `in` -> `out` channels; stride 1 or 2.
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride);
  /// [batch, in, H, W] -> [batch, out, H / stride, W / stride].
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(BasicBlock);

/// The network: stem (3x3 convolution to 16 channels, BatchNorm, ReLU), layer1..layer3, head (global average
/// pooling and a Linear to `classes`). Input [batch, 3, H, W] images, output [batch, classes] logits.
struct ResNetImpl : torch::nn::Module, Checkpointable {
  /// Throws c10::Error naming the value when blocks_per_layer < 1 or classes < 1.
  explicit ResNetImpl(int64_t blocks_per_layer = 3, int64_t classes = 10);
  /// A layer of `blocks` BasicBlocks, the first with the stride.
  static torch::nn::Sequential make_layer(int64_t in, int64_t out, int64_t blocks, int64_t stride);
  /// The stem: [batch, 3, H, W] images -> [batch, 16, H, W].
  torch::Tensor stem(const torch::Tensor& x);
  /// The head: layer3's [batch, 64, h, w] -> [batch, classes] logits.
  torch::Tensor head(const torch::Tensor& h);
  /// With gradient checkpointing on, every block is its own remat::checkpoint (with the options given), or,
  /// after gradient_checkpointing_enable(PlannedOptions), the blocks run planned in place.
  torch::Tensor forward(const torch::Tensor& x);
  using Checkpointable::gradient_checkpointing_enable;
  /// Plans the blocks of layer1..layer3 in place for a budget (remat::Planned, remat/planned.h): the first
  /// training step (per input shape) profiles them where they run, the next runs the plan optimal() finds;
  /// the stem's output and what it saved are the base the budget is above. Replaces per-block checkpointing
  /// until the next gradient_checkpointing_enable(CheckpointOptions). Throws c10::Error when the budget is
  /// not positive, and, at the planning step, as PlannedImpl::forward does.
  void gradient_checkpointing_enable(PlannedOptions options);
  /// The blocks' Planned, or nullptr before the first forward pass after
  /// gradient_checkpointing_enable(PlannedOptions).
  const PlannedImpl* planned() const { return planned_.is_empty() ? nullptr : planned_.get(); }
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr}, layer3{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

}  // namespace remat::models
