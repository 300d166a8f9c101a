#include <remat/checkpoint.h>
#include <remat/memory.h>

#include "checkpoint/region.h"
#include "support.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace {

using remat::CheckpointMode;
using remat::CheckpointOptions;
using remat::testing::clear_grads;
using remat::testing::expect_all_close;
using remat::testing::grads_of;
using remat::testing::max_abs_diff;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t w)
      : fc1(register_module("fc1", torch::nn::Linear(w, 2 * w))),
        fc2(register_module("fc2", torch::nn::Linear(2 * w, w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

class CheckpointTest : public ::testing::TestWithParam<CheckpointMode> {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    remat::testing::meter_on();
  }
  CheckpointOptions opts() const { return CheckpointOptions().mode(GetParam()); }
};

INSTANTIATE_TEST_SUITE_P(Modes, CheckpointTest,
                         ::testing::Values(CheckpointMode::kNonReentrant, CheckpointMode::kReentrant),
                         remat::testing::mode_name);

// ---------------------------------------------------------------------------------------------------------
// Gradients equal the un-checkpointed run

TEST_P(CheckpointTest, OneTensorGradientsEqualPlainRun) {
  Block block(16);
  auto x = torch::randn({8, 16}, torch::requires_grad());
  block(x).pow(2).sum().backward();
  auto plain = grads_of(*block);
  auto plain_x = x.grad().clone();

  clear_grads(*block);
  x.mutable_grad() = torch::Tensor();
  remat::checkpoint(block, x, opts()).pow(2).sum().backward();
  expect_all_close(grads_of(*block), plain, 0.0);
  EXPECT_EQ(max_abs_diff(x.grad(), plain_x), 0.0);
}

TEST_P(CheckpointTest, SeveralInputsAndOutputs) {
  Block block(8);
  auto a = torch::randn({4, 8}, torch::requires_grad());
  auto b = torch::randn({4, 8}, torch::requires_grad());
  auto fn = [&](const std::vector<torch::Tensor>& in) {
    auto h = block(in[0] * in[1]);
    return std::vector<torch::Tensor>{h.tanh(), (h * in[1]).sigmoid()};
  };
  auto loss_of = [](const std::vector<torch::Tensor>& outs) {
    return outs[0].sum() + 2 * outs[1].pow(2).sum();
  };
  loss_of(fn({a, b})).backward();
  auto plain = grads_of(*block);
  auto ga = a.grad().clone(), gb = b.grad().clone();

  clear_grads(*block);
  a.mutable_grad() = torch::Tensor();
  b.mutable_grad() = torch::Tensor();
  auto outs = remat::checkpoint(fn, {a, b}, opts().modules({block.ptr()}));
  ASSERT_EQ(outs.size(), 2u);
  loss_of(outs).backward();
  expect_all_close(grads_of(*block), plain);
  EXPECT_LE(max_abs_diff(a.grad(), ga), 1e-6);
  EXPECT_LE(max_abs_diff(b.grad(), gb), 1e-6);
}

TEST_P(CheckpointTest, IntegerOutputAndOutputWithoutGrad) {
  Block block(8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto fn = [&](const std::vector<torch::Tensor>& in) {
    auto h = block(in[0]);
    return std::vector<torch::Tensor>{h, h.argmax(1), torch::ones({3})};
  };
  fn({x})[0].pow(2).sum().backward();
  auto plain = grads_of(*block);
  auto gx = x.grad().clone();

  clear_grads(*block);
  x.mutable_grad() = torch::Tensor();
  auto outs = remat::checkpoint(fn, {x}, opts().modules({block.ptr()}));
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_EQ(outs[1].scalar_type(), torch::kLong);
  EXPECT_FALSE(outs[1].requires_grad());
  (outs[0].pow(2).sum() + outs[2].sum() * 0).backward();
  expect_all_close(grads_of(*block), plain);
  EXPECT_LE(max_abs_diff(x.grad(), gx), 1e-6);
}

TEST_P(CheckpointTest, ParametersTrainedWhenNoInputRequiresGrad) {
  // PyTorch's reentrant checkpoint leaves these weights without gradients; remat trains them in both modes.
  Block block(16);
  auto x = torch::randn({8, 16});
  block(x).sum().backward();
  auto plain = grads_of(*block);

  clear_grads(*block);
  remat::checkpoint(block, x, opts()).sum().backward();
  auto got = grads_of(*block);
  for (const auto& g : got)
    ASSERT_TRUE(g.defined());
  expect_all_close(got, plain, 0.0);
}

TEST_P(CheckpointTest, LambdaWithModulesOptionTrainsParameters) {
  Block block(16);
  auto x = torch::randn({8, 16});
  block(x).sum().backward();
  auto plain = grads_of(*block);

  clear_grads(*block);
  auto fn = [&](const torch::Tensor& t) { return block(t); };
  remat::checkpoint(fn, x, opts().modules({block.ptr()})).sum().backward();
  expect_all_close(grads_of(*block), plain, 0.0);
}

TEST_P(CheckpointTest, UndeclaredParametersStillTrainedUnderBackward) {
  // Parameters used by a lambda but not listed: with an input that requires grad, backward() trains them.
  Block block(16);
  auto x = torch::randn({8, 16}, torch::requires_grad());
  block(x).sum().backward();
  auto plain = grads_of(*block);

  clear_grads(*block);
  remat::checkpoint([&](const torch::Tensor& t) { return block(t); }, x, opts()).sum().backward();
  expect_all_close(grads_of(*block), plain, 1e-6);
}

TEST(CheckpointReentrant, UndeclaredWeightsTrainedWhenNoInputRequiresGrad) {
  // PyTorch's reentrant checkpoint freezes these weights silently (and remat refused the call before it
  // found them): kReentrant finds the tensors fn uses in its forward pass and trains them.
  Block block(4);
  auto x = torch::randn({2, 4});
  block(x).sum().backward();
  auto plain = grads_of(*block);
  clear_grads(*block);
  int calls = 0;
  auto fn = [&](const torch::Tensor& t) {
    ++calls;
    return block(t);
  };
  remat::checkpoint(fn, x, CheckpointOptions().mode(CheckpointMode::kReentrant)).sum().backward();
  EXPECT_EQ(calls, 2);  // the forward pass and the recompute
  expect_all_close(grads_of(*block), plain, 0.0);
}

// ---------------------------------------------------------------------------------------------------------
// Recomputation happens, and memory drops

TEST_P(CheckpointTest, RecomputesOnceAndCountsCalls) {
  Block block(8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const torch::Tensor& t) {
    ++calls;
    return block(t);
  };
  auto y = remat::checkpoint(fn, x, opts().modules({block.ptr()}));
  EXPECT_EQ(calls, 1);
  y.sum().backward();
  EXPECT_EQ(calls, 2);
}

TEST_P(CheckpointTest, BytesKeptUntilBackwardDropExactly) {
  const int64_t b = 32, w = 64;
  Block block(w);
  auto x = torch::randn({b, w}, torch::requires_grad());

  int64_t plain_kept = 0;
  {
    const int64_t before = remat::memory::active_bytes();
    auto y = block(x);
    plain_kept = remat::memory::active_bytes() - before;
    y.sum().backward();
  }
  // Without checkpointing: fc1's output (saved by gelu), gelu's output (saved by fc2) and the block's output.
  EXPECT_EQ(plain_kept, b * (2 * w + 2 * w + w) * 4);

  clear_grads(*block);
  int64_t ckpt_kept = 0;
  {
    const int64_t before = remat::memory::active_bytes();
    auto y = remat::checkpoint(block, x, opts().preserve_rng_state(false));
    ckpt_kept = remat::memory::active_bytes() - before;
    y.sum().backward();
  }
  // With it: only the block's output.
  EXPECT_EQ(ckpt_kept, b * w * 4);
}

TEST_P(CheckpointTest, ChainOfCheckpointsLowersPeak) {
  const int64_t b = 64, w = 64, depth = 12;
  torch::nn::Sequential seq;
  for (int i = 0; i < depth; ++i)
    seq->push_back(Block(w));
  auto x = torch::randn({b, w}, torch::requires_grad());

  auto step_peak = [&](bool ckpt) {
    for (auto& p : seq->parameters()) {
      if (p.grad().defined()) p.grad().zero_();  // keep the gradients allocated: they are not activations
    }
    remat::memory::PeakScope scope;
    auto h = x;
    for (auto& m : *seq) {
      auto block = std::dynamic_pointer_cast<BlockImpl>(m.ptr());
      h = ckpt ? remat::checkpoint(Block(block), h, opts()) : block->forward(h);
    }
    h.sum().backward();
    return scope.peak_over_base();
  };
  step_peak(false);  // grads allocated once, so both measured steps start from the same bytes
  const int64_t plain = step_peak(false);
  const int64_t ckpt = step_peak(true);
  EXPECT_LT(ckpt, plain * 0.4) << "plain " << plain << " checkpointed " << ckpt;
}

// ---------------------------------------------------------------------------------------------------------
// RNG

TEST_P(CheckpointTest, DropoutMaskReplayedAndGlobalRngUntouched) {
  Block block(16);
  torch::nn::Dropout drop(0.5);
  auto x = torch::randn({8, 16}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) { return drop(block(t)) * 3; };

  torch::manual_seed(42);
  fn(x).pow(2).sum().backward();
  auto after_plain = torch::rand({8});
  auto plain = grads_of(*block);
  auto gx = x.grad().clone();

  clear_grads(*block);
  x.mutable_grad() = torch::Tensor();
  torch::manual_seed(42);
  remat::checkpoint(fn, x, opts().modules({block.ptr()})).pow(2).sum().backward();
  auto after_ckpt = torch::rand({8});
  expect_all_close(grads_of(*block), plain, 0.0);
  EXPECT_EQ(max_abs_diff(x.grad(), gx), 0.0);
  EXPECT_TRUE(torch::equal(after_plain, after_ckpt));
}

// What a chain of checkpoints keeps for RNG replay: regions that draw keep the generator's state at their
// start (each shared with the region before, which captured it as its end), their end kept as a digest
// (k regions: k states; k + 1 before 2026-12-05, the last end held too, and a region's state at its last
// save); regions that draw nothing keep none.
TEST_P(CheckpointTest, ConsecutiveCheckpointsShareGeneratorStatesAndDrawlessOnesKeepNone) {
  const int64_t state_bytes = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  constexpr int kRegions = 5;
  auto kept = [&](bool dropout, bool preserve) {
    auto x = torch::randn({1000}, torch::requires_grad());
    const int64_t before = remat::memory::active_bytes();
    torch::Tensor h = x;
    for (int k = 0; k < kRegions; ++k) {
      h = remat::checkpoint(
          [dropout](const torch::Tensor& t) { return dropout ? torch::dropout(t, 0.5, true) * 2 : t * 2; }, h,
          opts().preserve_rng_state(preserve));
    }
    return remat::memory::active_bytes() - before;
  };
  EXPECT_EQ(kept(true, true) - kept(true, false), kRegions * state_bytes);
  EXPECT_EQ(kept(false, true) - kept(false, false), 0);
}

TEST_P(CheckpointTest, WithoutPreservedRngTheMaskDiffers) {
  Block block(16);
  torch::nn::Dropout drop(0.5);
  auto x = torch::randn({32, 16}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) { return drop(block(t)); };

  torch::manual_seed(42);
  fn(x).pow(2).sum().backward();
  auto after_plain = torch::rand({8});
  auto gx = x.grad().clone();

  x.mutable_grad() = torch::Tensor();
  torch::manual_seed(42);
  remat::checkpoint(fn, x, opts().modules({block.ptr()}).preserve_rng_state(false)).pow(2).sum().backward();
  auto after_ckpt = torch::rand({8});
  EXPECT_GT(max_abs_diff(x.grad(), gx), 0.0);           // another mask was drawn in the recompute
  EXPECT_FALSE(torch::equal(after_plain, after_ckpt));  // and the generator moved on
}

// ---------------------------------------------------------------------------------------------------------
// Stateful layers

TEST_P(CheckpointTest, BatchNormUpdatedOnce) {
  auto make = [] {
    torch::manual_seed(7);
    return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::ReLU(),
                                 torch::nn::Linear(16, 4));
  };
  auto plain = make();
  auto ckpt = make();
  auto x = torch::randn({10, 8});
  plain->forward(x).pow(2).sum().backward();
  remat::checkpoint(ckpt, x, opts()).pow(2).sum().backward();

  auto pb = plain->buffers(), cb = ckpt->buffers();
  ASSERT_EQ(pb.size(), 3u);  // running_mean, running_var, num_batches_tracked
  for (size_t i = 0; i < pb.size(); ++i)
    EXPECT_TRUE(torch::equal(pb[i], cb[i])) << "buffer " << i;
  EXPECT_EQ(cb[2].item<int64_t>(), 1);
  expect_all_close(grads_of(*ckpt), grads_of(*plain), 1e-6);
}

// A layer whose forward reads a buffer and then updates it in place (an EMA codebook), and updates another
// and then reads it. Before 2026-12-07 a recompute read both as the forward pass left them: the first's new
// value where the forward read the old, the second updated twice; every gradient was wrong, silently.
struct ReadsThenWritesImpl : torch::nn::Module {
  explicit ReadsThenWritesImpl(int64_t w) : fc(register_module("fc", torch::nn::Linear(w, w))) {
    read_first = register_buffer("read_first", torch::full({w}, 0.5));
    written_first = register_buffer("written_first", torch::full({w}, 2.0));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = fc(x) * (read_first + 1);
    {
      torch::NoGradGuard no_grad;
      read_first.mul_(0.5).add_(x.mean(0), 0.5);
      written_first.mul_(0.9).add_(y.mean(0), 0.1);
    }
    return torch::tanh(y * written_first);
  }
  torch::nn::Linear fc;
  torch::Tensor read_first, written_first;
};
TORCH_MODULE(ReadsThenWrites);

TEST_P(CheckpointTest, ABufferTheForwardReadsAndWritesInPlaceIsRecomputedAsTheForwardFoundIt) {
  auto make = [] {
    torch::manual_seed(3);
    return ReadsThenWrites(8);
  };
  auto plain = make();
  auto ckpt = make();
  const auto x = torch::randn({6, 8}, torch::requires_grad());
  const auto xc = x.detach().clone().requires_grad_(true);
  for (int step = 0; step < 2; ++step) {  // the second step from the state the first left
    plain->forward(x).pow(2).sum().backward();
    remat::checkpoint(ckpt, xc, opts()).pow(2).sum().backward();
    EXPECT_TRUE(torch::equal(ckpt->read_first, plain->read_first)) << step;
    EXPECT_TRUE(torch::equal(ckpt->written_first, plain->written_first)) << step;
    EXPECT_TRUE(torch::equal(xc.grad(), x.grad())) << step;
    expect_all_close(grads_of(*ckpt), grads_of(*plain), 0.0);
  }
}

TEST_P(CheckpointTest, ABufferTheForwardReadsAndWritesIsHeldOnceMoreWhileItsRegionIsRecomputed) {
  // While the recompute runs, the buffer holds the value the forward pass found, and one copy holds the value
  // the forward pass left, put back after. Before 2026-12-07 the recompute's StateRestore copied the found
  // value again before the recompute's write: two copies beside the one kept from the forward pass.
  remat::testing::meter_on();
  const auto x = torch::randn({4, 8}, torch::requires_grad());
  auto held_at_write = [&](int64_t n) {
    torch::Tensor buf = torch::full({n}, 0.5);
    int64_t at_write = -1;
    int calls = 0;
    auto fn = [&](const torch::Tensor& t) {
      torch::Tensor y = t * (buf + 1).mean();
      {
        torch::NoGradGuard no_grad;
        buf.mul_(0.5);
      }
      if (++calls == 2) at_write = remat::memory::active_bytes();
      return y.tanh();
    };
    x.mutable_grad() = torch::Tensor();
    auto loss = remat::checkpoint(fn, x, opts()).sum();
    const int64_t before = remat::memory::active_bytes();
    loss.backward();
    EXPECT_EQ(calls, 2);
    EXPECT_TRUE(torch::equal(buf, torch::full({n}, 0.25))) << "the value the forward pass left";
    const auto s = torch::full({}, 1.5);  // the mean the forward pass read
    EXPECT_LE(max_abs_diff(x.grad(), (1 - (x * s).tanh().pow(2)) * s), 1e-6);
    return at_write - before;
  };
  const int64_t extra = 4096;
  EXPECT_EQ(held_at_write(16 + extra) - held_at_write(16), extra * 4);
}

// ---------------------------------------------------------------------------------------------------------
// torch::autograd::grad, retain_graph, nesting

TEST_P(CheckpointTest, AutogradGradEqualsAndAccumulatesNothing) {
  Block block(8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  std::vector<torch::Tensor> wrt{x};
  for (const auto& p : block->parameters())
    wrt.push_back(p);

  auto plain = torch::autograd::grad({block(x).pow(2).sum()}, wrt);
  auto got = torch::autograd::grad({remat::checkpoint(block, x, opts()).pow(2).sum()}, wrt);
  expect_all_close(got, plain, 1e-6);
  EXPECT_FALSE(x.grad().defined());
  for (const auto& p : block->parameters())
    EXPECT_FALSE(p.grad().defined());
}

TEST_P(CheckpointTest, RetainGraphSecondBackwardDoubles) {
  Block block(8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  block(x).pow(2).sum().backward();
  auto once = grads_of(*block);

  clear_grads(*block);
  auto loss = remat::checkpoint(block, x, opts()).pow(2).sum();
  loss.backward({}, /*retain_graph=*/true);
  loss.backward();
  auto twice = grads_of(*block);
  for (auto& g : once)
    g = g * 2;
  expect_all_close(twice, once, 1e-5);
}

TEST_P(CheckpointTest, NestedCheckpointGradientsEqual) {
  Block inner(8), outer(8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto plain_fn = [&](const torch::Tensor& t) { return outer(inner(t).tanh()); };
  plain_fn(x).pow(2).sum().backward();
  auto plain_inner = grads_of(*inner), plain_outer = grads_of(*outer);
  auto gx = x.grad().clone();

  clear_grads(*inner);
  clear_grads(*outer);
  x.mutable_grad() = torch::Tensor();
  int inner_calls = 0;
  auto nested_fn = [&](const torch::Tensor& t) {
    auto h = remat::checkpoint(
        [&](const torch::Tensor& u) {
          ++inner_calls;
          return inner(u);
        },
        t, opts().modules({inner.ptr()}));
    return outer(h.tanh());
  };
  // The outer call lists the inner module: a kReentrant outer must know every parameter inside it.
  remat::checkpoint(nested_fn, x, opts().modules({inner.ptr(), outer.ptr()})).pow(2).sum().backward();
  expect_all_close(grads_of(*inner), plain_inner, 1e-6);
  expect_all_close(grads_of(*outer), plain_outer, 1e-6);
  EXPECT_LE(max_abs_diff(x.grad(), gx), 1e-6);
  EXPECT_GE(inner_calls, 2);
}

TEST(CheckpointNesting, MixedModesGradientsEqual) {
  for (auto outer_mode : {CheckpointMode::kNonReentrant, CheckpointMode::kReentrant}) {
    for (auto inner_mode : {CheckpointMode::kNonReentrant, CheckpointMode::kReentrant}) {
      torch::manual_seed(3);
      Block inner(8), outer(8);
      auto x = torch::randn({4, 8}, torch::requires_grad());
      outer(inner(x)).sum().backward();
      auto plain = grads_of(*inner);
      clear_grads(*inner);
      auto fn = [&](const torch::Tensor& t) {
        return outer(remat::checkpoint(inner, t, CheckpointOptions().mode(inner_mode)));
      };
      remat::checkpoint(fn, x, CheckpointOptions().mode(outer_mode).modules({inner.ptr(), outer.ptr()}))
          .sum()
          .backward();
      expect_all_close(grads_of(*inner), plain, 1e-6);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Determinism check

TEST_P(CheckpointTest, DeterminismCheckNamesTheMismatch) {
  auto x = torch::randn({4, 8}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const torch::Tensor& t) {
    auto u = calls++ == 0 ? t : t.to(torch::kDouble);
    return u * u;  // kNonReentrant sees the saved tensors change dtype, kReentrant the output
  };
  auto y = remat::checkpoint(fn, x, opts());
  EXPECT_THROW_WITH(y.sum().backward(), "remat::checkpoint", "determinism", "Float", "Double");
}

TEST_P(CheckpointTest, DeterminismCheckNamesAChangedShape) {
  auto x = torch::randn({4, 6}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const torch::Tensor& t) {
    auto u = calls++ == 0 ? t : t.narrow(0, 0, 3);
    return u.sin() * 2;
  };
  auto y = remat::checkpoint(fn, x, opts());
  // kReentrant checks the outputs ([4, 6] then [3, 6]); kNonReentrant the saved tensors (sin saves its
  // input).
  EXPECT_THROW_WITH(y.sum().backward(), "remat::checkpoint", "determinism", "[3, 6]", "[4, 6]");
}

TEST_P(CheckpointTest, BatchNormInALambdaWithModulesIsUpdatedOnce) {
  torch::manual_seed(3);
  torch::nn::Linear fc(8, 16);
  torch::nn::BatchNorm1d bn(16);
  auto x = torch::randn({10, 8}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) { return torch::relu(bn(fc(t))); };
  fn(x).pow(2).sum().backward();
  const auto plain_buffers = bn->buffers();
  std::vector<torch::Tensor> plain;
  for (const auto& b : plain_buffers)
    plain.push_back(b.clone());
  const auto plain_grads = grads_of(*fc);
  for (auto& b : bn->buffers())
    b.zero_();
  bn->running_var.fill_(1);
  clear_grads(*fc);
  clear_grads(*bn);
  x.mutable_grad() = torch::Tensor();
  remat::checkpoint(fn, x, opts().modules({fc.ptr(), bn.ptr()})).pow(2).sum().backward();
  const auto now = bn->buffers();
  ASSERT_EQ(now.size(), plain.size());
  for (size_t i = 0; i < now.size(); ++i)
    EXPECT_TRUE(now[i].equal(plain[i])) << "buffer " << i;
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 1);
  expect_all_close(grads_of(*fc), plain_grads, 1e-6);
}

// The natural first attempt for a block taken out of a Sequential: a lambda, no .modules(). The recompute's
// in-place writes to state (BatchNorm's running statistics and num_batches_tracked, a captured counter) are
// undone, while its in-place work on its own intermediate results and inputs is kept.
TEST_P(CheckpointTest, BatchNormInALambdaWithoutModulesIsUpdatedOnce) {
  auto make = [] {
    torch::manual_seed(3);
    return std::make_pair(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16));
  };
  auto [fc0, bn0] = make();
  auto [fc1, bn1] = make();
  auto counter0 = torch::zeros({2});
  auto counter1 = torch::zeros({2});
  auto block = [](torch::nn::Linear& fc, torch::nn::BatchNorm1d& bn, torch::Tensor& counter) {
    return [&](const torch::Tensor& t) {
      counter.narrow(0, 1, 1).add_(1);  // a captured tensor updated in place, through a view
      auto h = bn(fc(t));
      h.relu_();  // in place on an intermediate result that backward needs: must stay
      return h * h.sigmoid();
    };
  };
  torch::manual_seed(5);
  auto x = torch::randn({10, 8}, torch::requires_grad());
  block(fc0, bn0, counter0)(x).pow(2).sum().backward();
  const auto x_grad = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  remat::checkpoint(block(fc1, bn1, counter1), x, opts()).pow(2).sum().backward();

  const auto plain = bn0->buffers(), now = bn1->buffers();
  ASSERT_EQ(now.size(), 3u);
  for (size_t i = 0; i < now.size(); ++i)
    EXPECT_TRUE(now[i].equal(plain[i])) << "buffer " << i;
  EXPECT_EQ(bn1->num_batches_tracked.item<int64_t>(), 1);
  EXPECT_TRUE(counter1.equal(counter0)) << counter1;
  expect_all_close(grads_of(*fc1), grads_of(*fc0), 1e-6);
  expect_all_close(grads_of(*bn1), grads_of(*bn0), 1e-6);
  EXPECT_LE(max_abs_diff(x.grad(), x_grad), 1e-6);
}

TEST_P(CheckpointTest, ActivationsAreFreedAfterTheStep) {
  Block block(32);
  auto x = torch::randn({16, 32}, torch::requires_grad());
  // Gradients exist from a first step, so the second allocates none that stay.
  remat::checkpoint(block, x, opts()).pow(2).sum().backward();
  const int64_t before = remat::memory::active_bytes();
  {
    auto loss = remat::checkpoint(block, x, opts()).pow(2).sum();
    EXPECT_GT(remat::memory::active_bytes(), before);
    loss.backward();
  }
  EXPECT_EQ(remat::memory::active_bytes(), before);
}

TEST(CheckpointBranch, WhatABranchTheForwardDroppedSavedIsNotHeldThroughTheBackward) {
  // fn's router-like branch saves a tensor (sigmoid_'s result, `wide` columns) and is read only by an argmax,
  // so its graph dies in the forward pass. The recompute makes it again; before 2026-12-07 the kNonReentrant
  // recompute kept it with the tensors it hands out, to the region's backward end, where the plain run holds
  // none. Measured as the backward reaches exp's node (after the recompute, before the region's end): the
  // same bytes whatever the branch's width.
  remat::testing::meter_on();
  const int64_t b = 16, w = 8;
  const auto x = torch::randn({b, w}, torch::requires_grad());
  auto held_at_exp = [&](int64_t wide, bool ckpt) {
    int64_t held = -1;
    bool forward = true;
    auto fn = [&](const torch::Tensor& t) {
      const torch::Tensor scores = t.repeat({1, wide / w}).sigmoid_();  // saves its result; its graph dropped
      const torch::Tensor pick = scores.argmax(1, /*keepdim=*/true).to(t.dtype());
      torch::Tensor e = t.exp();  // saves its result
      if (forward) e.register_hook([&held](const torch::Tensor&) { held = remat::memory::active_bytes(); });
      forward = false;
      return e * (pick + 1);  // saves pick + 1
    };
    x.mutable_grad() = torch::Tensor();
    const int64_t before = remat::memory::active_bytes();
    (ckpt ? remat::checkpoint(fn, x, CheckpointOptions().mode(CheckpointMode::kNonReentrant)) : fn(x))
        .sum()
        .backward();
    EXPECT_GE(held, before) << wide;
    return std::make_pair(held - before, x.grad().clone());
  };
  const auto plain = held_at_exp(8 * w, false);
  const auto narrow = held_at_exp(w, true), wide = held_at_exp(64 * w, true);
  EXPECT_EQ(wide.first, narrow.first) << "the branch's " << b * 64 * w * 4 << " bytes held";
  EXPECT_EQ(wide.first, plain.first);
  EXPECT_TRUE(torch::equal(wide.second, plain.second));
  EXPECT_TRUE(torch::equal(narrow.second, plain.second));
}

TEST_P(CheckpointTest, DeterminismCheckOffMakesNoCheck) {
  auto x = torch::randn({4, 8}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const torch::Tensor& t) {
    auto u = calls++ == 0 ? t : t.to(torch::kDouble);
    return u * u;  // the same values in another dtype: autograd itself accepts it
  };
  auto y = remat::checkpoint(fn, x, opts().determinism_check(false));
  EXPECT_NO_THROW(y.sum().backward());
  EXPECT_LE(max_abs_diff(x.grad(), 2 * x), 1e-5);
}

// ---------------------------------------------------------------------------------------------------------
// Bad input, no grad

TEST_P(CheckpointTest, BadInputIsAClearErrorAndLeavesNothingHalfDone) {
  Block block(8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const std::vector<torch::Tensor>& in) {
    ++calls;
    return std::vector<torch::Tensor>{block(in[0])};
  };
  EXPECT_THROW_WITH(remat::checkpoint(fn, std::vector<torch::Tensor>{}, opts()), "remat::checkpoint",
                    "inputs is empty");
  EXPECT_THROW_WITH(remat::checkpoint(fn, {x, torch::Tensor()}, opts()), "remat::checkpoint",
                    "input 1 of 2 is an undefined tensor");
  EXPECT_EQ(calls, 0);
  auto none = [&](const std::vector<torch::Tensor>&) { return std::vector<torch::Tensor>{}; };
  EXPECT_THROW_WITH(remat::checkpoint(none, {x}, opts().modules({block.ptr()})), "remat::checkpoint",
                    "returned no tensor");
  auto undefined = [&](const torch::Tensor&) { return torch::Tensor(); };
  EXPECT_THROW_WITH(remat::checkpoint(undefined, x, opts().modules({block.ptr()})), "remat::checkpoint",
                    "undefined tensor as output 0 of 1");
  remat::TensorFn empty;
  EXPECT_THROW_WITH(remat::checkpoint(empty, x, opts()), "remat::checkpoint", "fn is empty");

  // Afterwards, plain and checkpointed runs still agree.
  block(x).sum().backward();
  auto plain = grads_of(*block);
  clear_grads(*block);
  remat::checkpoint(block, x, opts()).sum().backward();
  expect_all_close(grads_of(*block), plain, 0.0);
}

TEST_P(CheckpointTest, UnderNoGradJustRunsFn) {
  Block block(8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const torch::Tensor& t) {
    ++calls;
    return block(t);
  };
  torch::NoGradGuard no_grad;
  auto y = remat::checkpoint(fn, x, opts());
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(torch::allclose(y, block(x)));
}

TEST(CheckpointModule, EmptyHolderIsAnError) {
  torch::nn::Linear empty = nullptr;
  EXPECT_THROW_WITH(remat::checkpoint(empty, torch::ones({2, 2})), "remat::checkpoint", "empty");
}

// ---------------------------------------------------------------------------------------------------------
// Every call shape compiles and picks the right overload

TEST(CheckpointOverloads, EveryCallShapeCompiles) {
  torch::manual_seed(0);
  torch::nn::Linear linear(4, 4);
  Block mine(4);
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::ReLU());
  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto a = torch::randn({2, 4}, torch::requires_grad());

  auto y1 = remat::checkpoint(linear, x);
  auto y2 = remat::checkpoint(mine, x);
  auto y3 = remat::checkpoint(seq, x);
  auto y4 = remat::checkpoint([](const torch::Tensor& t) { return t * 2; }, x);
  auto y5 = remat::checkpoint(
      [](const std::vector<torch::Tensor>& t) { return std::vector<torch::Tensor>{t[0] + t[1]}; }, {x, a});
  remat::TensorFn f = [](const torch::Tensor& t) { return t.sin(); };
  remat::TensorsFn g = [](const std::vector<torch::Tensor>& t) {
    return std::vector<torch::Tensor>{t[0].cos()};
  };
  auto y6 = remat::checkpoint(f, x);
  auto y7 = remat::checkpoint(g, {x});
  const remat::TensorFn cf = f;
  auto y8 = remat::checkpoint(cf, x);

  static_assert(std::is_same_v<decltype(y1), torch::Tensor>);
  static_assert(std::is_same_v<decltype(y5), std::vector<torch::Tensor>>);
  static_assert(std::is_same_v<decltype(y7), std::vector<torch::Tensor>>);
  (y1.sum() + y2.sum() + y3.sum() + y4.sum() + y5[0].sum() + y6.sum() + y7[0].sum() + y8.sum()).backward();
  auto got_x = x.grad().clone();
  auto got = grads_of(*linear), got_mine = grads_of(*mine), got_seq = grads_of(*seq);
  // Every call shape computes the gradients of the same expression without checkpointing.
  clear_grads(*linear);
  clear_grads(*mine);
  clear_grads(*seq);
  x.mutable_grad() = torch::Tensor();
  a.mutable_grad() = torch::Tensor();
  (linear(x).sum() + mine(x).sum() + seq->forward(x).sum() + (x * 2).sum() + (x + a).sum() + x.sin().sum() +
   x.cos().sum() + x.sin().sum())
      .backward();
  // x's gradient sums eight contributions, which the checkpointed run may add in another order (CI once saw
  // 1.4e-6 with unseeded inputs).
  EXPECT_LE(max_abs_diff(got_x, x.grad()), 1e-5);
  expect_all_close(got, grads_of(*linear), 1e-6);
  expect_all_close(got_mine, grads_of(*mine), 1e-6);
  expect_all_close(got_seq, grads_of(*seq), 1e-6);
  EXPECT_LE(max_abs_diff(a.grad(), torch::ones_like(a)), 0.0);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// StateRestore on its own: what a recompute writes back and what it leaves

namespace {
TEST(StateRestore, WritesBackStateFromBeforeAndNothingItMade) {
  auto buffer = torch::zeros({4});
  auto counter = torch::zeros({}, torch::kLong);
  auto weight = torch::randn({4}, torch::requires_grad());
  auto input = torch::ones({4});
  torch::Tensor made, viewed;
  {
    remat::detail::StateRestore state({}, {input});
    buffer.add_(1);                  // state: written back
    buffer.narrow(0, 0, 2).mul_(3);  // again, through a view: the view's part is copied too
    counter += 1;                    // state
    input.mul_(2);                   // the region's input: its own work
    made = weight * 2;               // made here, then updated in place: kept
    made.detach().add_(1);
    viewed = torch::zeros({3});
    viewed.select(0, 1).fill_(7);
    EXPECT_TRUE(buffer.equal(torch::tensor({3.f, 3.f, 1.f, 1.f})));
    EXPECT_EQ(state.restored_count(), 3u);  // buffer, its view, counter
  }
  EXPECT_TRUE(buffer.equal(torch::zeros({4})));
  EXPECT_EQ(counter.item<int64_t>(), 0);
  EXPECT_TRUE(input.equal(torch::full({4}, 2.f)));
  EXPECT_LE(max_abs_diff(made, weight * 2 + 1), 0.0);
  EXPECT_TRUE(viewed.equal(torch::tensor({0.f, 7.f, 0.f})));
  // Outside the scope nothing is watched.
  buffer.add_(1);
  EXPECT_TRUE(buffer.equal(torch::ones({4})));
}

// What the watch costs per operator (printed, not asserted: speed is a benchmark's business; see
// docs/BENCHMARKS.md, "State restore").
TEST(StateRestore, CostPerOperator) {
  torch::NoGradGuard no_grad;
  auto x = torch::ones({1});
  constexpr int kOps = 20000;
  auto time_ops = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kOps; ++i)
      x = x.mul(1.0);
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / kOps;
  };
  std::vector<double> plain, watched, forward;
  for (int r = 0; r < 5; ++r) {
    plain.push_back(time_ops());
    {
      remat::detail::StateRestore state({}, {});
      watched.push_back(time_ops());
    }
    remat::detail::ForwardWrites writes({});  // a region's forward pass
    forward.push_back(time_ops());
    EXPECT_TRUE(writes.take().empty());
  }
  std::sort(plain.begin(), plain.end());
  std::sort(watched.begin(), watched.end());
  std::sort(forward.begin(), forward.end());
  std::printf(
      "StateRestore: a 1-element mul takes %.2f us plainly, %.2f us watched (+%.2f us), %.2f us under "
      "ForwardWrites (+%.2f us; medians of 5)\n",
      plain[2], watched[2], watched[2] - plain[2], forward[2], forward[2] - plain[2]);
  EXPECT_TRUE(x.equal(torch::ones({1})));
}
}  // namespace

namespace {
// Early stopping (kNonReentrant): the recompute ends once every tensor backward needs is back; what fn does
// after its last saved tensor runs once, in the forward pass. Off, fn runs whole each time.
TEST(EarlyStop, TheRecomputeEndsAtTheLastSavedTensor) {
  for (bool early : {true, false}) {
    int head = 0, tail = 0;
    auto x = torch::randn({4, 8}, torch::requires_grad());
    auto fn = [&](const torch::Tensor& t) {
      ++head;
      auto h = t.sin();  // saves t: the region's only saved tensor
      ++tail;
      return h * 2 + 1;  // saves nothing
    };
    remat::checkpoint(fn, x, CheckpointOptions().early_stop(early)).sum().backward();
    EXPECT_EQ(head, 2) << early;
    EXPECT_EQ(tail, early ? 1 : 2) << early;
    EXPECT_LE(max_abs_diff(x.grad(), 2 * x.detach().cos()), 1e-6) << early;
  }
}

TEST(EarlyStop, ARecomputeThatWritesWhatItSavedGivesAutogradsErrorWithoutIt) {
  // fn writes sigmoid's saved output in place: plain LibTorch raises. A recompute that stops at the last
  // saved tensor hands back the values saved (the gradient of the forward pass as computed); one that runs on
  // wrote them, and its hooks hand them back unchecked by autograd: remat raises autograd's error, never a
  // gradient of the values written.
  const torch::Tensor x = torch::randn({4, 8}, torch::requires_grad());
  auto fn = [](const torch::Tensor& t) {
    torch::Tensor y = t.sigmoid();
    y.mul_(2);
    return y;
  };
  const char* modified =
      "one of the variables needed for gradient computation has been modified by an inplace operation";
  EXPECT_THROW_WITH(fn(x).sum().backward(), modified);
  remat::checkpoint(fn, x, CheckpointOptions().early_stop(true)).sum().backward();
  const torch::Tensor s = x.detach().sigmoid();
  EXPECT_LE(max_abs_diff(x.grad(), 2 * s * (1 - s)), 1e-6);
  EXPECT_THROW_WITH(remat::checkpoint(fn, x, CheckpointOptions().early_stop(false)).sum().backward(),
                    modified, "which is output 0 of Sigmoid", "remat::checkpoint's recompute");
}

TEST(EarlyStop, DropoutMasksAndStateAreAsWithoutIt) {
  // A region whose last saved tensor is a dropout mask, followed by work that saves nothing: the stop comes
  // right after the mask's draw; the RNG check compares with the forward pass at that same point.
  torch::nn::Linear fc(8, 8);
  torch::nn::BatchNorm1d bn(8);
  auto run = [&](bool early) {
    torch::manual_seed(3);
    auto x = torch::randn({6, 8}, torch::requires_grad());
    auto fn = [&](const torch::Tensor& t) { return torch::dropout(bn(fc(t)), 0.3, true) * 3; };
    auto y = remat::checkpoint(fn, x, CheckpointOptions().early_stop(early));
    y.pow(2).sum().backward();
    std::vector<torch::Tensor> out{x.grad().clone(), torch::rand({4})};
    for (const auto& b : bn->buffers())
      out.push_back(b.clone());
    return out;
  };
  const auto with = run(true);
  for (auto& b : bn->buffers())
    b.zero_();
  bn->running_var.fill_(1);
  const auto without = run(false);
  ASSERT_EQ(with.size(), without.size());
  for (size_t i = 0; i < with.size(); ++i)
    EXPECT_TRUE(with[i].equal(without[i])) << i;  // gradients, the next random numbers, BatchNorm buffers
}
}  // namespace

namespace {
// remat::keep: selective checkpointing at the level of operations. A block whose two linear layers are kept
// calls: the recompute runs only GELU and the residual add.
struct KeptBlock {
  explicit KeptBlock(int64_t w) : fc1(w, 2 * w), fc2(2 * w, w) {}
  torch::Tensor operator()(const torch::Tensor& x) {
    // fc(t) as a kept call that counts its runs.
    auto kept = [](torch::nn::Linear& fc, int& calls, const torch::Tensor& t) {
      return remat::keep(
          remat::kMatmul,
          [&](const torch::Tensor& u) {
            ++calls;
            return fc(u);
          },
          t);
    };
    auto g = torch::gelu(kept(fc1, fc1_calls, x));
    ++gelu_calls;
    return x + kept(fc2, fc2_calls, g);
  }
  CheckpointOptions options(std::vector<std::string> keep) const {
    return CheckpointOptions().keep(std::move(keep)).modules({fc1.ptr(), fc2.ptr()});
  }
  torch::nn::Linear fc1, fc2;
  int fc1_calls = 0, fc2_calls = 0, gelu_calls = 0;
};

TEST(Keep, GradientsEqualAndKeptCallsRunOnce) {
  torch::manual_seed(0);
  KeptBlock block(16);
  auto x = torch::randn({8, 16}, torch::requires_grad());
  block(x).pow(2).sum().backward();
  std::vector<torch::Tensor> plain{x.grad().clone(), block.fc1->weight.grad().clone(),
                                   block.fc2->weight.grad().clone(), block.fc2->bias.grad().clone()};
  for (const auto& keep : {std::vector<std::string>{remat::kMatmul}, std::vector<std::string>{"other"}}) {
    const bool kept = keep[0] == remat::kMatmul;
    x.mutable_grad() = torch::Tensor();
    for (auto& p : {block.fc1->weight, block.fc2->weight, block.fc2->bias})
      p.mutable_grad() = torch::Tensor();
    block.fc1_calls = block.fc2_calls = block.gelu_calls = 0;
    remat::checkpoint([&](const torch::Tensor& t) { return block(t); }, x, block.options(keep))
        .pow(2)
        .sum()
        .backward();
    EXPECT_EQ(block.fc1_calls, kept ? 1 : 2) << keep[0];
    EXPECT_EQ(block.fc2_calls, kept ? 1 : 2) << keep[0];
    EXPECT_EQ(block.gelu_calls, 2) << keep[0];  // the cheap operation is recomputed either way
    std::vector<torch::Tensor> got{x.grad(), block.fc1->weight.grad(), block.fc2->weight.grad(),
                                   block.fc2->bias.grad()};
    expect_all_close(got, plain, 0.0);
  }
}

TEST(Keep, KeepsExactlyTheKeptOutputs) {
  torch::manual_seed(0);
  remat::testing::meter_on();
  const int64_t b = 32, w = 64;
  KeptBlock block(w);
  auto x = torch::randn({b, w}, torch::requires_grad());
  auto kept_bytes = [&](std::vector<std::string> keep) {
    const int64_t before = remat::memory::active_bytes();
    auto y = remat::checkpoint([&](const torch::Tensor& t) { return block(t); }, x,
                               block.options(std::move(keep)).preserve_rng_state(false));
    const int64_t kept = remat::memory::active_bytes() - before;
    y.sum().backward();
    return kept;
  };
  // Plain checkpointing keeps the output; keeping the matmuls adds fc1's output (2w) and fc2's (w). GELU's
  // output, the input fc2 saves, is recomputed from fc1's kept output.
  EXPECT_EQ(kept_bytes({}), b * w * 4);
  EXPECT_EQ(kept_bytes({remat::kMatmul}), b * (w + 2 * w + w) * 4);
  // Everything the step allocated is gone afterwards, the kept outputs included.
  const int64_t before = remat::memory::active_bytes();
  kept_bytes({remat::kMatmul});
  EXPECT_EQ(remat::memory::active_bytes(), before);
}

TEST(Keep, DropoutOutsideKeptCallsIsReplayedAndRetainGraphRunsThemAgain) {
  torch::manual_seed(1);
  KeptBlock block(8);
  auto x = torch::randn({6, 8}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) {
    return torch::dropout(block(torch::dropout(t, 0.3, true)), 0.3, true);
  };
  torch::manual_seed(2);
  auto plain_y = fn(x);
  plain_y.sum().backward();
  auto plain = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  torch::manual_seed(2);
  block.fc1_calls = 0;
  auto y = remat::checkpoint(fn, x, block.options({remat::kMatmul}));
  EXPECT_TRUE(y.equal(plain_y));
  y.sum().backward(/*gradient=*/{}, /*retain_graph=*/true);
  EXPECT_EQ(max_abs_diff(x.grad(), plain), 0.0);
  EXPECT_EQ(block.fc1_calls, 1);
  // A second backward recomputes again; the kept outputs were freed after the first, so the calls run.
  y.sum().backward();
  EXPECT_EQ(block.fc1_calls, 2);
  EXPECT_EQ(max_abs_diff(x.grad(), 2 * plain), 0.0);
}

TEST(Keep, EarlyStopInsideAKeptCallAndSeveralOutputs) {
  // The region's last saved tensors are saved inside a kept call with two outputs (a view of an input and a
  // parameter): the recompute hands them back and stops there.
  torch::manual_seed(0);
  torch::nn::Linear fc(8, 8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  int calls = 0, tail = 0;
  auto fn = [&](const torch::Tensor& t) {
    auto h = t.tanh();
    auto outs = remat::keep("proj",
                            [&](const std::vector<torch::Tensor>& in) {
                              ++calls;
                              return std::vector<torch::Tensor>{fc(in[0].t().t()), in[0] * 2};
                            },
                            {h});
    ++tail;
    return outs[0] + outs[1];
  };
  fn(x).sum().backward();
  auto plain = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  calls = tail = 0;
  remat::checkpoint(fn, x, CheckpointOptions().keep({"proj"}).modules({fc.ptr()})).sum().backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(tail, 1);
  EXPECT_LE(max_abs_diff(x.grad(), plain), 1e-6);
}

TEST(Keep, AGradientInsideFnThroughAKeptCall) {
  // fn takes a gradient of its own result through a kept call. In the forward pass the call runs (the
  // gradient reaches its input); in the recompute it does not, so there the same gradient is a clear error
  // rather than a silently missing contribution.
  torch::manual_seed(0);
  torch::nn::Linear fc(4, 4);
  auto x = torch::randn({3, 4}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) {
    auto h = remat::keep(
        "k", [&](const torch::Tensor& u) { return fc(u); }, t.tanh());
    auto g =
        torch::autograd::grad({h.pow(2).sum()}, {t}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return h.sum(1, true) * g;
  };
  const auto plain = fn(x);
  auto y = remat::checkpoint(fn, x, CheckpointOptions().keep({"k"}).modules({fc.ptr()}));
  EXPECT_LE(max_abs_diff(y, plain), 1e-6);
  try {
    y.sum().backward();
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("remat::keep('k'): fn takes a gradient through a kept call's output"),
        std::string::npos)
        << e.what();
  }
  // Without the tag in keep the same region trains.
  x.mutable_grad() = torch::Tensor();
  remat::checkpoint(fn, x, CheckpointOptions().modules({fc.ptr()})).sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

TEST(Keep, BadUseIsAClearError) {
  torch::nn::Linear fc(4, 4);
  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto expect_error = [](const std::function<void()>& f, const std::string& words) {
    try {
      f();
      ADD_FAILURE() << "no error; expected: " << words;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  const auto keep = CheckpointOptions().keep({"k"});
  expect_error(
      [&] {
        remat::checkpoint(
            [&](const torch::Tensor& t) {
              return remat::keep(
                  "k", [](const torch::Tensor& u) { return torch::dropout(u, 0.5, true); }, t);
            },
            x, keep);
      },
      "remat::keep('k'): fn drew random numbers");
  expect_error(
      [&] {
        remat::checkpoint(
            [&](const torch::Tensor& t) {
              auto u = t * 1;
              return remat::keep(
                  "k", [](const torch::Tensor& v) { return v.mul_(2); }, u);
            },
            x, keep);
      },
      "remat::keep('k'): fn modified input 0 in place");
  expect_error([&] { remat::checkpoint(fc, x, CheckpointOptions(keep).mode(CheckpointMode::kReentrant)); },
               "CheckpointOptions::keep (1 tag, the first 'k') needs CheckpointMode::kNonReentrant");
  expect_error(
      [&] {
        remat::keep(
            "k", [](const torch::Tensor& u) { return u; }, torch::Tensor());
      },
      "remat::keep: input 0 is an undefined tensor");
  expect_error([&] { remat::keep("k", remat::TensorFn(), x); }, "remat::keep('k'): fn is empty");
  // A kept output written to before the backward pass.
  torch::Tensor kept_out;
  auto y = remat::checkpoint(
      [&](const torch::Tensor& t) {
        kept_out = remat::keep(
            "k", [&](const torch::Tensor& u) { return fc(u); }, t);
        return kept_out.tanh();
      },
      x, CheckpointOptions(keep).modules({fc.ptr()}));
  {
    torch::NoGradGuard no_grad;
    kept_out.add_(1);
  }
  expect_error([&] { y.sum().backward(); }, "output 0 was modified in place after the call");
  // Outside a checkpoint, and under NoGradGuard, keep simply runs fn.
  EXPECT_TRUE(remat::keep(
                  "k", [](const torch::Tensor& u) { return u * 3; }, x)
                  .equal(x * 3));
}
}  // namespace
