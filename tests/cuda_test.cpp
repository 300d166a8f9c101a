// remat's runtime on CUDA: every feature against the plain run on the GPU. Each test skips without a CUDA
// device, so the suite passes on CPU machines; `./test --cuda` runs them on a lent GPU (docs/testing.md).
// Gradients are compared within a tolerance scaled to the reference's size, since cuBLAS and fused kernels
// may pick other algorithms between two runs; dropout masks that differed would be off by O(1).

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <optional>
#include <thread>

#include <remat/memory.h>
#include <remat/offload.h>
#include <remat/planned.h>
#include <remat/planner/planner.h>
#include <remat/policy.h>
#include <remat/profile.h>
#include <remat/remat.h>
#include <remat/sequential.h>
#include <remat/version.h>
#if REMAT_HAS_DISTRIBUTED
#include <remat/distributed.h>
#include <remat/models.h>

#include <cstdlib>
#endif

#include "detail/compat.h"
#include "support.h"

namespace {

using remat::CheckpointMode;
using remat::CheckpointOptions;
using remat::testing::max_abs_diff;

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
  const torch::Device dev{torch::kCUDA, 0};
  torch::TensorOptions on() const { return torch::TensorOptions().device(dev); }
};

// Within `rtol` of the reference's largest entry (and both defined, or both not).
void expect_close(const torch::Tensor& got, const torch::Tensor& want, double rtol, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!want.defined()) return;
  const double scale = 1.0 + want.detach().abs().max().item<double>();
  EXPECT_LE(max_abs_diff(got, want), rtol * scale) << what;
}

// A transformer-like block: LayerNorm, two projections, GELU, dropout; what most tests run.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t w, double p = 0.1) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})));
    fc1 = register_module("fc1", torch::nn::Linear(w, 4 * w));
    fc2 = register_module("fc2", torch::nn::Linear(4 * w, w));
    drop = register_module("drop", torch::nn::Dropout(p));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + drop(fc2(torch::gelu(fc1(ln(x))))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

// Block i of `seq` under remat::checkpoint with `o` (its module declared).
torch::Tensor checkpoint_block(torch::nn::Sequential& seq, size_t i, const torch::Tensor& h,
                               CheckpointOptions o) {
  auto block = seq[i]->as<BlockImpl>();
  return remat::checkpoint([block](const torch::Tensor& t) { return block->forward(t); }, h,
                           o.modules({seq[i]}));
}

torch::nn::Sequential blocks(int64_t depth, int64_t w, torch::Device dev) {
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < depth; ++i)
    seq->push_back(Block(w));
  seq->to(dev);
  return seq;
}

struct Grads {
  std::vector<torch::Tensor> g;
  torch::Tensor next_draw;  // the CUDA generator's next numbers: left as the plain run leaves it
};

// Runs `forward` on x (seeded), backward of the squared sum, and collects x's and the parameters' gradients.
Grads run(torch::nn::Module& m, const torch::Tensor& x0,
          const std::function<torch::Tensor(const torch::Tensor&)>& f) {
  for (auto& p : m.parameters())
    p.mutable_grad() = torch::Tensor();
  auto x = x0.detach().clone().requires_grad_(true);
  torch::manual_seed(11);
  f(x).pow(2).sum().backward();
  Grads out;
  out.g.push_back(x.grad());
  for (const auto& p : m.parameters())
    out.g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  out.next_draw = torch::rand({8}, x0.options());
  return out;
}

void expect_same(const Grads& got, const Grads& want, double rtol, const std::string& what) {
  ASSERT_EQ(got.g.size(), want.g.size()) << what;
  for (size_t i = 0; i < got.g.size(); ++i)
    expect_close(got.g[i], want.g[i], rtol, what + ", gradient " + std::to_string(i));
  EXPECT_TRUE(torch::equal(got.next_draw, want.next_draw)) << what << ": the generator moved differently";
}

// On CUDA the CUDA generator draws dropout's mask: it is replayed, and left as it was found.
TEST(CheckpointCuda, DropoutMaskReplayedOnCudaInBothModes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device dev(torch::kCUDA, 0);
  for (auto mode : {CheckpointMode::kNonReentrant, CheckpointMode::kReentrant}) {
    torch::manual_seed(0);
    torch::nn::Linear fc(64, 64);
    fc->to(dev);
    const auto x = torch::randn({32, 64}, torch::TensorOptions().device(dev).requires_grad(true));
    auto fn = [&](const torch::Tensor& t) { return torch::dropout(torch::gelu(fc(t)), 0.5, true); };
    torch::manual_seed(7);
    fn(x).pow(2).sum().backward();
    const auto plain_x = x.grad().clone(), plain_w = fc->weight.grad().clone();
    const auto after_plain = torch::rand({16}, torch::TensorOptions().device(dev));
    x.mutable_grad() = torch::Tensor();
    fc->weight.mutable_grad() = torch::Tensor();
    torch::manual_seed(7);
    remat::checkpoint(fn, x, CheckpointOptions().mode(mode).modules({fc.ptr()})).pow(2).sum().backward();
    EXPECT_TRUE(torch::equal(x.grad(), plain_x));
    EXPECT_TRUE(torch::equal(fc->weight.grad(), plain_w));
    EXPECT_TRUE(torch::equal(torch::rand({16}, torch::TensorOptions().device(dev)), after_plain));
  }
}

TEST(MemoryCuda, CachingAllocatorStatistics) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto dev = torch::Device(torch::kCUDA, 0);
  const int64_t before = remat::memory::active_bytes(dev);
  remat::memory::reset_peak(dev);
  {
    auto t = torch::empty({1 << 20}, torch::TensorOptions().device(dev));
    EXPECT_GE(remat::memory::active_bytes(dev) - before, int64_t{4} << 20);
  }
  EXPECT_GE(remat::memory::peak_bytes(dev) - before, int64_t{4} << 20);
}

// The defect of the first GPU run: a plain CUDA backward pass first, then every way remat runs a region, in
// one process (kNonReentrant threw LibTorch's assertion on its device queues).
TEST_F(CudaTest, PlainBackwardFirstThenEveryMode) {
  torch::manual_seed(0);
  auto seq = blocks(4, 64, dev);
  const auto x = torch::randn({8, 16, 64}, on());
  const Grads plain = run(*seq, x, [&](const torch::Tensor& t) { return seq->forward(t); });
  auto stages = remat::stages_of(seq);
  auto each = [&](CheckpointOptions o) {
    return [&stages, o](const torch::Tensor& t) {
      torch::Tensor h = t;
      for (const auto& s : stages)
        h = remat::checkpoint(s.fn, h, CheckpointOptions(o).modules({s.module}));
      return h;
    };
  };
  expect_same(run(*seq, x, each(CheckpointOptions())), plain, 1e-5, "kNonReentrant");
  expect_same(run(*seq, x, each(CheckpointOptions().mode(CheckpointMode::kReentrant))), plain, 1e-5,
              "kReentrant");
  for (auto outer : {CheckpointMode::kNonReentrant, CheckpointMode::kReentrant}) {
    for (auto inner : {CheckpointMode::kNonReentrant, CheckpointMode::kReentrant}) {
      auto nested = [&](const torch::Tensor& t) {
        return remat::checkpoint(
            [&](const torch::Tensor& u) {
              torch::Tensor h = stages[0].fn(u);
              h = remat::checkpoint(stages[1].fn, h, CheckpointOptions().mode(inner));
              return stages[3].fn(stages[2].fn(h));
            },
            t, CheckpointOptions().mode(outer));
      };
      expect_same(run(*seq, x, nested), plain, 1e-5, "nested");
    }
  }
  expect_same(run(*seq, x, [&](const torch::Tensor& t) { return remat::checkpoint_sequential(seq, 2, t); }),
              plain, 1e-5, "checkpoint_sequential");
  const remat::Chain chain = remat::profile_chain(stages, x);
  for (const auto& plan :
       {remat::checkpoint_all(chain), remat::optimal(chain, remat::min_feasible_budget(chain))})
    expect_same(run(*seq, x, [&](const torch::Tensor& t) { return remat::run_plan(stages, plan, t); }), plain,
                1e-5, "run_plan " + plan.to_string());
}

// 80 nested kReentrant regions on CUDA: past LibTorch's per-thread depth, the device thread hands the deepest
// passes to the engine's pool.
TEST_F(CudaTest, DeeplyNestedRegions) {
  torch::manual_seed(1);
  auto w = torch::randn({32, 32}, on().requires_grad(true));
  const auto x = torch::randn({4, 32}, on());
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, int, bool)> nest =
      [&](const torch::Tensor& h, const torch::Tensor& weight, int level, bool ckpt) -> torch::Tensor {
    if (level == 80) return torch::tanh(h.mm(weight));
    auto body = [&, level, ckpt](const std::vector<torch::Tensor>& in) {
      return std::vector<torch::Tensor>{nest(torch::tanh(in[0]) * 0.9, in[1], level + 1, ckpt)};
    };
    return ckpt ? remat::checkpoint(body, {h, weight},
                                    CheckpointOptions().mode(level % 2 ? CheckpointMode::kReentrant
                                                                       : CheckpointMode::kNonReentrant))[0]
                : body({h, weight})[0];
  };
  auto grads = [&](bool ckpt) {
    w.mutable_grad() = torch::Tensor();
    auto xx = x.clone().requires_grad_(true);
    nest(xx, w, 0, ckpt).sum().backward();
    return std::make_pair(xx.grad().clone(), w.grad().clone());
  };
  const auto plain = grads(false), got = grads(true);
  expect_close(got.first, plain.first, 1e-5, "input");
  expect_close(got.second, plain.second, 1e-5, "weight");
}

// Dropout's masks replayed from the CUDA generator under CUDA autocast in fp16 and bf16, both modes: the
// recompute re-enters the forward pass's autocast state.
TEST_F(CudaTest, AutocastFp16AndBf16BothModes) {
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    torch::manual_seed(2);
    auto seq = blocks(2, 64, dev);
    const auto x = torch::randn({8, 16, 64}, on());
    auto under_autocast = [&](std::function<torch::Tensor(const torch::Tensor&)> f) {
      return [f, dtype](const torch::Tensor& t) {
        const bool was = remat::detail::compat::autocast_enabled(c10::DeviceType::CUDA);
        remat::detail::compat::set_autocast_enabled(c10::DeviceType::CUDA, true);
        remat::detail::compat::set_autocast_dtype(c10::DeviceType::CUDA, dtype);
        at::autocast::increment_nesting();
        torch::Tensor y = f(t).to(torch::kFloat);
        if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
        remat::detail::compat::set_autocast_enabled(c10::DeviceType::CUDA, was);
        return y;
      };
    };
    const Grads plain = run(*seq, x, under_autocast([&](const torch::Tensor& t) { return seq->forward(t); }));
    for (auto mode : {CheckpointMode::kNonReentrant, CheckpointMode::kReentrant}) {
      auto ckpt = under_autocast([&, mode](const torch::Tensor& t) {
        torch::Tensor h = t;
        for (size_t i = 0; i < seq->size(); ++i)
          h = checkpoint_block(seq, i, h, CheckpointOptions().mode(mode));
        return h;
      });
      const Grads got = run(*seq, x, ckpt);
      EXPECT_EQ(got.g[1].scalar_type(), torch::kFloat);
      expect_same(got, plain, dtype == torch::kHalf ? 2e-3 : 2e-2,
                  std::string(c10::toString(dtype)) +
                      (mode == CheckpointMode::kReentrant ? " kReentrant" : " kNonReentrant"));
    }
  }
}

// torch::autograd::grad inside a kNonReentrant region (a gradient penalty, on the device thread), and
// second-order gradients through a checkpoint in both modes.
TEST_F(CudaTest, GradInsideARegionAndSecondOrder) {
  torch::manual_seed(3);
  auto w = torch::randn({16, 16}, on().requires_grad(true));
  const auto x = torch::randn({4, 16}, on().requires_grad(true));
  auto penalty = [&](const torch::Tensor& t) {
    auto a = t.mm(w);
    auto b = torch::tanh(a);
    auto g = torch::autograd::grad({b.pow(2).sum()}, {a}, {}, true, true)[0];
    return torch::sigmoid(b) + 0.1 * g;
  };
  auto grads_of = [&](const torch::Tensor& y) {
    auto gs = torch::autograd::grad({y.pow(2).sum()}, {x, w});
    return gs;
  };
  const auto plain = grads_of(penalty(x));
  const auto got = grads_of(remat::checkpoint(penalty, x));
  expect_close(got[0], plain[0], 1e-5, "penalty: x");
  expect_close(got[1], plain[1], 1e-5, "penalty: w");

  auto f = [&](const torch::Tensor& t) { return torch::tanh(t.mm(w)).pow(3); };
  auto second = [&](const torch::Tensor& y) {
    auto g = torch::autograd::grad({y.sum()}, {x}, {}, true, true)[0];
    return torch::autograd::grad({g.pow(2).sum()}, {w})[0];
  };
  const auto want = second(f(x));
  for (auto mode : {CheckpointMode::kNonReentrant, CheckpointMode::kReentrant})
    expect_close(second(remat::checkpoint(f, x, CheckpointOptions().mode(mode))), want, 1e-5, "second order");
}

// Policies and remat::keep on CUDA operators, fused scaled-dot-product attention included; the kept products
// are not run again by the recompute.
TEST_F(CudaTest, PoliciesAndKeepOnCudaOperators) {
  torch::manual_seed(4);
  auto seq = blocks(2, 64, dev);
  const auto x = torch::randn({8, 16, 64}, on());
  const Grads plain = run(*seq, x, [&](const torch::Tensor& t) { return seq->forward(t); });
  for (const remat::Policy& p :
       {remat::policy::matmuls(), remat::policy::attention_core(), remat::policy::recompute_pointwise()}) {
    auto f = [&, p](const torch::Tensor& t) {
      torch::Tensor h = t;
      for (size_t i = 0; i < seq->size(); ++i)
        h = checkpoint_block(seq, i, h, CheckpointOptions().policy(p));
      return h;
    };
    expect_same(run(*seq, x, f), plain, 1e-5, "policy " + p.name());
  }
  torch::nn::Linear fc(64, 64);
  fc->to(dev);
  auto kept = [&](const torch::Tensor& t) {
    auto h = remat::keep(
        "proj", [&](const torch::Tensor& u) { return fc(u); }, t);
    return torch::gelu(h) * 2;
  };
  const Grads plain_keep = run(*fc, x, kept);
  expect_same(run(*fc, x,
                  [&](const torch::Tensor& t) {
                    return remat::checkpoint(kept, t, CheckpointOptions().keep({"proj"}));
                  }),
              plain_keep, 1e-5, "remat::keep");
#if TORCH_VERSION_MAJOR >= 2
  const auto q = torch::randn({2, 4, 64, 32}, on().requires_grad(true));
  auto attention = [](const torch::Tensor& t) {
    return at::scaled_dot_product_attention(t, t * 2, t.cos(), {}, /*dropout_p=*/0.2, /*is_causal=*/true);
  };
  auto sdpa = [&](const std::optional<remat::Policy>& p) {
    q.mutable_grad().reset();
    torch::manual_seed(5);
    auto y = p ? remat::checkpoint(attention, q, CheckpointOptions().policy(*p)) : attention(q);
    y.pow(2).sum().backward();
    return std::make_pair(q.grad().clone(), torch::rand({4}, on()));
  };
  const auto want = sdpa(std::nullopt);
  for (const remat::Policy& p : {remat::policy::attention_core(), remat::policy::matmuls()}) {
    const auto got = sdpa(p);
    expect_close(got.first, want.first, 1e-4, "fused attention under " + p.name());
    EXPECT_TRUE(torch::equal(got.second, want.second)) << p.name();
  }
#endif
}

// Early stopping on CUDA: the recompute ends once every tensor the backward pass needs is back (what comes
// after the region's last save is not run again).
TEST_F(CudaTest, EarlyStop) {
  torch::manual_seed(6);
  auto w = torch::randn({32, 32}, on().requires_grad(true));
  const auto x = torch::randn({8, 32}, on().requires_grad(true));
  int tails = 0;
  auto f = [&](const torch::Tensor& t) {
    auto h = torch::tanh(t.mm(w));
    ++tails;  // after the last save: the output's own computation does not save
    return h * 3;
  };
  auto y = remat::checkpoint(f, x, CheckpointOptions().early_stop(true));
  EXPECT_EQ(tails, 1);
  y.sum().backward();
  EXPECT_EQ(tails, 1) << "the recompute ran past its last save";
  auto w2 = w.detach().requires_grad_(true);
  auto x2 = x.detach().requires_grad_(true);
  (torch::tanh(x2.mm(w2)) * 3).sum().backward();
  expect_close(w.grad(), w2.grad(), 1e-5, "w");
  expect_close(x.grad(), x2.grad(), 1e-5, "x");
}

// The profiler on CUDA: each stage's bytes exact (the output's), times synchronized (a stage that waits on
// the GPU is timed at its GPU time), and the caller's statistics untouched.
TEST_F(CudaTest, ProfilerMeasuresWithoutTouchingTheCallersPeak) {
  torch::manual_seed(7);
  auto seq = blocks(3, 128, dev);
  const auto x = torch::randn({16, 64, 128}, on());
  {
    auto big = torch::empty({64 << 20}, on());  // 256 MiB: the caller's peak
  }
  const int64_t before = remat::memory::peak_bytes(dev);
  const remat::Chain chain = remat::profile_chain(remat::stages_of(seq), x);
  EXPECT_EQ(remat::memory::peak_bytes(dev), before) << "the profiler reset or moved the caller's peak";
  for (const auto& s : chain.stages) {
    EXPECT_EQ(s.output_bytes, 16 * 64 * 128 * 4);
    EXPECT_GT(s.saved_bytes, s.output_bytes);
    EXPECT_GT(s.fwd_ms, 0.0);
    EXPECT_GT(s.bwd_ms, 0.0);
  }
}

// A peak window follows the bytes tensors request and leaves the allocator's statistics alone.
TEST_F(CudaTest, PeakWindowLeavesTheAllocatorsPeakAlone) {
  remat::memory::reset_peak(dev);
  {
    auto big = torch::empty({32 << 20}, on());  // 128 MiB
  }
  const int64_t user_peak = remat::memory::peak_bytes(dev);
  remat::memory::PeakWindow outer(dev);
  {
    remat::memory::PeakWindow inner(dev);
    auto a = torch::empty({1000}, on());  // 4000 bytes requested (the allocator rounds the block to 4096)
    EXPECT_EQ(inner.active_over_base(), 4000);
    {
      auto b = torch::empty({250}, on());
      EXPECT_EQ(inner.peak_over_base(), 5000);
    }
    EXPECT_EQ(inner.active_over_base(), 4000);
    EXPECT_EQ(inner.peak_over_base(), 5000);
  }
  EXPECT_EQ(outer.peak_over_base(), 5000);
  EXPECT_EQ(outer.active_over_base(), 0);
  EXPECT_EQ(remat::memory::peak_bytes(dev), user_peak);
}

// remat::Planned on CUDA: every step the plain run's, the step's peak within the budget and near the
// prediction, the caller's own peak statistic untouched, the rest of the step's time synchronized.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t w, int64_t depth) {
    in = register_module("in", torch::nn::Linear(32, w));
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < depth; ++i)
      h->push_back(Block(w));
    head = register_module("head", torch::nn::Linear(w, 1));
  }
  torch::Tensor loss(const torch::Tensor& x, torch::Device dev) {
    torch::Tensor a = torch::relu(in(x));
    base = remat::memory::active_bytes(dev);
    if (planned) {
      a = (*planned)->forward(a);
    } else {
      for (size_t i = 0; i < h->size(); ++i)
        a = (*h)[i]->as<BlockImpl>()->forward(a);
    }
    auto out = head(a);
    if (slow_rest) {  // GPU work in the rest of the step that the host does not wait for
      for (int i = 0; i < 20; ++i)
        out = out + torch::matmul(filler, filler).mean() * 0;
    }
    return out.pow(2).mean();
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::ModuleList h{nullptr};
  std::optional<remat::Planned> planned;
  int64_t base = 0;
  bool slow_rest = false;
  torch::Tensor filler;
};
TORCH_MODULE(Net);

// A Net on `dev` from seed 0 (two of them are the same model).
Net seeded_net(int64_t w, int64_t depth, torch::Device dev) {
  torch::manual_seed(0);
  Net n(w, depth);
  n->to(dev);
  return n;
}

// The blocks of `net` as Planned's stages.
std::vector<remat::StageFn> stages_of_net(Net& net) {
  std::vector<remat::StageFn> out;
  for (size_t i = 0; i < net->h->size(); ++i) {
    auto block = net->h[i]->as<BlockImpl>();
    out.push_back({"block" + std::to_string(i), [block](const torch::Tensor& t) { return block->forward(t); },
                   net->h[i]});
  }
  return out;
}

// One training step of `n` (seeded); its loss and gradients.
std::vector<torch::Tensor> net_step(Net& n, const torch::Tensor& x, torch::Device dev) {
  for (auto& p : n->parameters())
    p.mutable_grad() = torch::Tensor();
  torch::manual_seed(9);
  auto loss = n->loss(x, dev);
  loss.backward();
  std::vector<torch::Tensor> g{loss.detach()};
  for (const auto& p : n->parameters())
    g.push_back(p.grad().clone());
  return g;
}

// The plain step's peak over the base (a second step: gradients allocated).
int64_t plain_net_peak(Net& plain, const torch::Tensor& x, torch::Device dev) {
  net_step(plain, x, dev);
  remat::memory::reset_peak(dev);
  net_step(plain, x, dev);
  return remat::memory::peak_bytes(dev) - plain->base;
}

// What the Planned CUDA tests share: 6 blocks of width 256 on an input from seed 8, a plain net and one to
// plan (the same model), the blocks of the latter as stages, and a budget of half the plain step's peak.
struct HalfPeak {
  explicit HalfPeak(torch::Device d)
      : dev(d),
        x((torch::manual_seed(8), torch::randn({16, 128, 32}, torch::TensorOptions().device(d)))),
        plain(seeded_net(w, depth, d)),
        net(seeded_net(w, depth, d)),
        stages(stages_of_net(net)),
        plain_peak(plain_net_peak(plain, x, d)),
        budget(plain_peak / 2) {}
  std::vector<torch::Tensor> step(Net& n) { return net_step(n, x, dev); }

  static constexpr int64_t w = 256, depth = 6;
  torch::Device dev;
  torch::Tensor x;
  Net plain, net;
  std::vector<remat::StageFn> stages;
  int64_t plain_peak, budget;
};

TEST_F(CudaTest, PlannedTrainsAsPlainWithinTheBudgetAndLeavesTheCallersPeak) {
  HalfPeak t(dev);
  Net &plain = t.plain, &net = t.net;
  const int64_t plain_peak = t.plain_peak, budget = t.budget, w = HalfPeak::w, depth = HalfPeak::depth;
  auto step = [&](Net& n) { return t.step(n); };
  net->planned.emplace(t.stages, remat::PlannedOptions().budget(budget));
  for (int s = 0; s < 3; ++s) {
    const auto want = step(plain);
    {
      auto big = torch::empty({plain_peak / 2}, on());  // the caller's peak, far above the step's
    }
    const int64_t user_peak = remat::memory::peak_bytes(dev);
    const auto got = step(net);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      expect_close(got[i], want[i], 1e-5, "step " + std::to_string(s) + " value " + std::to_string(i));
    EXPECT_GE(remat::memory::peak_bytes(dev), user_peak) << "remat lowered the caller's peak";
    if ((*net->planned)->is_planned()) {
      EXPECT_LE((*net->planned)->predicted_peak_bytes(), budget);
      EXPECT_LE((*net->planned)->last_peak_bytes(), budget + budget / 50)
          << (*net->planned)->plan()->to_string();
    }
  }
  EXPECT_TRUE((*net->planned)->is_planned());

  // The rest of the step is timed with the device synchronized: GPU work the host does not wait for counts.
  torch::manual_seed(0);
  Net slow(w, depth);
  slow->to(dev);
  slow->slow_rest = true;
  slow->filler = torch::randn({2048, 2048}, on());
  slow->planned.emplace(stages_of_net(slow), remat::PlannedOptions().budget(plain_peak * 2));
  step(slow);
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i)
    (void)(torch::matmul(slow->filler, slow->filler).mean() * 0);
  torch::cuda::synchronize();
  const double filler_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_NE((*slow->planned)->rest_of_step(), nullptr);
  EXPECT_GE((*slow->planned)->rest_of_step()->ms, 0.5 * filler_ms);
}

TEST_F(CudaTest, OffloadIsThePlainRunAndFreesTheDevice) {
  // remat::Offload's CUDA path: a side stream after the producing stream, events, pinned blocks, copies back
  // waited for on the current stream. The same kernels on the same values: the plain run's gradients bitwise.
  const int64_t w = 256;
  torch::manual_seed(0);
  auto seq = blocks(4, w, dev);
  const auto x = torch::randn({32, 128, w}, on());
  auto forward = [&](const torch::Tensor& t) { return seq->forward(t); };
  const Grads want = run(*seq, x, forward);
  auto pool = std::make_shared<remat::HostPool>();
  EXPECT_TRUE(pool->pinned());
  int64_t held_plain = 0, held_offloaded = 0;
  remat::OffloadStats stats;
  auto measure = [&](bool offload) {
    for (auto& p : seq->parameters())
      p.mutable_grad() = torch::Tensor();
    auto leaf = x.detach().clone().requires_grad_(true);
    torch::manual_seed(11);
    torch::cuda::synchronize();
    const int64_t base = remat::memory::active_bytes(dev);
    torch::Tensor loss;
    {
      std::optional<remat::Offload> o;
      if (offload)
        o.emplace(remat::OffloadOptions().pool(pool).min_bytes(1 << 20).keep_on_device(seq->parameters()));
      loss = seq->forward(leaf).pow(2).sum();
      if (o) {
        o->close();
        o->finish_copies();
        stats = o->stats();
      }
    }
    torch::cuda::synchronize();
    (offload ? held_offloaded : held_plain) = remat::memory::active_bytes(dev) - base;
    loss.backward();
    Grads out;
    out.g.push_back(leaf.grad());
    for (const auto& p : seq->parameters())
      out.g.push_back(p.grad().clone());
    out.next_draw = torch::rand({8}, x.options());
    return out;
  };
  expect_same(measure(true), want, 0.0, "offloaded");
  measure(false);
  EXPECT_GT(stats.offloaded, 0);
  EXPECT_EQ(pool->in_use_bytes(), 0);
  // What went to the host left the device (the input's copy frees nothing: the caller holds it).
  EXPECT_LE(held_offloaded, held_plain - (stats.offloaded_bytes - static_cast<int64_t>(x.nbytes())))
      << held_plain << " " << stats.offloaded_bytes;
  const remat::OffloadBandwidth bw = remat::offload_bandwidth(dev, 64 << 20);
  EXPECT_GT(bw.to_host_gb_per_s, 1.0);
  EXPECT_GT(bw.to_device_gb_per_s, 1.0);
  std::cout << "offload bandwidth: " << bw.to_host_gb_per_s << " GB/s to the host, " << bw.to_device_gb_per_s
            << " GB/s back\n";
}

using MatmulSeeingAlignment256 = remat::testing::MatmulSeeingAlignment<256>;

TEST_F(CudaTest, AViewAtAnOffsetComesBackAtItsAlignmentAndBitwise) {
  // Tensors saved at offsets into one fp16 storage (2, 64 and 256 bytes in: PyTorch hands cuBLASLt each
  // operand's alignment, the largest power of two up to 256 dividing its address, and cuBLASLt picks its
  // algorithm by it), found on the device where the storage is alive, brought back where it is not: each
  // starts at its address modulo 256 as saved, and the gradient is the plain run's bitwise.
  torch::manual_seed(0);
  const auto half = on().dtype(torch::kHalf);
  const torch::Tensor values = torch::randn({128 * 64 + 128}, half);
  const torch::Tensor w = torch::randn({64, 64}, half.requires_grad(true));
  auto step = [&](bool offloaded, bool keep_base, remat::OffloadStats* stats) {
    w.mutable_grad() = torch::Tensor();
    torch::Tensor base = values.clone();
    torch::Tensor loss;
    std::optional<remat::Offload> scope;
    if (offloaded) scope.emplace(remat::OffloadOptions().min_bytes(1024));
    for (int64_t k : {1, 32, 128}) {
      const torch::Tensor y = MatmulSeeingAlignment256::apply(base.narrow(0, k, 128 * 64).view({128, 64}), w);
      loss = loss.defined() ? loss + y.to(torch::kFloat).sum() : y.to(torch::kFloat).sum();
    }
    if (scope) scope->close();
    if (!keep_base) base = torch::Tensor();
    loss.backward();
    torch::cuda::synchronize();
    if (scope) *stats = scope->stats();
    return w.grad().clone();
  };
  for (bool keep_base : {true, false}) {
    MatmulSeeingAlignment256::seen().clear();
    const torch::Tensor want = step(false, true, nullptr);
    const std::vector<int64_t> saved(MatmulSeeingAlignment256::seen().begin(),
                                     MatmulSeeingAlignment256::seen().begin() + 3);
    MatmulSeeingAlignment256::seen().clear();
    remat::OffloadStats stats;
    EXPECT_TRUE(torch::equal(step(true, keep_base, &stats), want)) << keep_base;
    auto seen = MatmulSeeingAlignment256::seen();
    ASSERT_EQ(seen.size(), 6u);
    EXPECT_EQ(std::vector<int64_t>(seen.begin(), seen.begin() + 3), saved) << keep_base;
    std::vector<int64_t> back(seen.begin() + 3, seen.end()), sorted_saved = saved;
    std::sort(back.begin(), back.end());
    std::sort(sorted_saved.begin(), sorted_saved.end());
    EXPECT_EQ(back, sorted_saved) << keep_base;
    EXPECT_EQ(stats.brought_back, keep_base ? 0 : 3) << keep_base;
  }
}

TEST_F(CudaTest, PlannedOffloadsOnCudaWithinTheBudget) {
  HalfPeak t(dev);
  Net &plain = t.plain, &net = t.net;
  const int64_t budget = t.budget;
  auto step = [&](Net& n) { return t.step(n); };
  remat::PlannerOptions offload;
  offload.offload = true;
  net->planned.emplace(t.stages, remat::PlannedOptions().budget(budget).planner(offload));
  for (int s = 0; s < 3; ++s) {
    const auto want = step(plain);
    const auto got = step(net);
    for (size_t i = 0; i < got.size(); ++i)
      expect_close(got[i], want[i], 1e-5, "step " + std::to_string(s) + " value " + std::to_string(i));
  }
  ASSERT_TRUE((*net->planned)->is_planned());
  const remat::Chain* chain = (*net->planned)->chain();
  EXPECT_TRUE(chain->can_offload());
  std::cout << "planned with offloading at half the plain peak: " << (*net->planned)->plan()->to_string()
            << "; predicted " << (*net->planned)->predicted_peak_bytes() << ", measured "
            << (*net->planned)->last_peak_bytes() << " bytes; bandwidth " << chain->to_host_gb_per_s << " / "
            << chain->to_device_gb_per_s << " GB/s\n";
  EXPECT_LE((*net->planned)->last_peak_bytes(), budget + budget / 50) << (*net->planned)->plan()->to_string();
}

// One step of `seq` on x, plainly or under run_plan with `plan` (its offloads from `pool`, tensors of 1 MiB
// and more): the loss, the parameters' gradients and the CUDA generator's next draw; *peak (if given) the
// step's peak above the bytes alive before it, plus x's (the chain counts its input).
static std::vector<torch::Tensor> plan_step_on(torch::nn::Sequential& seq, const torch::Tensor& x,
                                               const torch::Tensor& weight,
                                               const std::optional<remat::Plan>& plan,
                                               const std::shared_ptr<remat::HostPool>& pool, int64_t* peak) {
  for (auto& p : seq->parameters())
    p.mutable_grad() = torch::zeros_like(p);
  torch::manual_seed(11);
  torch::cuda::synchronize();
  std::vector<torch::Tensor> out;
  {
    remat::memory::PeakWindow window(x.device());
    const torch::Tensor y = plan ? remat::run_plan(remat::stages_of(seq), *plan, x, {}, nullptr,
                                                   remat::OffloadOptions().pool(pool).min_bytes(1 << 20))
                                 : seq->forward(x);
    const torch::Tensor loss = (y * weight).sum();
    loss.backward();
    torch::cuda::synchronize();
    if (peak) *peak = window.peak_over_base() + static_cast<int64_t>(x.nbytes());
    out.push_back(loss.detach());
  }
  for (const auto& p : seq->parameters())
    out.push_back(p.grad().clone());
  out.push_back(torch::rand({8}, x.options()));
  return out;
}

// The executor tests' model: five blocks of width 256 on `dev` (seeded), an input of 32 x 128 and the weight
// of the loss's sum.
struct FiveBlocks {
  torch::nn::Sequential seq;
  torch::Tensor x, weight;
};
static FiveBlocks five_blocks(torch::Device dev) {
  torch::manual_seed(0);
  FiveBlocks b{blocks(5, 256, dev), {}, {}};
  b.x = torch::randn({32, 128, 256}, torch::TensorOptions().device(dev));
  b.weight = torch::randn({32, 128, 256}, torch::TensorOptions().device(dev));
  return b;
}

// A planned step (got) against the plain one (want): values within 1e-5, the generator where the plain run
// leaves it; the measured peak between `lower` and 1.10 of simulate()'s; the pool's peak the simulated host
// bytes, and nothing of it in use after the step.
static void expect_as_simulated(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                                int64_t peak, const remat::Simulation& sim, const remat::HostPool& pool,
                                const std::string& what, double lower) {
  for (size_t i = 0; i + 1 < got.size(); ++i)
    expect_close(got[i], want[i], 1e-5, what + ": value " + std::to_string(i));
  EXPECT_TRUE(torch::equal(got.back(), want.back())) << what << ": the generator moved differently";
  std::cout << what << ": measured " << peak << ", predicted " << sim.peak_bytes << " bytes; host "
            << pool.peak_bytes() << ", predicted " << sim.host_peak_bytes << "\n";
  EXPECT_GE(static_cast<double>(peak), lower * static_cast<double>(sim.peak_bytes)) << what;
  EXPECT_LE(static_cast<double>(peak), 1.10 * static_cast<double>(sim.peak_bytes)) << what;
  EXPECT_EQ(pool.peak_bytes(), sim.host_peak_bytes) << what;
  EXPECT_EQ(pool.in_use_bytes(), 0) << what;
}

TEST_F(CudaTest, ThePlanExecutorRunsEveryOffloadedWayWithinThePrediction) {
  // run_plan's Fa@host, Fk[matmuls]@host (the checkpoint's kept products sent to the stage's Offload) and
  // Fc@host (the held input saved under it) on CUDA: side stream, events, pinned blocks, a tensor still on
  // the device handed out as itself. The plain run's values; the measured peak within 10% of simulate()'s and
  // not under 99% of it; the pool's peak the simulated host bytes. (The CPU's version: offload_test.cpp.)
  FiveBlocks b = five_blocks(dev);
  auto& seq = b.seq;
  const torch::Tensor &x = b.x, &weight = b.weight;
  const remat::Chain chain =
      remat::profile_chain(seq, x,
                           remat::ProfileOptions().warmup(1).repeats(1).offload_min_bytes(1 << 20).policies(
                               {remat::policy::matmuls()}));
  ASSERT_TRUE(chain.can_offload());
  EXPECT_TRUE(chain.holds_outputs);
  EXPECT_FALSE(chain.copies_at_once);  // copies on a side stream, hidden behind the computation
  auto step = [&](const std::optional<remat::Plan>& plan, const std::shared_ptr<remat::HostPool>& pool,
                  int64_t* peak) { return plan_step_on(seq, x, weight, plan, pool, peak); };
  const std::vector<torch::Tensor> want = step(std::nullopt, nullptr, nullptr);
  for (const char* text : {"Fa0@host Fk1[matmuls]@host Fc2@host Fk3[matmuls] Fa4 L B4 B3 Fa2 B2 B1 B0",
                           "Fc0@host Fc1@host Fk2[matmuls]@host Fc3@host Fa4 L B4 Fa3 B3 B2 Fa1 B1 Fa0 B0"}) {
    const remat::Plan plan = remat::testing::plan_of_text(5, text);
    const remat::Simulation sim = remat::simulate(chain, plan);
    auto pool = std::make_shared<remat::HostPool>();
    int64_t peak = 0;
    const std::vector<torch::Tensor> got = step(plan, pool, &peak);
    expect_as_simulated(got, want, peak, sim, *pool, text, 0.99);
  }
}

TEST_F(CudaTest, ThePlanExecutorRunsStreamedAndAssignedStagesWithinThePrediction) {
  // Issue 42's outcomes in run_plan on CUDA: Fa@stream with the chain's window and with none (each saved
  // tensor sent as it is made, back just ahead of its use), and Fk{...} group assignments with k, h and r.
  // The plain run's values; the measured peak within 10% of simulate()'s (a streamed stage is charged its
  // window in full: an upper bound); the pool's peak the simulated host bytes. (The CPU's versions:
  // offload_test.cpp, models_test.cpp.)
  FiveBlocks b = five_blocks(dev);
  auto& seq = b.seq;
  const torch::Tensor &x = b.x, &weight = b.weight;
  const remat::Chain chain = remat::profile_chain(
      seq, x, remat::ProfileOptions().warmup(1).repeats(1).offload_min_bytes(1 << 20).groups(true));
  remat::Plan plan =
      remat::testing::plan_of_text(5, "Fa0@stream Fk1{k} Fk2{k} Fa3@stream Fa4 L B4 B3 B2 B1 B0");
  for (size_t i : {1u, 2u}) {
    const auto& groups = chain.stages[i].groups;
    ASSERT_GE(groups.size(), 2u) << chain.stages[i].name;
    std::string assignment;
    for (size_t g = 0; g < groups.size(); ++g)
      assignment += i == 1 ? 'h' : "rhk"[g % 3];
    plan.ops[i].groups = assignment;
  }
  remat::testing::name_groups_and_windows(plan, chain);
  ASSERT_GT(plan.stream_windows[0], 0);
  plan.stream_windows[3] = 0;  // no window
  const remat::Simulation sim = remat::simulate(chain, plan);
  const std::vector<torch::Tensor> want = plan_step_on(seq, x, weight, std::nullopt, nullptr, nullptr);
  auto pool = std::make_shared<remat::HostPool>();
  int64_t peak = 0;
  const std::vector<torch::Tensor> got = plan_step_on(seq, x, weight, plan, pool, &peak);
  expect_as_simulated(got, want, peak, sim, *pool, plan.to_string(), 0.85);
}

#if REMAT_HAS_DISTRIBUTED
// C++ data parallel on NCCL (issue 44), world size 1: remat::distributed::DataParallel over a "nccl" group
// gives the plain run's gradients under each way of running the model (the average over one rank is its
// own), with the CPU tensors of its bookkeeping and of Planned's agreement going through the device.
TEST_F(CudaTest, DataParallelOnNcclWithOneRankGivesThePlainGradientsUnderEveryStrategy) {
  namespace dist = remat::distributed;
  if (!dist::has_nccl()) GTEST_SKIP() << "this build has no NCCL";
  for (const auto& [k, v] :
       std::vector<std::pair<const char*, std::string>>{{"RANK", "0"},
                                                        {"WORLD_SIZE", "1"},
                                                        {"LOCAL_RANK", "0"},
                                                        {"MASTER_ADDR", "127.0.0.1"},
                                                        {"MASTER_PORT", std::to_string(dist::free_port())}})
    ::setenv(k, v.c_str(), 1);
  auto group =
      dist::init_process_group(dist::InitOptions().backend("nccl").timeout(std::chrono::seconds(60)));
  EXPECT_EQ(group->backend(), "nccl");
  group->barrier();
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({32, 64}, on());
  for (const std::string strategy : {"none", "nonreentrant", "reentrant", "plan", "planned"}) {
    auto make = [&] {
      torch::manual_seed(0);
      auto mlp = remat::models::ResidualMlp(
          remat::models::ResidualMlpOptions().depth(4).width(64).hidden(128).dropout(0));
      mlp->to(dev);
      return mlp;
    };
    auto plain = make(), mlp = make();
    std::function<torch::Tensor(const torch::Tensor&)> forward = [mlp](const torch::Tensor& in) mutable {
      return mlp->forward(in);
    };
    if (strategy == "nonreentrant" || strategy == "reentrant") {
      mlp->gradient_checkpointing_enable(CheckpointOptions().mode(
          strategy == "reentrant" ? CheckpointMode::kReentrant : CheckpointMode::kNonReentrant));
    } else if (strategy == "plan") {
      auto stages = remat::stages_of(mlp->blocks());
      const remat::Plan plan = remat::sqrt_n(remat::profile_chain(stages, x));
      for (const auto& p : mlp->parameters())
        p.mutable_grad() = torch::Tensor();
      forward = [stages, plan](const torch::Tensor& in) { return remat::run_plan(stages, plan, in); };
    } else if (strategy == "planned") {
      auto planned = remat::Planned(
          remat::stages_of(mlp->blocks()),
          remat::PlannedOptions().budget(int64_t{1} << 30).agree(dist::same_plan_on_every_rank(group)));
      forward = [planned](const torch::Tensor& in) mutable { return planned->forward(in); };
    }
    dist::DataParallel dp(mlp.ptr(), group);
    for (int step = 0; step < 2; ++step) {  // Planned profiles the first step and plans the second
      for (auto* m :
           {static_cast<torch::nn::Module*>(plain.get()), static_cast<torch::nn::Module*>(mlp.get())})
        for (auto& p : m->parameters())
          p.mutable_grad() = torch::Tensor();
      plain->forward(x).pow(2).mean().backward();
      forward(x).pow(2).mean().backward();
      const auto a = plain->parameters(), b = mlp->parameters();
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_TRUE(b[i].grad().defined()) << strategy;
        const double scale = std::max(1e-12, a[i].grad().abs().max().item<double>());
        EXPECT_LE(max_abs_diff(a[i].grad(), b[i].grad()) / scale, 1e-5) << strategy << " step " << step;
      }
    }
    EXPECT_EQ(dp.stats().steps, 2) << strategy;
  }
  for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"})
    ::unsetenv(k);
}
#endif

}  // namespace
