#pragma once
/// \file
/// CifarNet: the CIFAR-10 model of the "Training larger-than-memory PyTorch models using gradient
/// checkpointing" article: two conv blocks, dropout, a linear head. Enabling checkpointing checkpoints its
/// second conv block, as the article does (dropout stays outside the checkpointed block).
///
///   remat::models::CifarNet net;
///   net->gradient_checkpointing_enable();
///   auto logits = net->forward(torch::randn({64, 3, 32, 32}));   // [64, 10]

#include <remat/models/checkpointable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

namespace remat::models {

class CifarNetImpl : public torch::nn::Module, public Checkpointable {
 public:
  /// The article's layers, with LibTorch's default initialisation.
  CifarNetImpl();
  /// logits [batch, 10] for images [batch, 3, 32, 32]. Throws c10::Error naming the shape when it is not
  /// that.
  torch::Tensor forward(const torch::Tensor& images);

  torch::nn::Sequential cnn_block_1{nullptr}, cnn_block_2{nullptr}, linearize{nullptr};
  torch::nn::Dropout dropout_1{nullptr}, dropout_2{nullptr}, dropout_3{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(CifarNet);

}  // namespace remat::models
