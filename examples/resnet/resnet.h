#pragma once
// A CIFAR-style ResNet as C++ users write it (the LibTorch tutorials' shape: BasicBlock with two BatchNorms,
// a downsample Sequential, blocks held in layer1..layer3 Sequentials), and the ways remat checkpoints it.
// Used by examples/resnet/main.cpp and tests/resnet_test.cpp.
#include <remat/models/resnet.h>
#include <remat/remat.h>

#include <string>
#include <vector>

namespace resnet_example {

// The model: BasicBlock (two 3x3 convolutions with a BatchNorm each, a downsample Sequential where the shape
// changes) and ResNet (stem, blocks in the Sequentials layer1..layer3, head), in the shape the LibTorch
// tutorials give it. Its code is remat::models::ResNet (include/remat/models/resnet.h), which the benchmarks
// use too; what follows is how a user checkpoints it.
using remat::models::BasicBlock;
using remat::models::BasicBlockImpl;
using remat::models::ResNet;
using remat::models::ResNetImpl;

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
