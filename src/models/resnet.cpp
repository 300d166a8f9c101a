#include "remat/models/resnet.h"

#include <torch/nn/functional/pooling.h>

#include "remat/checkpoint.h"

#include "kept.h"

namespace remat::models {

namespace {
torch::nn::Conv2dOptions conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false);
}
}  // namespace

BasicBlockImpl::BasicBlockImpl(int64_t in, int64_t out, int64_t stride)
    : conv1(register_module("conv1", torch::nn::Conv2d(conv(in, out, 3, stride)))),
      bn1(register_module("bn1", torch::nn::BatchNorm2d(out))),
      conv2(register_module("conv2", torch::nn::Conv2d(conv(out, out, 3, 1)))),
      bn2(register_module("bn2", torch::nn::BatchNorm2d(out))) {
  if (stride != 1 || in != out) {
    downsample = register_module(
        "downsample",
        torch::nn::Sequential(torch::nn::Conv2d(conv(in, out, 1, stride)), torch::nn::BatchNorm2d(out)));
  }
}

torch::Tensor BasicBlockImpl::forward(const torch::Tensor& x) {
  // The convolutions are marked for selective checkpointing (CheckpointOptions().keep({remat::kConv})).
  auto out = torch::relu(bn1(detail::kept_conv(conv1, x)));
  out = bn2(detail::kept_conv(conv2, out));
  out = out + (downsample ? downsample->forward(x) : x);
  return torch::relu(out);
}

ResNetImpl::ResNetImpl(int64_t blocks_per_layer, int64_t classes) {
  TORCH_CHECK(blocks_per_layer >= 1, "remat::models::ResNet: blocks_per_layer must be >= 1, got ",
              blocks_per_layer);
  TORCH_CHECK(classes >= 1, "remat::models::ResNet: classes must be >= 1, got ", classes);
  conv1 = register_module("conv1", torch::nn::Conv2d(conv(3, 16, 3, 1)));
  bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
  layer1 = register_module("layer1", make_layer(16, 16, blocks_per_layer, 1));
  layer2 = register_module("layer2", make_layer(16, 32, blocks_per_layer, 2));
  layer3 = register_module("layer3", make_layer(32, 64, blocks_per_layer, 2));
  fc = register_module("fc", torch::nn::Linear(64, classes));
}

torch::nn::Sequential ResNetImpl::make_layer(int64_t in, int64_t out, int64_t blocks, int64_t stride) {
  torch::nn::Sequential layer;
  layer->push_back(BasicBlock(in, out, stride));
  for (int64_t i = 1; i < blocks; ++i)
    layer->push_back(BasicBlock(out, out, 1));
  return layer;
}

torch::Tensor ResNetImpl::stem(const torch::Tensor& x) {
  return torch::relu(bn1(conv1(x)));
}

torch::Tensor ResNetImpl::head(const torch::Tensor& h) {
  return fc(torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1));
}

void ResNetImpl::gradient_checkpointing_enable(PlannedOptions options) {
  enable_planning(std::move(options), "remat::models::ResNet::gradient_checkpointing_enable");
}

torch::Tensor ResNetImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = stem(x);
  if (planning()) {
    if (planned_.is_empty())
      planned_ = Planned(stages_at(*this, {"layer1", "layer2", "layer3"}), *planned_options_);
    return head(planned_->forward(h));
  }
  for (auto* layer : {&layer1, &layer2, &layer3}) {
    if (!checkpointing_enabled_) {
      h = (*layer)->forward(h);
      continue;
    }
    for (size_t i = 0; i < (*layer)->size(); ++i)
      h = remat::checkpoint((*layer)->ptr<BasicBlockImpl>(i), h, checkpoint_options_);
  }
  return head(h);
}

}  // namespace remat::models
