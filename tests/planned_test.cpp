// remat::Planned (remat/planned.h): every step the plain run's, planned after one profiling step, the step's
// peak within the budget and near the prediction, infeasible budgets refused, a new shape planned anew.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <remat/memory.h>
#include <remat/planned.h>
#include <remat/sequential.h>

#include <optional>

namespace {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t w) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})));
    fc1 = register_module("fc1", torch::nn::Linear(w, 4 * w));
    fc2 = register_module("fc2", torch::nn::Linear(4 * w, w));
    drop = register_module("drop", torch::nn::Dropout(0.2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + drop(fc2(torch::gelu(fc1(ln(x))))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

// A model as users write it: an input projection, blocks in a ModuleList, a head; the loop over the blocks is
// the one place that changes to use Planned.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t w, int64_t depth) {
    in = register_module("in", torch::nn::Linear(8, w));
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < depth; ++i)
      h->push_back(Block(w));
    head = register_module("head", torch::nn::Linear(w, 1));
  }
  torch::Tensor loss(const torch::Tensor& x) {
    torch::Tensor a = torch::relu(in(x));
    base_bytes = remat::memory::active_bytes();  // the base of the budget: alive when the blocks start
    remat::memory::reset_peak();
    if (planned) {
      a = (*planned)->forward(a);
    } else {
      for (size_t i = 0; i < h->size(); ++i)
        a = (*h)[i]->as<BlockImpl>()->forward(a);
    }
    return head(a).pow(2).mean();
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::ModuleList h{nullptr};
  std::optional<remat::Planned> planned;
  int64_t base_bytes = 0;
};
TORCH_MODULE(Net);

struct Step {
  torch::Tensor loss, next_draw;
  std::vector<torch::Tensor> grads;
};

// One training step; the gradients set to none first (as zero_grad does by default in LibTorch 2.x), or
// zeroed in place.
Step step(Net& net, const torch::Tensor& x, bool grads_to_none = true) {
  for (auto& p : net->parameters()) {
    if (grads_to_none) {
      p.mutable_grad() = torch::Tensor();
    } else if (p.grad().defined()) {
      p.mutable_grad().zero_();
    }
  }
  Step s;
  s.loss = net->loss(x);
  s.loss.backward();
  for (const auto& p : net->parameters())
    s.grads.push_back(p.grad().clone());
  s.next_draw = torch::rand({4});
  return s;
}

void expect_equal(const Step& a, const Step& b, const std::string& what) {
  EXPECT_TRUE(torch::equal(a.loss, b.loss)) << what;
  EXPECT_TRUE(torch::equal(a.next_draw, b.next_draw)) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << what << ": gradient " << i;
}

class PlannedTest : public ::testing::Test {
 protected:
  void SetUp() override { remat::memory::track_cpu(); }
};

// The plain step's peak above the bytes alive when the blocks start, for choosing budgets.
int64_t plain_chain_peak(int64_t w, int64_t depth, const torch::Tensor& x) {
  torch::manual_seed(0);
  Net net(w, depth);
  step(net, x);  // gradients allocated, as in the measured steps
  torch::manual_seed(1);
  const int64_t base = remat::memory::active_bytes();
  remat::memory::reset_peak();
  net->loss(x).backward();
  return remat::memory::peak_bytes() - base;
}

TEST_F(PlannedTest, EveryStepIsThePlainRunsAndThePlanComesAfterOneProfilingStep) {
  const int64_t w = 64, depth = 6;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({16, 32, 8});
  const int64_t budget = plain_chain_peak(w, depth, x) / 2;
  torch::manual_seed(0);
  Net plain(w, depth);
  torch::manual_seed(0);
  Net planned(w, depth);
  planned->planned = planned->register_module(
      "planned",
      remat::Planned(remat::stages_at<BlockImpl>(*planned, {"h"}), remat::PlannedOptions().budget(budget)));
  for (int s = 0; s < 4; ++s) {
    torch::manual_seed(100 + s);
    const Step a = step(plain, x);
    torch::manual_seed(100 + s);
    const Step b = step(planned, x);
    expect_equal(a, b, "step " + std::to_string(s));
    if (s == 0) EXPECT_FALSE((*planned->planned)->is_planned());
    if (s >= 1) {
      EXPECT_TRUE((*planned->planned)->is_planned()) << "step " << s;
      EXPECT_EQ((*planned->planned)->profiling_steps(), 1);
    }
  }
  // Registered as a submodule, Planned adds no parameter (the optimizer sees each once).
  EXPECT_EQ(planned->parameters().size(), plain->parameters().size());
}

TEST_F(PlannedTest, TheStepsPeakIsWithinTheBudgetAndNearThePrediction) {
  const int64_t w = 64, depth = 8;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({16, 32, 8});
  const int64_t plain_peak = plain_chain_peak(w, depth, x);
  for (const double fraction : {0.3, 0.5, 0.8}) {
    const auto budget = static_cast<int64_t>(fraction * static_cast<double>(plain_peak));
    torch::manual_seed(0);
    Net net(w, depth);
    net->planned =
        remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(budget));
    step(net, x, false);  // gradients allocated before the profiling step, zeroed in place from then on
    for (int s = 0; s < 3; ++s) {
      step(net, x, false);
      const int64_t measured = remat::memory::peak_bytes() - net->base_bytes;
      if (s == 0) continue;
      const remat::PlannedImpl& p = **net->planned;
      ASSERT_TRUE(p.is_planned());
      // The tolerance: 2% of the prediction either way.
      const int64_t tolerance = p.predicted_peak_bytes() / 50;
      EXPECT_LE(p.predicted_peak_bytes(), budget);
      EXPECT_LE(measured, budget + tolerance) << "budget " << budget << " plan " << p.plan()->to_string();
      EXPECT_NEAR(static_cast<double>(measured), static_cast<double>(p.predicted_peak_bytes()),
                  static_cast<double>(tolerance))
          << fraction << " " << p.plan()->to_string();
      EXPECT_GT(p.last_peak_bytes(), 0);
    }
  }
}

TEST_F(PlannedTest, AnInfeasibleBudgetIsRefusedAtPlanningNamingTheLeastFeasibleOne) {
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 16, 8});
  torch::manual_seed(0);
  Net plain(32, 4);
  torch::manual_seed(0);
  Net net(32, 4);
  net->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(1024));
  torch::manual_seed(7);
  const Step a = step(plain, x);
  torch::manual_seed(7);
  const Step b = step(net, x);  // the profiling step trains as the plain run
  expect_equal(a, b, "profiling step");
  try {
    step(net, x);
    FAIL() << "an infeasible budget was accepted";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("remat::Planned: the budget of 1024 bytes is below the least feasible one"),
              std::string::npos)
        << what;
  }
  EXPECT_THROW(remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(0)),
               c10::Error);
  EXPECT_THROW(remat::Planned(std::vector<remat::StageFn>{}, remat::PlannedOptions().budget(1)), c10::Error);
}

TEST_F(PlannedTest, ANewShapeIsProfiledAndPlannedAnewAndAShapeSeenBeforeKeepsItsPlan) {
  const int64_t w = 32, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x32 = torch::randn({8, 32, 8}), x48 = torch::randn({8, 48, 8});
  const int64_t budget = plain_chain_peak(w, depth, x48) / 2;
  torch::manual_seed(0);
  Net plain(w, depth);
  torch::manual_seed(0);
  Net net(w, depth);
  net->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(budget));
  const std::vector<const torch::Tensor*> inputs{&x32, &x32, &x48, &x48, &x32, &x48};
  const std::vector<bool> planned_after{false, true, false, true, true, true};
  for (size_t s = 0; s < inputs.size(); ++s) {
    torch::manual_seed(200 + static_cast<int64_t>(s));
    const Step a = step(plain, *inputs[s]);
    torch::manual_seed(200 + static_cast<int64_t>(s));
    const Step b = step(net, *inputs[s]);
    expect_equal(a, b, "step " + std::to_string(s));
    EXPECT_EQ((*net->planned)->is_planned(), planned_after[s]) << "step " << s;
  }
  EXPECT_EQ((*net->planned)->profiling_steps(), 1);
}

TEST_F(PlannedTest, APlannedModuleGoneBeforeTheBackwardPassLeavesNothingDangling) {
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({4, 8, 8});
  torch::manual_seed(0);
  Net net(16, 3);
  net->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(1 << 30));
  torch::Tensor loss = net->loss(x);  // the profiling step's forward: its hook waits for the backward pass
  net->planned.reset();               // the only holder: the module is destroyed
  loss.backward();                    // the hook writes to what it shares, not to the module (ASan checks)
  for (const auto& p : net->parameters())
    EXPECT_TRUE(p.grad().defined());
}

TEST_F(PlannedTest, EvalModeAndNoGradRunTheStagesPlainly) {
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({4, 8, 8});
  torch::manual_seed(0);
  Net net(16, 3);
  auto planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(1));
  torch::Tensor plain;
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(3);
    plain = net->loss(x);
    net->planned = planned;
    torch::manual_seed(3);
    EXPECT_TRUE(torch::equal(net->loss(x), plain));  // no profiling, no plan, no error for the budget
  }
  EXPECT_FALSE(planned->is_planned());
  net->eval();
  planned->eval();
  net->planned.reset();
  const torch::Tensor eval_plain = net->loss(x);
  net->planned = planned;
  EXPECT_TRUE(torch::equal(net->loss(x), eval_plain));
  EXPECT_FALSE(planned->is_planned());
}

}  // namespace
