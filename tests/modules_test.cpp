// remat::checkpoint on what containers hand out (std::shared_ptr<Impl>, AnyModule, holders) and on modules
// whose forward takes several tensors or returns several.
#include <remat/checkpoint.h>
#include <remat/sequential.h>

#include "support.h"

#include <tuple>

namespace {

using remat::CheckpointMode;
using remat::CheckpointOptions;
using remat::testing::clear_grads;
using remat::testing::expect_all_close;
using remat::testing::grads_of;
using remat::testing::max_abs_diff;

// A residual block with BatchNorm, counting its forward calls.
struct NormBlockImpl : torch::nn::Module {
  explicit NormBlockImpl(int64_t w)
      : fc(register_module("fc", torch::nn::Linear(w, w))),
        bn(register_module("bn", torch::nn::BatchNorm1d(w))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    return x + torch::relu(bn(fc(x)));
  }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
  int calls = 0;
};
TORCH_MODULE(NormBlock);

// forward(x, mask) -> tensor; forward with two outputs as a tuple and as a vector.
struct MaskedImpl : torch::nn::Module {
  MaskedImpl() : fc(register_module("fc", torch::nn::Linear(6, 6))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask) {
    ++calls;
    return torch::tanh(fc(x)) * mask;
  }
  torch::nn::Linear fc;
  int calls = 0;
};
TORCH_MODULE(Masked);

struct PairImpl : torch::nn::Module {
  PairImpl() : fc(register_module("fc", torch::nn::Linear(6, 6))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor y) {
    ++calls;
    auto h = torch::gelu(fc(x + y));
    return {h * y, h.sigmoid()};
  }
  torch::nn::Linear fc;
  int calls = 0;
};
TORCH_MODULE(Pair);

struct SplitImpl : torch::nn::Module {
  SplitImpl() : fc(register_module("fc", torch::nn::Linear(6, 12))) {}
  std::vector<torch::Tensor> forward(const torch::Tensor& x) {
    ++calls;
    return torch::gelu(fc(x)).chunk(2, 1);
  }
  torch::nn::Linear fc;
  int calls = 0;
};
TORCH_MODULE(Split);

std::vector<torch::Tensor> buffers_of(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& b : m.buffers())
    out.push_back(b.clone());
  return out;
}

class ModulesTest : public ::testing::TestWithParam<CheckpointMode> {
 protected:
  void SetUp() override { torch::manual_seed(0); }
  CheckpointOptions opts() const { return CheckpointOptions().mode(GetParam()); }
};

INSTANTIATE_TEST_SUITE_P(Modes, ModulesTest,
                         ::testing::Values(CheckpointMode::kNonReentrant, CheckpointMode::kReentrant),
                         remat::testing::mode_name);

// The reference: a Sequential of three BatchNorm blocks, run plainly. Every way of checkpointing what the
// container hands out must give its loss, gradients and buffers, running each block's forward twice.
TEST_P(ModulesTest, WhatContainersHandOutTrainsLikeThePlainRun) {
  torch::nn::Sequential seq(NormBlock(8), NormBlock(8), NormBlock(8));
  const auto x = torch::randn({5, 8});
  const auto start_params = [&] {
    std::vector<torch::Tensor> p;
    for (const auto& t : seq->parameters())
      p.push_back(t.detach().clone());
    return p;
  }();
  const auto start_buffers = buffers_of(*seq);
  auto reset = [&] {
    torch::NoGradGuard no_grad;
    auto params = seq->parameters();
    for (size_t i = 0; i < params.size(); ++i)
      params[i].copy_(start_params[i]);
    auto buffers = seq->buffers();
    for (size_t i = 0; i < buffers.size(); ++i)
      buffers[i].copy_(start_buffers[i]);
    clear_grads(*seq);
    for (size_t i = 0; i < seq->size(); ++i)
      seq->ptr<NormBlockImpl>(i)->calls = 0;
  };
  const auto loss_plain = seq->forward(x).pow(2).mean();
  loss_plain.backward();
  const auto grads = grads_of(*seq);
  const auto buffers = buffers_of(*seq);

  const std::vector<std::pair<std::string, std::function<torch::Tensor(const torch::Tensor&)>>> ways = {
      {"shared_ptr<Impl>",
       [&](torch::Tensor h) {
         for (size_t i = 0; i < seq->size(); ++i)
           h = remat::checkpoint(seq->ptr<NormBlockImpl>(i), h, opts());
         return h;
       }},
      {"AnyModule",
       [&](torch::Tensor h) {
         for (auto& m : *seq)
           h = remat::checkpoint(m, h, opts());
         return h;
       }},
      {"const AnyModule, holder rebuilt from the pointer",
       [&](torch::Tensor h) {
         const torch::nn::AnyModule first = seq->begin()[0];
         h = remat::checkpoint(first, h, opts());
         h = remat::checkpoint(NormBlock(seq->ptr<NormBlockImpl>(1)), h, opts());
         return remat::checkpoint(std::static_pointer_cast<NormBlockImpl>(seq->ptr(2)), h, opts());
       }},
      {"Impl* (what ->as<Impl>() gives) and Impl&",
       [&](torch::Tensor h) {
         h = remat::checkpoint(seq->ptr(0)->as<NormBlockImpl>(), h, opts());
         const NormBlockImpl* const_impl = seq->ptr(1)->as<NormBlockImpl>();
         h = remat::checkpoint(const_cast<NormBlockImpl*>(const_impl), h, opts());
         return remat::checkpoint(*seq->ptr<NormBlockImpl>(2), h, opts());
       }},
  };
  for (const auto& [name, run] : ways) {
    SCOPED_TRACE(name);
    reset();
    const auto loss = run(x).pow(2).mean();
    loss.backward();
    EXPECT_EQ(loss.item<float>(), loss_plain.item<float>());
    expect_all_close(grads_of(*seq), grads, 0.0);
    expect_all_close(buffers_of(*seq), buffers, 0.0);  // running statistics and num_batches_tracked: once
    for (size_t i = 0; i < seq->size(); ++i)
      EXPECT_EQ(seq->ptr<NormBlockImpl>(i)->calls, 2) << "block " << i;
  }
}

TEST_P(ModulesTest, ForwardWithSeveralTensorsInAndOut) {
  Masked masked;
  Pair pair;
  Split split;
  const auto x = torch::randn({4, 6}, torch::requires_grad());
  const auto y = torch::randn({4, 6}, torch::requires_grad());
  const auto mask = (torch::rand({4, 6}) > 0.3).to(torch::kFloat);
  auto loss_of = [&](const torch::Tensor& m, const std::tuple<torch::Tensor, torch::Tensor>& p,
                     const std::vector<torch::Tensor>& s) {
    return m.pow(2).sum() + (std::get<0>(p) * std::get<1>(p)).sum() + (s[0] - s[1]).pow(2).sum();
  };
  loss_of(masked(x, mask), pair(x, y), split(y)).backward();
  const auto grads_m = grads_of(*masked), grads_p = grads_of(*pair), grads_s = grads_of(*split);
  const auto gx = x.grad().clone(), gy = y.grad().clone();
  clear_grads(*masked), clear_grads(*pair), clear_grads(*split);
  x.mutable_grad() = torch::Tensor(), y.mutable_grad() = torch::Tensor();
  masked->calls = pair->calls = split->calls = 0;

  torch::Tensor m = remat::checkpoint(masked, x, mask, opts());
  std::tuple<torch::Tensor, torch::Tensor> p = remat::checkpoint(pair, x, y, opts());
  std::vector<torch::Tensor> s = remat::checkpoint(split.ptr(), y, opts());
  ASSERT_EQ(s.size(), 2u);
  loss_of(m, p, s).backward();
  expect_all_close(grads_of(*masked), grads_m, 0.0);
  expect_all_close(grads_of(*pair), grads_p, 0.0);
  expect_all_close(grads_of(*split), grads_s, 0.0);
  // x and y collect several contributions, which the checkpointed run may add in another order.
  EXPECT_LE(max_abs_diff(x.grad(), gx), 1e-6);
  EXPECT_LE(max_abs_diff(y.grad(), gy), 1e-6);
  EXPECT_EQ(masked->calls, 2);
  EXPECT_EQ(pair->calls, 2);
  EXPECT_EQ(split->calls, 2);
}

TEST_P(ModulesTest, DefaultOptionsAndStructuredBindings) {
  Pair pair;
  const auto x = torch::randn({3, 6}, torch::requires_grad());
  const auto y = torch::randn({3, 6});
  auto [a, b] = remat::checkpoint(pair, x, y);  // no options: kNonReentrant
  (a + b).sum().backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_EQ(pair->calls, 2);
}

// A model as LibTorch users write one: its blocks in a ModuleList. Each element checkpointed through
// ->as<Impl>(), and the list as stages (stages_at<Impl>) for checkpoint_sequential and the plan executor,
// train as the plain loop does; nothing is registered twice.
struct ListModelImpl : torch::nn::Module {
  ListModelImpl()
      : blocks(register_module("h", torch::nn::ModuleList(NormBlock(8), NormBlock(8), NormBlock(8)))) {}
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(ListModel);

TEST_P(ModulesTest, AModuleListsElementsAndTheListAsStages) {
  ListModel model;
  const auto x = torch::randn({5, 8}, torch::requires_grad());
  const size_t params = model->parameters().size();
  auto plain = [&] {
    torch::Tensor h = x;
    for (const auto& m : *model->blocks)
      h = m->as<NormBlockImpl>()->forward(h);
    return h;
  };
  // BatchNorm buffers move with every forward: compare gradients of steps that start from the same buffers.
  const auto start = buffers_of(*model);
  auto restore = [&] {
    torch::NoGradGuard no_grad;
    auto b = model->buffers();
    for (size_t i = 0; i < b.size(); ++i)
      b[i].copy_(start[i]);
    clear_grads(*model);
  };
  restore();
  plain().pow(2).mean().backward();
  const auto grads = grads_of(*model);
  const auto buffers = buffers_of(*model);
  const auto stages = remat::stages_at<NormBlockImpl>(*model, {"h"});
  ASSERT_EQ(stages.size(), 3u);
  EXPECT_EQ(stages[1].name, "h.1:NormBlock");
  const std::vector<std::pair<std::string, std::function<torch::Tensor()>>> ways = {
      {"list[i]->as<Impl>()",
       [&] {
         torch::Tensor h = x;
         for (size_t i = 0; i < model->blocks->size(); ++i)
           h = remat::checkpoint((*model->blocks)[i]->as<NormBlockImpl>(), h, opts());
         return h;
       }},
      {"stages_at<Impl> + checkpoint_sequential",
       [&] {
         return remat::checkpoint_sequential(
             stages, 2, x, remat::SequentialOptions().checkpoint(opts()).checkpoint_last_segment(true));
       }},
      {"stages_at<Impl> + run_plan", [&] {
         if (GetParam() == CheckpointMode::kReentrant) return remat::checkpoint_sequential(stages, 3, x);
         return remat::run_plan(stages, remat::segmented(3, {0, 1, 2}, true), x);
       }}};
  for (const auto& [name, run] : ways) {
    SCOPED_TRACE(name);
    restore();
    run().pow(2).mean().backward();
    expect_all_close(grads_of(*model), grads, 0.0);
    expect_all_close(buffers_of(*model), buffers, 0.0);
  }
  EXPECT_EQ(model->parameters().size(), params);  // nothing registered twice
  // An element path, and the errors.
  EXPECT_EQ(remat::stages_at<NormBlockImpl>(*model, {"h.2"}).size(), 1u);
  EXPECT_THROW_WITH(remat::stages_at(*model, {"h"}), "remat::stages_at", "'h' is a ModuleList",
                    "remat::stages_at<ElementImpl>(root, {\"h\"})");
  EXPECT_THROW_WITH(remat::stages_at<torch::nn::LinearImpl>(*model, {"h"}), "'h.0' is a NormBlock, not a",
                    "LinearImpl");
  EXPECT_THROW_WITH(remat::stages_at<NormBlockImpl>(*model, {"h.7"}), "'h.7' names no submodule");
  EXPECT_THROW_WITH(remat::stages_at<NormBlockImpl>(*model, {"h.0.fc"}), "'h.0.fc' is a Linear",
                    "neither a Sequential or a ModuleList nor an element of one");
}

TEST(Modules, AnImplNotOwnedByASharedPtrIsRefused) {
  NormBlockImpl on_stack(8);
  const auto x = torch::randn({2, 8}, torch::requires_grad());
  EXPECT_THROW_WITH(remat::checkpoint(on_stack, x), "remat::checkpoint", "is not owned by a std::shared_ptr");
  EXPECT_THROW_WITH(remat::checkpoint(&on_stack, x), "is not owned by a std::shared_ptr");
  EXPECT_THROW_WITH(remat::checkpoint(static_cast<NormBlockImpl*>(nullptr), x),
                    "the module is a null pointer");
}

TEST(Modules, EmptyHandlesAreRefused) {
  const auto x = torch::randn({2, 8}, torch::requires_grad());
  EXPECT_THROW_WITH(remat::checkpoint(std::shared_ptr<NormBlockImpl>(), x), "remat::checkpoint",
                    "the module is empty");
  EXPECT_THROW_WITH(remat::checkpoint(torch::nn::AnyModule(), x), "remat::checkpoint", "the module is empty");
  EXPECT_THROW_WITH(remat::checkpoint(NormBlock(nullptr), x), "remat::checkpoint", "the module is empty");
  Masked masked;
  EXPECT_THROW_WITH(remat::checkpoint(masked, x.narrow(1, 0, 6), torch::Tensor()), "remat::checkpoint",
                    "undefined");
}

}  // namespace
