#pragma once
// A CIFAR-style ResNet as C++ users write it (the LibTorch tutorials' shape: BasicBlock with two BatchNorms,
// a downsample Sequential, blocks held in layer1..layer3 Sequentials), and the ways remat checkpoints it.
// Used by examples/resnet/main.cpp and tests/resnet_test.cpp.
#include <remat/remat.h>

#include <string>
#include <vector>

namespace resnet_example {

struct BasicBlockImpl : torch::nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1(register_module(
            "conv1",
            torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(out))),
        conv2(register_module(
            "conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(out))) {
    if (stride != 1 || in != out) {
      downsample = register_module(
          "downsample",
          torch::nn::Sequential(
              torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)),
              torch::nn::BatchNorm2d(out)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = torch::relu(bn1(conv1(x)));
    out = bn2(conv2(out));
    out = out + (downsample ? downsample->forward(x) : x);
    return torch::relu(out);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::BatchNorm2d bn1, bn2;
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(BasicBlock);

struct ResNetImpl : torch::nn::Module {
  explicit ResNetImpl(int64_t blocks_per_layer = 3, int64_t classes = 10) {
    conv1 = register_module("conv1",
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
    layer1 = register_module("layer1", make_layer(16, 16, blocks_per_layer, 1));
    layer2 = register_module("layer2", make_layer(16, 32, blocks_per_layer, 2));
    layer3 = register_module("layer3", make_layer(32, 64, blocks_per_layer, 2));
    fc = register_module("fc", torch::nn::Linear(64, classes));
  }
  static torch::nn::Sequential make_layer(int64_t in, int64_t out, int64_t blocks, int64_t stride) {
    torch::nn::Sequential layer;
    layer->push_back(BasicBlock(in, out, stride));
    for (int64_t i = 1; i < blocks; ++i)
      layer->push_back(BasicBlock(out, out, 1));
    return layer;
  }
  torch::Tensor stem(const torch::Tensor& x) { return torch::relu(bn1(conv1(x))); }
  torch::Tensor head(const torch::Tensor& h) { return fc(torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1)); }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(layer3->forward(layer2->forward(layer1->forward(stem(x)))));
  }
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr}, layer3{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

/// The ways the example checkpoints the blocks.
enum class Way {
  kNone,               // no checkpointing
  kPerBlockModule,     // remat::checkpoint on what the container hands out (kNonReentrant)
  kPerBlockReentrant,  // the same in kReentrant mode
  kPerBlockAny,        // remat::checkpoint on the AnyModule a range-for over the Sequential gives
  kPerBlockLambda,     // a lambda around each block, no .modules(): BatchNorm still updated once
  kSequential,         // checkpoint_sequential over layer1..layer3 (stages_at), count-balanced
  kSegments,           // checkpoint_segments over layer1..layer3 at given starts (balanced by memory)
  kPlan,               // the plan executor over layer1..layer3
};

/// The logits under a way. `starts` serves kSegments, `plan` kPlan, `segments` kSequential.
inline torch::Tensor forward(ResNet& net, const torch::Tensor& x, Way way, int64_t segments = 3,
                             const std::vector<int64_t>& starts = {}, const remat::Plan* plan = nullptr) {
  torch::Tensor h = net->stem(x);
  using remat::CheckpointMode;
  using remat::CheckpointOptions;
  switch (way) {
    case Way::kNone:
      for (auto* layer : {&net->layer1, &net->layer2, &net->layer3})
        h = (*layer)->forward(h);
      break;
    case Way::kPerBlockModule:
    case Way::kPerBlockReentrant: {
      const auto mode =
          way == Way::kPerBlockModule ? CheckpointMode::kNonReentrant : CheckpointMode::kReentrant;
      for (auto* layer : {&net->layer1, &net->layer2, &net->layer3}) {
        for (size_t i = 0; i < (*layer)->size(); ++i)
          h = remat::checkpoint((*layer)->ptr<BasicBlockImpl>(i), h, CheckpointOptions().mode(mode));
      }
      break;
    }
    case Way::kPerBlockAny:
      for (auto* layer : {&net->layer1, &net->layer2, &net->layer3}) {
        for (auto& block : **layer)
          h = remat::checkpoint(block, h);
      }
      break;
    case Way::kPerBlockLambda:
      for (auto* layer : {&net->layer1, &net->layer2, &net->layer3}) {
        for (size_t i = 0; i < (*layer)->size(); ++i) {
          auto block = (*layer)->ptr<BasicBlockImpl>(i);
          h = remat::checkpoint([block](const torch::Tensor& t) { return block->forward(t); }, h);
        }
      }
      break;
    case Way::kSequential:
      h = remat::checkpoint_sequential(remat::stages_at(*net, {"layer1", "layer2", "layer3"}), segments, h);
      break;
    case Way::kSegments:
      h = remat::checkpoint_segments(remat::stages_at(*net, {"layer1", "layer2", "layer3"}), starts, h);
      break;
    case Way::kPlan:
      h = remat::run_plan(remat::stages_at(*net, {"layer1", "layer2", "layer3"}), *plan, h);
      break;
  }
  return net->head(h);
}

/// The stem and the head (with the loss) as the stages around the chain, for remat::profile_step.
inline remat::StageFn stem_stage(ResNet& net) {
  return {"stem", [net](const torch::Tensor& x) mutable { return net->stem(x); }, net.ptr()};
}
inline remat::StageFn head_stage(ResNet& net, const torch::Tensor& labels) {
  return {"head+loss",
          [net, labels](const torch::Tensor& h) mutable {
            return torch::nn::functional::cross_entropy(net->head(h), labels);
          },
          net.ptr()};
}

}  // namespace resnet_example
