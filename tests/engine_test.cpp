// remat's autograd mechanics: one engine whatever ran first, remat's per-thread state on every thread
// autograd runs a backward pass on, and no silently wrong gradient from nested kReentrant regions. Each test
// runs in a process of its own (ctest runs every test separately), so the order of backward passes inside a
// test is the process's whole history.

#include <torch/csrc/autograd/engine.h>

#include <atomic>
#include <functional>
#include <thread>

#include "support.h"

#include <remat/policy.h>

namespace {

using remat::CheckpointMode;
using remat::CheckpointOptions;
using remat::testing::max_abs_diff;

CheckpointOptions reentrant() {
  return CheckpointOptions().mode(CheckpointMode::kReentrant);
}

// The regression case of the nesting defect: a kReentrant region whose lambda calls another, both lambdas
// using `w` without declaring it. PyTorch's use_reentrant=True gives the plain gradient for the same program;
// remat gave `w` a different one, silently.
TEST(EngineNesting, NestedReentrantUndeclaredGetsPlainGradient) {
  torch::manual_seed(0);
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto h = torch::randn({4, 8}, torch::requires_grad());
  auto layer = [&](const torch::Tensor& t) { return torch::tanh(t.mm(w)); };

  layer(layer(h)).sum().backward();
  const auto gw = w.grad().clone(), gh = h.grad().clone();
  w.mutable_grad() = torch::Tensor();
  h.mutable_grad() = torch::Tensor();

  remat::checkpoint(
      [&](const torch::Tensor& u) {
        return remat::checkpoint([&](const torch::Tensor& v) { return layer(v); }, layer(u), reentrant());
      },
      h, reentrant())
      .sum()
      .backward();
  EXPECT_LE(max_abs_diff(h.grad(), gh), 1e-6);
  EXPECT_LE(max_abs_diff(w.grad(), gw), 1e-6);
}

// Deeper: three kReentrant levels and a kNonReentrant one in the middle, `w` used only in the innermost
// region (no outer region's recomputed graph reaches it).
TEST(EngineNesting, UndeclaredUsedOnlyInTheInnermostOfMixedNesting) {
  torch::manual_seed(1);
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto h = torch::randn({4, 8}, torch::requires_grad());
  auto inner = [&](const torch::Tensor& t) { return torch::sin(t.mm(w)); };
  auto plain = [&](const torch::Tensor& x) { return inner(torch::tanh(torch::tanh(x) * 2) * 3).sum(); };
  plain(h).backward();
  const auto gw = w.grad().clone(), gh = h.grad().clone();

  for (auto middle : {CheckpointMode::kReentrant, CheckpointMode::kNonReentrant}) {
    w.mutable_grad() = torch::Tensor();
    h.mutable_grad() = torch::Tensor();
    auto out = remat::checkpoint(
        [&](const torch::Tensor& a) {
          return remat::checkpoint(
              [&](const torch::Tensor& b) {
                return remat::checkpoint(inner, torch::tanh(b) * 3, reentrant());
              },
              torch::tanh(a) * 2, CheckpointOptions().mode(middle));
        },
        h, reentrant());
    out.sum().backward();
    EXPECT_LE(max_abs_diff(h.grad(), gh), 1e-6);
    EXPECT_LE(max_abs_diff(w.grad(), gw), 1e-6);
  }
}

// Under torch::autograd::grad an undeclared tensor gets its gradient too, nested or not: kReentrant finds
// the tensors a region uses in its forward pass and makes them inputs of its node (it warned before, and
// under nesting it said nothing).
TEST(EngineNesting, GradOfAnUndeclaredTensorIsExact) {
  auto w = torch::randn({8, 5}, torch::requires_grad());
  auto h = torch::randn({4, 8}, torch::requires_grad());
  auto layer = [&](const torch::Tensor& t) { return torch::tanh(t.mm(w)); };
  auto want_w = torch::autograd::grad({layer(h).sum()}, {w})[0];
  auto got_w = torch::autograd::grad({remat::checkpoint(layer, h, reentrant()).sum()}, {w})[0];
  EXPECT_LE(max_abs_diff(got_w, want_w), 1e-6);

  auto square = torch::randn({8, 8}, torch::requires_grad());
  auto layer2 = [&](const torch::Tensor& t) { return torch::tanh(t.mm(square)); };
  auto nested = [&] {
    return remat::checkpoint(
               [&](const torch::Tensor& u) { return remat::checkpoint(layer2, u * 2, reentrant()); }, h,
               reentrant())
        .sum();
  };
  auto want = torch::autograd::grad({layer2(h * 2).sum()}, {square, h});
  auto got = torch::autograd::grad({nested()}, {square, h});
  EXPECT_LE(max_abs_diff(got[0], want[0]), 1e-6);
  EXPECT_LE(max_abs_diff(got[1], want[1]), 1e-6);
  auto got_h = torch::autograd::grad({nested()}, {h})[0];  // the undeclared tensor not asked for
  EXPECT_LE(max_abs_diff(got_h, want[1]), 1e-6);
  EXPECT_FALSE(square.grad().defined());  // and nothing accumulated
}

// A tensor that requires grad, computed outside a kReentrant region and used inside without being an input,
// gets its gradient through the region's node too (it was dropped before, silently), under both calls.
TEST(EngineNesting, CapturedNonLeafGetsItsGradient) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto h = torch::randn({4, 8}, torch::requires_grad());
  torch::Tensor scaled;
  auto f = [&](const torch::Tensor& t) { return torch::tanh(t.mm(scaled)); };
  auto run = [&](bool checkpointed) {
    scaled = w * 2;  // computed outside, requires grad
    return (checkpointed ? remat::checkpoint(f, h, reentrant()) : f(h)).sum();
  };
  run(false).backward();
  const auto gw = w.grad().clone(), gh = h.grad().clone();
  w.mutable_grad() = torch::Tensor();
  h.mutable_grad() = torch::Tensor();
  run(true).backward();
  EXPECT_LE(max_abs_diff(w.grad(), gw), 1e-6);
  EXPECT_LE(max_abs_diff(h.grad(), gh), 1e-6);
  auto g = torch::autograd::grad({run(true)}, {w})[0];
  EXPECT_LE(max_abs_diff(g, gw), 1e-6);
}

// The engine defect: a plain backward pass, then a kNonReentrant region's, then 80 nested kReentrant regions
// (past LibTorch's per-thread depth of 60, so the deepest passes run on the engine's pool) and their
// backward, then a plain one again, in one process. On 2.15 this crashed (remat's engine, a second Engine,
// had no pool of its own after the base engine had run first).
TEST(EngineThreads, PlainThenNonReentrantThenEightyNestedReentrant) {
  torch::manual_seed(2);
  auto w = torch::randn({6, 6}, torch::requires_grad());
  auto x = torch::randn({3, 6});
  (x.mm(w)).sum().backward();  // a plain backward pass first
  w.mutable_grad() = torch::Tensor();
  remat::checkpoint([&](const torch::Tensor& t) { return torch::tanh(t.mm(w)); }, x.requires_grad_())
      .sum()
      .backward();
  w.mutable_grad() = torch::Tensor();

  const int depth = 80;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, int)> nest =
      [&](const torch::Tensor& h, const torch::Tensor& weight, int level) -> torch::Tensor {
    if (level == depth) return torch::tanh(h.mm(weight));
    return remat::checkpoint(
        [&, level](const std::vector<torch::Tensor>& in) {
          return std::vector<torch::Tensor>{nest(torch::tanh(in[0]) * 0.5, in[1], level + 1)};
        },
        {h, weight}, reentrant())[0];
  };
  auto x2 = torch::randn({3, 6}, torch::requires_grad());
  nest(x2, w, 0).sum().backward();
  const auto gw = w.grad().clone(), gx = x2.grad().clone();

  auto w_plain = w.detach().requires_grad_();
  auto x_plain = x2.detach().requires_grad_();
  torch::Tensor h = x_plain;
  for (int level = 0; level < depth; ++level)
    h = torch::tanh(h) * 0.5;
  torch::tanh(h.mm(w_plain)).sum().backward();  // and a plain backward pass after it
  EXPECT_LE(max_abs_diff(gw, w_plain.grad()), 1e-6);
  EXPECT_LE(max_abs_diff(gx, x_plain.grad()), 1e-6);
}

// Execution goes to one engine: after remat has installed its engine, LibTorch's default engine runs backward
// passes through the base engine's threads (a plain pass after remat's still works, and the default engine's
// own type is remat's).
TEST(EngineThreads, OneEngineExecutes) {
  auto w = torch::randn({4, 4}, torch::requires_grad());
  remat::checkpoint([&](const torch::Tensor& t) { return t.mm(w); },
                    torch::randn({2, 4}, torch::requires_grad()))
      .sum()
      .backward();
  EXPECT_NE(typeid(torch::autograd::Engine::get_default_engine()), typeid(torch::autograd::Engine));
  w.mutable_grad() = torch::Tensor();
  torch::randn({2, 4}).mm(w).sum().backward();
  EXPECT_TRUE(w.grad().defined());
}

// The region used by the worker-thread tests: a kNonReentrant region with a policy, a remat::keep call and a
// gradient taken inside with create_graph (a gradient penalty), so that its forward pass itself runs a
// backward pass, and its recompute does again.
struct PenaltyRegion {
  torch::Tensor w1, w2;
  torch::Tensor operator()(const torch::Tensor& x) const {
    auto a = remat::keep(
        "proj", [&](const torch::Tensor& t) { return t.mm(w1); }, x);
    auto b = torch::tanh(a);
    // d/da sum(tanh(a)^2); under no-grad (an enclosing kReentrant region's forward pass) the same value
    // without autograd.
    torch::Tensor g = torch::GradMode::is_enabled()
                          ? torch::autograd::grad({b.pow(2).sum()}, {a}, {}, /*retain_graph=*/true,
                                                  /*create_graph=*/true)[0]
                          : (2 * b) * (1 - b * b);
    return torch::sigmoid(b.mm(w2)) + 0.1 * g.mm(w2);
  }
};

CheckpointOptions penalty_options() {
  return CheckpointOptions().keep({"proj"}).policy(remat::policy::matmuls());
}

// Runs `region` under `depth` nested kReentrant regions (each taking the weights as inputs) and backward.
std::vector<torch::Tensor> deep_grads(const PenaltyRegion& region, const torch::Tensor& x, int depth,
                                      bool checkpointed) {
  auto w1 = region.w1.detach().requires_grad_();
  auto w2 = region.w2.detach().requires_grad_();
  auto xx = x.detach().requires_grad_();
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, int)> nest =
      [&](const torch::Tensor& h, const torch::Tensor& a, const torch::Tensor& b,
          int level) -> torch::Tensor {
    if (level == depth) {
      PenaltyRegion r{a, b};
      return checkpointed ? remat::checkpoint(r, h, penalty_options()) : r(h);
    }
    auto body = [&, level](const std::vector<torch::Tensor>& in) {
      return std::vector<torch::Tensor>{nest(in[0] * 0.9, in[1], in[2], level + 1)};
    };
    return checkpointed ? remat::checkpoint(body, {h, a, b}, reentrant())[0] : body({h, a, b})[0];
  };
  nest(xx, w1, w2, 0).sum().backward();
  return {xx.grad(), w1.grad(), w2.grad()};
}

// A region's backward pass and recompute forced onto autograd's pool threads: inside kReentrant regions
// nested about as deep as LibTorch's per-thread limit of 60, the region's forward pass (during the
// enclosing region's recompute) runs its inner gradient on the calling thread, and its recompute (during the
// enclosing region's nested pass, one level deeper) on a pool thread, whose inner gradient goes to yet
// another pool thread. That one must be inside the region too (saved-tensor hooks, the policy's interceptor,
// the kept call), or the recompute saves other tensors than the forward pass did.
TEST(EngineThreads, RecomputeOnAPoolThreadSeesTheRegion) {
  torch::manual_seed(3);
  PenaltyRegion region{torch::randn({6, 6}), torch::randn({6, 6})};
  auto x = torch::randn({3, 6});
  for (int depth = 56; depth <= 64; ++depth) {
    const auto want = deep_grads(region, x, depth, /*checkpointed=*/false);
    const auto got = deep_grads(region, x, depth, /*checkpointed=*/true);
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_LE(max_abs_diff(got[i], want[i]), 1e-5) << "gradient " << i << " at depth " << depth;
  }
}

// The same region's backward pass run from another thread than its forward pass.
TEST(EngineThreads, BackwardFromAnotherThread) {
  torch::manual_seed(4);
  PenaltyRegion region{torch::randn({6, 6}), torch::randn({6, 6})};
  auto x = torch::randn({3, 6});
  const auto want = deep_grads(region, x, 2, /*checkpointed=*/false);

  auto w1 = region.w1.detach().requires_grad_();
  auto w2 = region.w2.detach().requires_grad_();
  auto xx = x.detach().requires_grad_();
  auto out = remat::checkpoint(PenaltyRegion{w1, w2}, xx * 0.9 * 0.9, penalty_options());
  std::thread([&] { out.sum().backward(); }).join();
  EXPECT_LE(max_abs_diff(xx.grad(), want[0]), 1e-5);
  EXPECT_LE(max_abs_diff(w1.grad(), want[1]), 1e-5);
  EXPECT_LE(max_abs_diff(w2.grad(), want[2]), 1e-5);
}

}  // namespace
