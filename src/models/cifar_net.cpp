#include "remat/models/cifar_net.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/pooling.h>

namespace remat::models {
namespace {
torch::nn::Sequential conv_block(int64_t in, int64_t mid, int64_t out) {
  auto conv = [](int64_t i, int64_t o) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(i, o, 3).padding(1));
  };
  return torch::nn::Sequential(conv(in, mid), torch::nn::ReLU(), conv(mid, out), torch::nn::ReLU(),
                               torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)));
}
}  // namespace

CifarNetImpl::CifarNetImpl()
    : cnn_block_1(register_module("cnn_block_1", conv_block(3, 32, 64))),
      cnn_block_2(register_module("cnn_block_2", conv_block(64, 64, 64))),
      linearize(register_module(
          "linearize", torch::nn::Sequential(torch::nn::Linear(64 * 8 * 8, 512), torch::nn::ReLU()))),
      dropout_1(register_module("dropout_1", torch::nn::Dropout(0.25))),
      dropout_2(register_module("dropout_2", torch::nn::Dropout(0.25))),
      dropout_3(register_module("dropout_3", torch::nn::Dropout(0.5))),
      out(register_module("out", torch::nn::Linear(512, 10))) {}

torch::Tensor CifarNetImpl::forward(const torch::Tensor& images) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == 3 && images.size(2) == 32 && images.size(3) == 32,
              "remat::models::CifarNet: images must be [batch, 3, 32, 32], got ", images.sizes());
  auto x = dropout_1(cnn_block_1->forward(images));
  x = checkpointing_enabled_ ? remat::checkpoint(cnn_block_2, x, checkpoint_options_)
                             : cnn_block_2->forward(x);
  x = torch::flatten(dropout_2(x), 1);
  return out(dropout_3(linearize->forward(x)));
}

}  // namespace remat::models
