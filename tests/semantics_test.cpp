// What users of torch.utils.checkpoint rely on, checked in remat: autocast carried into the recompute,
// torch::autograd::grad inside a checkpointed function, second-order gradients, custom autograd Functions,
// and the engine checks that stop kNonReentrant from silently keeping every activation.

#include <ATen/SavedTensorHooks.h>
#include <c10/util/Exception.h>
#include <remat/checkpoint.h>
#include <remat/sequential.h>
#include <torch/csrc/autograd/engine.h>
#include <unordered_set>

#include <torch/version.h>

#include <atomic>

#include "autocast.h"
#include "detail/compat.h"
#include "support.h"

namespace {

using remat::CheckpointMode;
using remat::CheckpointOptions;
using remat::testing::clear_grads;
using remat::testing::expect_all_close;
using remat::testing::grads_of;
using remat::testing::max_abs_diff;
namespace compat = remat::detail::compat;

class SemanticsTest : public ::testing::TestWithParam<CheckpointMode> {
 protected:
  void SetUp() override { torch::manual_seed(0); }
  CheckpointOptions opts() const { return CheckpointOptions().mode(GetParam()); }
};

INSTANTIATE_TEST_SUITE_P(Modes, SemanticsTest,
                         ::testing::Values(CheckpointMode::kNonReentrant, CheckpointMode::kReentrant),
                         remat::testing::mode_name);

using remat::testing::CpuAutocast;

// ---------------------------------------------------------------------------------------------------------
// Autocast

// PyTorch's check_graph_dies (TestNestedCheckpoint): once the region's input and output are gone, nothing of
// the graph survives, the input's gradient accumulator included; with and without a backward pass.
//
// Ported to C++ with a weak reference to every node of the graph, LibTorch 2.x keeps the accumulator as long
// as the weak reference to the node that saved the input lives: a node whose last strong reference goes while
// weak ones remain releases its edges but keeps its saved variables (Node::release_resources), and a saved
// variable packed through saved-tensor hooks, as every kNonReentrant region's are, holds its leaf's
// accumulator (SavedVariable::save_metadata). Python's weakrefs to grad_fn take no such C++ reference. So the
// accumulator is held by the observer's weak references and goes with them: bounded, and checked here on
// both builds (1.13 frees a node's members with its last strong reference).
TEST_P(SemanticsTest, TheGraphDiesWithItsTensors) {
  for (const bool backward : {false, true}) {
    for (const bool scalar : {true, false}) {
      const std::string what = std::string(scalar ? "0-dim" : "1-dim") + " input, " +
                               (backward ? "after" : "without") + " a backward pass";
      remat::detail::compat::WeakNode accumulator;
      std::vector<remat::detail::compat::WeakNode> others;  // the rest of the graph, as a C++ port holds it
      for (const bool hold_others : {false, true}) {
        others.clear();
        {
          const auto a =
              scalar ? torch::tensor(1.5, torch::requires_grad()) : torch::randn({3}, torch::requires_grad());
          auto out = remat::checkpoint([](const torch::Tensor& x) { return x.sin().exp().sin(); }, a,
                                       remat::CheckpointOptions().mode(GetParam()));
          accumulator = remat::detail::compat::WeakNode(torch::autograd::impl::try_get_grad_accumulator(a));
          ASSERT_TRUE(accumulator.alive());
          if (hold_others) {
            std::vector<remat::detail::compat::WeakNode::Ptr> stack{out.grad_fn()};
            while (!stack.empty()) {
              auto node = stack.back();
              stack.pop_back();
              others.emplace_back(node);
              for (const auto& e : node->next_edges())
                if (e.function) stack.push_back(e.function);
            }
          }
          if (backward) out.sum().backward();
        }
        if (!hold_others) EXPECT_FALSE(accumulator.alive()) << what;
      }
      others.clear();  // the port's weak references go: so does the accumulator
      EXPECT_FALSE(accumulator.alive()) << what << ", once the weak references to the graph are gone";
    }
  }
}

TEST_P(SemanticsTest, AutocastIsReenteredInTheRecompute) {
  torch::nn::Linear fc1(16, 32), fc2(32, 8);
  auto fn = [&](const torch::Tensor& t) { return fc2(torch::relu(fc1(t))); };
  auto x = torch::randn({4, 16}, torch::requires_grad());

  torch::Tensor plain_y;
  {
    CpuAutocast ac;
    plain_y = fn(x);
  }
  ASSERT_EQ(plain_y.scalar_type(), torch::kBFloat16);
  plain_y.to(torch::kFloat).pow(2).sum().backward();
  auto plain = grads_of(*fc1);
  auto plain2 = grads_of(*fc2);
  auto plain_x = x.grad().clone();

  clear_grads(*fc1);
  clear_grads(*fc2);
  x.mutable_grad() = torch::Tensor();
  torch::Tensor y;
  {
    CpuAutocast ac;
    y = remat::checkpoint(fn, x, opts().modules({fc1.ptr(), fc2.ptr()}));
  }
  ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_FALSE(compat::autocast_enabled(c10::DeviceType::CPU));
  // The recompute runs in bfloat16 as the forward pass did (the determinism check would throw otherwise),
  // so the gradients are those of the plain bfloat16 run, bit for bit.
  y.to(torch::kFloat).pow(2).sum().backward();
  expect_all_close(grads_of(*fc1), plain, 0.0);
  expect_all_close(grads_of(*fc2), plain2, 0.0);
  EXPECT_EQ(max_abs_diff(x.grad(), plain_x), 0.0);
  // The backward pass left autocast as it found it.
  EXPECT_FALSE(compat::autocast_enabled(c10::DeviceType::CPU));
}

// The region runs with autocast's cache off, its forward pass and its recompute: with the backward inside the
// caller's autocast region, the gradients are the plain run's and nothing is left in the cache once the
// backward is done. Before (2026-12-03), kReentrant's no-grad forward left a cast of the weight without
// history there, which the recompute took on LibTorch 1.13: the weight got no gradient at all (PyPI's 2.15
// makes a new cast); kNonReentrant left the cast held past the backward.
TEST_P(SemanticsTest, AutocastsCacheIsOffInTheRegionWithTheBackwardInsideTheAutocastRegion) {
  remat::memory::track_cpu();
  // Its own weight, not a view of it: autocast caches the casts of leaves that require grad and are no views.
  const auto w = torch::randn({64, 64}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) { return torch::relu(torch::mm(t, w)); };
  const auto x = torch::randn({8, 64}, torch::requires_grad());
  torch::Tensor plain_w, plain_x;
  for (const bool checkpointed : {false, true}) {
    w.mutable_grad() = torch::Tensor();
    x.mutable_grad() = torch::Tensor();
    const int64_t base = remat::memory::active_bytes();
    {
      CpuAutocast ac;
      torch::Tensor y = checkpointed ? remat::checkpoint(fn, x, opts()) : fn(x);
      y.to(torch::kFloat).pow(2).sum().backward();
      y = torch::Tensor();
      if (checkpointed) {
        // Inside the region: nothing but the two gradients.
        EXPECT_EQ(remat::memory::active_bytes() - base, w.nbytes() + x.nbytes());
      }
    }
    ASSERT_TRUE(w.grad().defined()) << checkpointed;
    if (!checkpointed) {
      plain_w = w.grad().clone(), plain_x = x.grad().clone();
      continue;
    }
    EXPECT_TRUE(torch::equal(w.grad(), plain_w));
    EXPECT_TRUE(torch::equal(x.grad(), plain_x));
  }
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
}

TEST_P(SemanticsTest, RegionRunWithoutAutocastIsRecomputedWithoutIt) {
  // The opposite case: backward() called inside an autocast region must not recompute in bfloat16 a region
  // whose forward pass ran in float32.
  torch::nn::Linear fc(8, 8);
  auto x = torch::randn({2, 8}, torch::requires_grad());
  auto y = remat::checkpoint([&](const torch::Tensor& t) { return torch::tanh(fc(t)); }, x,
                             opts().modules({fc.ptr()}));
  auto loss = y.pow(2).sum();
  {
    CpuAutocast ac;
    EXPECT_NO_THROW(loss.backward());
    EXPECT_TRUE(compat::autocast_enabled(c10::DeviceType::CPU));
  }
  auto got = fc->weight.grad().clone();
  // The plain run, its backward under the same autocast (backward ops are autocast too).
  clear_grads(*fc);
  x.mutable_grad() = torch::Tensor();
  auto plain_loss = torch::tanh(fc(x)).pow(2).sum();
  {
    CpuAutocast ac;
    plain_loss.backward();
  }
  EXPECT_EQ(max_abs_diff(got, fc->weight.grad()), 0.0);
}

TEST(SemanticsExecutor, AutocastIsReenteredByCheckpointSequential) {
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(16, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                            torch::nn::GELU(), torch::nn::Linear(16, 4));
  auto x = torch::randn({4, 16}, torch::requires_grad());
  torch::Tensor plain_y;
  {
    CpuAutocast ac;
    plain_y = seq->forward(x);
  }
  plain_y.to(torch::kFloat).sum().backward();
  auto plain = grads_of(*seq);
  auto plain_x = x.grad().clone();
  clear_grads(*seq);
  x.mutable_grad() = torch::Tensor();
  torch::Tensor y;
  {
    CpuAutocast ac;
    y = remat::checkpoint_sequential(seq, 3, x);
  }
  ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
  y.to(torch::kFloat).sum().backward();
  expect_all_close(grads_of(*seq), plain, 0.0);
  EXPECT_EQ(max_abs_diff(x.grad(), plain_x), 0.0);
}

// ---------------------------------------------------------------------------------------------------------
// torch::autograd::grad inside the checkpointed function

// A gradient penalty: fn returns y and |dy/dx|^2 computed with create_graph, so the loss depends on a first
// derivative of the region's own intermediate results.
std::vector<torch::Tensor> penalty_fn(torch::nn::Linear& fc, const std::vector<torch::Tensor>& in) {
  auto y = torch::tanh(fc(in[0])).pow(2).sum(1);
  auto g = torch::autograd::grad({y.sum()}, {in[0]}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  return {y, g.pow(2).sum(1)};
}

TEST_P(SemanticsTest, GradInsideTheFunctionWorksAndMatchesThePlainRun) {
  if (GetParam() == CheckpointMode::kReentrant) GTEST_SKIP() << "kReentrant refuses it (next tests)";
  torch::nn::Linear fc(6, 6);
  auto x = torch::randn({3, 6}, torch::requires_grad());
  auto plain_out = penalty_fn(fc, {x});
  (plain_out[0].sum() + plain_out[1].sum()).backward();
  auto plain = grads_of(*fc);
  auto plain_x = x.grad().clone();

  clear_grads(*fc);
  x.mutable_grad() = torch::Tensor();
  auto out = remat::checkpoint([&](const std::vector<torch::Tensor>& in) { return penalty_fn(fc, in); }, {x},
                               opts().modules({fc.ptr()}));
  EXPECT_EQ(max_abs_diff(out[0], plain_out[0]), 0.0);
  EXPECT_EQ(max_abs_diff(out[1], plain_out[1]), 0.0);
  (out[0].sum() + out[1].sum()).backward();
  expect_all_close(grads_of(*fc), plain, 1e-6);
  EXPECT_LE(max_abs_diff(x.grad(), plain_x), 1e-6);
}

TEST_P(SemanticsTest, GradInsideWithoutCreateGraphWorks) {
  if (GetParam() == CheckpointMode::kReentrant) GTEST_SKIP() << "kReentrant refuses it (next tests)";
  // fn uses a gradient as a plain value (no create_graph), e.g. a physics-informed residual's direction.
  torch::nn::Linear fc(5, 5);
  auto x = torch::randn({2, 5}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) {
    auto y = torch::sin(fc(t)).sum();
    auto g = torch::autograd::grad({y}, {t}, {}, /*retain_graph=*/true)[0];
    return fc(t) * g;
  };
  fn(x).sum().backward();
  auto plain = grads_of(*fc);
  clear_grads(*fc);
  remat::checkpoint(fn, x, opts().modules({fc.ptr()})).sum().backward();
  expect_all_close(grads_of(*fc), plain, 1e-6);
}

TEST(SemanticsReentrant, GradInsideTheFunctionIsAClearError) {
  torch::nn::Linear fc(6, 6);
  auto x = torch::randn({3, 6}, torch::requires_grad());
  auto before = fc->weight.clone();
  EXPECT_THROW_WITH(
      remat::checkpoint([&](const std::vector<torch::Tensor>& in) { return penalty_fn(fc, in); }, {x},
                        CheckpointOptions().mode(CheckpointMode::kReentrant).modules({fc.ptr()})),
      "remat::checkpoint", "kReentrant cannot support", "kNonReentrant");
  EXPECT_FALSE(fc->weight.grad().defined());
  EXPECT_TRUE(fc->weight.equal(before));
}

// ---------------------------------------------------------------------------------------------------------
// Second-order gradients

TEST_P(SemanticsTest, DoubleBackwardOfACheckpointOfAFunction) {
  auto x = torch::tensor({1.5, -2.0, 0.5}, torch::requires_grad());
  auto y = remat::checkpoint([](const torch::Tensor& t) { return t.pow(3); }, x, opts());
  auto g = torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  EXPECT_EQ(max_abs_diff(g, 3 * x.detach().pow(2)), 0.0);
  auto gg = torch::autograd::grad({g.sum()}, {x})[0];
  EXPECT_EQ(max_abs_diff(gg, 6 * x.detach()), 0.0);
}

TEST_P(SemanticsTest, BackwardWithCreateGraphBuildsASecondOrderGraph) {
  auto x = torch::tensor({1.5, -2.0, 0.5}, torch::requires_grad());
  auto y = remat::checkpoint([](const torch::Tensor& t) { return t.pow(3); }, x, opts());
  y.sum().backward({}, /*retain_graph=*/true, /*create_graph=*/true);
  auto g = x.grad();
  ASSERT_TRUE(g.requires_grad());
  x.mutable_grad() = torch::Tensor();
  g.sum().backward();
  EXPECT_EQ(max_abs_diff(x.grad(), 6 * x.detach()), 0.0);
}

TEST_P(SemanticsTest, DoubleBackwardThroughParametersEqualsThePlainRun) {
  // Hessian-vector products through a module: a function of a checkpoint, with parameters in the region.
  torch::nn::Linear fc(4, 4);
  auto x = torch::randn({3, 4}, torch::requires_grad());
  auto hvp = [&](bool ckpt) {
    auto h = ckpt ? remat::checkpoint([&](const torch::Tensor& t) { return torch::tanh(fc(t)); }, x,
                                      opts().modules({fc.ptr()}))
                  : torch::tanh(fc(x));
    auto loss = (h * x).pow(2).sum();
    auto gs =
        torch::autograd::grad({loss}, {x, fc->weight}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    auto second = torch::autograd::grad({gs[0].sum() + gs[1].pow(2).sum()}, {x, fc->weight, fc->bias});
    return std::vector<torch::Tensor>{gs[0].detach(), gs[1].detach(), second[0], second[1], second[2]};
  };
  auto plain = hvp(false);
  auto got = hvp(true);
  expect_all_close(got, plain, 1e-5);
}

TEST_P(SemanticsTest, DoubleBackwardThroughNestedCheckpoints) {
  auto x = torch::tensor({0.3, -1.2, 2.0}, torch::requires_grad());
  auto inner = [&](const torch::Tensor& t) { return torch::sin(t) * t; };
  auto outer = [&](const torch::Tensor& t) { return remat::checkpoint(inner, t, opts()).pow(2); };
  auto y = remat::checkpoint(outer, x, opts());
  auto g = torch::autograd::grad({y.sum()}, {x}, {}, true, true)[0];
  auto gg = torch::autograd::grad({g.sum()}, {x})[0];

  auto xp = x.detach().requires_grad_(true);
  auto yp = (torch::sin(xp) * xp).pow(2);
  auto gp = torch::autograd::grad({yp.sum()}, {xp}, {}, true, true)[0];
  auto ggp = torch::autograd::grad({gp.sum()}, {xp})[0];
  EXPECT_LE(max_abs_diff(g, gp), 1e-6);
  EXPECT_LE(max_abs_diff(gg, ggp), 1e-6);
}

TEST_P(SemanticsTest, CheckpointInsideAFunctionWhoseGradientIsDifferentiated) {
  auto x = torch::tensor({0.7, -0.4}, torch::requires_grad());
  auto f = [&](const torch::Tensor& t, bool ckpt) {
    auto c = ckpt ? remat::checkpoint([](const torch::Tensor& u) { return torch::exp(u) * u; }, t, opts())
                  : torch::exp(t) * t;
    return (c * t).sum();
  };
  auto g = torch::autograd::grad({f(x, true)}, {x}, {}, true, true)[0];
  auto gg = torch::autograd::grad({g.pow(2).sum()}, {x})[0];
  auto gp = torch::autograd::grad({f(x, false)}, {x}, {}, true, true)[0];
  auto ggp = torch::autograd::grad({gp.pow(2).sum()}, {x})[0];
  EXPECT_LE(max_abs_diff(g, gp), 1e-6);
  EXPECT_LE(max_abs_diff(gg, ggp), 1e-6);
}

TEST_P(SemanticsTest, DoubleBackwardWithAnInputPassedTwice) {
  auto x = torch::tensor({1.0, 2.0}, torch::requires_grad());
  auto outs = remat::checkpoint(
      [](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{in[0] * in[1].pow(2)}; },
      {x, x}, opts());
  auto g = torch::autograd::grad({outs[0].sum()}, {x}, {}, true, true)[0];
  EXPECT_EQ(max_abs_diff(g, 3 * x.detach().pow(2)), 0.0);
  auto gg = torch::autograd::grad({g.sum()}, {x})[0];
  EXPECT_EQ(max_abs_diff(gg, 6 * x.detach()), 0.0);
}

// ---------------------------------------------------------------------------------------------------------
// Custom autograd Functions inside a region

struct SaveConstant : torch::autograd::Function<SaveConstant> {
  static std::atomic<int> identical;
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& scale) {
    ctx->save_for_backward({scale});
    ctx->saved_data["scale"] = scale;  // the tensor itself, to compare identities in backward
    return x * scale;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables()[0];
    if (saved.unsafeGetTensorImpl() == ctx->saved_data["scale"].toTensor().unsafeGetTensorImpl()) ++identical;
    return {grads[0] * saved, torch::Tensor()};
  }
};
std::atomic<int> SaveConstant::identical{0};

TEST_P(SemanticsTest, CustomFunctionGetsBackTheTensorItSaved) {
  // remat hands the tensor a recompute saved back as it is. LibTorch 1.13's SavedVariable wraps every
  // tensor that went through saved-tensor hooks in a new one (2.x returns it as it is when it needs no
  // autograd history), so on 1.13 kNonReentrant gives an equal tensor, not the same one.
  const bool same_object = TORCH_VERSION_MAJOR >= 2 || GetParam() == CheckpointMode::kReentrant;
  auto scale = torch::full({3}, 2.5);  // does not require grad
  auto x = torch::randn({3}, torch::requires_grad());
  SaveConstant::identical = 0;
  remat::checkpoint([&](const torch::Tensor& t) { return SaveConstant::apply(t * 1.0, scale); }, x, opts())
      .sum()
      .backward();
  EXPECT_EQ(SaveConstant::identical.load(), same_object ? 1 : 0);
  EXPECT_EQ(max_abs_diff(x.grad(), torch::full({3}, 2.5)), 0.0);
}

// ---------------------------------------------------------------------------------------------------------
// kReentrant under torch::autograd::grad: undeclared parameters get their gradients (the region's forward
// pass finds them and makes them inputs of its node)

TEST(SemanticsReentrant, UndeclaredParameterAskedForUnderGradGetsItsGradient) {
  torch::nn::Linear fc(7, 3);
  auto x = torch::randn({2, 7}, torch::requires_grad());
  auto y = remat::checkpoint([&](const torch::Tensor& t) { return fc(t); }, x,
                             CheckpointOptions().mode(CheckpointMode::kReentrant));
  compat::WarningCapture collector;
  auto grads = torch::autograd::grad({y.sum()}, {x, fc->weight});
  auto want = torch::autograd::grad({fc(x).sum()}, {x, fc->weight});
  EXPECT_EQ(max_abs_diff(grads[0], want[0]), 0.0);
  EXPECT_EQ(max_abs_diff(grads[1], want[1]), 0.0);
  EXPECT_TRUE(collector.messages.empty());
  EXPECT_FALSE(fc->weight.grad().defined());
}

TEST(SemanticsReentrant, UndeclaredParameterNotAskedForGetsNothing) {
  torch::nn::Linear fc(9, 2);
  auto x = torch::randn({2, 9}, torch::requires_grad());
  auto y = remat::checkpoint([&](const torch::Tensor& t) { return fc(t); }, x,
                             CheckpointOptions().mode(CheckpointMode::kReentrant));
  compat::WarningCapture collector;
  auto gx = torch::autograd::grad({y.sum()}, {x})[0];
  EXPECT_EQ(max_abs_diff(gx, fc->weight.sum(0).expand({2, 9})), 0.0);
  EXPECT_TRUE(collector.messages.empty());
  EXPECT_FALSE(fc->weight.grad().defined());
}

// ---------------------------------------------------------------------------------------------------------
// No silent fallback: kNonReentrant refuses to run where its hooks would not be called

struct OtherEngine : torch::autograd::Engine {};
torch::autograd::Engine* saved_engine = nullptr;
torch::autograd::Engine& other_engine() {
  static OtherEngine* engine = new OtherEngine();
  return *engine;
}
torch::autograd::Engine& restore_engine() {
  return *saved_engine;
}

TEST(SemanticsEngine, AnotherDefaultEngineIsAClearError) {
  auto x = torch::randn({3}, torch::requires_grad());
  // Make sure remat's engine is installed, then put another one (as `import torch` does) in its place.
  remat::checkpoint([](const torch::Tensor& t) { return t.exp(); }, x).sum().backward();
  saved_engine = &torch::autograd::Engine::get_default_engine();
  torch::autograd::set_default_engine_stub(&other_engine);
  EXPECT_THROW_WITH(remat::checkpoint([](const torch::Tensor& t) { return t.exp(); }, x), "remat::checkpoint",
                    "another engine", "kReentrant");
  // kReentrant does not depend on the engine.
  x.mutable_grad() = torch::Tensor();
  remat::checkpoint([](const torch::Tensor& t) { return t.exp(); }, x,
                    CheckpointOptions().mode(CheckpointMode::kReentrant))
      .sum()
      .backward();
  EXPECT_EQ(max_abs_diff(x.grad(), x.detach().exp()), 0.0);
  torch::autograd::set_default_engine_stub(&restore_engine);
  EXPECT_NO_THROW(remat::checkpoint([](const torch::Tensor& t) { return t.exp(); }, x));
}

TEST(SemanticsEngine, DisabledSavedTensorHooksAreAClearError) {
  auto x = torch::randn({3}, torch::requires_grad());
  at::SavedTensorDefaultHooks::disable("disabled by the test");
  EXPECT_THROW_WITH(remat::checkpoint([](const torch::Tensor& t) { return t.exp(); }, x), "remat::checkpoint",
                    "disabled", "disabled by the test");
  at::SavedTensorDefaultHooks::enable();
  EXPECT_NO_THROW(remat::checkpoint([](const torch::Tensor& t) { return t.exp(); }, x).sum().backward());
}

}  // namespace
