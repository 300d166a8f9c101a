// remat::Offload on the CPU (the CPU as the device; the host pool's blocks outside the meter): every step the
// plain run's gradients bitwise, the bytes that leave the device exact, copies carried out late read only
// once landed, nesting with checkpoint regions, torch::autograd::grad, the pool's bound, in-place writes.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <remat/checkpoint.h>
#include <remat/memory.h>
#include <remat/models.h>
#include <remat/offload.h>
#include <remat/planner/planner.h>
#include <remat/policy.h>
#include <remat/profile.h>
#include <remat/sequential.h>

#include <optional>
#include <thread>

#include "autocast.h"
#include "support.h"

namespace {

using remat::testing::meter_on;

constexpr int64_t kWidth = 256, kBatch = 64, kHidden = kWidth * kBatch * 4;  // a hidden state: 64 KiB

// Four blocks (linear, GELU, dropout), each a module of its own (for checkpointing block by block).
struct Mlp {
  std::vector<torch::nn::Sequential> blocks;
  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> out;
    for (const auto& b : blocks)
      for (const auto& p : b->parameters())
        out.push_back(p);
    return out;
  }
};

Mlp mlp() {
  torch::manual_seed(0);
  Mlp m;
  for (int i = 0; i < 4; ++i) {
    m.blocks.push_back(
        torch::nn::Sequential(torch::nn::Linear(kWidth, kWidth),
                              torch::nn::Functional([](const torch::Tensor& t) { return torch::gelu(t); }),
                              torch::nn::Dropout(0.1)));
  }
  return m;
}

struct Step {
  torch::Tensor loss;
  std::vector<torch::Tensor> grads;
  int64_t held = 0;               // bytes alive after the forward pass, above the step's start
  remat::OffloadStats offloaded;  // the Offload's counts after the forward pass
  torch::Tensor next_draw;
};

// One step; `open` makes the scope the forward pass runs in (none when null); ckpt: each block checkpointed
// (with `options`); use_grad: torch::autograd::grad instead of backward(); finish: the scope's copies waited
// for before its counts are read (and `held`).
Step run(Mlp& model, const torch::Tensor& x,
         const std::function<std::unique_ptr<remat::Offload>()>& open = nullptr, bool ckpt = false,
         bool use_grad = false, const remat::CheckpointOptions& options = {}, bool finish = false) {
  meter_on();
  for (auto& p : model.parameters())
    p.mutable_grad() = torch::zeros_like(p);
  torch::manual_seed(7);
  const int64_t base = remat::memory::active_bytes();
  torch::Tensor out;
  remat::OffloadStats stats;
  {
    std::unique_ptr<remat::Offload> scope = open ? open() : nullptr;
    torch::Tensor h = x;
    for (auto& block : model.blocks) {
      h = ckpt ? remat::checkpoint([&](const torch::Tensor& in) { return block->forward(in); }, h, options)
               : block->forward(h);
    }
    out = h;
    if (scope && finish) scope->finish_copies();
    if (scope) stats = scope->stats();
  }
  Step r;
  r.offloaded = stats;
  r.held = remat::memory::active_bytes() - base;
  r.loss = out.square().mean();
  if (use_grad) {
    r.grads = torch::autograd::grad({r.loss}, model.parameters());
  } else {
    r.loss.backward();
    for (auto& p : model.parameters())
      r.grads.push_back(p.grad().clone());
  }
  r.loss = r.loss.detach();
  r.next_draw = torch::rand({3});
  return r;
}

void expect_same(const Step& a, const Step& b) {
  EXPECT_TRUE(torch::equal(a.loss, b.loss));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << "gradient " << i;
  EXPECT_TRUE(torch::equal(a.next_draw, b.next_draw));
}

torch::Tensor input() {
  return torch::randn({kBatch, kWidth}, torch::TensorOptions().dtype(torch::kFloat));
}

// One step of a residual MLP's blocks: plain, or through run_plan with offloading on `pool` (min_bytes one
// hidden state; `copy_delay` as OffloadOptions'). `held` is the peak above the step's start plus the input
// the chain counts, as profile_test's plans are measured.
Step plan_step(torch::nn::Sequential& seq, const torch::Tensor& x, const torch::Tensor& weight,
               const std::optional<remat::Plan>& plan, const std::shared_ptr<remat::HostPool>& pool,
               int copy_delay = 0) {
  for (auto& p : seq->parameters())
    p.mutable_grad() = torch::zeros_like(p);
  torch::manual_seed(11);
  Step r;
  const int64_t base = remat::memory::active_bytes();
  remat::memory::reset_peak();
  const torch::Tensor out =
      plan ? remat::run_plan(remat::stages_of(seq), *plan, x, {}, nullptr,
                             remat::OffloadOptions().pool(pool).min_bytes(kHidden).copy_delay(copy_delay))
           : seq->forward(x);
  r.loss = (out * weight).sum();
  r.loss.backward();
  r.held = remat::memory::peak_bytes() - base + static_cast<int64_t>(x.nbytes());
  r.loss = r.loss.detach();
  for (auto& p : seq->parameters())
    r.grads.push_back(p.grad().clone());
  r.next_draw = torch::rand({3});
  return r;
}

}  // namespace

TEST(Offload, SavedTensorsLeaveTheDeviceAndEveryStepIsThePlainRun) {
  auto model = mlp();
  const torch::Tensor x = input();
  const Step plain = run(model, x);
  auto pool = std::make_shared<remat::HostPool>();
  const Step got = run(model, x, [&] {
    auto o = std::make_unique<remat::Offload>(
        remat::OffloadOptions().pool(pool).min_bytes(kHidden).keep_on_device(model.parameters()));
    return o;
  });
  expect_same(plain, got);
  // Each linear's input (the batch too: its copy frees nothing, the caller holds it), each GELU's input and
  // each dropout's mask where it is a float tensor (LibTorch 1.13) go to the host; the bool masks of 2.x (16
  // KiB) stay; the copies free on the device exactly what they copied, less the batch.
  const int64_t bytes = got.offloaded.offloaded_bytes;
  EXPECT_TRUE(bytes == 8 * kHidden || bytes == 12 * kHidden) << bytes;
  EXPECT_EQ(pool->peak_bytes(), bytes);
  EXPECT_EQ(got.held, plain.held - (bytes - kHidden));
  EXPECT_EQ(pool->in_use_bytes(), 0);
  // A second step reuses the blocks.
  const int64_t reserved = pool->reserved_bytes();
  expect_same(plain, run(model, x, [&] {
                return std::make_unique<remat::Offload>(
                    remat::OffloadOptions().pool(pool).min_bytes(kHidden).keep_on_device(model.parameters()));
              }));
  EXPECT_EQ(pool->reserved_bytes(), reserved);
}

TEST(Offload, HeldUntilWaitedForEachSourceStaysOnTheDeviceUntilItsCopyIsWaitedFor) {
  // OffloadOptions::hold_until_waited (what the plan executor opens its Offloads with): on the CPU the copies
  // are made at once, and their sources stay on the device until finish_copies(), as on a GPU while the
  // copies are in flight; then the bytes that leave are those of the Offload that lets go at once.
  auto model = mlp();
  const torch::Tensor x = input();
  const Step plain = run(model, x);
  auto pool = std::make_shared<remat::HostPool>();
  auto open = [&](bool hold) {
    return [&, hold] {
      return std::make_unique<remat::Offload>(remat::OffloadOptions()
                                                  .pool(pool)
                                                  .min_bytes(kHidden)
                                                  .keep_on_device(model.parameters())
                                                  .hold_until_waited(hold));
    };
  };
  const Step held = run(model, x, open(true));
  expect_same(plain, held);
  EXPECT_GT(held.offloaded.offloaded_bytes, 0);
  EXPECT_EQ(held.held, plain.held);  // nothing waited for: every source still on the device
  const Step waited = run(model, x, open(true), false, false, {}, /*finish=*/true);
  const Step at_once = run(model, x, open(false));
  expect_same(plain, waited);
  EXPECT_EQ(waited.offloaded.offloaded_bytes, at_once.offloaded.offloaded_bytes);
  EXPECT_EQ(waited.held, at_once.held);
  EXPECT_LT(waited.held, plain.held);
  EXPECT_EQ(pool->in_use_bytes(), 0);
}

TEST(Offload, LateCopiesAreReadOnlyOnceLandedAndPrefetchStartsThem) {
  // The copies are carried out only when waited for or `delay` copies later, and hold their sources weakly:
  // reading early gives wrong gradients, releasing a source first raises.
  auto model = mlp();
  const torch::Tensor x = input();
  const Step plain = run(model, x);
  for (int delay : {1, 3, 100}) {
    std::shared_ptr<remat::HostPool> pool = std::make_shared<remat::HostPool>();
    std::unique_ptr<remat::Offload> keep;
    const Step got = run(model, x, [&] {
      auto o = std::make_unique<remat::Offload>(
          remat::OffloadOptions().pool(pool).min_bytes(4096).copy_delay(delay).keep_on_device(
              model.parameters()));
      return o;
    });
    expect_same(plain, got);
  }
  // prefetch() before the backward pass: every tensor's copy back started ahead, then read.
  auto pool = std::make_shared<remat::HostPool>();
  torch::manual_seed(7);
  for (auto p : model.parameters())
    p.mutable_grad() = torch::zeros_like(p);
  remat::Offload o(
      remat::OffloadOptions().pool(pool).min_bytes(4096).copy_delay(2).keep_on_device(model.parameters()));
  torch::Tensor h = x;
  for (auto& block : model.blocks)
    h = block->forward(h);
  torch::Tensor loss = h.square().mean();
  o.close();
  o.finish_copies();
  o.prefetch();
  loss.backward();
  const remat::OffloadStats s = o.stats();
  EXPECT_GT(s.offloaded, 0);
  // The batch (the first linear's input) and the output (square's) are still alive on the device when the
  // backward pass needs them: handed out as they are, not copied back beside themselves.
  EXPECT_EQ(s.found_on_device, 2);
  EXPECT_EQ(s.brought_back + s.found_on_device, s.offloaded);
  EXPECT_EQ(s.prefetched, s.brought_back);
  EXPECT_TRUE(torch::equal(loss.detach(), plain.loss));
  for (size_t i = 0; i < plain.grads.size(); ++i)
    EXPECT_TRUE(torch::equal(model.parameters()[i].grad(), plain.grads[i])) << i;
}

TEST(Offload, NestsWithCheckpointRegionsAndServesAutogradGrad) {
  auto model = mlp();
  const torch::Tensor x = input();
  // Around checkpoint regions: the regions keep their inputs, which go to the host.
  const Step plain_ckpt = run(model, x, nullptr, /*ckpt=*/true);
  auto pool = std::make_shared<remat::HostPool>();
  const Step got = run(
      model, x,
      [&] {
        return std::make_unique<remat::Offload>(
            remat::OffloadOptions().pool(pool).min_bytes(kHidden).keep_on_device(model.parameters()));
      },
      /*ckpt=*/true);
  expect_same(plain_ckpt, got);
  EXPECT_EQ(got.offloaded.offloaded, 4);  // the regions' inputs, the batch included
  EXPECT_EQ(got.held, plain_ckpt.held - 3 * kHidden);
  // An Offload inside a region (its forward and its recompute).
  {
    for (auto p : model.parameters())
      p.mutable_grad() = torch::zeros_like(p);
    torch::manual_seed(7);
    torch::Tensor h = x;
    for (auto& block : model.blocks) {
      h = remat::checkpoint(
          [&](const torch::Tensor& in) {
            remat::Offload inner(
                remat::OffloadOptions().min_bytes(kHidden).keep_on_device(model.parameters()));
            return block->forward(in);
          },
          h);
    }
    torch::Tensor loss = h.square().mean();
    loss.backward();
    EXPECT_TRUE(torch::equal(loss.detach(), plain_ckpt.loss));
    for (size_t i = 0; i < plain_ckpt.grads.size(); ++i)
      EXPECT_TRUE(torch::equal(model.parameters()[i].grad(), plain_ckpt.grads[i])) << i;
  }
  // torch::autograd::grad, offloaded.
  const Step plain = run(model, x, nullptr, false, /*use_grad=*/true);
  expect_same(
      plain, run(
                 model, x,
                 [&] { return std::make_unique<remat::Offload>(remat::OffloadOptions().min_bytes(kHidden)); },
                 false, true));
}

TEST(Offload, UnderCpuAutocastEveryStepIsThePlainRun) {
  // bf16 autocast: the saved tensors are the low-precision ones (and the weights' casts, which the cast cache
  // holds for the region: offloaded like any saved tensor); the gradients are the plain autocast run's.
  auto model = mlp();
  const torch::Tensor x = input();
  auto under = [&](const std::function<std::unique_ptr<remat::Offload>()>& open) {
    std::optional<remat::testing::CpuAutocast> autocast;
    autocast.emplace();
    for (auto p : model.parameters())
      p.mutable_grad() = torch::zeros_like(p);
    torch::manual_seed(7);
    torch::Tensor h = x;
    {
      std::unique_ptr<remat::Offload> scope = open ? open() : nullptr;
      for (auto& block : model.blocks)
        h = block->forward(h);
    }
    torch::Tensor loss = h.to(torch::kFloat).square().mean();
    autocast.reset();
    loss.backward();
    std::vector<torch::Tensor> g{loss.detach()};
    for (const auto& p : model.parameters())
      g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = under(nullptr);
  const auto got = under([&] {
    auto o = std::make_unique<remat::Offload>(
        remat::OffloadOptions().min_bytes(kHidden / 2).keep_on_device(model.parameters()));
    return o;
  });
  ASSERT_EQ(plain.size(), got.size());
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(torch::equal(plain[i], got[i])) << i;
}

TEST(Offload, ThePoolsBoundKeepsTheRestOnTheDevice) {
  auto model = mlp();
  const torch::Tensor x = input();
  const Step plain = run(model, x);
  auto pool = std::make_shared<remat::HostPool>(3 * kHidden);
  const Step got = run(model, x, [&] {
    return std::make_unique<remat::Offload>(
        remat::OffloadOptions().pool(pool).min_bytes(kHidden).keep_on_device(model.parameters()));
  });
  expect_same(plain, got);
  EXPECT_GT(got.offloaded.kept_on_device, 0);
  EXPECT_EQ(pool->reserved_bytes(), 3 * kHidden);
  EXPECT_EQ(pool->in_use_bytes(), 0);
}

TEST(Offload, AnInPlaceWriteDuringACopyIsAnErrorNotAWrongGradient) {
  const torch::Tensor x = torch::randn({64, 256}, torch::requires_grad());
  const torch::Tensor w = torch::randn({256, 256}, torch::requires_grad());
  auto step = [&](int delay, bool hold) {
    x.mutable_grad() = torch::Tensor();
    torch::Tensor h = x.matmul(w);
    torch::Tensor y;
    {
      remat::Offload o(remat::OffloadOptions().min_bytes(0).copy_delay(delay).hold_until_waited(hold));
      y = h.sin();
    }
    h.mul_(2);  // what sin saved
    y.sum().backward();
  };
  const torch::Tensor want = torch::cos(x.detach().matmul(w.detach())).matmul(w.detach().t());
  step(0, false);  // copied at once: the values saved
  EXPECT_TRUE(torch::allclose(x.grad(), want));
  step(0, true);  // copied at once, its source held until waited for (the executor's): the values saved too
  EXPECT_TRUE(torch::allclose(x.grad(), want));
  EXPECT_THROW_WITH(step(100, false), "remat::Offload", "modified by an in-place operation while its copy");
}

TEST(Offload, ATensorStillOnTheDeviceComesBackAsItselfUnlessWrittenSince) {
  // Another holder (the stage before, whose output it is; here the caller) keeps it on the device: a copy
  // back would be a second one there. Written in place after prefetch() found it, the saved values come from
  // the host.
  meter_on();
  const torch::Tensor x = input();
  const torch::Tensor w = torch::randn({kBatch, kWidth}, torch::requires_grad());
  auto step = [&](bool write) {
    torch::Tensor h = x.clone();
    remat::Offload o(remat::OffloadOptions().min_bytes(1024));
    const torch::Tensor y = h * w;  // saves h (offloaded) and w (a leaf that requires grad: stays)
    o.close();
    o.prefetch();
    if (write) h.add_(1);
    w.mutable_grad() = torch::Tensor();
    y.sum().backward();
    EXPECT_TRUE(torch::equal(w.grad(), x)) << write;
    return o.stats();
  };
  const remat::OffloadStats alive = step(false);
  EXPECT_EQ(alive.offloaded, 1);
  EXPECT_EQ(alive.found_on_device, 1);
  EXPECT_EQ(alive.brought_back, 0);
  const remat::OffloadStats written = step(true);
  EXPECT_EQ(written.found_on_device, 0);
  EXPECT_EQ(written.brought_back, 1);
}

// v @ w, saving both, with the alignment modulo 64 bytes of v's address in the forward and in the backward.
using MatmulSeeingAlignment = remat::testing::MatmulSeeingAlignment<64>;

TEST(Offload, ADenseViewAtAnOffsetComesBackAsItselfFoundOrBroughtBack) {
  // A saved tensor that starts inside its storage (a slice one element in: 4 bytes, no multiple of 64), found
  // on the device where its storage is still alive, or brought back from the host where it is not: its
  // values, and a copy back starts at its address's alignment (modulo 64 bytes on the CPU, 256 on CUDA), so
  // that kernels that compute or choose by alignment (MKL's GEMM, cuBLASLt) run on it as on the tensor saved.
  meter_on();
  torch::manual_seed(0);
  const torch::Tensor w = torch::randn({64, 64}, torch::requires_grad());
  const torch::Tensor values = torch::randn({64 * 64 + 1});
  auto step = [&](bool offloaded, bool keep_base, remat::OffloadStats* stats) {
    w.mutable_grad() = torch::Tensor();
    torch::Tensor base = values.clone();
    torch::Tensor loss;
    {
      std::optional<remat::Offload> scope;
      if (offloaded) scope.emplace(remat::OffloadOptions().min_bytes(1024));
      // Saves the view (sent) and w (a leaf that requires grad: stays).
      loss = MatmulSeeingAlignment::apply(base.narrow(0, 1, 64 * 64).view({64, 64}), w).sum();
      if (scope) {
        scope->close();
        if (!keep_base) base = torch::Tensor();  // only the saved view held its storage: gone now
        scope->prefetch();
        *stats = scope->stats();
      }
    }
    loss.backward();
    return w.grad().clone();
  };
  const torch::Tensor plain = step(false, true, nullptr);
  for (bool keep_base : {true, false}) {
    MatmulSeeingAlignment::seen().clear();
    remat::OffloadStats stats;
    const torch::Tensor got = step(true, keep_base, &stats);
    EXPECT_TRUE(torch::equal(plain, got)) << keep_base;
    EXPECT_EQ(stats.offloaded, 1) << keep_base;
    EXPECT_EQ(stats.found_on_device, keep_base ? 1 : 0);
    EXPECT_EQ(stats.brought_back, keep_base ? 0 : 1);
    EXPECT_EQ(MatmulSeeingAlignment::seen(), (std::vector<int64_t>{4, 4})) << keep_base;
    // The copy back's block is the offset's residue larger (the CPU allocator's blocks are 64-byte aligned).
    EXPECT_EQ(stats.alignment_bytes, keep_base ? 0 : 4) << keep_base;
  }
}

TEST(Offload, BytesSavedThroughSeveralViewsGoOnceAndAStorageKeptOnTheDeviceGoesNot) {
  // As in attention blocks: the input saved by two linears, each through a 2-D view of its own (same bytes);
  // h saved contiguous by gelu and as every other column by sin (a view with gaps keeps h on the device; a
  // transposed view, dense, would go).
  // Before: the input went once per view (and came back once per view), and h was copied for nothing.
  meter_on();
  torch::manual_seed(0);
  torch::nn::Linear q(64, 64), k(64, 64), o(64, 64);
  const torch::Tensor x = torch::randn({4, 64, 64});  // 64 KiB
  const int64_t bytes = x.numel() * 4;
  auto step = [&](bool offloaded, remat::OffloadStats* stats) {
    for (auto* m : {&q, &k, &o}) {
      for (auto& p : (*m)->parameters())
        p.mutable_grad() = torch::zeros_like(p);
    }
    const torch::Tensor in = x.clone().requires_grad_();
    torch::Tensor loss;
    {
      std::optional<remat::Offload> scope;
      if (offloaded) scope.emplace(remat::OffloadOptions().min_bytes(bytes));
      const torch::Tensor a = in * 2;  // not a leaf: it may go
      const torch::Tensor h = q(a) * k(a);
      using torch::indexing::Slice;
      const torch::Tensor y =
          o(torch::gelu(h) +
            h.index({Slice(), Slice(), Slice(0, torch::indexing::None, 2)}).sin().repeat({1, 1, 2}));
      if (scope) *stats = scope->stats();
      loss = y.sum();
    }
    loss.backward();
    std::vector<torch::Tensor> grads{in.grad()};
    for (auto* m : {&q, &k, &o}) {
      for (auto& p : (*m)->parameters())
        grads.push_back(p.grad().clone());
    }
    return grads;
  };
  remat::OffloadStats stats;
  const auto plain = step(false, nullptr), got = step(true, &stats);
  ASSERT_EQ(plain.size(), got.size());
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(torch::equal(plain[i], got[i])) << i;
  // a once, q(a) and k(a) (the product saves both), the sum the last linear saves; not h.
  EXPECT_EQ(stats.offloaded, 4);
  EXPECT_EQ(stats.offloaded_bytes, 4 * bytes);
}

TEST(Offload, ATensorSavedWithinBytesSavedWholeBeforeItComesBackOnce) {
  // An in-place ReLU saves its output whole; a Linear then saves the output's two halves of rows (dense views
  // of the same bytes, the second at an offset). They share the whole's entry: sent once, brought back once,
  // and with retain_graph (nothing dropped between the backward passes) the device holds them once, as the
  // plain run does. Before (found 2026-12-04), the halves came back apart beside the whole: 64 KiB more.
  meter_on();
  torch::manual_seed(0);
  torch::nn::Linear lin(64, 64);
  const torch::Tensor x = torch::randn({256, 64}, torch::requires_grad());
  auto step = [&](bool offloaded, remat::OffloadStats* stats, int64_t* peak) {
    lin->zero_grad();
    x.mutable_grad() = torch::Tensor();
    const int64_t base = remat::memory::active_bytes();
    std::optional<remat::Offload> scope;
    if (offloaded) scope.emplace(remat::OffloadOptions().min_bytes(0).keep_on_device(lin->parameters()));
    torch::Tensor loss;
    {
      const torch::Tensor r = (x * 2).relu_();  // saves r (64 KiB)
      const auto halves = r.chunk(2, 0);  // rows 0-127 and 128-255 (32 KiB each, the second at an offset)
      loss = (lin(halves[0]) * lin(halves[1])).sum();
    }
    if (scope) scope->close();
    remat::memory::reset_peak();  // the backward passes' peak: where the copies come back
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    *peak = remat::memory::peak_bytes() - base;
    if (scope) *stats = scope->stats();
    std::vector<torch::Tensor> grads{x.grad().clone()};
    for (const auto& p : lin->parameters())
      grads.push_back(p.grad().clone());
    return grads;
  };
  int64_t plain_peak = 0, peak = 0;
  remat::OffloadStats stats;
  const auto want = step(false, nullptr, &plain_peak);
  const auto got = step(true, &stats, &peak);
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(torch::equal(want[i], got[i])) << i;
  // r, and the product's factors (the outputs of lin, 32 KiB each); not the halves. Each back once.
  EXPECT_EQ(stats.offloaded, 3);
  EXPECT_EQ(stats.offloaded_bytes, 128 << 10);
  EXPECT_EQ(stats.brought_back, 3);
  EXPECT_LE(peak, plain_peak);
}

// The start of the error plain autograd raises for a saved tensor written in place since it was saved.
constexpr const char* kModified =
    "one of the variables needed for gradient computation has been modified by an inplace operation";

TEST(Offload, AnInPlaceWriteToASavedTensorLeftOnTheDeviceIsAutogradsError) {
  // Behind saved-tensor hooks autograd checks no version: each way a saved tensor stays on the device (below
  // min_bytes, over the pool's bound, a view with gaps, a storage another saved tensor keeps there) gave the
  // gradient of the values written, where plain LibTorch raises.
  const torch::Tensor x = torch::randn({64, 256}, torch::requires_grad());
  auto written = [&] {  // sigmoid saves its output, written after
    torch::Tensor y = torch::sigmoid(x);
    y.mul_(2);
    return y.sum();
  };
  using torch::indexing::Slice;
  auto written_kept_by_a_view = [&] {  // h saved whole by gelu and through a view with gaps by sin
    torch::Tensor h = x * 2;
    torch::Tensor loss =
        torch::gelu(h).sum() + h.index({Slice(), Slice(0, torch::indexing::None, 2)}).sin().sum();
    h.mul_(2);
    return loss;
  };
  auto bounded = std::make_shared<remat::HostPool>(0, false);
  const std::vector<std::pair<std::function<torch::Tensor()>, remat::OffloadOptions>> cases{
      {written, remat::OffloadOptions().min_bytes(int64_t{1} << 30)},
      {written, remat::OffloadOptions().min_bytes(0).pool(bounded)},
      {written_kept_by_a_view, remat::OffloadOptions().min_bytes(1024)},
  };
  for (const auto& [f, options] : cases) {
    EXPECT_THROW_WITH(f().backward(), kModified, "is at version 1; expected version 0");
    torch::Tensor loss;
    {
      remat::Offload o(options);
      loss = f();
    }
    EXPECT_THROW_WITH(loss.backward(), kModified, "[CPUFloatType [", "is at version 1; expected version 0",
                      "remat::Offload");
  }
  // The storage kept there, found alive by prefetch() and written after it.
  {
    torch::Tensor h = x * 2, loss;
    {
      remat::Offload o(remat::OffloadOptions().min_bytes(1024));
      loss = torch::gelu(h).sum() + h.index({Slice(), Slice(0, torch::indexing::None, 2)}).sin().sum();
      o.close();
      o.prefetch();
    }
    h.mul_(2);
    EXPECT_THROW_WITH(loss.backward(), kModified, "remat::Offload");
  }
  // The tensor named as autograd names it.
  torch::Tensor loss;
  {
    remat::Offload o(remat::OffloadOptions().min_bytes(int64_t{1} << 30));
    loss = written();
  }
  EXPECT_THROW_WITH(loss.backward(), "[CPUFloatType [64, 256]], which is output 0 of Sigmoid");
}

TEST(Offload, ADenseViewThatIsNotContiguousGoesAndComesBackAsTheSameView) {
  // exp saves its output, here a transposed (dense, not contiguous) tensor: its storage's bytes go to the
  // host and come back as the same view (it stayed on the device before 2026-11-28, as the Python package's
  // did).
  const torch::Tensor t = torch::randn({256, 64}, torch::requires_grad());
  torch::Tensor y;
  remat::OffloadStats stats;
  {
    remat::Offload o(remat::OffloadOptions().min_bytes(0));
    y = (t.t() * 2).exp();
    ASSERT_FALSE(y.is_contiguous());
    stats = o.stats();
  }
  y.sum().backward();
  EXPECT_EQ(stats.offloaded, 1);
  EXPECT_TRUE(torch::equal(t.grad(), (t.t() * 2).exp().t() * 2));
}

TEST(Offload, AStorageKeptOnTheDeviceByAViewFreedFirstStaysForItsOtherSave) {
  // h saved whole by gelu (offloaded) and again through a view with gaps by sin, which keeps h on the device
  // (its host copy is dropped). sin's backward runs first and frees its view; gelu's must still find h there.
  // Before: "a saved tensor's bytes are neither on the host nor on the device".
  meter_on();
  const torch::Tensor x = torch::randn({4, 64, 64}, torch::requires_grad());
  auto step = [&](bool offloaded) {
    x.mutable_grad() = torch::Tensor();
    const int64_t base = remat::memory::active_bytes();
    torch::Tensor loss;
    {
      std::optional<remat::Offload> o;
      if (offloaded) o.emplace(remat::OffloadOptions().min_bytes(1024));
      const torch::Tensor h = x * 2;
      const torch::Tensor g = torch::gelu(h);
      const torch::Tensor s = h.index({torch::indexing::Slice(), torch::indexing::Slice(),
                                       torch::indexing::Slice(0, torch::indexing::None, 2)})
                                  .sin();
      loss = g.sum() + s.sum();
      if (o) EXPECT_EQ(o->stats().offloaded, 0);  // h was not offloaded after all
    }
    loss.backward();
    loss = torch::Tensor();
    // Nothing held after the step but the input's gradient.
    EXPECT_EQ(remat::memory::active_bytes() - base, static_cast<int64_t>(x.grad().nbytes())) << offloaded;
    return x.grad().clone();
  };
  const torch::Tensor plain = step(false);
  EXPECT_TRUE(torch::equal(step(true), plain));
}

TEST(Offload, BytesAutogradSavedOutsideEveryOffloadAreFoundOnTheDeviceNotBroughtBack) {
  // An in-place ReLU before the scope saves its output (ReluBackward holds those bytes); the linear layer
  // inside saves the same tensor as its input. Its bytes never leave the device: the backward pass finds them
  // there (the storage's weak reference and the saved tensor's version counter) instead of a second copy
  // beside them. Written in place after the save, the plain run's error. (The Python package's long property
  // run found it there; this holds the C++ library to it.)
  meter_on();
  torch::manual_seed(0);
  torch::nn::Linear lin(256, 256);
  const torch::Tensor x = torch::randn({64, 256}, torch::requires_grad());
  auto step = [&](bool offloaded, bool write, remat::OffloadStats* stats) -> std::string {
    x.mutable_grad() = torch::Tensor();
    lin->zero_grad();
    torch::Tensor y;
    {
      torch::Tensor h = (x * 2).relu_();
      std::optional<remat::Offload> o;
      if (offloaded) o.emplace(remat::OffloadOptions().min_bytes(0));
      y = lin(h);
      if (o) o->close();
      if (write) h.mul_(2);
      try {
        y.square().mean().backward();
      } catch (const c10::Error& e) {
        return e.what();
      }
      if (o && stats) *stats = o->stats();
    }
    return "";
  };
  EXPECT_EQ(step(false, false, nullptr), "");
  const torch::Tensor plain = x.grad().clone();
  remat::OffloadStats stats;
  EXPECT_EQ(step(true, false, &stats), "");
  EXPECT_TRUE(torch::equal(x.grad(), plain));
  EXPECT_GE(stats.offloaded, 1);
  EXPECT_GE(stats.found_on_device, 1);
  EXPECT_EQ(stats.brought_back + stats.found_on_device, stats.offloaded);
  EXPECT_EQ(stats.brought_back, 0);
  EXPECT_NE(step(false, true, nullptr).find("modified by an inplace operation"), std::string::npos);
  EXPECT_NE(step(true, true, nullptr).find("modified by an inplace operation"), std::string::npos);
}

TEST(Offload, ScopesEndInAnyOrder) {
  // A training loop that replaces its Offload each step opens the new one before the old one ends: that
  // aborted the process (an internal assert in a destructor). Each step's saves go to its own Offload, and
  // every step is the plain run.
  Mlp model = mlp();
  const torch::Tensor x = input();
  const Step plain = run(model, x);
  auto pool = std::make_shared<remat::HostPool>();
  auto no_hooks = [] {
    return torch::autograd::Engine::get_default_engine().get_default_saved_variable_hooks() == nullptr;
  };
  {
    std::unique_ptr<remat::Offload> off;
    for (int step = 0; step < 3; ++step) {
      off = std::make_unique<remat::Offload>(remat::OffloadOptions().min_bytes(1024).pool(pool));
      const Step got = run(model, x);
      expect_same(plain, got);
      EXPECT_GT(off->stats().offloaded, 0) << step;
    }
  }
  EXPECT_TRUE(no_hooks());
  // Two scopes ended first-opened first: the other takes what is saved until it ends too.
  auto a = std::make_unique<remat::Offload>(remat::OffloadOptions().min_bytes(0));
  auto b = std::make_unique<remat::Offload>(remat::OffloadOptions().min_bytes(0));
  a.reset();
  const torch::Tensor xg = x.detach().requires_grad_();
  torch::Tensor y = (xg * 2).sin();  // saves xg * 2
  EXPECT_EQ(b->stats().offloaded, 1);
  b.reset();
  EXPECT_TRUE(no_hooks());
  y.sum().backward();
  EXPECT_TRUE(torch::allclose(xg.grad(), 2 * (xg.detach() * 2).cos()));
  // Ended on another thread than its own: closed, its thread's hooks off; and, between two scopes of this
  // thread, it leaves nothing they reach when they end in any order.
  auto c = std::make_unique<remat::Offload>(remat::OffloadOptions().min_bytes(0));
  std::thread([&] { c.reset(); }).join();
  EXPECT_TRUE(no_hooks());
  auto outer = std::make_unique<remat::Offload>(remat::OffloadOptions().min_bytes(0));
  c = std::make_unique<remat::Offload>(remat::OffloadOptions().min_bytes(0));
  std::thread([&] { c.reset(); }).join();
  auto inner = std::make_unique<remat::Offload>(remat::OffloadOptions().min_bytes(0));
  outer.reset();
  y = (xg * 2).sin();
  EXPECT_EQ(inner->stats().offloaded, 1);
  inner.reset();
  EXPECT_TRUE(no_hooks());
}

TEST(Offload, RefusesBadOptions) {
  EXPECT_THROW_WITH(remat::Offload(remat::OffloadOptions().min_bytes(-1)), "remat::Offload", "min_bytes",
                    "-1");
  EXPECT_THROW_WITH(remat::Offload(remat::OffloadOptions().copy_delay(-3)), "remat::Offload", "copy_delay",
                    "-3");
  EXPECT_THROW_WITH(remat::HostPool(-2), "remat::HostPool", "max_bytes", "-2");
  remat::HostPool pool(1024, false);
  EXPECT_THROW_WITH(pool.reserve(4096, 1024), "remat::HostPool::reserve", "max_bytes");
}

TEST(Offload, ThePlanExecutorRunsEveryOffloadedWayWithinThePrediction) {
  // run_plan offloads what a kept stage saves (Fa@host), what a checkpoint keeps (Fk[matmuls]@host: the kept
  // products, sent to the enclosing Offload once the stage's forward is done) and a checkpointed stage's
  // input (Fc@host): every step the plain step's gradients bitwise (dropout included), the measured peak
  // within the executor's tolerance of simulate()'s (docs/planning.md: at most 10% above, never below), the
  // host pool's peak the simulated host bytes. The chain comes from the profiler, which measures each way's
  // cost.
  meter_on();
  torch::manual_seed(0);
  remat::models::ResidualMlp mlp(remat::models::ResidualMlpOptions().depth(5).width(kWidth).dropout(0.1));
  auto& seq = mlp->blocks();
  const torch::Tensor x = input(), weight = torch::randn({kBatch, kWidth});
  const remat::Chain chain =
      remat::profile_chain(seq, x,
                           remat::ProfileOptions().warmup(0).repeats(1).offload_min_bytes(kHidden).policies(
                               {remat::policy::matmuls()}));
  ASSERT_TRUE(chain.can_offload());
  EXPECT_TRUE(chain.holds_outputs);
  EXPECT_TRUE(chain.copies_at_once);  // the CPU's copies are made at once: the planner hides none of them
  for (const auto& s : chain.stages) {
    ASSERT_TRUE(s.offload && s.checkpoint_offload && s.policies.at(0).offload) << s.name;
    // Fc: its input. Fk[matmuls]: fc1's and fc2's products (4 and 1 hidden states; fc2's is then the
    // residual sum's operand, not the output). Fa: those and GELU's input, beyond the output.
    EXPECT_TRUE(s.checkpoint_offload->input);
    EXPECT_EQ(s.policies[0].offload->bytes, 5 * kHidden) << s.name;
    EXPECT_FALSE(s.policies[0].offload->input || s.policies[0].offload->output);
    EXPECT_GE(s.offload->bytes, 8 * kHidden) << s.name;
  }
  auto step = [&](const std::optional<remat::Plan>& plan, const std::shared_ptr<remat::HostPool>& pool) {
    return plan_step(seq, x, weight, plan, pool);
  };
  const Step plain = step(std::nullopt, nullptr);
  for (const char* text : {"Fa0@host Fk1[matmuls]@host Fc2@host Fk3[matmuls] Fa4 L B4 B3 Fa2 B2 B1 B0",
                           "Fc0@host Fc1@host Fk2[matmuls]@host Fc3@host Fa4 L B4 Fa3 B3 B2 Fa1 B1 Fa0 B0"}) {
    const remat::Plan plan = remat::testing::plan_of_text(5, text);
    const remat::Simulation sim = remat::simulate(chain, plan);
    auto pool = std::make_shared<remat::HostPool>();
    const Step got = step(plan, pool);
    expect_same(plain, got);
    EXPECT_GE(static_cast<double>(got.held), 0.99 * static_cast<double>(sim.peak_bytes)) << text;
    EXPECT_LE(static_cast<double>(got.held), 1.10 * static_cast<double>(sim.peak_bytes)) << text;
    EXPECT_EQ(pool->peak_bytes(), sim.host_peak_bytes) << text;  // hidden states: no rounding
    EXPECT_EQ(pool->in_use_bytes(), 0);
    // What offloading saves at the peak is what simulate() says it saves, within a quarter of a hidden state
    // (RNG states; a stage's input held on the device as well as on the host would be a whole one: in the
    // second plan, Fc3's input is Fk2's output, which the executor holds; it comes back as it is).
    remat::Plan on_device = plan;
    for (auto& op : on_device.ops)
      op.offload = false;
    const Step kept = step(on_device, pool);
    expect_same(plain, kept);
    EXPECT_NEAR(static_cast<double>(kept.held - got.held),
                static_cast<double>(remat::simulate(chain, on_device).peak_bytes - sim.peak_bytes),
                kHidden / 4)
        << text;
  }
}

// Three outcomes per operator call (remat::CheckpointPolicy): each block checkpointed, its linear's output
// answered `linear`, its GELU's kept on the device (kMustSave), its dropout recomputed.
TEST(Offload, EachCallKeptSentToTheHostOrRecomputedGivesThePlainGradients) {
  auto model = mlp();
  const torch::Tensor x = input();
  const Step plain = run(model, x);
  auto policy_with = [](remat::CheckpointPolicy linear) {
    return remat::Policy("three", [linear](const remat::OpCall& c) {
      if (c.name == "aten::linear" || c.name == "aten::addmm")
        return linear;  // addmm where linear is not seen
      if (c.name == "aten::gelu") return remat::CheckpointPolicy::kMustSave;
      return remat::CheckpointPolicy::kPreferRecompute;
    });
  };
  auto step = [&](remat::CheckpointPolicy linear, bool offloading, int copy_delay = 0) {
    std::function<std::unique_ptr<remat::Offload>()> open;
    if (offloading) {
      open = [&] {
        return std::make_unique<remat::Offload>(remat::OffloadOptions()
                                                    .min_bytes(kHidden)
                                                    .copy_delay(copy_delay)
                                                    .keep_on_device(model.parameters()));
      };
    }
    return run(model, x, open, /*ckpt=*/true, false, remat::CheckpointOptions().policy(policy_with(linear)),
               /*finish=*/true);
  };
  using P = remat::CheckpointPolicy;
  const Step kept = step(P::kMustSave, false);
  expect_same(plain, kept);
  // Sent to the host through a copy engine that delays each copy until waited for (read early, or released
  // before its copy: a wrong gradient, or an error): the plain run's step; the four linears' outputs and the
  // blocks' inputs (the checkpoints save them through the Offload's hooks) leave, the GELUs' outputs stay.
  for (int delay : {0, 2}) {
    const Step host = step(P::kMustCpuOffload, true, delay);
    expect_same(plain, host);
    EXPECT_EQ(host.offloaded.offloaded, 8) << delay;
    EXPECT_EQ(host.offloaded.offloaded_bytes, 8 * kHidden) << delay;
    EXPECT_EQ(host.held, kept.held - 4 * kHidden - 3 * kHidden) << delay;  // the batch is the caller's
  }
  // Inside an Offload, kPreferSave (a bool policy's true) goes with it; kMustSave stays.
  EXPECT_EQ(step(P::kPreferSave, true).offloaded.offloaded, 8);
  const Step stays = step(P::kMustSave, true);
  expect_same(plain, stays);
  EXPECT_EQ(stays.offloaded.offloaded, 4);
  EXPECT_EQ(stays.held, kept.held - 3 * kHidden);
  // A host answer with no Offload open is refused by name; the gradients stay as they were.
  for (auto& p : model.parameters())
    p.mutable_grad() = torch::zeros_like(p);
  EXPECT_THROW_WITH(remat::checkpoint([&](const torch::Tensor& in) { return model.blocks[0]->forward(in); },
                                      x, remat::CheckpointOptions().policy(policy_with(P::kMustCpuOffload))),
                    "policy 'three' answered MUST_CPU_OFFLOAD for aten::", ", and no remat::Offload is open");
  for (auto& p : model.parameters())
    EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0);
}

// Group assignments (Fk{khr}) in C++: the profiler finds each block's saved groups (fc1's product and GELU's
// output, which autograd saves; fc2's product, which it does not (dropout saves only its mask), and dropout's
// output with its mask: the recompute skips each kept or sent; named as the policy sees them), and
// run_plan carries out any assignment of them: every step the plain step's gradients bitwise (dropout
// recomputed), through a copy engine that delays each copy until waited for too; the measured peak within
// the executor's tolerance of simulate()'s; the host pool's peak the simulated host bytes.
// A call made after autograd's last save in a stage's forward is no group: a recompute that stops early at
// that save never makes it again, so keeping it would save no time and hold its outputs through the backward.
// In fc2(relu(fc1(x))) + x, fc2 saves its input before its product is made: fc1's product (which ReLU does
// not save: all of it unsaved) and ReLU's output are the groups, fc2's product is not.
TEST(Offload, ACallAfterTheLastSaveIsNoGroup) {
  meter_on();
  torch::manual_seed(0);
  torch::nn::Linear fc1(kWidth, 4 * kWidth), fc2(4 * kWidth, kWidth);
  auto module = std::make_shared<torch::nn::Module>();
  module->register_module("fc1", fc1);
  module->register_module("fc2", fc2);
  const auto l1 = fc1.ptr(), l2 = fc2.ptr();
  const remat::StageFn stage{
      "block", [=](const torch::Tensor& x) { return l2->forward(torch::relu(l1->forward(x))) + x; }, module};
  const remat::Chain chain = remat::profile_chain(
      {stage}, input(), remat::ProfileOptions().warmup(0).repeats(1).offload_min_bytes(kHidden).groups(true));
  const auto& groups = chain.stages[0].groups;
  std::vector<std::string> names;
  for (const auto& g : groups)
    names.push_back(g.name);
  EXPECT_EQ(names, (std::vector<std::string>{"aten::addmm#0", "aten::relu#0"}));
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].unsaved_bytes, groups[0].bytes);
  EXPECT_EQ(groups[1].unsaved_bytes, 0);
}

// A block whose layer norm makes outputs below offload_min_bytes (its mean and reciprocal deviation).
struct NormBlockImpl : torch::nn::Module {
  NormBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kWidth, kWidth))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        fc2(register_module("fc2", torch::nn::Linear(kWidth, kWidth))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(norm(fc1(x))) + x; }
  torch::nn::Linear fc1;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc2;
};
TORCH_MODULE(NormBlock);

// Profiled for offloading, a call with an output below offload_min_bytes is a group all the same, those bytes
// its stays_bytes (an Offload keeps them on the device when the group is sent): layer norm's mean and
// reciprocal deviation beside its output. Before 2026-12-05 such a call was no group. A plan sending it runs
// bitwise the plain step, with the host bytes simulate() predicts (the mean and deviation not among them).
TEST(Offload, ACallWithOutputsTooSmallToSendIsAGroupWhoseSmallOutputsStay) {
  meter_on();
  torch::manual_seed(0);
  torch::nn::Sequential seq{NormBlock(), NormBlock()};
  const torch::Tensor x = input(), weight = torch::randn({kBatch, kWidth});
  const remat::Chain chain = remat::profile_chain(
      seq, x, remat::ProfileOptions().warmup(0).repeats(1).offload_min_bytes(kHidden).groups(true));
  std::vector<std::vector<std::string>> names;
  std::string sends;  // the layer norm sent, the rest recomputed (both stages' groups are alike)
  for (const auto& s : chain.stages) {
    const auto& groups = s.groups;
    const auto norm_group = std::find_if(groups.begin(), groups.end(), [](const remat::SavedGroup& g) {
      return g.name.find("layer_norm") != std::string::npos;
    });
    ASSERT_NE(norm_group, groups.end()) << s.name;
    const int64_t stats = 2 * kBatch * 4;  // mean and reciprocal deviation: a float per row each
    EXPECT_EQ(norm_group->bytes, kHidden + stats);
    EXPECT_EQ(norm_group->stays_bytes, stats);
    names.emplace_back();
    sends.assign(groups.size(), 'r');
    for (const auto& g : groups) {
      names.back().push_back(g.name);
      if (&g != &*norm_group) EXPECT_EQ(g.stays_bytes, 0) << g.name;
    }
    sends[static_cast<size_t>(norm_group - groups.begin())] = 'h';
    EXPECT_EQ(names.back(), names.front());
    const remat::PolicyCost cost = remat::group_cost(s, sends);
    ASSERT_TRUE(cost.offload.has_value());
    EXPECT_EQ(cost.offload->bytes, kHidden);
  }
  const Step plain = plan_step(seq, x, weight, std::nullopt, nullptr);
  remat::Plan plan = remat::testing::plan_of_text(2, "Fk0{" + sends + "} Fa1 L B1 B0");
  plan.group_names = names;
  const remat::Simulation sim = remat::simulate(chain, plan);
  EXPECT_EQ(sim.host_peak_bytes, kHidden);
  // The step here holds what the chain does not count beside the stages (the loss's product with `weight`):
  // the same above simulate() for every plan, which the plan keeping everything measures.
  const remat::Plan kept = remat::testing::plan_of_text(2, "Fa0 Fa1 L B1 B0");
  const int64_t beside =
      plan_step(seq, x, weight, kept, nullptr).held - remat::simulate(chain, kept).peak_bytes;
  for (int delay : {0, 2}) {
    auto pool = std::make_shared<remat::HostPool>();
    const Step got = plan_step(seq, x, weight, plan, pool, delay);
    expect_same(plain, got);
    EXPECT_EQ(got.held - beside, sim.peak_bytes);
    EXPECT_EQ(pool->peak_bytes(), sim.host_peak_bytes);
    EXPECT_EQ(pool->in_use_bytes(), 0);
  }
}

// A block whose forward peaks early, at a transient that nothing saves (a product that wide,
// only summed: 48 hidden states), before the calls whose outputs it saves.
struct EarlyPeakBlockImpl : torch::nn::Module {
  EarlyPeakBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kWidth, 4 * kWidth))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kWidth, kWidth))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor wide = x.repeat({1, 48}).sum(-1, /*keepdim=*/true);
    return fc2(torch::gelu(fc1(x + wide))) + x;
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(EarlyPeakBlock);

// One EarlyPeakBlock (seeded), its input, the loss's weight, and its chain profiled with groups on the meter.
struct EarlyPeak {
  torch::nn::Sequential seq;
  torch::Tensor x, weight;
  remat::Chain chain;
};
EarlyPeak early_peak() {
  meter_on();
  torch::manual_seed(0);
  EarlyPeak p{torch::nn::Sequential{EarlyPeakBlock()}, {}, {}, {}};
  p.x = input();
  p.weight = torch::randn({kBatch, kWidth});
  p.chain = remat::profile_chain(
      p.seq, p.x, remat::ProfileOptions().warmup(0).repeats(1).offload_min_bytes(kHidden).groups(true));
  return p;
}

// The C++ profiler measures the plain forward's peak before each group's call (SavedGroup::
// fwd_peak_before_bytes; as the Python profiler does, both since 2026-12-05). A group assignment that
// recomputes the wide product and keeps the later groups holds, part way through its recompute, that product
// beside them: above both of the recompute's ends, which were all the model charged before (the step held 10
// hidden states above its prediction then). Now the step holds its prediction to the byte; with the figures
// left out (-1, as before) the prediction falls below what the step holds.
TEST(Offload, AGroupAssignmentsRecomputeIsChargedTheForwardsPeakBeforeTheGroupsItHasNotReached) {
  auto [seq, x, weight, chain] = early_peak();
  const auto& groups = chain.stages[0].groups;
  std::vector<std::string> names;
  std::string assignment;  // the wide product and its sum recomputed, the rest kept
  for (const auto& g : groups) {
    names.push_back(g.name);
    assignment += g.name.rfind("aten::repeat", 0) == 0 || g.name.rfind("aten::sum", 0) == 0 ? 'r' : 'k';
    EXPECT_GE(g.fwd_peak_before_bytes, 0) << g.name;
  }
  ASSERT_GE(groups.size(), 4u);
  EXPECT_EQ(names[0], "aten::repeat#0");
  EXPECT_EQ(groups[0].fwd_peak_before_bytes, 0);  // nothing made before it
  EXPECT_EQ(names[1], "aten::sum#0");
  // The wide product (and on PyTorch 2.15 64 bytes more: something small alive beside it at its peak).
  EXPECT_GE(groups[1].fwd_peak_before_bytes, 48 * kHidden);
  EXPECT_LE(groups[1].fwd_peak_before_bytes, 48 * kHidden + 256);
  // The step's peak is in the block's recompute, with the loss and its gradient alive beside the chain (two
  // floats, in plan_step's backward): for every group recomputed, as for the assignment.
  const int64_t beside = 2 * static_cast<int64_t>(sizeof(float));
  const Step plain = plan_step(seq, x, weight, std::nullopt, nullptr);
  for (const std::string& text : {std::string(groups.size(), 'r'), assignment}) {
    remat::Plan plan = remat::testing::plan_of_text(1, "Fk0{" + text + "} L B0");
    plan.group_names = {names};
    const remat::Simulation sim = remat::simulate(chain, plan);
    const Step got = plan_step(seq, x, weight, plan, nullptr);
    expect_same(plain, got);
    EXPECT_EQ(got.held - beside, sim.peak_bytes) << text;
    EXPECT_EQ(sim.op_peak_bytes[2], sim.peak_bytes) << text;
    if (text == assignment) {
      EXPECT_GT(sim.op_recompute_peak_bytes[2], sim.op_recompute_end_bytes[2]);  // it peaks part way
      remat::Chain unmeasured = chain;
      for (auto& g : unmeasured.stages[0].groups)
        g.fwd_peak_before_bytes = -1;
      EXPECT_EQ(got.held - beside - remat::simulate(unmeasured, plan).peak_bytes, 10 * kHidden);
    }
  }
}

// The C++ profiler measures, per group, the forward without saving's peak after it lets go of the group's
// outputs (SavedGroup::fwd_peak_after_bytes; as the Python profiler does, both since 2026-12-06). The wide
// product (48 hidden states) is alive at the block's forward's peak; kept, the forward holds it past that,
// beside what comes after, not beside the peak again: the step, whose peak is that forward, holds the
// prediction (and the checkpoint's generator state, which simulate() leaves to the step's context). With the
// figures left out (-1, as before) the prediction is more than 30 hidden states above what it holds.
TEST(Offload, AGroupAssignmentsForwardIsChargedWhatItKeepsOnlyPastWhereItWouldBeLetGoOf) {
  auto [seq, x, weight, chain] = early_peak();
  const auto& groups = chain.stages[0].groups;
  std::vector<std::string> names;
  std::string assignment;  // the wide product kept, the rest recomputed
  for (const auto& g : groups) {
    names.push_back(g.name);
    assignment += g.name == "aten::repeat#0" ? 'k' : 'r';
    EXPECT_GE(g.fwd_peak_after_bytes, 0) << g.name;
  }
  ASSERT_EQ(names[0], "aten::repeat#0");
  EXPECT_GT(groups[0].fwd_peak_after_bytes, 0);
  EXPECT_LT(groups[0].fwd_peak_after_bytes, groups[0].bytes);  // let go of before what comes after peaks
  const Step plain = plan_step(seq, x, weight, std::nullopt, nullptr);
  remat::Plan plan = remat::testing::plan_of_text(1, "Fk0{" + assignment + "} L B0");
  plan.group_names = {names};
  const remat::Simulation sim = remat::simulate(chain, plan);
  const Step got = plan_step(seq, x, weight, plan, nullptr);
  expect_same(plain, got);
  EXPECT_EQ(sim.op_peak_bytes[0], sim.peak_bytes);  // the forward
  const int64_t state = 5056;                       // the CPU generator's state the checkpoint holds
  EXPECT_EQ(got.held, sim.peak_bytes + state);
  remat::Chain unmeasured = chain;
  for (auto& g : unmeasured.stages[0].groups)
    g.fwd_peak_after_bytes = -1;
  EXPECT_GT(remat::simulate(unmeasured, plan).peak_bytes - got.held, 30 * kHidden);
}

TEST(Offload, EachSavedGroupKeptSentOrRecomputedRunsWithinThePrediction) {
  meter_on();
  torch::manual_seed(0);
  remat::models::ResidualMlp mlp(remat::models::ResidualMlpOptions().depth(3).width(kWidth).dropout(0.1));
  auto& seq = mlp->blocks();
  const torch::Tensor x = input(), weight = torch::randn({kBatch, kWidth});
  const remat::Chain profiled = remat::profile_chain(
      seq, x, remat::ProfileOptions().warmup(0).repeats(1).offload_min_bytes(kHidden).groups(true));
  ASSERT_TRUE(profiled.can_offload());
  for (const auto& s : profiled.stages) {
    ASSERT_EQ(s.groups.size(), 4u) << s.name;
    EXPECT_EQ(s.groups[0].name, "aten::addmm#0");  // the policy sees nn::Linear's addmm
    EXPECT_EQ(s.groups[1].name, "aten::gelu#0");
    EXPECT_EQ(s.groups[2].name, "aten::addmm#1");    // fc2's product: autograd does not save it
    EXPECT_EQ(s.groups[3].name, "aten::dropout#0");  // its output and the mask made inside it
    EXPECT_EQ(s.groups[0].bytes, 4 * kHidden);
    EXPECT_EQ(s.groups[1].bytes, 4 * kHidden);
    EXPECT_EQ(s.groups[2].bytes, kHidden);
    EXPECT_EQ(s.groups[3].bytes, 2 * kHidden);
    // What of them autograd does not save: fc2's product, and dropout's output (not its mask).
    EXPECT_EQ(s.groups[0].unsaved_bytes + s.groups[1].unsaved_bytes, 0);
    EXPECT_EQ(s.groups[2].unsaved_bytes, kHidden);
    EXPECT_EQ(s.groups[3].unsaved_bytes, kHidden);
    EXPECT_GT(s.groups[0].bytes + s.groups[1].bytes + s.groups[2].bytes + s.groups[3].bytes,
              s.saved_bytes - s.output_bytes);  // more than the block saves
    for (const auto& g : s.groups)
      EXPECT_GE(g.recompute_ms, 0.0);
  }
  auto step = [&](const std::optional<remat::Plan>& plan, const std::shared_ptr<remat::HostPool>& pool,
                  int copy_delay) { return plan_step(seq, x, weight, plan, pool, copy_delay); };
  const Step plain = step(std::nullopt, nullptr, 0);
  std::vector<std::vector<std::string>> names;
  for (const auto& s : profiled.stages) {
    names.emplace_back();
    for (const auto& g : s.groups)
      names.back().push_back(g.name);
  }
  for (const char* text :
       {"Fk0{hhhh} Fk1{kkkk} Fk2{rrrr} L B2 B1 B0", "Fk0{hrhr} Fk1{rhkh} Fa2 L B2 B1 B0",
        "Fk0{khrk} Fc1 Fk2{hkkr} L B2 Fa1 B1 B0", "Fk0{rrkr} Fk1{rrrh} Fk2{rrhk} L B2 B1 B0"}) {
    remat::Plan plan = remat::testing::plan_of_text(3, text);
    plan.group_names = names;
    const remat::Simulation sim = remat::simulate(profiled, plan);
    for (int delay : {0, 2}) {
      auto pool = std::make_shared<remat::HostPool>();
      const Step got = step(plan, pool, delay);
      expect_same(plain, got);
      EXPECT_GE(static_cast<double>(got.held), 0.99 * static_cast<double>(sim.peak_bytes)) << text;
      EXPECT_LE(static_cast<double>(got.held), 1.10 * static_cast<double>(sim.peak_bytes)) << text;
      EXPECT_EQ(pool->peak_bytes(), sim.host_peak_bytes) << text;
      EXPECT_EQ(pool->in_use_bytes(), 0);
    }
  }
  // A plan that assigns groups without naming them (parsed from text) is refused by name, before any stage
  // runs.
  const remat::Plan unnamed = remat::testing::plan_of_text(3, "Fk0{hhhh} Fa1 Fa2 L B2 B1 B0");
  EXPECT_THROW_WITH(remat::run_plan(remat::stages_of(seq), unnamed, x), "remat::run_plan",
                    "does not name the stage's saved groups");
  // The per-layer planner assigns groups where they pay: on a profile whose whole-stage ways are made costly
  // (recomputing a block or a group slow, no whole-stage offloading or streaming; copies free), so that the
  // plan follows the budget rather than this machine's timings, at some budget between its least and the
  // plain peak its plan has a group assignment, names the groups, and runs as predicted.
  remat::PlannerOptions options;
  options.offload = true;
  remat::Chain chain = profiled;
  for (auto& s : chain.stages) {
    s.offload.reset();
    s.checkpoint_fwd_ms = s.checkpoint_bwd_ms = s.fwd_nosave_ms = 1e3;
    for (auto& g : s.groups)
      g.recompute_ms = 1e3 / static_cast<double>(s.groups.size());
  }
  chain.to_host_gb_per_s = chain.to_device_gb_per_s = 1e6;
  const int64_t least = remat::per_layer_min_budget(chain, options);
  const int64_t most =
      remat::simulate(chain, remat::testing::plan_of_text(3, "Fa0 Fa1 Fa2 L B2 B1 B0")).peak_bytes;
  std::optional<remat::Plan> planned;
  for (int k = 0; k <= 16 && !planned; ++k) {
    remat::Plan p = remat::per_layer(chain, least + (most - least) * k / 16, options);
    for (const auto& op : p.ops)
      if (!op.groups.empty()) planned = p;
  }
  ASSERT_TRUE(planned.has_value());
  EXPECT_EQ(planned->group_names, names) << planned->to_string();
  auto pool = std::make_shared<remat::HostPool>();
  const Step got = step(*planned, pool, 0);
  expect_same(plain, got);
  EXPECT_LE(static_cast<double>(got.held), 1.10 * static_cast<double>(planned->predicted.peak_bytes));
}

// What prefetch() brings back ahead of a streamed stage's backward (Offload::ahead_bytes, the chain's
// OffloadCost::ahead_bytes): the last tensors saved, newest first, while they fit in the window. The stage
// sends gelu's input (2w), fc2's input (2w) and tanh's output (w, its output), in that order (x, a leaf,
// stays); the window is 2w. Its output, found on the device (the next stage holds it), takes nothing of the
// window.
TEST(Offload, AheadBytesIsWhatPrefetchBringsBack) {
  meter_on();
  torch::manual_seed(0);
  const int64_t width = 64, rows = 256, w = width * rows * 4;
  torch::nn::Linear fc1(width, 2 * width), fc2(2 * width, width);
  std::vector<at::Tensor> params = fc1->parameters();
  for (const auto& p : fc2->parameters())
    params.push_back(p);
  for (bool found : {false, true}) {
    const torch::Tensor x = torch::randn({rows, width}).requires_grad_();
    remat::Offload o(remat::OffloadOptions().min_bytes(1024).window(2 * w).keep_on_device(params));
    torch::Tensor out = torch::tanh(fc2(torch::gelu(fc1(x))));
    o.close();
    o.finish_copies();
    EXPECT_EQ(o.stats().offloaded, 3);
    EXPECT_EQ(o.ahead_bytes(2 * w), w);
    EXPECT_EQ(o.ahead_bytes(2 * w, {out}), 2 * w);
    EXPECT_EQ(o.ahead_bytes(0), 0);
    EXPECT_EQ(o.ahead_bytes(6 * w), 5 * w);
    torch::Tensor loss = out.sum();
    if (!found) out = torch::Tensor();  // its storage gone: only its copy on the host is left
    const int64_t before = remat::memory::active_bytes();
    o.prefetch();
    EXPECT_EQ(remat::memory::active_bytes() - before, found ? 2 * w : w) << found;
    EXPECT_EQ(o.stats().brought_back, 1);
    EXPECT_EQ(o.stats().found_on_device, found ? 1 : 0);
    loss.backward();
    EXPECT_TRUE(x.grad().defined());
    EXPECT_THROW_WITH(o.ahead_bytes(-1), "remat::Offload::ahead_bytes", "window must be >= 0");
  }
}

// A tensor saved by two operators comes back once, as the entry of its first save; the backward pass asks
// for it at the later operator's backward, before the tensors saved between the two (`s`, saved by tanh and
// again by the last product, whose backward runs first). What prefetch() brought back ahead of those stays
// until they are asked for, and counts against the window as what comes back after them does. Before (found
// 2026-12-05 on GPT-OSS in the Python runtime, the same code), only the tensors saved before the one asked
// for counted: twice the window came back ahead at once here (read when the product's backward is done).
TEST(Offload, AWindowBoundsWhatComesBackAheadWhereTheBackwardAsksForATensorSavedEarlier) {
  meter_on();
  torch::manual_seed(0);
  const int64_t w = kHidden;
  const torch::Tensor x = input().requires_grad_();
  auto f = [](const torch::Tensor& x, torch::Tensor* hold) {
    const torch::Tensor s = x.exp().exp().tanh();  // saved: both exps' outputs, then tanh's (s)
    const torch::Tensor h = s.exp().exp();         // then these two
    if (hold) *hold = h;
    return h * s.detach();  // s saved again: the same bytes
  };
  const torch::Tensor want = torch::autograd::grad({f(x, nullptr).sum()}, {x})[0];
  remat::Offload o(remat::OffloadOptions().min_bytes(kHidden).window(2 * w).copy_delay(100));
  torch::Tensor h;
  const torch::Tensor loss = f(x, &h).sum();
  o.close();
  o.finish_copies();
  EXPECT_EQ(o.stats().offloaded, 5);    // s's second save is its first's entry
  int64_t before = 0, at_product = -1;  // the bytes alive once the product's backward is done, above `before`
  h.register_hook([&](const at::Tensor&) { at_product = remat::memory::active_bytes() - before; });
  h = torch::Tensor();  // its bytes only on the host now
  o.prefetch();         // the last two saved: the window
  before = remat::memory::active_bytes();
  const torch::Tensor got = torch::autograd::grad({loss}, {x})[0];
  EXPECT_TRUE(torch::equal(got, want));
  // s brought back, h's gradient and the loss's: nothing more ahead than what prefetch() brought back.
  EXPECT_EQ(at_product, 2 * w + static_cast<int64_t>(loss.nbytes()));
  EXPECT_GT(o.stats().prefetched, 0);
  EXPECT_EQ(o.stats().brought_back, 5);
}

// A window (OffloadOptions::window, what a streamed stage runs with): at most that many bytes of copies in
// flight to the host (a copy engine that holds every copy until waited for shows it: with window 0 the
// forward leaves what copies at once leave), and in the backward pass the tensors saved before the one asked
// for come back ahead within the window (prefetched), every step the plain run's.
TEST(Offload, AWindowBoundsTheCopiesInFlightAndWhatComesBackAhead) {
  auto model = mlp();
  const torch::Tensor x = input();
  const Step plain = run(model, x);
  auto open_with = [&](int64_t window, int delay) {
    return [&model, window, delay] {
      return std::make_unique<remat::Offload>(
          remat::OffloadOptions().min_bytes(kHidden).window(window).copy_delay(delay).keep_on_device(
              model.parameters()));
    };
  };
  const Step at_once = run(model, x, open_with(-1, 0));
  const Step held = run(model, x, open_with(-1, 100));
  const Step bounded = run(model, x, open_with(0, 100));
  const Step two = run(model, x, open_with(2 * kHidden, 100));
  for (const Step* s : {&at_once, &held, &bounded, &two})
    expect_same(plain, *s);
  EXPECT_GT(held.held, at_once.held);  // the copies' sources, held until waited for
  EXPECT_EQ(bounded.held, at_once.held);
  EXPECT_EQ(two.held, at_once.held + 2 * kHidden);  // the two last copies still in flight
  // Coming back: with window 0 each tensor when asked for; with two hidden states, ahead of their use.
  auto backward_stats = [&](int64_t window) {
    remat::Offload o(
        remat::OffloadOptions().min_bytes(kHidden).window(window).keep_on_device(model.parameters()));
    torch::Tensor h = x;
    for (auto& block : model.blocks)
      h = block->forward(h);
    o.close();
    h.square().mean().backward();
    return o.stats();
  };
  const remat::OffloadStats zero = backward_stats(0), ahead = backward_stats(2 * kHidden);
  EXPECT_GT(zero.brought_back, 0);
  EXPECT_EQ(zero.prefetched, 0);
  EXPECT_EQ(ahead.brought_back, zero.brought_back);
  EXPECT_GT(ahead.prefetched, 0);
  EXPECT_THROW_WITH(remat::Offload(remat::OffloadOptions().window(-2)), "remat::Offload",
                    "window must be >= 0");
}
