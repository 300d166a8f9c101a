// Operator-level policies (remat/policy.h): no edit to forward, gradients and RNG equal to the plain run,
// kept bytes exact, the level at which calls are asked, random operators, writes to kept outputs, and every
// error.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <remat/memory.h>
#include <remat/models.h>
#include <remat/remat.h>

#include <map>

#include "autograd/watch.h"
#include "detail/compat.h"
#include "support.h"

namespace {

using remat::testing::grads_of;
using remat::testing::max_abs_diff;

// A GPT block as LibTorch users write it, untouched by remat: pre-LayerNorm, causal self-attention with a
// registered mask buffer, GELU MLP, dropout everywhere.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t c, int64_t heads, int64_t t, double p) : heads(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
    attn = register_module("attn", torch::nn::Linear(c, 3 * c));
    proj = register_module("proj", torch::nn::Linear(c, c));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
    fc = register_module("fc", torch::nn::Linear(c, 4 * c));
    out = register_module("out", torch::nn::Linear(4 * c, c));
    drop = register_module("drop", torch::nn::Dropout(p));
    mask = register_buffer("mask", torch::tril(torch::ones({t, t})).view({1, 1, t, t}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
    auto qkv = attn(ln1(x)).split(c, 2);
    auto q = qkv[0].view({b, t, heads, c / heads}).transpose(1, 2);
    auto k = qkv[1].view({b, t, heads, c / heads}).transpose(1, 2);
    auto v = qkv[2].view({b, t, heads, c / heads}).transpose(1, 2);
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(c / heads)));
    att = att.masked_fill(mask.index({torch::indexing::Slice(), torch::indexing::Slice(),
                                      torch::indexing::Slice(0, t), torch::indexing::Slice(0, t)}) == 0,
                          -INFINITY);
    att = drop(torch::softmax(att, -1));
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, c});
    auto h = x + drop(proj(y));
    return h + drop(out(torch::gelu(fc(ln2(h)))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear attn{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::Tensor mask;
};
TORCH_MODULE(Block);

// Counts the calls of the named operators this thread runs while alive (remat's dispatcher watch; a kept
// call handed back by a recompute does not run).
struct OpCounter final : remat::detail::OpWatcher {
  explicit OpCounter(std::vector<std::string> names) : names(std::move(names)), scope(this, "test", true) {}
  void before(const c10::OperatorHandle&, c10::ArrayRef<c10::IValue>, int) override {}
  void after(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue>, int, bool ran) override {
    if (ran && std::find(names.begin(), names.end(), op.schema().name()) != names.end())
      ++counts[op.schema().name()];
  }
  std::vector<std::string> names;
  std::map<std::string, int> counts;
  remat::detail::WatchScope scope;
};

struct StepRun {
  torch::Tensor loss;
  std::vector<torch::Tensor> grads;
  torch::Tensor next_draw;  // the generator's next numbers after the step
};

// One training step of two blocks on x, each checkpointed with `options` (or plain), from the same seed.
StepRun step(std::vector<Block>& blocks, const torch::Tensor& x,
             const std::optional<remat::CheckpointOptions>& options) {
  for (auto& b : blocks)
    remat::testing::clear_grads(*b);
  torch::manual_seed(7);
  torch::Tensor h = x;
  for (auto& b : blocks)
    h = options ? remat::checkpoint(b, h, *options) : b->forward(h);
  StepRun r;
  r.loss = h.pow(2).mean();
  r.loss.backward();
  for (auto& b : blocks)
    for (auto& g : grads_of(*b))
      r.grads.push_back(g);
  r.next_draw = torch::rand({4});
  return r;
}

void expect_same(const StepRun& a, const StepRun& b, const std::string& what) {
  EXPECT_TRUE(torch::equal(a.loss, b.loss)) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_EQ(max_abs_diff(a.grads[i], b.grads[i]), 0.0) << what << ": gradient " << i;
  EXPECT_TRUE(torch::equal(a.next_draw, b.next_draw)) << what << ": the RNG moved on differently";
}

TEST(Policy, EveryPresetTrainsTheUntouchedBlockAsThePlainRun) {
  torch::manual_seed(0);
  std::vector<Block> blocks{Block(16, 2, 8, 0.2), Block(16, 2, 8, 0.2)};
  const auto x = torch::randn({2, 8, 16}, torch::requires_grad());
  const StepRun plain = step(blocks, x, std::nullopt);
  for (const remat::Policy& p :
       {remat::policy::matmuls(), remat::policy::attention_core(), remat::policy::recompute_pointwise(),
        remat::Policy([](const std::string&) { return true; }).named("everything"),
        remat::Policy([](const std::string&) { return false; }).named("nothing")}) {
    for (const bool early : {true, false}) {
      const StepRun r = step(blocks, x, remat::CheckpointOptions().policy(p).early_stop(early));
      expect_same(plain, r, p.name() + (early ? "" : " without early stopping"));
    }
  }
}

TEST(Policy, MatmulsKeepsTheProductsAndTheRecomputeSkipsThem) {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  torch::nn::Linear fc1(32, 64), fc2(64, 32);
  const auto x = torch::randn({16, 32}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) { return fc2(torch::gelu(fc1(t))); };
  for (const bool with_policy : {false, true}) {
    auto options = remat::CheckpointOptions();
    if (with_policy) options.policy(remat::policy::matmuls());
    const int64_t before = remat::memory::active_bytes();
    auto y = remat::checkpoint(fn, x, options);
    const int64_t kept = remat::memory::active_bytes() - before;
    // Kept: the output, and with the policy the first product; what addmm saved (its input, the transposed
    // weight) are views of its inputs and cost nothing.
    EXPECT_EQ(kept, (16 * 32 + (with_policy ? 16 * 64 : 0)) * 4) << with_policy;
    OpCounter counter({"aten::addmm", "aten::gelu"});
    y.sum().backward();
    // Without the policy the recompute runs the first product; it stops early inside the second, as soon as
    // that one has saved its input (its output is the region's own).
    EXPECT_EQ(counter.counts["aten::addmm"], with_policy ? 0 : 1) << "recomputed products";
    EXPECT_EQ(counter.counts["aten::gelu"], 1) << "GELU is recomputed either way";
    remat::testing::clear_grads(*fc1), remat::testing::clear_grads(*fc2), x.mutable_grad().reset();
  }
}

TEST(Policy, AttentionProductsAreKeptWithoutCopiesOfTheirOperands) {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  const auto q = torch::randn({2, 4, 8, 16}, torch::requires_grad());
  const auto k = torch::randn({2, 4, 8, 16}, torch::requires_grad());
  const auto v = torch::randn({2, 4, 8, 16}, torch::requires_grad());
  auto fn = [](const std::vector<torch::Tensor>& in) {
    auto s = torch::matmul(in[0], in[1].transpose(-2, -1));  // k transposed: matmul copies it for its bmm
    return std::vector<torch::Tensor>{torch::matmul(torch::softmax(s, -1), in[2])};
  };
  const int64_t before = remat::memory::active_bytes();
  auto out = remat::checkpoint(fn, {q, k, v}, remat::CheckpointOptions().policy(remat::policy::matmuls()));
  // The scores (the first bmm's product) and the output (the second's): matmul's bmm is kept, not matmul,
  // whose copies of the operands are recomputed.
  EXPECT_EQ(remat::memory::active_bytes() - before, (2 * 4 * 8 * 8 + 2 * 4 * 8 * 16) * 4);
  OpCounter counter({"aten::bmm", "aten::_softmax"});
  out[0].sum().backward();
  EXPECT_EQ(counter.counts["aten::_softmax"], 1);
  // No bmm of the forward pass is run again: the backward pass's own products are 4 bmm.
  EXPECT_EQ(counter.counts["aten::bmm"], 4);
}

TEST(Policy, ALinearOnThreeDimensionsKeepsItsProductWithTheBiasAddedInPlace) {
  // LibTorch's F::linear on a 3-D input is matmul, then `output += bias` on the kept product: the write is
  // made part of the kept call, so the product is kept with its bias and neither is redone.
  remat::memory::track_cpu();
  torch::manual_seed(0);
  torch::nn::Linear fc(16, 24);
  const auto x = torch::randn({2, 5, 16}, torch::requires_grad());
  remat::detail::compat::WarningCapture warnings;
  auto fn = [&](const torch::Tensor& t) { return torch::tanh(fc(t)); };
  std::map<std::string, int> counts[2];
  std::vector<torch::Tensor> grads[2];
  for (const bool with_policy : {false, true}) {
    auto options = remat::CheckpointOptions().early_stop(false);  // every recompute runs to the end
    if (with_policy) options.policy(remat::policy::matmuls());
    const int64_t before = remat::memory::active_bytes();
    auto y = remat::checkpoint(fn, x, options);
    // Kept: the output, and with the policy the product (its bias added in place).
    EXPECT_EQ(remat::memory::active_bytes() - before, (with_policy ? 2 : 1) * (2 * 5 * 24) * 4);
    OpCounter counter({"aten::mm", "aten::add_", "aten::tanh"});
    y.pow(2).sum().backward();
    counts[with_policy] = counter.counts;
    grads[with_policy] = {fc->weight.grad().clone(), fc->bias.grad().clone(), x.grad().clone()};
    remat::testing::clear_grads(*fc), x.mutable_grad().reset();  // undefined, so none is accumulated by add_
  }
  // The recompute skips the product and the bias added to it (the backward pass's own calls are the same).
  EXPECT_EQ(counts[1]["aten::mm"], counts[0]["aten::mm"] - 1);
  EXPECT_EQ(counts[1]["aten::add_"], counts[0]["aten::add_"] - 1);
  EXPECT_EQ(counts[1]["aten::tanh"], counts[0]["aten::tanh"]);
  EXPECT_TRUE(warnings.messages.empty()) << warnings.messages.front();
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(max_abs_diff(grads[0][i], grads[1][i]), 0.0) << i;
}

TEST(Policy, AnInPlaceWriteOfAKeptOutputIsPartOfTheCallOrReleasesIt) {
  torch::manual_seed(0);
  const auto x = torch::randn({6, 5}, torch::requires_grad());
  auto keep_all = remat::Policy([](const std::string&) { return true; }).named("everything");
  // exp's output kept, then written in place by relu_ (a ResNet's in-place ReLU): part of the call.
  auto fn = [](const torch::Tensor& t) {
    auto e = torch::exp(t) - 2.0;
    return torch::relu_(e).sin();
  };
  torch::Tensor plain = fn(x).sum();
  plain.backward();
  const auto plain_grad = x.grad().clone();
  x.mutable_grad().reset();
  remat::detail::compat::WarningCapture warnings;
  auto y = remat::checkpoint(fn, x, remat::CheckpointOptions().policy(keep_all));
  y.sum().backward();
  EXPECT_EQ(max_abs_diff(x.grad(), plain_grad), 0.0);
  EXPECT_TRUE(warnings.messages.empty());
  x.mutable_grad().reset();
  // A write of a kept output together with another tensor (max's values and indices, out=) cannot be part
  // of the call: the call is recomputed instead, and a warning says so.
  auto two_writes = [](const torch::Tensor& t) {
    auto e = t.detach() * 3;  // kept (no gradient flows through it)
    auto idx = torch::empty({5}, torch::kLong);
    auto values = e.narrow(0, 0, 1).squeeze(0);  // a view of the kept output
    at::max_out(values, idx, t.detach(), 0);
    return t.sin() * e.sum();
  };
  two_writes(x).sum().backward();
  const auto ref_grad = x.grad().clone();
  x.mutable_grad().reset();
  auto z = remat::checkpoint(two_writes, x, remat::CheckpointOptions().policy(keep_all));
  z.sum().backward();
  EXPECT_EQ(max_abs_diff(x.grad(), ref_grad), 0.0);
  ASSERT_FALSE(warnings.messages.empty());
  EXPECT_NE(
      warnings.messages.back().find("policy 'everything' kept the output of aten::mul, which aten::max then "
                                    "writes in place together with other tensors"),
      std::string::npos)
      << warnings.messages.back();
}

TEST(Policy, AWriteToAKeptOutputTheCallSavedIsRecomputedNotHandedBackWritten) {
  // Found by the fuzz: sigmoid, kept, saves its own output, which mul_ then writes (an invalid program: plain
  // LibTorch raises). Made part of the call, the recompute handed sigmoid's saved output back written, and
  // the gradient came from 2 * sigmoid, silently. Now the call is recomputed, with a warning: its recompute
  // stops at sigmoid's save, and the gradient is the one of the values saved (the program writing a copy).
  const auto x = torch::randn({6, 5}, torch::requires_grad());
  auto keep_sigmoid = remat::Policy([](const std::string& op) { return op == "aten::sigmoid"; }).named("sig");
  auto fn = [](const torch::Tensor& t) {
    auto s = torch::sigmoid(t);
    auto y = s * 3;
    s.mul_(2);
    return y + s;
  };
  EXPECT_THROW_WITH(fn(x).sum().backward(), "modified by an inplace operation");
  x.mutable_grad().reset();
  auto twin = [](const torch::Tensor& t) {
    auto s = torch::sigmoid(t).clone();
    auto y = s * 3;
    s.mul_(2);
    return y + s;
  };
  twin(x).sum().backward();
  const auto want = x.grad().clone();
  x.mutable_grad().reset();
  remat::detail::compat::WarningCapture warnings;
  remat::checkpoint(fn, x, remat::CheckpointOptions().policy(keep_sigmoid)).sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), want)) << max_abs_diff(x.grad(), want);
  ASSERT_FALSE(warnings.messages.empty());
  EXPECT_NE(
      warnings.messages.back().find("policy 'sig' kept the output of aten::sigmoid, which aten::mul_ then "
                                    "writes in place although the call saved it"),
      std::string::npos)
      << warnings.messages.back();
}

TEST(Policy, AKeptCallsConjugateAndNegativeViewsComeBackWithTheirBits) {
  // Found by the fuzz: c * c.conj() saves c.conj() (a conjugate view of c, its input), imag(conj(c)) a
  // negative view. Kept by the policy, the saved views were rebuilt from the input without their bits, and
  // the gradient came out wrong (by hundreds), silently.
  const auto x = torch::randn({4, 8}, torch::requires_grad());
  auto fn = [](const torch::Tensor& t) {
    const auto c = torch::view_as_complex(t.reshape({4, 4, 2}));
    return torch::cat({torch::real(c * c.conj()), torch::imag(c.conj()) * torch::real(c)}, 1);
  };
  fn(x).pow(2).sum().backward();
  const auto plain = x.grad().clone();
  auto keep_all = remat::Policy([](const std::string&) { return true; }).named("everything");
  for (const auto& policy :
       {keep_all, remat::Policy([](const std::string& op) { return op == "aten::mul"; })}) {
    x.mutable_grad().reset();
    remat::checkpoint(fn, x, remat::CheckpointOptions().policy(policy)).pow(2).sum().backward();
    EXPECT_TRUE(torch::equal(x.grad(), plain)) << policy.name() << ": " << max_abs_diff(x.grad(), plain);
  }
}

TEST(Policy, WritesToKeptOutputsHoldThroughASecondBackwardAndMakeThemTrainable) {
  // Found by the fuzz test (tests/fuzz_test.cpp, which draws a policy per program). Each case: gradients
  // equal to the plain run's after backward twice (retain_graph: the second recompute runs what the first
  // handed back).
  torch::manual_seed(0);
  auto keep_all = remat::Policy([](const std::string&) { return true; }).named("everything");
  torch::nn::Linear fc(6, 6);
  const auto bias = torch::randn({6}, torch::requires_grad());
  const auto constant = torch::randn({4, 6});
  const auto x = torch::randn({4, 6}, torch::requires_grad());
  struct Case {
    const char* what;
    std::function<torch::Tensor(const torch::Tensor&)> fn;
    torch::Tensor input;
    remat::CheckpointOptions options;
  };
  const Case cases[] = {
      // A constant's product kept, then a trained bias added in place: the product is handed back requiring
      // grad, so the recompute records and saves what the forward pass did.
      {"constant product, bias added in place",
       [&](const torch::Tensor& t) { return (2 * t).add_(bias).tanh(); }, constant,
       remat::CheckpointOptions().policy(keep_all)},
      // h + 0.5 (an add that calls another add) kept and written by mul_: in the second recompute it runs
      // again,
      // and so does the write, with the copy autograd makes of what mul_ overwrites.
      {"a nested call's output written in place",
       [](const torch::Tensor& t) { return (t + 0.5).mul_(torch::sigmoid(t)).sin(); }, x,
       remat::CheckpointOptions().policy(keep_all)},
      // remat::keep calls and a policy in one region: in the second recompute the keep call runs again, its
      // operators still not asked.
      {"keep tags and a policy",
       [&](const torch::Tensor& t) {
         return torch::tanh(remat::keep(
                                remat::kMatmul, [&](const torch::Tensor& u) { return fc(u); }, t))
             .exp();
       },
       x, remat::CheckpointOptions().keep({remat::kMatmul}).policy(remat::policy::matmuls())},
  };
  for (const Case& c : cases) {
    std::vector<torch::Tensor> params{bias, x, fc->weight, fc->bias};
    auto grads = [&](bool checkpointed) {
      for (auto& t : params)
        t.mutable_grad().reset();
      auto y = checkpointed ? remat::checkpoint(c.fn, c.input, c.options) : c.fn(c.input);
      auto loss = y.pow(2).sum();
      loss.backward({}, /*retain_graph=*/true);
      loss.backward();
      std::vector<torch::Tensor> out;
      for (auto& t : params)
        out.push_back(t.grad().defined() ? t.grad().clone() : torch::Tensor());
      return out;
    };
    const auto plain = grads(false);
    std::vector<torch::Tensor> got;
    try {
      got = grads(true);
    } catch (const c10::Error& e) {
      ADD_FAILURE() << c.what << ": " << e.what_without_backtrace();
      continue;
    }
    for (size_t i = 0; i < plain.size(); ++i) {
      ASSERT_EQ(plain[i].defined(), got[i].defined()) << c.what << ": gradient " << i;
      if (plain[i].defined()) EXPECT_EQ(max_abs_diff(plain[i], got[i]), 0.0) << c.what << ": gradient " << i;
    }
  }
}

TEST(Policy, KeptDropoutKeepsItsMaskAndTheGeneratorMovesOnAsInThePlainRun) {
  torch::manual_seed(0);
  std::vector<Block> blocks{Block(16, 2, 8, 0.3)};
  const auto x = torch::randn({2, 8, 16}, torch::requires_grad());
  const StepRun plain = step(blocks, x, std::nullopt);
  // Keeping the dropouts (their masks come from the forward pass) and recomputing the rest, which draws
  // nothing then: the generator must still end where the plain run's does.
  remat::Policy dropouts(
      [](const std::string& op) { return op == "aten::dropout" || op == "aten::native_dropout"; });
  expect_same(plain, step(blocks, x, remat::CheckpointOptions().policy(dropouts.named("dropouts"))),
              "dropouts");
  expect_same(plain, step(blocks, x, remat::CheckpointOptions().policy(remat::policy::attention_core())),
              "attention_core, its dropout recomputed");
}

TEST(Policy, FusedAttentionWithDropoutIsExactKeptOrRecomputed) {
#if TORCH_VERSION_MAJOR >= 2
  torch::manual_seed(0);
  const auto q = torch::randn({2, 2, 8, 16}, torch::requires_grad());
  auto fn = [](const torch::Tensor& t) {
    return at::scaled_dot_product_attention(t, t * 2, t.cos(), {}, /*dropout_p=*/0.3, /*is_causal=*/true);
  };
  auto run = [&](const std::optional<remat::Policy>& p) {
    q.mutable_grad().reset();
    torch::manual_seed(3);
    auto y = p ? remat::checkpoint(fn, q, remat::CheckpointOptions().policy(*p)) : fn(q);
    y.pow(2).sum().backward();
    return std::make_pair(q.grad().clone(), torch::rand({3}));
  };
  const auto plain = run(std::nullopt);
  for (const remat::Policy& p : {remat::policy::attention_core(),
                                 remat::Policy([](const std::string&) { return true; }).named("all")}) {
    const auto r = run(p);
    EXPECT_EQ(max_abs_diff(r.first, plain.first), 0.0) << p.name();
    EXPECT_TRUE(torch::equal(r.second, plain.second)) << p.name();
  }
#else
  GTEST_SKIP() << "LibTorch 1.13 has no scaled_dot_product_attention";
#endif
}

TEST(Policy, PresetsDecideAtTheLevelTheirCallsAreAsked) {
  torch::manual_seed(0);
  Block block(16, 2, 6, 0.0);  // 6 positions, heads of 8: a score is [2, 2, 6, 6]
  const auto x = torch::randn({2, 6, 16}, torch::requires_grad());
  auto asked_with = [&](const remat::Policy& preset) {
    std::vector<std::string> kept;
    remat::Policy recorder(preset.name(), [&](const remat::OpCall& c) {
      const bool k = preset.keeps(c);
      if (k) kept.push_back(c.name);
      return k;
    });
    remat::checkpoint(block, x, remat::CheckpointOptions().policy(recorder)).sum().backward();
    return kept;
  };
  // The six projections' products (mm under F::linear's matmul) and the attention's two bmm.
  const auto m = asked_with(remat::policy::matmuls());
  EXPECT_EQ(std::count(m.begin(), m.end(), "aten::mm"), 4);
  EXPECT_EQ(std::count(m.begin(), m.end(), "aten::bmm"), 2);
  EXPECT_EQ(m.size(), 6u);
  // Nothing that touches the [b, h, t, t] scores is kept by attention_core; the projections are.
  const auto a = asked_with(remat::policy::attention_core());
  for (const char* core : {"aten::_softmax", "aten::softmax", "aten::masked_fill", "aten::bmm"})
    EXPECT_EQ(std::count(a.begin(), a.end(), core), 0) << core;
  EXPECT_EQ(std::count(a.begin(), a.end(), "aten::mm"), 4);
  // recompute_pointwise keeps no pointwise call.
  const auto p = asked_with(remat::policy::recompute_pointwise());
  for (const char* pw : {"aten::gelu", "aten::add", "aten::mul", "aten::masked_fill", "aten::dropout"})
    EXPECT_EQ(std::count(p.begin(), p.end(), pw), 0) << pw;
  EXPECT_GT(std::count(p.begin(), p.end(), "aten::native_layer_norm") +
                std::count(p.begin(), p.end(), "aten::layer_norm"),
            0);
}

TEST(Policy, KeptBytesAreExactForEachPreset) {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({32}));
  torch::nn::Linear fc1(32, 64), fc2(64, 32);
  const auto x = torch::randn({16, 32}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) { return fc2(torch::gelu(fc1(ln(t)))); };
  const int64_t f = 4, out = 16 * 32 * f, h = 16 * 64 * f, norm = 16 * 32 * f, stats = 2 * 16 * f;
  // Kept beside the output: matmuls the first product; recompute_pointwise also LayerNorm's output with its
  // mean and rstd (saved inside layer_norm and not its outputs, so held); attention_core (no attention here)
  // everything, the GELU too.
  const std::vector<std::pair<remat::Policy, int64_t>> expected{
      {remat::policy::matmuls(), out + h},
      {remat::policy::recompute_pointwise(), out + h + norm + stats},
      {remat::policy::attention_core(), out + h + norm + stats + h}};
  for (const auto& [p, bytes] : expected) {
    const int64_t before = remat::memory::active_bytes();
    auto y = remat::checkpoint(fn, x, remat::CheckpointOptions().policy(p));
    EXPECT_EQ(remat::memory::active_bytes() - before, bytes) << p.name();
    y.sum().backward();
  }
}

TEST(Policy, AnInnerCheckpointWithoutAPolicyRecomputesWhatIsInsideIt) {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  const auto x = torch::randn({64, 64}, torch::requires_grad());
  auto keep_all = remat::Policy([](const std::string&) { return true; }).named("everything");
  auto inner = [](const torch::Tensor& t) { return torch::exp(t).sin(); };
  const int64_t before = remat::memory::active_bytes();
  auto y = remat::checkpoint([&](const torch::Tensor& t) { return remat::checkpoint(inner, t * 2).cos(); }, x,
                             remat::CheckpointOptions().policy(keep_all));
  // Kept by the outer region: t * 2 and cos (the region's output). exp and sin belong to the inner region,
  // which keeps nothing: its output is dropped as the outer region's saved tensor.
  EXPECT_EQ(remat::memory::active_bytes() - before, 2 * 64 * 64 * 4);
  OpCounter counter({"aten::exp"});
  y.sum().backward();
  // exp runs in the outer recompute (the inner region's forward pass) and in the inner one: had the outer
  // policy kept it, the outer recompute would have skipped it.
  EXPECT_EQ(counter.counts["aten::exp"], 2);
}

// Another library holding the dispatcher key remat watches operators with: a policy is a clear error, not a
// silent no-op. In a process of its own (a fresh copy of this binary), where the key is taken before remat
// asks for it.
TEST(PolicyDeathTest, AnotherLibraryHoldingTheDispatcherKeyIsAClearError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        static torch::Library taken(torch::Library::IMPL, "_", remat::detail::kWatchKey, __FILE__, __LINE__);
        taken.fallback(torch::CppFunction::makeFallthrough());
        const auto x = torch::randn({4}, torch::requires_grad());
        try {
          remat::checkpoint([](const torch::Tensor& t) { return t.sin().exp(); }, x,
                            remat::CheckpointOptions().policy(remat::policy::matmuls()));
        } catch (const c10::Error& e) {
          const std::string what = e.what_without_backtrace();
          std::cerr << what << std::endl;
          std::exit(what.find("an operator-level policy needs remat's dispatcher fallback") !=
                                std::string::npos &&
                            what.find("which another library in this process holds") != std::string::npos
                        ? 0
                        : 2);
        }
        std::exit(1);  // ran without its policy
      },
      ::testing::ExitedWithCode(0), "another library");
}

TEST(Policy, ErrorsNameTheProblem) {
  const auto x = torch::randn({4}, torch::requires_grad());
  auto fn = [](const torch::Tensor& t) { return t.exp(); };
  EXPECT_THROW_WITH(remat::checkpoint(fn, x,
                                      remat::CheckpointOptions()
                                          .mode(remat::CheckpointMode::kReentrant)
                                          .policy(remat::policy::matmuls())),
                    "CheckpointOptions::policy ('matmuls') needs CheckpointMode::kNonReentrant");
  EXPECT_THROW_WITH(remat::Policy("has space", [](const remat::OpCall&) { return true; }), "remat::Policy",
                    "'has space'");
  EXPECT_THROW_WITH(remat::Policy("x", std::function<bool(const remat::OpCall&)>()),
                    "decision function is empty");
  EXPECT_THROW_WITH(remat::policy::preset("fast"), "no preset named 'fast'", "matmuls, attention_core");
  EXPECT_THROW_WITH(remat::Policy().named("x"), "there is no policy to name");
  EXPECT_THROW_WITH(remat::policy::matmuls().named(""), "must be non-empty");
  EXPECT_EQ(remat::policy::preset("attention_core").name(), "attention_core");
  // A policy that throws: the error reaches the caller of the forward pass.
  remat::Policy throws("throws",
                       [](const remat::OpCall& c) -> bool { TORCH_CHECK(false, "no opinion on ", c.name); });
  EXPECT_THROW_WITH(remat::checkpoint(fn, x, remat::CheckpointOptions().policy(throws)),
                    "no opinion on aten::exp");
  // A region that does other work in its recompute than in its forward pass.
  int runs = 0;
  auto changing = [&](const torch::Tensor& t) { return ++runs == 1 ? t.exp().sin() : t.sin().exp(); };
  auto keep_all = remat::Policy([](const std::string&) { return true; }).named("everything");
  auto y =
      remat::checkpoint(changing, x, remat::CheckpointOptions().policy(keep_all).determinism_check(false));
  EXPECT_THROW_WITH(y.sum().backward(), "operator call 0 of the recompute is aten::sin, but was aten::exp",
                    "fn must do the same work");
}

}  // namespace
