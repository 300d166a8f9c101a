// The ResNet example (examples/resnet/resnet.h): every way remat checkpoints it gives the plain run's loss,
// gradients and BatchNorm buffers; the planner's floor is no worse than per-block checkpointing; stages
// found by path, balanced segments and the whole-step prediction.
#include <remat/remat.h>

#include "../examples/resnet/resnet.h"
#include "support.h"

namespace {

using remat::testing::max_abs_diff;
using resnet_example::Way;

struct Result {
  torch::Tensor loss;
  std::vector<torch::Tensor> grads, buffers;
};

// One training step (forward, backward) of a fresh, identically initialised network under `way`.
Result step(Way way, const torch::Tensor& x, const torch::Tensor& labels, int64_t segments = 3,
            const std::vector<int64_t>& starts = {}, const remat::Plan* plan = nullptr) {
  torch::manual_seed(1);
  resnet_example::ResNet net(2);
  torch::manual_seed(2);  // the same random state for every way (no dropout here, but keep it honest)
  Result r;
  r.loss = torch::nn::functional::cross_entropy(resnet_example::forward(net, x, way, segments, starts, plan),
                                                labels);
  r.loss.backward();
  for (const auto& p : net->parameters())
    r.grads.push_back(p.grad().clone());
  for (const auto& b : net->buffers())
    r.buffers.push_back(b.clone());
  return r;
}

void expect_same(const Result& got, const Result& want, const std::string& what) {
  EXPECT_LE(max_abs_diff(got.loss, want.loss), 1e-6) << what;
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  for (size_t i = 0; i < got.grads.size(); ++i)
    EXPECT_LE(max_abs_diff(got.grads[i], want.grads[i]), 1e-5) << what << ", gradient " << i;
  ASSERT_EQ(got.buffers.size(), want.buffers.size()) << what;
  for (size_t i = 0; i < got.buffers.size(); ++i)
    EXPECT_TRUE(got.buffers[i].equal(want.buffers[i])) << what << ", buffer " << i;
}

TEST(ResNetExample, EveryWayGivesThePlainLossGradientsAndBuffers) {
  torch::manual_seed(0);
  const auto x = torch::randn({4, 3, 16, 16});
  const auto labels = torch::randint(10, {4});
  const Result plain = step(Way::kNone, x, labels);
  // num_batches_tracked of every BatchNorm is 1 after one plain step; it is among the buffers compared.
  int64_t counters = 0;
  for (const auto& b : plain.buffers) {
    if (b.scalar_type() != torch::kLong) continue;
    EXPECT_EQ(b.item<int64_t>(), 1);
    ++counters;
  }
  EXPECT_EQ(counters, 1 + 6 * 2 + 2);  // stem, two per block, two downsamples

  expect_same(step(Way::kPerBlockModule, x, labels), plain, "per block, module");
  expect_same(step(Way::kPerBlockReentrant, x, labels), plain, "per block, kReentrant");
  expect_same(step(Way::kPerBlockAny, x, labels), plain, "per block, AnyModule");
  expect_same(step(Way::kPerBlockLambda, x, labels), plain, "per block, lambda without modules");
  for (int64_t k : {1, 2, 3, 6})
    expect_same(step(Way::kSequential, x, labels, k), plain,
                "checkpoint_sequential(" + std::to_string(k) + ")");
  expect_same(step(Way::kSegments, x, labels, 0, {0, 1, 4}), plain, "segments at 0, 1, 4");

  const remat::Chain chain = remat::uniform_chain(6, 1.0, 2.0, 1000, 3000);
  for (const remat::Plan& plan : {remat::checkpoint_all(chain), remat::optimal(chain, 12000)})
    expect_same(step(Way::kPlan, x, labels, 0, {}, &plan), plain, "plan " + plan.to_string());
}

TEST(ResNetExample, StagesFoundByPathShareTheModules) {
  resnet_example::ResNet net(2);
  const auto stages = remat::stages_at(*net, {"layer1", "layer2.1", "layer3"});
  ASSERT_EQ(stages.size(), 5u);
  EXPECT_EQ(stages[0].name, "layer1.0:BasicBlock");
  EXPECT_EQ(stages[2].name, "layer2.1:BasicBlock");
  EXPECT_EQ(stages[2].module.get(), net->layer2->ptr(1).get());  // shared, not copied
  EXPECT_EQ(net->parameters().size(), 3u + 6 * 6 + 2 * 3 + 2u);  // nothing registered twice
  auto expect_error = [&](const std::vector<std::string>& paths, const std::string& words) {
    try {
      remat::stages_at(*net, paths);
      ADD_FAILURE() << "no error for " << paths.front();
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("remat::stages_at"), std::string::npos) << what;
      EXPECT_NE(what.find(words), std::string::npos) << what;
    }
  };
  expect_error({"layer4"}, "'layer4' names no submodule");
  expect_error({"layer4"}, "layer1, layer2, layer3");
  expect_error({"layer1.0.conv1"}, "neither a Sequential or a ModuleList nor an element of one");
  expect_error({}, "no paths");
}

TEST(ResNetExample, ChainInputLeavesTheModelAsItWas) {
  torch::manual_seed(0);
  resnet_example::ResNet net(1);
  std::vector<torch::Tensor> before;
  for (const auto& b : net->buffers())
    before.push_back(b.clone());
  const auto x = torch::randn({2, 3, 8, 8});
  const auto h = remat::chain_input(resnet_example::stem_stage(net), x);
  EXPECT_EQ(h.sizes(), (std::vector<int64_t>{2, 16, 8, 8}));
  EXPECT_FALSE(h.requires_grad());
  const auto after = net->buffers();
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_TRUE(after[i].equal(before[i])) << "buffer " << i;
  // The stem in train mode did update its statistics during the call: equal to running it plainly once.
  torch::NoGradGuard no_grad;
  EXPECT_LE(max_abs_diff(h, net->stem(x)), 0.0);
}

// The planner's floor against the simplest API, and the whole step's prediction against the meter.
TEST(ResNetExample, PlannerFloorReachesPerBlockCheckpointingAndTheStepIsPredicted) {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  resnet_example::ResNet net(3);
  const auto x = torch::randn({16, 3, 32, 32});
  const auto labels = torch::randint(10, {16});
  const auto stages = remat::stages_at(*net, {"layer1", "layer2", "layer3"});
  const remat::StepProfile profile =
      remat::profile_step(resnet_example::stem_stage(net), stages, resnet_example::head_stage(net, labels), x,
                          remat::ProfileOptions().warmup(0).repeats(1));
  ASSERT_EQ(profile.chain.size(), 9);
  ASSERT_EQ(profile.step.size(), 11);
  auto peak = [&](Way way, const remat::Plan* plan) {
    return remat::measure_step(
               *net,
               [&] {
                 return torch::nn::functional::cross_entropy(
                     resnet_example::forward(net, x, way, 3, {}, plan), labels);
               },
               remat::MeasureOptions().warmup(1).steps(1))
        .peak_bytes;
  };
  const remat::Plan floor = remat::optimal(profile.chain, remat::min_feasible_budget(profile.chain));
  const int64_t per_block = peak(Way::kPerBlockModule, nullptr);
  const int64_t at_floor = peak(Way::kPlan, &floor);
  // docs/planning.md: the executor at the planner's floor, and the plan that checkpoints every block, are
  // within 2% of per-block kNonReentrant checkpointing. (The latter was a full-resolution activation above it
  // until the executor handed each stage's output to its backward by move: the block's last ReLU saves its
  // result, and the executor's reference kept it for the block's whole backward.)
  EXPECT_LE(static_cast<double>(at_floor), 1.02 * static_cast<double>(per_block))
      << "floor " << at_floor << " per block " << per_block;
  const remat::Plan all = remat::checkpoint_all(profile.chain);
  const int64_t at_all = peak(Way::kPlan, &all);
  EXPECT_LE(static_cast<double>(at_all), 1.02 * static_cast<double>(per_block))
      << "checkpoint_all " << at_all << " per block " << per_block;

  const int64_t input = static_cast<int64_t>(x.nbytes());
  for (const remat::Plan& plan :
       {floor, remat::no_checkpoint(profile.chain), remat::uniform(profile.chain, 3)}) {
    const int64_t predicted = remat::simulate(profile.step, remat::step_plan(plan)).peak_bytes - input;
    const int64_t measured = peak(Way::kPlan, &plan);
    // docs/planning.md: the whole step's predicted peak is within 3% of the meter's on this model.
    EXPECT_LE(std::abs(static_cast<double>(predicted - measured)), 0.03 * static_cast<double>(measured))
        << plan.to_string() << ": predicted " << predicted << ", measured " << measured;
  }
}

}  // namespace
