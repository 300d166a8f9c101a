// remat::Planned (remat/planned.h): every step the plain run's, planned after one profiling step, the step's
// peak within the budget and near the prediction, infeasible budgets refused, a new shape planned anew.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <remat/memory.h>
#include <remat/models.h>
#include <remat/planned.h>
#include <remat/planner/chain.h>
#include <remat/planner/device.h>
#include <remat/planner/units.h>
#include <remat/policy.h>
#include <remat/sequential.h>

#include <atomic>
#include <memory>
#include <optional>
#include <random>

#include "../examples/gpt/gpt.h"
#include "autocast.h"
#include "detail/compat.h"
#include "support.h"

namespace {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t w, bool norm = true) {
    // LibTorch 1.13's CPU LayerNorm takes no bfloat16 input with float weights: no norm under autocast.
    if (norm) ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})));
    fc1 = register_module("fc1", torch::nn::Linear(w, 4 * w));
    fc2 = register_module("fc2", torch::nn::Linear(4 * w, w));
    drop = register_module("drop", torch::nn::Dropout(0.2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + drop(fc2(torch::gelu(fc1(ln ? ln(x) : x)))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

// A model as users write it: an input projection, blocks in a ModuleList, a head; the loop over the blocks is
// the one place that changes to use Planned.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t w, int64_t depth, bool norm = true) {
    in = register_module("in", torch::nn::Linear(8, w));
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < depth; ++i)
      h->push_back(Block(w, norm));
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
  for (const auto& p : net->parameters())  // (a frozen parameter's: an empty tensor, equal only to another's)
    s.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros({0}));
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

// One step of each net from the same seed, the planned one's loss, gradients and next draw against the plain
// one's.
void expect_step_as_plain(Net& plain, Net& net, const torch::Tensor& x, uint64_t seed,
                          const std::string& what) {
  torch::manual_seed(seed);
  const Step a = step(plain, x);
  torch::manual_seed(seed);
  const Step b = step(net, x);
  expect_equal(a, b, what);
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

// A plain net and one of the same weights whose blocks run under a Planned made with `options`.
std::pair<Net, Net> plain_and_planned(int64_t w, int64_t depth, const remat::PlannedOptions& options) {
  torch::manual_seed(0);
  Net plain(w, depth);
  torch::manual_seed(0);
  Net net(w, depth);
  net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), options);
  return {plain, net};
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
    expect_step_as_plain(plain, planned, x, 100 + s, "step " + std::to_string(s));
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
  // Gradients zeroed in place (allocated before the profiling step), or set to none before every step, so
  // that the backward pass allocates them stage by stage (charged from each stage's backward on).
  for (const bool to_none : {false, true})
    for (const double fraction : {0.3, 0.5, 0.8}) {
      SCOPED_TRACE(to_none ? "gradients set to none" : "gradients zeroed");
      const auto budget = static_cast<int64_t>(fraction * static_cast<double>(plain_peak));
      torch::manual_seed(0);
      Net net(w, depth);
      net->planned =
          remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(budget));
      step(net, x, to_none);
      for (int s = 0; s < 3; ++s) {
        step(net, x, to_none);
        const int64_t measured = remat::memory::peak_bytes() - net->base_bytes;
        if (s == 0) continue;
        const remat::PlannedImpl& p = **net->planned;
        ASSERT_TRUE(p.is_planned());
        // The tolerance: 2% of the prediction either way.
        const int64_t tolerance = p.predicted_peak_bytes() / 50;
        EXPECT_LE(p.predicted_peak_bytes(), budget);
        EXPECT_LE(measured, budget + tolerance) << "budget " << budget << " plan " << p.plan()->to_string();
        // Above the prediction by at most 2%; below it by at most 2%, or 5% when the backward pass
        // allocates the gradients (charged for the whole of their stage's backward operation).
        EXPECT_LE(measured, p.predicted_peak_bytes() + tolerance) << fraction << " " << p.plan()->to_string();
        EXPECT_GE(measured, p.predicted_peak_bytes() - (to_none ? 5 * tolerance / 2 : tolerance))
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
  // An exclude text the planners cannot read is refused at construction, not at the end of the first step's
  // backward pass (before 2026-12-07), when the model's gradients are made.
  remat::PlannerOptions bad;
  bad.exclude = {"Fk", "Fc"};
  try {
    remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                   remat::PlannedOptions().budget(1 << 20).planner(bad));
    FAIL() << "exclude 'Fc' was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("remat::Planned: cannot exclude 'Fc'"), std::string::npos)
        << e.what();
  }
  bad.exclude = {"Fk[tags]", "Fk[matmuls]"};
  EXPECT_NO_THROW(remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                                 remat::PlannedOptions().budget(1 << 20).planner(bad)));
}

TEST_F(PlannedTest, ANewShapeIsProfiledAndPlannedAnewAndAShapeSeenBeforeKeepsItsPlan) {
  const int64_t w = 32, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x32 = torch::randn({8, 32, 8}), x48 = torch::randn({8, 48, 8});
  const int64_t budget = plain_chain_peak(w, depth, x48) / 2;
  // Every new shape profiled: with borrow_plans the lengths below 48 would run the plan of 48 (the test after
  // this one).
  auto [plain, net] = plain_and_planned(w, depth, remat::PlannedOptions().budget(budget).borrow_plans(false));
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
  EXPECT_EQ((*net->planned)->profiled_shapes(), 2);
  // Each new shape profiles again: as the step of the eighth begins (kProfiledShapesWarnedAt), a warning
  // names the shapes, once; every step stays the plain run's.
  ASSERT_EQ(remat::kProfiledShapesWarnedAt, 8);
  for (const int64_t length : {16, 20, 24, 28, 36, 40, 44, 16}) {
    const torch::Tensor x = torch::randn({8, length, 8});
    remat::detail::compat::WarningCapture capture;
    expect_step_as_plain(plain, net, x, 300 + length, "sequence " + std::to_string(length));
    const int64_t shapes = (*net->planned)->profiled_shapes();
    if (shapes == 8 && length == 40) {
      ASSERT_EQ(capture.messages.size(), 1u);
      EXPECT_NE(capture.messages[0].find("8 shapes so far (the input's shapes: [8, 16, 32], [8, 20, 32]"),
                std::string::npos)
          << capture.messages[0];
    } else {
      EXPECT_TRUE(capture.messages.empty()) << "sequence " << length << ": " << capture.messages[0];
    }
  }
  EXPECT_EQ((*net->planned)->profiled_shapes(), 9);
}

TEST_F(PlannedTest, ANewShapeThatAPlannedOneCoversRunsItsPlanAndOneThatHoldsMoreIsProfiled) {
  const int64_t w = 32, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x48 = torch::randn({8, 48, 8}), x64 = torch::randn({8, 64, 8});
  const int64_t budget = plain_chain_peak(w, depth, x48) / 2;
  auto [plain, net] = plain_and_planned(w, depth, remat::PlannedOptions().budget(budget));
  remat::PlannedImpl& p = **net->planned;
  expect_step_as_plain(plain, net, x48, 400, "the profiling step of 48");
  expect_step_as_plain(plain, net, x48, 401, "48");
  const std::string plan48 = p.plan()->to_string();
  const int64_t predicted48 = p.predicted_peak_bytes();
  // 32 and 40 positions, a batch of 6, and 6 of 44 run the plan of 48 at once (no profiling step), every step
  // the plain run's, within that plan's prediction.
  for (const auto& sizes :
       std::vector<std::vector<int64_t>>{{8, 32, 8}, {8, 40, 8}, {6, 48, 8}, {6, 44, 8}}) {
    const torch::Tensor x = torch::randn(sizes);
    const std::string what = "shape " + c10::str(c10::IntArrayRef(sizes));
    expect_step_as_plain(plain, net, x, 402, what);
    EXPECT_TRUE(p.plan_borrowed()) << what;
    EXPECT_EQ(p.plan()->to_string(), plan48) << what;
    EXPECT_EQ(p.predicted_peak_bytes(), predicted48) << what;
    EXPECT_EQ(p.profiling_steps(), 0) << what;
    EXPECT_GT(p.last_peak_bytes(), 0) << what;
    EXPECT_LE(p.last_peak_bytes(), predicted48) << what;
    expect_step_as_plain(plain, net, x, 403, what + ", again");
  }
  EXPECT_EQ(p.profiled_shapes(), 1);
  EXPECT_EQ(p.borrowed_shapes(), 4);
  // 64 positions: longer than any planned shape, profiled; 56 then runs the plan of 64, and 36 still that of
  // 48, the covering shape with the fewer elements.
  expect_step_as_plain(plain, net, x64, 404, "the profiling step of 64");
  EXPECT_FALSE(p.is_planned());
  expect_step_as_plain(plain, net, x64, 405, "64");
  const int64_t predicted64 = p.predicted_peak_bytes();
  expect_step_as_plain(plain, net, torch::randn({8, 56, 8}), 406, "56");
  EXPECT_TRUE(p.plan_borrowed());
  EXPECT_EQ(p.predicted_peak_bytes(), predicted64);
  expect_step_as_plain(plain, net, torch::randn({8, 36, 8}), 407, "36");
  EXPECT_EQ(p.predicted_peak_bytes(), predicted48);
  EXPECT_EQ(p.profiled_shapes(), 2);
  EXPECT_EQ(p.borrowed_shapes(), 6);

  // A stage whose memory does not only grow with its input: below 40 positions it also keeps its input
  // repeated 64 times (tanh's output, saved for its backward pass). A step of 32 under the plan of 48 holds
  // more than that plan predicts: a warning says so, and the next step of 32 profiles it.
  torch::manual_seed(0);
  Net odd(w, depth);
  std::vector<remat::StageFn> stages = remat::stages_at<BlockImpl>(*odd, {"h"});
  const remat::TensorFn block = stages[1].fn;
  stages[1].fn = [block](const torch::Tensor& x) {
    torch::Tensor h = block(x);
    if (x.size(1) >= 40) return h;
    const torch::Tensor t = x.repeat({1, 1, 64}).tanh();
    return h + t.view({x.size(0), x.size(1), 64, x.size(2)}).sum(2);
  };
  odd->planned = remat::Planned(stages, remat::PlannedOptions().budget(int64_t{1} << 40));
  remat::PlannedImpl& q = **odd->planned;
  step(odd, x48);
  step(odd, x48);
  const torch::Tensor x32 = torch::randn({8, 32, 8});
  step(odd, x32);
  EXPECT_TRUE(q.plan_borrowed());
  EXPECT_GT(q.last_peak_bytes(), q.predicted_peak_bytes() * 102 / 100);
  {
    remat::detail::compat::WarningCapture capture;
    step(odd, x32);
    ASSERT_EQ(capture.messages.size(), 1u);
    EXPECT_NE(
        capture.messages[0].find("a step of the input shape [8, 32, 32] ran the plan of a larger shape"),
        std::string::npos)
        << capture.messages[0];
  }
  EXPECT_FALSE(q.plan_borrowed());
  EXPECT_FALSE(q.is_planned());  // this step profiled
  EXPECT_EQ(q.profiled_shapes(), 2);
  step(odd, x32);
  EXPECT_TRUE(q.is_planned());
  EXPECT_LE(q.last_peak_bytes(), q.predicted_peak_bytes() * 102 / 100);
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
  // model->eval() reaches the stages' modules: Planned, not registered here, follows them.
  net->eval();
  net->planned.reset();
  const torch::Tensor eval_plain = net->loss(x);
  net->planned = planned;
  EXPECT_TRUE(planned->is_training());
  EXPECT_TRUE(torch::equal(net->loss(x), eval_plain));
  EXPECT_FALSE(planned->is_planned());
  // Planned's own eval flag, the model training (dropout on): the stages run plainly, nothing profiled.
  planned->eval();
  net->train();
  net->planned.reset();
  torch::manual_seed(4);
  const torch::Tensor train_plain = net->loss(x);
  net->planned = planned;
  torch::manual_seed(4);
  EXPECT_TRUE(torch::equal(net->loss(x), train_plain));
  EXPECT_FALSE(planned->is_planned());
  EXPECT_EQ(planned->chain(), nullptr);
}

// Stages that count their calls, for telling a profiling step from a step that only runs the stages.
std::vector<remat::StageFn> counted(std::vector<remat::StageFn> stages,
                                    std::shared_ptr<std::atomic<int>> calls) {
  for (auto& s : stages) {
    auto fn = s.fn;
    s.fn = [fn, calls](const torch::Tensor& x) {
      ++*calls;
      return fn(x);
    };
  }
  return stages;
}

// Out of memory in a planned step (each allocation of a step failing in turn, remat's CPU test limit): where
// the error rises inside the plan (its forward, or its backward node), it carries remat's words, the planner
// library's (as the Python package's): the plan, the predicted peak against the budget, the device's reading,
// the budget that would have fit. The next step runs.
TEST_F(PlannedTest, OutOfMemoryInsideThePlanNamesThePlanAndTheBudgetThatWouldHaveFit) {
  const int64_t w = 32, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 32, 8});
  const int64_t budget = plain_chain_peak(w, depth, x) / 2;
  auto device = [budget](c10::Device) {
    remat::memory::DeviceMemory m;
    m.free_bytes = budget / 4;  // what the device had left when the allocation failed
    m.total_bytes = int64_t{4} << 30;
    return m;
  };
  torch::manual_seed(0);
  Net net(w, depth);
  net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                                remat::PlannedOptions().budget(budget).read_device(device));
  step(net, x);  // profiles
  step(net, x);
  const remat::PlannedImpl& p = **net->planned;
  ASSERT_TRUE(p.is_planned());
  const std::string plan = p.plan()->to_string();
  const int64_t before = remat::memory::cpu_allocation_count();
  step(net, x);
  const int64_t allocations = remat::memory::cpu_allocation_count() - before;
  int forward = 0, backward = 0;
  for (int64_t n = 1; n <= allocations; ++n) {
    remat::memory::testing::fail_cpu_allocation_at(n);
    try {
      step(net, x);
    } catch (const c10::OutOfMemoryError& e) {
      const std::string what = e.what();
      const bool in_forward =
          what.find("remat::Planned: out of memory in the forward pass") != std::string::npos;
      const bool in_backward =
          what.find("remat::Planned: out of memory in the backward pass (the plan's operation ") !=
          std::string::npos;
      forward += in_forward;
      backward += in_backward;
      if (in_forward || in_backward) {
        EXPECT_NE(what.find("in a step that ran the plan " + plan), std::string::npos) << what;
        EXPECT_NE(what.find("for a budget of " + remat::format_bytes(budget) + " (" + std::to_string(budget) +
                            " bytes)"),
                  std::string::npos)
            << what;
        EXPECT_NE(what.find("the device had " + remat::format_bytes(budget / 4) + " free"), std::string::npos)
            << what;
        EXPECT_NE(what.find("a budget that would have fit: "), std::string::npos) << what;
      }
    }
    remat::memory::testing::fail_cpu_allocation_at(0);
  }
  EXPECT_GT(forward, 0);
  EXPECT_GT(backward, 0);
  EXPECT_NO_THROW(step(net, x));
}

// fit_device: the budget is remat::device_budget over what the device had when the profiling step began
// (here a device of the test's making on the CPU), and the plan the one that budget in bytes gets from the
// same profile; on a CPU input without such a device it is an error before anything runs.
TEST_F(PlannedTest, FittingTheDevicePlansForWhatItHasFreeAsThatBudgetInBytesWould) {
  const int64_t w = 32, depth = 5;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 32, 8});
  const int64_t budget = plain_chain_peak(w, depth, x) / 2;
  const int64_t margin = int64_t{256} << 20;  // remat::device_margin of a 4 GiB device
  ASSERT_EQ(remat::device_margin(int64_t{4} << 30), margin);
  auto device = [budget, margin](c10::Device) {
    remat::memory::DeviceMemory m;
    m.free_bytes = budget + margin;
    m.total_bytes = int64_t{4} << 30;
    return m;
  };
  torch::manual_seed(0);
  Net plain(w, depth);
  torch::manual_seed(0);
  Net net(w, depth);
  net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                                remat::PlannedOptions().fit_device(1.0).read_device(device));
  for (int s = 0; s < 3; ++s) {
    expect_step_as_plain(plain, net, x, 400 + s, "step " + std::to_string(s));
  }
  const remat::PlannedImpl& p = **net->planned;
  ASSERT_TRUE(p.is_planned());
  EXPECT_EQ(p.budget_bytes(), budget);
  EXPECT_LE(p.predicted_peak_bytes(), budget);
  // The saved profile planned for that budget in bytes gives the same plan.
  torch::manual_seed(0);
  Net twin(w, depth);
  twin->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*twin, {"h"}), remat::PlannedOptions().budget(budget));
  (*twin->planned)->use_profile({{8, 32, w}}, *p.chain());
  step(twin, x);
  step(twin, x);
  ASSERT_TRUE((*twin->planned)->is_planned());
  EXPECT_EQ((*twin->planned)->plan()->to_string(), p.plan()->to_string());

  // A device with too little free: the message says how the budget was made.
  torch::manual_seed(0);
  Net small(w, depth);
  small->planned = remat::Planned(remat::stages_at<BlockImpl>(*small, {"h"}),
                                  remat::PlannedOptions().fit_device(0.5).read_device(device));
  step(small, x);
  try {
    step(small, x);
    FAIL() << "a budget below the least was accepted";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("remat::Planned: the budget of 0 bytes (fit_device 0.5"), std::string::npos) << what;
    EXPECT_NE(what.find("cached by its allocator - 0 B lost to fragmentation, less a margin of 256.0 MiB)"),
              std::string::npos)
        << what;
  }

  // On the CPU without a device to read: an error before any stage runs, the gradients untouched.
  torch::manual_seed(0);
  Net cpu(w, depth);
  cpu->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*cpu, {"h"}), remat::PlannedOptions().fit_device(1.0));
  try {
    step(cpu, x);
    FAIL() << "fit_device on the CPU was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("remat::Planned: fit_device fits the step to a CUDA device's free "
                                         "memory, but this input is on cpu"),
              std::string::npos)
        << e.what();
  }
  for (const auto& param : cpu->parameters())
    EXPECT_FALSE(param.grad().defined());
  EXPECT_THROW(
      remat::Planned(remat::stages_at<BlockImpl>(*cpu, {"h"}), remat::PlannedOptions().fit_device(1.5)),
      c10::Error);
  EXPECT_THROW(remat::Planned(remat::stages_at<BlockImpl>(*cpu, {"h"}),
                              remat::PlannedOptions().budget(1 << 20).fit_device(0.9)),
               c10::Error);
}

TEST_F(PlannedTest, AStepAboveItsPredictionIsPlannedAgainBelowTheBudgetOnce) {
  // replan_on_overshoot (issue 45): a profile made wrong on purpose (each stage's saved bytes beyond its
  // output scaled by 0.6, times that make keeping a stage faster than recomputing it) predicts less than the
  // plan's steps hold. The step after the first planned one is planned again below the budget by the
  // overshoot, and holds within the budget; once per input shape. Every step is the plain run's.
  const int64_t w = 64, depth = 6;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({16, 32, 8});
  const int64_t plain_peak = plain_chain_peak(w, depth, x);
  torch::manual_seed(0);
  Net first(w, depth);
  first->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*first, {"h"}), remat::PlannedOptions().budget(plain_peak));
  step(first, x);
  step(first, x);
  remat::Chain wrong = *(*first->planned)->chain();
  for (remat::Stage& st : wrong.stages) {
    st.saved_bytes = st.output_bytes + (st.saved_bytes - st.output_bytes) * 6 / 10;
    st.policies.clear();
    st.fwd_ms = 1;
    st.fwd_nosave_ms = st.checkpoint_fwd_ms = 5;
    st.bwd_ms = 2;
    st.checkpoint_bwd_ms = 8;
  }
  const int64_t budget = plain_peak * 7 / 10;
  auto make = [&](bool replan) {
    torch::manual_seed(0);
    Net net(w, depth);
    net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                                  remat::PlannedOptions().budget(budget).replan_on_overshoot(replan));
    (*net->planned)->use_profile({{16, 32, w}}, wrong);
    return net;
  };
  torch::manual_seed(0);
  Net plain(w, depth);
  Net net = make(true);
  const remat::PlannedImpl& p = **net->planned;
  expect_step_as_plain(plain, net, x, 400, "the step that measures the rest");
  expect_step_as_plain(plain, net, x, 401, "the first planned step");
  ASSERT_TRUE(p.is_planned());
  const std::string first_plan = p.plan()->to_string();
  const int64_t predicted = p.predicted_peak_bytes();
  const int64_t overshoot = p.last_peak_bytes() - predicted;
  ASSERT_TRUE(p.prediction_error().has_value());
  ASSERT_GT(*p.prediction_error(), remat::kPredictionTolerance) << first_plan;
  EXPECT_EQ(p.budget_lowered_bytes(), 0);
  // The next step runs a plan made below the budget by the overshoot, and stays within the budget; said.
  std::optional<remat::detail::compat::WarningCapture> said(std::in_place);
  expect_step_as_plain(plain, net, x, 402, "the step planned again");
  ASSERT_EQ(said->messages.size(), 1u);
  EXPECT_NE(said->messages[0].find("above the plan's prediction of " + std::to_string(predicted) + " bytes"),
            std::string::npos)
      << said->messages[0];
  EXPECT_NE(said->messages[0].find("replan_on_overshoot: planned again below the budget by " +
                                   std::to_string(overshoot) + " bytes"),
            std::string::npos)
      << said->messages[0];
  said.reset();
  EXPECT_EQ(p.budget_lowered_bytes(), overshoot);
  EXPECT_NE(p.plan()->to_string(), first_plan);
  EXPECT_LE(p.predicted_peak_bytes(), budget - overshoot);
  EXPECT_LE(p.last_peak_bytes(), budget) << p.plan()->to_string();
  // Once per input shape: the new plan's own miss is not planned again.
  const std::string second_plan = p.plan()->to_string();
  said.emplace();
  expect_step_as_plain(plain, net, x, 403, "a later step");
  EXPECT_TRUE(said->messages.empty()) << said->messages[0];  // once per input shape
  said.reset();
  EXPECT_EQ(p.plan()->to_string(), second_plan);

  // Without the option the plan is kept.
  Net kept = make(false);
  said.emplace();
  step(kept, x);
  step(kept, x);
  step(kept, x);  // the step after the miss: said once, with what the option would do
  ASSERT_EQ(said->messages.size(), 1u);
  EXPECT_NE(said->messages[0].find("PlannedOptions::replan_on_overshoot plans again for the budget less the "
                                   "overshoot"),
            std::string::npos)
      << said->messages[0];
  said.reset();
  EXPECT_EQ((*kept->planned)->plan()->to_string(), first_plan);
  EXPECT_EQ((*kept->planned)->budget_lowered_bytes(), 0);
  ASSERT_TRUE((*kept->planned)->prediction_error().has_value());
  EXPECT_GT(*(*kept->planned)->prediction_error(), remat::kPredictionTolerance);

  // Not with ranks that agree on one plan.
  try {
    remat::Planned(remat::stages_at<BlockImpl>(*kept, {"h"}),
                   remat::PlannedOptions().budget(budget).replan_on_overshoot(true).agree(
                       [](std::vector<torch::Tensor>&) {}));
    FAIL() << "replan_on_overshoot with agree was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("remat::Planned: replan_on_overshoot plans again from one rank's"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(PlannedTest, ASavedProfileIsUsedInsteadOfProfilingAndGivesTheSamePlan) {
  const int64_t w = 32, depth = 5;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 32, 8});
  const int64_t budget = plain_chain_peak(w, depth, x) / 2;
  torch::manual_seed(0);
  Net first(w, depth);
  first->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*first, {"h"}), remat::PlannedOptions().budget(budget));
  step(first, x);
  step(first, x);
  ASSERT_TRUE((*first->planned)->is_planned());
  ASSERT_NE((*first->planned)->rest_of_step(), nullptr);
  // Saved as the CLI's chain JSON, read back.
  const std::string json = remat::to_json(*(*first->planned)->chain());
  const remat::Chain saved = remat::chain_from_json(json);

  torch::manual_seed(0);
  Net plain(w, depth);
  torch::manual_seed(0);
  Net net(w, depth);
  auto calls = std::make_shared<std::atomic<int>>(0);
  net->planned = remat::Planned(counted(remat::stages_at<BlockImpl>(*net, {"h"}), calls),
                                remat::PlannedOptions().budget(budget));
  // The shape of Planned's input (the blocks' input), not of the model's.
  const std::vector<int64_t> blocks_input{8, 32, w};
  (*net->planned)->use_profile({blocks_input}, saved);
  for (int s = 0; s < 3; ++s) {
    *calls = 0;
    expect_step_as_plain(plain, net, x, 300 + s, "step " + std::to_string(s));
    // Step 0 runs every stage checkpointed (a forward and a recompute each), no profiling runs.
    if (s == 0) EXPECT_EQ(calls->load(), 2 * depth);
  }
  const remat::PlannedImpl& p = **net->planned;
  ASSERT_TRUE(p.is_planned());
  EXPECT_EQ(p.profiling_steps(), 1);
  EXPECT_EQ(p.plan()->to_string(), (*first->planned)->plan()->to_string());

  // Without a saved profile, the first step profiles: many more calls.
  torch::manual_seed(0);
  Net fresh(w, depth);
  auto fresh_calls = std::make_shared<std::atomic<int>>(0);
  fresh->planned = remat::Planned(counted(remat::stages_at<BlockImpl>(*fresh, {"h"}), fresh_calls),
                                  remat::PlannedOptions().budget(budget));
  step(fresh, x);
  EXPECT_GT(fresh_calls->load(), 4 * depth);

  // Bad profiles: the wrong number of stages, or another input size (found at that shape's first step).
  remat::Chain short_chain = saved;
  short_chain.stages.pop_back();
  EXPECT_THROW((*fresh->planned)->use_profile({{4, 32, w}}, short_chain), c10::Error);
  remat::Chain other = saved;
  other.input_bytes *= 2;
  const torch::Tensor y = torch::randn({4, 32, 8});
  (*fresh->planned)->use_profile({{4, 32, w}}, other);
  try {
    step(fresh, y);
    FAIL() << "a profile of another input size was used";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("input_bytes " + std::to_string(other.input_bytes)),
              std::string::npos)
        << e.what();
  }
  step(fresh, x);
  EXPECT_THROW((*fresh->planned)->use_profile({blocks_input}, saved), c10::Error);  // already planned
}

// A block that takes a per-step extra tensor: a [T] gate on the sequence positions (as a mask would be).
TEST_F(PlannedTest, StagesWithExtraTensorsGetThemEveryStepAndTheirShapesKeyThePlan) {
  const int64_t w = 32, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 32, 8});
  const torch::Tensor gate32 = (torch::rand({32, 1}) > 0.3).to(torch::kFloat);
  const torch::Tensor gate16 = (torch::rand({16, 1}) > 0.3).to(torch::kFloat);
  torch::manual_seed(0);
  Net plain(w, depth);
  torch::manual_seed(0);
  Net net(w, depth);
  std::vector<remat::ArgsStageFn> stages;
  for (size_t i = 0; i < net->h->size(); ++i) {
    auto block = net->h->ptr<BlockImpl>(i);
    stages.push_back({"gated" + std::to_string(i),
                      [block](const torch::Tensor& h, const std::vector<torch::Tensor>& args) {
                        return block->forward(h) * args.at(0);
                      },
                      block});
  }
  auto planned = remat::Planned(stages, remat::PlannedOptions().budget(1 << 30));
  auto gated_loss = [&](Net& n, const torch::Tensor& in, const torch::Tensor& gate, bool use_planned) {
    torch::Tensor a = torch::relu(n->in(in));
    if (use_planned) {
      a = planned->forward(a, {gate});
    } else {
      for (size_t i = 0; i < n->h->size(); ++i)
        a = n->h->at<BlockImpl>(i).forward(a) * gate;
    }
    return n->head(a).pow(2).mean();
  };
  const std::vector<const torch::Tensor*> gates{&gate32, &gate32, &gate16, &gate16, &gate32};
  // The gates' shapes key the plan too: the shorter one's first step runs the plan of the longer (a new shape
  // that it covers: borrow_plans).
  const std::vector<bool> planned_after{false, true, true, true, true},
      borrowed{false, false, true, true, false};
  for (size_t s = 0; s < gates.size(); ++s) {
    for (Net* n : {&plain, &net}) {
      for (auto& p : (*n)->parameters())
        p.mutable_grad() = torch::Tensor();
    }
    const torch::Tensor in = gates[s] == &gate16 ? x.narrow(1, 0, 16) : x;
    torch::manual_seed(400 + static_cast<int64_t>(s));
    const torch::Tensor la = gated_loss(plain, in, *gates[s], false);
    la.backward();
    torch::manual_seed(400 + static_cast<int64_t>(s));
    const torch::Tensor lb = gated_loss(net, in, *gates[s], true);
    lb.backward();
    EXPECT_TRUE(torch::equal(la, lb)) << "step " << s;
    const auto pa = plain->parameters(), pb = net->parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_TRUE(torch::equal(pa[i].grad(), pb[i].grad())) << "step " << s << " gradient " << i;
    EXPECT_EQ(planned->is_planned(), planned_after[s]) << "step " << s;
    EXPECT_EQ(planned->plan_borrowed(), borrowed[s]) << "step " << s;
  }
  // Extra tensors for stages that take none: an error naming them.
  auto one_arg = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(1));
  EXPECT_THROW(one_arg->forward(x, {gate32}), c10::Error);
  EXPECT_THROW(planned->forward(x, {torch::Tensor()}), c10::Error);
}

// Two nets of the same weights, without norms (LibTorch 1.13's CPU LayerNorm takes no bfloat16 input with
// float weights), the second's blocks planned for `num / den` of the plain step's peak on x (8 rows).
struct AutocastTwins {
  torch::Tensor x;
  Net plain{nullptr}, net{nullptr};
};
AutocastTwins autocast_twins(int64_t w, int64_t depth, int64_t num, int64_t den) {
  AutocastTwins t;
  torch::manual_seed(5);
  t.x = torch::randn({8, 32, 8});
  torch::manual_seed(0);
  t.plain = Net(w, depth, false);
  torch::manual_seed(0);
  t.net = Net(w, depth, false);
  t.net->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*t.net, {"h"}),
                     remat::PlannedOptions().budget(plain_chain_peak(w, depth, t.x) * num / den));
  return t;
}

TEST_F(PlannedTest, GradientAccumulationAndCpuAutocastAreAsWithoutIt) {
  auto [x, plain, net] = autocast_twins(32, 4, 1, 3);
  for (const bool autocast : {false, true}) {
    for (int s = 0; s < 3; ++s) {
      // Two micro-batches accumulated into the gradients, then read.
      std::vector<std::vector<torch::Tensor>> grads;
      std::vector<torch::Tensor> losses;
      int64_t predicted[2] = {0, 0};  // per micro-batch, the prediction of the plan that ran it
      for (Net* n : {&plain, &net}) {
        for (auto& p : (*n)->parameters())
          p.mutable_grad() = torch::Tensor();
        for (int micro = 0; micro < 2; ++micro) {
          torch::manual_seed(500 + 10 * s + micro);
          std::optional<remat::testing::CpuAutocast> scope;
          if (autocast) scope.emplace();
          torch::Tensor loss = (*n)->loss(x.narrow(0, 4 * micro, 4));
          scope.reset();
          loss.backward();
          losses.push_back(loss.detach());
          const remat::PlannedImpl& p = **net->planned;
          if (n == &net && !autocast && s > 0) {
            // The first micro-batch's backward makes the gradients, the second's adds to them: each runs the
            // plan for its state (made at its first step in it), which charges the gradients it makes. Before
            // (found 2026-12-02), the one plan, made at the second micro-batch, charged none, and the first
            // held 8.7% more than predicted.
            ASSERT_TRUE(p.prediction_error().has_value());
            EXPECT_LE(*p.prediction_error(), remat::kPredictionTolerance)
                << "step " << s << " micro-batch " << micro << ": " << p.plan()->to_string() << " held "
                << p.last_peak_bytes() << " against " << p.predicted_peak_bytes();
            predicted[micro] = p.predicted_peak_bytes();
          }
        }
        if (n == &net && !autocast && s > 0) EXPECT_GT(predicted[0], predicted[1]) << "step " << s;
        grads.emplace_back();
        for (const auto& p : (*n)->parameters())
          grads.back().push_back(p.grad().clone());
      }
      for (int micro = 0; micro < 2; ++micro)
        EXPECT_TRUE(torch::equal(losses[micro], losses[2 + micro])) << autocast << " step " << s;
      for (size_t i = 0; i < grads[0].size(); ++i)
        EXPECT_TRUE(torch::equal(grads[0][i], grads[1][i])) << autocast << " step " << s << " gradient " << i;
    }
    EXPECT_TRUE((*net->planned)->is_planned());
  }
}

// A token table before the stages, whose backward makes its whole gradient once the stages' backward is done,
// and an accumulation whose profiling step came at a later micro-batch (the gradients there): a first
// micro-batch's step makes every gradient, and the table's backward runs with the stages' gradients held.
// Before (found 2026-12-07), the part before's measured peak was charged as measured, without them, and such
// a step held 9.5% above its prediction (0.006% now); a later micro-batch's is predicted without them again.
struct EmbedNetImpl : torch::nn::Module {
  EmbedNetImpl(int64_t vocab, int64_t w, int64_t depth) {
    embed = register_module("embed", torch::nn::Embedding(vocab, w));
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < depth; ++i)
      h->push_back(Block(w));
    head = register_module("head", torch::nn::Linear(w, 1));
  }
  torch::Tensor loss(const torch::Tensor& ids) { return head((*planned)->forward(embed(ids))).pow(2).mean(); }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::Linear head{nullptr};
  std::optional<remat::Planned> planned;
};
TORCH_MODULE(EmbedNet);

TEST_F(PlannedTest, AStepMakingTheGradientsAfterOneProfiledWithThemIsPredictedWithThem) {
  torch::manual_seed(0);
  EmbedNet net(16384, 64, 3);
  net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                                remat::PlannedOptions().budget(int64_t{1} << 30));
  const torch::Tensor ids = torch::randint(16384, {8, 16});
  for (auto& p : net->parameters())
    p.mutable_grad() = torch::zeros_like(p);  // profiled as a later micro-batch
  net->loss(ids).backward();
  const remat::PlannedImpl& planned = **net->planned;
  int64_t predicted[2] = {0, 0};
  for (int s = 0; s < 4; ++s) {
    const bool first = s % 2 == 0;
    if (first) {
      for (auto& p : net->parameters())
        p.mutable_grad() = torch::Tensor();
    }
    net->loss(ids).backward();
    ASSERT_TRUE(planned.prediction_error().has_value());
    EXPECT_LE(std::abs(*planned.prediction_error()), remat::kPredictionTolerance)
        << "step " << s << ": " << planned.plan()->to_string() << " held " << planned.last_peak_bytes()
        << " against " << planned.predicted_peak_bytes();
    predicted[first ? 0 : 1] = planned.predicted_peak_bytes();
  }
  EXPECT_GT(predicted[0], predicted[1]);
}

// A call under autocast is a shape of its own (its stages save the matmuls' bfloat16 results), and so is a
// call in another dtype: each profiled and planned apart, each step the plain run's and within its
// prediction. Before (found 2026-12-02), a shape was keyed by its sizes alone: the float32 steps ran the plan
// profiled under CPU autocast, 66% above its prediction (19% above the budget), and the float64 ones that
// plan too, 233% above.
// The stages' parameters are part of a call's key (which require grad, their dtypes and sizes), as they are
// of the Python package's: a stage frozen on an input that needs no gradient makes no graph and saves
// nothing, so freezing the first stages or unfreezing them (gradual unfreezing) is a new key, profiled and
// planned. Before (found 2026-12-07), the plan profiled with two stages frozen ran on after they were
// unfrozen, its steps far above its prediction.
TEST_F(PlannedTest, FreezingOrUnfreezingTheStagesKeysAShapeApart) {
  const int64_t w = 32, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 32, 8});
  auto [plain, net] =
      plain_and_planned(w, depth, remat::PlannedOptions().budget(plain_chain_peak(w, depth, x) * 6 / 10));
  const remat::PlannedImpl& p = **net->planned;
  auto freeze = [](Net& n, bool frozen) {  // the input projection and the first two blocks
    for (auto& q : n->in->parameters())
      q.requires_grad_(!frozen);
    for (size_t i = 0; i < 2; ++i)
      for (auto& q : (*n->h)[i]->parameters())
        q.requires_grad_(!frozen);
  };
  for (int s = 0; s < 6; ++s) {
    if (s % 3 == 0) {
      freeze(plain, s == 0);
      freeze(net, s == 0);
    }
    expect_step_as_plain(plain, net, x, 900 + s, "step " + std::to_string(s));
    EXPECT_EQ(p.profiled_shapes(), s < 3 ? 1 : 2) << "step " << s;
    if (s % 3 == 0) continue;
    ASSERT_TRUE(p.prediction_error().has_value()) << s;
    EXPECT_LE(std::abs(*p.prediction_error()), remat::kPredictionTolerance)
        << "step " << s << ": " << p.plan()->to_string() << " held " << p.last_peak_bytes() << " against "
        << p.predicted_peak_bytes();
  }
}

TEST_F(PlannedTest, AutocastAndDtypeKeyAShapeApart) {
  auto [x, plain, net] = autocast_twins(32, 4, 3, 4);
  const remat::PlannedImpl& p = **net->planned;
  for (const char* how : {"autocast", "float32", "float64"}) {
    const bool autocast = std::string(how) == "autocast";
    if (std::string(how) == "float64") {
      plain->to(torch::kDouble);
      net->to(torch::kDouble);
    }
    const torch::Tensor input = std::string(how) == "float64" ? x.to(torch::kDouble) : x;
    for (int s = 0; s < 3; ++s) {
      Step got[2];
      for (int k = 0; k < 2; ++k) {
        Net& n = k == 0 ? plain : net;
        for (auto& q : n->parameters())
          q.mutable_grad() = torch::Tensor();
        torch::manual_seed(700 + s);
        std::optional<remat::testing::CpuAutocast> scope;
        if (autocast) scope.emplace();
        got[k].loss = n->loss(input);
        scope.reset();
        got[k].loss.backward();
        for (const auto& q : n->parameters())
          got[k].grads.push_back(q.grad().clone());
        got[k].next_draw = torch::rand({4});
      }
      expect_equal(got[0], got[1], std::string(how) + " step " + std::to_string(s));
      if (s == 0) continue;
      ASSERT_TRUE(p.prediction_error().has_value()) << how;
      EXPECT_LE(std::abs(*p.prediction_error()), remat::kPredictionTolerance)
          << how << " step " << s << ": " << p.plan()->to_string() << " held " << p.last_peak_bytes()
          << " against " << p.predicted_peak_bytes();
    }
  }
  EXPECT_EQ(p.profiled_shapes(), 3);

  // A saved profile goes to the first call of its sizes, whatever its dtype (a chain records none; its
  // input_bytes are checked against the input's); a later call of those sizes in another dtype is profiled on
  // its own.
  const remat::Chain saved = *p.chain();  // the float64 one
  net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                                remat::PlannedOptions().budget(p.budget_bytes()));
  const remat::PlannedImpl& q = **net->planned;
  (*net->planned)->use_profile({{8, 32, 32}}, saved);  // the blocks' input
  for (int s = 0; s < 2; ++s)
    step(net, x.to(torch::kDouble));
  EXPECT_TRUE(q.is_planned());
  EXPECT_EQ(q.profiled_shapes(), 0);
  net->to(torch::kFloat);
  step(net, x);
  EXPECT_FALSE(q.is_planned());
  EXPECT_EQ(q.profiled_shapes(), 1);
}

// On a CPU device a stage that runs again (Fc) keeps its generators' states for its replay: the CPU
// generator's, 5,056 bytes, charged once per such stage. Before, run_plan kept them for every stage and
// Planned charged none (the tests' nets held 25 to 30 KB more than predicted, 2.7% to 5.7%). Then 1.1% above
// (the last of consecutive stages that run again kept its end state too); since its end state is a digest,
// 0.14% below.
TEST_F(PlannedTest, TheGeneratorStatesOfStagesThatRunAgainArePredictedOnTheCpu) {
  const int64_t w = 32, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 32, 8});
  torch::manual_seed(0);
  Net net(w, depth);
  net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                                remat::PlannedOptions().budget(plain_chain_peak(w, depth, x) * 4 / 10));
  for (int s = 0; s < 3; ++s)
    step(net, x);
  const remat::PlannedImpl& p = **net->planned;
  ASSERT_TRUE(p.is_planned());
  EXPECT_NE(p.plan()->to_string().find("Fc"), std::string::npos) << p.plan()->to_string();
  ASSERT_NE(p.step_readings(), nullptr);
  EXPECT_EQ(p.step_readings()->checkpoint_state_bytes,
            static_cast<int64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes()));
  // The head's backward hands the blocks a whole gradient (StepReadings::output_grad_storage_bytes read).
  EXPECT_EQ(p.step_readings()->output_grad_storage_bytes, p.step_readings()->output_grad_bytes);
  ASSERT_TRUE(p.prediction_error().has_value());
  EXPECT_LE(std::abs(*p.prediction_error()), remat::kPredictionTolerance)
      << p.plan()->to_string() << ": " << p.last_peak_bytes() << " against " << p.predicted_peak_bytes();
}

// Stages that read a buffer and then update it in place (an EMA): a checkpointed stage's recompute reads the
// copy its first run kept, which the step holds from that run to the recompute; the model charges the
// largest stage's copies on every checkpointed stage (checkpoint_state_bytes), as the Python package does
// (its rule for a layer's written buffers).
TEST_F(PlannedTest, AStageThatReadsAndUpdatesABufferIsRecomputedAsItsForwardFoundItAndItsCopyIsPredicted) {
  struct EmaImpl : torch::nn::Module {
    explicit EmaImpl(int64_t w) {
      fc1 = register_module("fc1", torch::nn::Linear(w, 4 * w));
      fc2 = register_module("fc2", torch::nn::Linear(4 * w, w));
      avg = register_buffer("avg", torch::full({64, w}, 0.5));  // 8 KiB at w = 32
    }
    torch::Tensor forward(const torch::Tensor& x) {
      torch::Tensor y = x + fc2(torch::gelu(fc1(x))) * (avg.mean(0) + 1);
      torch::NoGradGuard no_grad;
      avg.mul_(0.5).add_(x.mean(), 0.5);
      return y;
    }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
    torch::Tensor avg;
  };
  const int64_t w = 32, depth = 4;
  auto make = [&] {
    torch::manual_seed(0);
    std::vector<std::shared_ptr<EmaImpl>> blocks;
    for (int64_t i = 0; i < depth; ++i)
      blocks.push_back(std::make_shared<EmaImpl>(w));
    return blocks;
  };
  auto plain = make();
  auto blocks = make();
  std::vector<remat::StageFn> stages;
  for (const auto& b : blocks)
    stages.push_back({"ema", [b](const torch::Tensor& t) { return b->forward(t); }, b});
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 32, w});
  auto loss_of = [](const torch::Tensor& out) { return out.pow(2).mean(); };
  // The plain step's peak above its input, for a budget that checkpoints.
  int64_t plain_peak = 0;
  {
    const auto xs = x.clone().requires_grad_(true);
    const int64_t base = remat::memory::active_bytes();
    remat::memory::reset_peak();
    torch::Tensor h = xs;
    for (const auto& b : make())
      h = b->forward(h);
    loss_of(h).backward();
    plain_peak = remat::memory::peak_bytes() - base;
  }
  remat::Planned planned(stages, remat::PlannedOptions().budget(plain_peak * 5 / 10));
  for (int s = 0; s < 3; ++s) {
    const auto xp = x.clone().requires_grad_(true), xq = x.clone().requires_grad_(true);
    torch::Tensor h = xp;
    for (const auto& b : plain)
      h = b->forward(h);
    loss_of(h).backward();
    loss_of(planned->forward(xq)).backward();
    EXPECT_TRUE(torch::equal(xq.grad(), xp.grad())) << s;
    for (int64_t i = 0; i < depth; ++i) {
      EXPECT_TRUE(torch::equal(blocks[i]->avg, plain[i]->avg)) << s << " " << i;
      EXPECT_TRUE(torch::equal(blocks[i]->fc1->weight.grad(), plain[i]->fc1->weight.grad())) << s << " " << i;
      blocks[i]->zero_grad();
      plain[i]->zero_grad();
    }
  }
  const remat::PlannedImpl& p = *planned;
  ASSERT_TRUE(p.is_planned());
  EXPECT_NE(p.plan()->to_string().find("Fc"), std::string::npos) << p.plan()->to_string();
  ASSERT_NE(p.step_readings(), nullptr);
  EXPECT_EQ(p.step_readings()->checkpoint_state_bytes,
            static_cast<int64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes()) + 64 * w * 4);
  // Within the prediction, which charges each checkpointed stage the largest copy to its backward's end (the
  // copy goes at its recompute, and the recompute holds two more while it runs: safe, not exact; 2.3% high
  // here). Without the charge the step held 9,408 bytes above it.
  EXPECT_LE(p.last_peak_bytes(), p.predicted_peak_bytes()) << p.plan()->to_string();
  EXPECT_GE(p.last_peak_bytes(), p.predicted_peak_bytes() * 95 / 100) << p.plan()->to_string();
}

// PlannedOptions::agree gets every number the plan is made from (remat::plan_figures) and the plan is made
// from what it returns.
TEST_F(PlannedTest, AgreeReplacesTheNumbersThePlanIsMadeFrom) {
  const int64_t w = 32, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 32, 8});
  int agreed = 0, asked = 0;
  int64_t seen_input_bytes = 0;
  auto doubled = [&](std::vector<torch::Tensor>& numbers) {
    if (numbers.size() == 1 && numbers[0].numel() == 1) {
      // Each training call's one number: 2 where this rank's shape has no plan (at the profiling step), 1
      // where it has none for the gradients the step begins with, else 0 (every step here begins with them
      // none).
      EXPECT_EQ(numbers[0].item<int64_t>(), asked == 0 ? 2 : 0);
      ++asked;
      return;
    }
    ++agreed;
    ASSERT_EQ(numbers.size(), 2u);
    seen_input_bytes = numbers[0][0].item<int64_t>();
    // another rank that needs twice the memory: every byte count doubled (the flags, 0 or 1, kept)
    numbers[0] = torch::where(numbers[0] > 1, numbers[0] * 2, numbers[0]);
  };
  torch::manual_seed(0);
  Net net(w, depth);
  net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                                remat::PlannedOptions().budget(1 << 30).agree(doubled));
  step(net, x);
  const int64_t measured_saved = (*net->planned)->chain()->stages[0].saved_bytes;
  step(net, x);
  step(net, x);
  EXPECT_EQ(agreed, 1);                         // once, at the planning step
  EXPECT_EQ(asked, 3);                          // at each training call
  EXPECT_EQ(seen_input_bytes, 8 * 32 * w * 4);  // the chain's input: the blocks' float input, first
  EXPECT_EQ((*net->planned)->chain()->stages[0].saved_bytes, 2 * measured_saved);
  auto bad = [](std::vector<torch::Tensor>& numbers) {
    if (numbers.size() == 2) numbers.pop_back();
  };
  torch::manual_seed(0);
  Net other(w, depth);
  other->planned = remat::Planned(remat::stages_at<BlockImpl>(*other, {"h"}),
                                  remat::PlannedOptions().budget(1 << 30).agree(bad));
  step(other, x);
  EXPECT_THROW(step(other, x), c10::Error);
  // A budget no plan fits: planned once, at the call after the profiling step (on every rank alike, the
  // figures agreed), and that shape's error at each of its calls.
  int planning = 0;
  auto same = [&](std::vector<torch::Tensor>& numbers) { planning += numbers.size() == 2; };
  torch::manual_seed(0);
  Net tight(w, depth);
  tight->planned = remat::Planned(remat::stages_at<BlockImpl>(*tight, {"h"}),
                                  remat::PlannedOptions().budget(1).agree(same));
  step(tight, x);
  for (int k = 0; k < 2; ++k) {
    try {
      step(tight, x);
      ADD_FAILURE() << "a budget of 1 byte was planned";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("below the least feasible one"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(planning, 1);
}

// A loss that saves the chain's output (`square`) holds it through the last layer's backward, where the
// executor lets go of its own hold as that backward begins (the C++ profiler measures it so): what holding
// it adds is charged back there (Stage::bwd_output_freed_bytes, detail::output_held_back_bytes()). Before
// (found 2026-12-03), BertModel's planned steps held one hidden state above the prediction of every plan
// that kept the last layer (1.0-1.5%; its layers end in a LayerNorm, which does not save its output).
TEST_F(PlannedTest, ALossThatHoldsTheOutputThroughTheLastLayersBackwardIsPredicted) {
  const auto config = remat::models::BertConfig()
                          .vocab_size(60)
                          .hidden_size(64)
                          .num_hidden_layers(2)
                          .num_attention_heads(4)
                          .intermediate_size(256)
                          .max_position_embeddings(32)
                          .hidden_dropout_prob(0)
                          .attention_probs_dropout_prob(0);
  torch::manual_seed(0);
  remat::models::BertModel bert(config);
  const torch::Tensor ids = torch::randint(60, {8, 32});
  bert->gradient_checkpointing_enable(remat::PlannedOptions().budget(int64_t{1} << 40));  // every layer kept
  for (int s = 0; s < 3; ++s) {
    bert->zero_grad();
    bert->forward(ids).square().mean().backward();
  }
  const remat::PlannedImpl& p = *bert->planned();
  ASSERT_TRUE(p.prediction_error().has_value());
  EXPECT_GT(p.chain()->stages.back().bwd_output_freed_bytes, 0);
  // Not above it (exact on LibTorch 1.13; 0.17% below on 2.15); within 1% below.
  EXPECT_LE(*p.prediction_error(), 0.001)
      << p.plan()->to_string() << ": " << p.last_peak_bytes() << " against " << p.predicted_peak_bytes();
  EXPECT_GE(*p.prediction_error(), -0.01)
      << p.plan()->to_string() << ": " << p.last_peak_bytes() << " against " << p.predicted_peak_bytes();
}

// A C++ temporary holds the stages' output to the step's end: `bert->forward(ids).square().mean().backward()`
// keeps forward()'s result until the full expression ends, past the last layer's backward, so a plan that
// recomputes a layer after it holds that output beside the recompute. Planned reads whether the caller held
// it (StepReadings::outputs_held_to_end) and the model charges it to the step's end. Before (found
// 2026-12-03), it was not read, and at the least feasible budget (every layer but the last checkpointed, the
// recompute of the layer before the last its peak) the step held one hidden state above its prediction (+2.3%
// here; +1.5% on a 4-layer BertModel of width 128). A caller that lets go of it (the loss made in a statement
// of its own) reads false, charged as before.
TEST_F(PlannedTest, AnOutputTheCallerHoldsToTheStepsEndIsReadAndPredicted) {
  const auto config = remat::models::BertConfig()
                          .vocab_size(60)
                          .hidden_size(64)
                          .num_hidden_layers(4)
                          .num_attention_heads(4)
                          .intermediate_size(256)
                          .max_position_embeddings(128)
                          .hidden_dropout_prob(0)
                          .attention_probs_dropout_prob(0);
  torch::manual_seed(0);
  const torch::Tensor ids = torch::randint(60, {4, 128});
  for (const bool temporary : {true, false}) {
    const std::string what = temporary ? "output held to the end" : "output let go of";
    auto train = [&](remat::models::BertModel& bert) {
      bert->zero_grad();
      if (temporary) {
        bert->forward(ids).square().mean().backward();
      } else {
        torch::Tensor loss = bert->forward(ids).square().mean();
        loss.backward();
      }
    };
    // The least feasible budget, from a first model's profiling step.
    torch::manual_seed(0);
    remat::models::BertModel first(config);
    first->gradient_checkpointing_enable(remat::PlannedOptions().budget(int64_t{1} << 40));
    train(first);
    const remat::StepReadings* readings = first->planned()->step_readings();
    ASSERT_NE(readings, nullptr) << what;
    ASSERT_EQ(readings->outputs_held_to_end.size(), 4u) << what;
    EXPECT_EQ(readings->outputs_held_to_end.back(), temporary) << what;
    for (size_t j = 0; j + 1 < 4; ++j)
      EXPECT_FALSE(readings->outputs_held_to_end[j]) << what << ": stage " << j;
    const int64_t least = remat::min_step_budget(*first->planned()->chain(), remat::step_context(*readings));

    torch::manual_seed(0);
    remat::models::BertModel bert(config);
    bert->gradient_checkpointing_enable(remat::PlannedOptions().budget(least));
    for (int s = 0; s < 3; ++s)
      train(bert);
    const remat::PlannedImpl& p = *bert->planned();
    ASSERT_TRUE(p.prediction_error().has_value()) << what;
    EXPECT_LE(*p.prediction_error(), 0.001) << what << ": " << p.plan()->to_string() << ": "
                                            << p.last_peak_bytes() << " against " << p.predicted_peak_bytes();
    EXPECT_GE(*p.prediction_error(), -0.01) << what << ": " << p.plan()->to_string() << ": "
                                            << p.last_peak_bytes() << " against " << p.predicted_peak_bytes();
  }
}

namespace {

// The tests' tiny BERT, and a batch for it: token ids and a padding mask.
remat::models::BertConfig tiny_bert() {
  return remat::models::BertConfig()
      .vocab_size(60)
      .hidden_size(32)
      .num_hidden_layers(4)
      .num_attention_heads(4)
      .intermediate_size(64)
      .max_position_embeddings(32);
}
struct TinyBatch {
  torch::Tensor ids, mask;
};
TinyBatch tiny_bert_batch() {
  torch::manual_seed(1);
  TinyBatch b{torch::randint(60, {4, 24}), torch::ones({4, 24})};
  b.mask.narrow(1, 18, 6).zero_();
  return b;
}

// One step of `plain` and of `bert` (the same weights) from `seed`: the loss, the next draw and every
// gradient the plain one's, bitwise.
void expect_bert_step_as_plain(remat::models::BertModel& plain, remat::models::BertModel& bert,
                               const TinyBatch& in, uint64_t seed, const std::string& what) {
  std::vector<torch::Tensor> la, lb;
  for (remat::models::BertModel* m : {&plain, &bert}) {
    (*m)->zero_grad();
    torch::manual_seed(seed);
    torch::Tensor loss = (*m)->forward(in.ids, in.mask).pow(2).mean();
    loss.backward();
    (m == &plain ? la : lb).push_back(loss);
    (m == &plain ? la : lb).push_back(torch::rand({4}));
  }
  EXPECT_TRUE(torch::equal(la[0], lb[0]) && torch::equal(la[1], lb[1])) << what;
  const auto pa = plain->parameters(), pb = bert->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    if (!pa[i].grad().defined()) continue;  // the pooler
    EXPECT_TRUE(torch::equal(pa[i].grad(), pb[i].grad())) << what << ": gradient " << i;
  }
}

}  // namespace

// remat's own models in one line: gradient_checkpointing_enable(PlannedOptions).
TEST_F(PlannedTest, BertAndResNetPlanTheirBlocksInOneLineAndTrainAsThePlainModel) {
  using remat::models::BertConfig;
  using remat::models::BertModel;
  using remat::models::ResNet;
  const auto config = tiny_bert();
  const TinyBatch in = tiny_bert_batch();
  torch::manual_seed(0);
  BertModel plain(config);
  torch::manual_seed(0);
  BertModel bert(config);
  bert->gradient_checkpointing_enable(remat::PlannedOptions().budget(1 << 30));  // the one line
  EXPECT_EQ(bert->planned(), nullptr);
  for (int s = 0; s < 3; ++s)
    expect_bert_step_as_plain(plain, bert, in, 600 + s, "BERT step " + std::to_string(s));
  ASSERT_NE(bert->planned(), nullptr);
  EXPECT_TRUE(bert->planned()->is_planned());
  EXPECT_EQ(bert->planned()->chain()->size(), 4);
  // Its plan keeps every layer and peaks in the last layer's forward, where the executor keeps the
  // generators' state it took as the forward pass began (as plain bytes since 2026-12-05; before 2026-12-03,
  // a tensor not charged, 5,048 bytes above the prediction, 0.43%; then a tensor charged).
  ASSERT_TRUE(bert->planned()->prediction_error().has_value());
  EXPECT_LE(std::abs(*bert->planned()->prediction_error()), 0.001)
      << bert->planned()->plan()->to_string() << ": " << bert->planned()->last_peak_bytes() << " against "
      << bert->planned()->predicted_peak_bytes();
  EXPECT_EQ(bert->parameters().size(), plain->parameters().size());
  bert->eval();
  plain->eval();
  EXPECT_TRUE(torch::equal(bert->forward(in.ids, in.mask), plain->forward(in.ids, in.mask)));
  EXPECT_THROW(bert->gradient_checkpointing_enable(remat::PlannedOptions()), c10::Error);  // no budget

  torch::manual_seed(0);
  ResNet plain_net(1);
  torch::manual_seed(0);
  ResNet net(1);
  net->gradient_checkpointing_enable(remat::PlannedOptions().budget(1 << 30));
  torch::manual_seed(2);
  const torch::Tensor images = torch::randn({4, 3, 16, 16});
  for (int s = 0; s < 3; ++s) {
    plain_net->zero_grad();
    net->zero_grad();
    torch::Tensor la = plain_net->forward(images).pow(2).mean();
    la.backward();
    torch::Tensor lb = net->forward(images).pow(2).mean();
    lb.backward();
    EXPECT_TRUE(torch::equal(la, lb)) << "ResNet step " << s;
    const auto pa = plain_net->parameters(), pb = net->parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_TRUE(torch::equal(pa[i].grad(), pb[i].grad())) << "ResNet step " << s << " gradient " << i;
    const auto ba = plain_net->buffers(), bb = net->buffers();  // BatchNorm's statistics, updated once
    for (size_t i = 0; i < ba.size(); ++i)
      EXPECT_TRUE(torch::equal(ba[i], bb[i])) << "ResNet step " << s << " buffer " << i;
  }
  EXPECT_TRUE(net->planned()->is_planned());
  EXPECT_EQ(net->planned()->chain()->size(), 3);
  net->gradient_checkpointing_enable();  // back to per-block checkpointing
  EXPECT_EQ(net->planned(), nullptr);
}

}  // namespace

namespace {

namespace {

// A GPT of 4 layers and 4 heads with dropout 0.1, its vocabulary, sequence length and width as given.
gpt_example::GPTConfig small_gpt(int64_t vocab, int64_t block_size, int64_t width) {
  gpt_example::GPTConfig c;
  c.vocab_size = vocab;
  c.block_size = block_size;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_embd = width;
  c.dropout = 0.1;
  return c;
}

}  // namespace

// examples/gpt's model as users write it, its head tied to its token embedding: the head's backward leaves
// the embedding's partial gradient held through the blocks' backward (the embedding's gradient is summed at
// its last use), which the step's model charges (StepContext::rest_grads_bytes, from the profiling step's
// readings). Planned at three budgets between per-block checkpointing's peak and the plain step's, every
// planned step's peak is within the budget and within 2% of the prediction.
TEST_F(PlannedTest, ATiedGptStaysWithinTheBudgetAndThePrediction) {
  // A large tied embedding beside short sequences: its partial gradient (4 MiB) outweighs the logits, and the
  // step's peak comes at the end of the blocks' backward, where the blocks' gradients have arrived beside it.
  const gpt_example::GPTConfig c = small_gpt(4096, 32, 256);
  torch::manual_seed(3);
  const auto idx = torch::randint(0, c.vocab_size, {8, c.block_size});
  const auto targets = torch::randint(0, c.vocab_size, {8, c.block_size});
  // A step's peak above the bytes alive when the blocks start (Planned's base), as the GPT's loss runs it.
  auto peak_of = [&](gpt_example::GPT& gpt) {
    gpt->zero_grad();
    auto x = gpt->embed(idx);
    remat::memory::PeakWindow window;
    auto logits = gpt->head(gpt->blocks(x));
    torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), targets.view({-1})).backward();
    return window.peak_over_base();
  };
  torch::manual_seed(0);
  gpt_example::GPT gpt(c);
  peak_of(gpt);
  const int64_t plain = peak_of(gpt);
  gpt->checkpointing = remat::CheckpointOptions();
  const int64_t per_block = peak_of(gpt);
  ASSERT_LT(per_block, plain);
  for (double f : {0.6, 0.8, 0.95}) {
    const int64_t budget = per_block + static_cast<int64_t>(f * static_cast<double>(plain - per_block));
    torch::manual_seed(0);
    gpt_example::GPT planned(c);
    planned->gradient_checkpointing_enable(remat::PlannedOptions().budget(budget));
    for (int s = 0; s < 3; ++s) {
      planned->zero_grad();
      planned->loss(idx, targets).backward();
    }
    const remat::PlannedImpl& p = *planned->planned;
    ASSERT_TRUE(p.is_planned());
    // loss() lets go of the blocks' output, which ln_f saved: the head's backward frees it, as read when it
    // hands the blocks its gradient (counted back into what the head leaves held, the model letting go of it
    // once: without that the prediction was that output's bytes low through the blocks' backward).
    ASSERT_NE(p.step_readings(), nullptr);
    EXPECT_EQ(p.step_readings()->output_freed_bytes, 8 * c.block_size * c.n_embd * 4);
    EXPECT_LE(p.predicted_peak_bytes(), budget) << f;
    EXPECT_LE(p.last_peak_bytes(), budget) << f << ": " << p.plan()->to_string();
    EXPECT_LE(p.last_peak_bytes(), p.predicted_peak_bytes() + p.predicted_peak_bytes() / 50)
        << f << ": " << p.plan()->to_string();
    // The prediction holds both ways: the error each planned step reports is within 2% (issue 45).
    ASSERT_TRUE(p.prediction_error().has_value());
    EXPECT_DOUBLE_EQ(*p.prediction_error(), double(p.last_peak_bytes() - p.predicted_peak_bytes()) /
                                                double(p.predicted_peak_bytes()));
    EXPECT_LE(std::abs(*p.prediction_error()), remat::kPredictionTolerance)
        << f << ": " << p.plan()->to_string();
  }
}

}  // namespace

TEST_F(PlannedTest, OffloadingPlansKeptStagesWithWhatTheySaveOnTheHost) {
  // PlannerOptions::offload: the per-layer planner, each stage profiled for offloading; a plan with Fa@host
  // runs those stages under remat::Offload on Planned's host pool. The plan is made from a profile whose
  // checkpointing is made costly and whose copies are free, so that it follows the budget, not this machine's
  // timings: at half the plain peak, stages are kept with what they save on the host.
  const int64_t w = 64, depth = 6;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({16, 32, 8});
  const int64_t budget = plain_chain_peak(w, depth, x) / 2;
  remat::PlannerOptions offload;
  offload.offload = true;
  const auto options = remat::PlannedOptions().budget(budget).planner(offload).offload_min_bytes(64 << 10);
  // The chain a Planned net profiles at its first step with options `o`.
  auto profiled_with = [&](const remat::PlannedOptions& o) {
    torch::manual_seed(0);
    Net net(w, depth);
    net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), o);
    step(net, x);
    return *(*net->planned)->chain();
  };
  remat::Chain chain = profiled_with(options);
  ASSERT_TRUE(chain.can_offload());
  for (auto& s : chain.stages) {
    ASSERT_TRUE(s.offload.has_value()) << s.name;
    // What Fa keeps beyond the output goes (fc1's and fc2's inputs, GELU's input; the dropout mask and
    // LayerNorm's statistics are below the threshold); the output (a residual sum) is not saved, and its
    // input (the executor's leaf) never goes.
    EXPECT_GT(s.offload->bytes, (s.saved_bytes - s.output_bytes) / 2) << s.name;
    EXPECT_FALSE(s.offload->output);
    EXPECT_FALSE(s.offload->input);
    // Its stream figures: the forward's peak streamed at most the plain forward's (its working set: what it
    // saves leaves as it is made); the window, one of the hidden states it sends ([16, 32, 4w] floats).
    ASSERT_TRUE(s.offload->can_stream()) << s.name;
    EXPECT_LE(s.offload->stream_fwd_bytes, s.saved_bytes + s.fwd_tmp_bytes) << s.name;
    EXPECT_EQ(s.offload->window_bytes, 16 * 32 * 4 * w * 4) << s.name;
    // What comes back ahead of its backward with that window: the last tensor it sends, dropout's mask (a
    // float tensor of the hidden state's size); fc2's input, sent before it, would overfill the window.
    EXPECT_EQ(s.offload->ahead_bytes, 16 * 32 * w * 4) << s.name;
    s.checkpoint_fwd_ms = s.checkpoint_bwd_ms = 1e3;
    s.fwd_nosave_ms = 1e3;
  }
  // Streamed, below: here each stage kept with what it saves on the host, whole (no stream figures).
  const remat::Chain streamable = chain;
  for (auto& s : chain.stages) {
    s.offload->stream_fwd_bytes = s.offload->stream_bwd_bytes = -1;
    s.offload->window_bytes = 0;
  }
  chain.to_host_gb_per_s = chain.to_device_gb_per_s = 1e6;

  torch::manual_seed(0);
  Net plain(w, depth);
  // A Planned net on `profile`: every step the plain one's; once planned, the plan has `needle`, the measured
  // peak is within 2% of the prediction, and the pool's peak is the predicted host bytes (blocks rounded to
  // 512 bytes).
  auto run_on = [&](const remat::Chain& profile, const remat::PlannedOptions& o, const std::string& needle) {
    torch::manual_seed(0);
    Net net(w, depth);
    net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), o);
    (*net->planned)->use_profile({{16, 32, w}}, profile);
    for (int s = 0; s < 4; ++s) {
      torch::manual_seed(400 + s);
      const Step a = step(plain, x);
      torch::manual_seed(400 + s);
      const auto& pool = (*net->planned)->host_pool();
      pool->reset_peak();
      const Step b = step(net, x);
      const int64_t measured = remat::memory::peak_bytes() - net->base_bytes;
      expect_equal(a, b, needle + " step " + std::to_string(s));
      if (s < 2) continue;
      const remat::PlannedImpl& p = **net->planned;
      ASSERT_TRUE(p.is_planned());
      const std::string plan = p.plan()->to_string();
      EXPECT_NE(plan.find(needle), std::string::npos) << plan;
      EXPECT_LE(p.predicted_peak_bytes(), budget);
      EXPECT_LE(measured, p.predicted_peak_bytes() + p.predicted_peak_bytes() / 50) << plan;
      EXPECT_GE(pool->peak_bytes(), p.plan()->predicted.host_peak_bytes) << plan;
      EXPECT_LE(pool->peak_bytes(), p.plan()->predicted.host_peak_bytes + 512 * 8 * depth) << plan;
      EXPECT_EQ(pool->in_use_bytes(), 0);
    }
  };
  run_on(chain, options, "@host");
  // Streamed (Fa@stream, the plan's window per stage): each saved tensor sent as it is made and back just
  // ahead of its use; every step the plain one's, within 2% above the prediction (which charges the window
  // in full).
  remat::Chain streaming = streamable;
  for (auto& s : streaming.stages) {
    s.checkpoint_fwd_ms = s.checkpoint_bwd_ms = s.fwd_nosave_ms = 1e3;
  }
  streaming.to_host_gb_per_s = streaming.to_device_gb_per_s = 1e6;
  run_on(streaming, options, "@stream");
  // Under a policy: when keeping only the matmuls is what costs nothing, the plan keeps them on the host
  // (Fk[matmuls]@host: each stage's checkpoint sends its kept products to the stage's Offload).
  const auto with_policy = remat::PlannedOptions(options).policies({remat::policy::matmuls()});
  remat::Chain kept = profiled_with(with_policy);
  for (auto& s : kept.stages) {
    ASSERT_TRUE(s.policies.at(0).offload.has_value()) << s.name;
    s.fwd_ms = s.bwd_ms = 1.0;
    s.checkpoint_fwd_ms = s.checkpoint_bwd_ms = s.fwd_nosave_ms = 1e3;
    s.policies[0].fwd_ms = s.policies[0].bwd_ms = 0.0;
  }
  kept.to_host_gb_per_s = kept.to_device_gb_per_s = 1e6;
  run_on(kept, with_policy, "[matmuls]@host");
  // Group assignments (PlannedOptions::groups): when each block's saved groups are what pays to keep or send
  // (no Fa@host; recomputing a group or the block costly), the plan assigns them (Fk{...}) and names them,
  // and every step runs within 2% of its prediction.
  const auto with_groups = remat::PlannedOptions(options).groups(true);
  remat::Chain grouped = profiled_with(with_groups);
  for (auto& s : grouped.stages) {
    ASSERT_FALSE(s.groups.empty()) << s.name;
    s.offload.reset();
    s.checkpoint_fwd_ms = s.checkpoint_bwd_ms = s.fwd_nosave_ms = 1e3;
    for (auto& g : s.groups)
      g.recompute_ms = 1e3 / static_cast<double>(s.groups.size());
  }
  grouped.to_host_gb_per_s = grouped.to_device_gb_per_s = 1e6;
  run_on(grouped, with_groups, "{");
  // Bad options.
  Net bad(w, depth);
  EXPECT_THROW(remat::Planned(remat::stages_at<BlockImpl>(*bad, {"h"}),
                              remat::PlannedOptions().budget(budget).planner(offload).offload_min_bytes(-1)),
               c10::Error);
}

// A per-layer plan for `chain` drawn from `seed`, as text: each stage kept, checkpointed, kept or
// checkpointed with what it saves on the host, streamed, or under a group assignment whose groups are each
// kept, sent or recomputed (the ways the per-layer planner chooses among).
std::string drawn_plan(const remat::Chain& chain, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(rng); };
  std::string fwd, bwd;
  for (int64_t i = 0; i < chain.size(); ++i) {
    const std::string k = std::to_string(i);
    const char* ways[] = {"Fa", "Fc", "Fa@host", "Fc@host", "Fa@stream", "Fk"};
    std::string way = ways[pick(6)];
    const size_t at = way.find('@');
    way.insert(at == std::string::npos ? way.size() : at, k);
    if (way == "Fk" + k) {
      way += "{";
      for (size_t g = 0; g < chain.stages[static_cast<size_t>(i)].groups.size(); ++g)
        way += "khr"[pick(3)];
      way += "}";
    }
    fwd += way + " ";
    bwd = (way.rfind("Fc", 0) == 0 ? "Fa" + k + " " : "") + "B" + k + (bwd.empty() ? "" : " ") + bwd;
  }
  return fwd + "L " + bwd;
}

// The plans drawn per test: REMAT_DRAWN_PLANS, or `fallback`.
uint64_t drawn_plans(uint64_t fallback) {
  const char* env = std::getenv("REMAT_DRAWN_PLANS");
  return env != nullptr && *env != '\0' ? std::strtoull(env, nullptr, 10) : fallback;
}

// PlannedOptions::choose_plan: a plan of one's own, run, measured and checked as Planned's own. Plans drawn
// at random from one profile (each stage kept, checkpointed, kept or checkpointed with what it saves on the
// host, streamed, or under a group assignment whose groups are each kept, sent or recomputed: the mixes the
// planner may choose, whether or not this machine's timings make it choose them) run as the plain step and
// hold their predicted peaks exactly (Planned's own window, and the caller's), at most them where a stage
// streams (its window charged in full), the host pool what simulate() says (its blocks rounded to 512 bytes).
// Before (found 2026-12-05 by this test), a kept call that drew random numbers (dropout kept or sent) held
// the generators' state after it as a tensor, one CPU state above the prediction to its region's recompute,
// and a checkpointed stage was charged its state through the backward after its recompute, which the executor
// no longer holds (one state high). REMAT_DRAWN_PLANS=N draws N (default 24; 300 pass); REMAT_DRAWN_PLAN=text
// runs one plan.
TEST_F(PlannedTest, PlansOfOnesOwnRunAsPlannedAndDrawnMixesHoldAtMostTheirPredictions) {
  const int64_t w = 64, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 32, 8});
  remat::PlannerOptions offload;
  offload.offload = true;
  const auto options = remat::PlannedOptions()
                           .budget(int64_t{1} << 40)
                           .planner(offload)
                           .offload_min_bytes(16 << 10)
                           .groups(true);
  remat::Chain chain;
  {
    torch::manual_seed(0);
    Net net(w, depth);
    net->planned = remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), options);
    step(net, x);
    chain = *(*net->planned)->chain();
  }
  ASSERT_TRUE(chain.can_offload());
  for (const auto& s : chain.stages) {
    ASSERT_GE(s.groups.size(), 3u) << s.name;
    ASSERT_TRUE(s.offload && s.offload->can_stream()) << s.name;
  }
  torch::manual_seed(0);
  Net plain(w, depth);
  // One Planned net on the saved profile running `text`'s plan (its groups and windows named from the chain):
  // its readings step, then two planned steps, each the plain one's.
  auto run = [&](const std::string& text, int64_t budget) {
    remat::Plan plan = remat::testing::plan_of_text(depth, text);
    remat::testing::name_groups_and_windows(plan, chain);
    auto seen = std::make_shared<std::vector<int64_t>>();
    torch::manual_seed(0);
    Net net(w, depth);
    net->planned =
        remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}),
                       remat::PlannedOptions(options).budget(budget).choose_plan(
                           [plan, seen](const remat::Chain& c, const remat::StepContext&, int64_t b) {
                             EXPECT_EQ(c.size(), plan.num_stages);
                             seen->push_back(b);
                             return plan;
                           }));
    (*net->planned)->use_profile({{8, 32, w}}, chain);
    for (int s = 0; s < 3; ++s) {
      torch::manual_seed(500 + s);
      const Step a = step(plain, x);
      torch::manual_seed(500 + s);
      (*net->planned)->host_pool()->reset_peak();
      const Step b = step(net, x);
      const int64_t measured = remat::memory::peak_bytes() - net->base_bytes;
      expect_equal(a, b, text + " step " + std::to_string(s));
      if (s == 0) continue;
      const remat::PlannedImpl& p = **net->planned;
      EXPECT_EQ(p.plan()->to_string(), plan.to_string());
      EXPECT_EQ(*seen, std::vector<int64_t>{budget});  // called once, with the budget
      const remat::Simulation sim = remat::simulate(chain, plan);
      EXPECT_EQ(p.plan()->predicted.peak_bytes, sim.peak_bytes);
      // Exact but where a stage streams (its window charged in full; on the CPU each copy is made at once).
      if (text.find("@stream") == std::string::npos) {
        EXPECT_EQ(p.last_peak_bytes(), p.predicted_peak_bytes()) << text;
      } else {
        EXPECT_LE(p.last_peak_bytes(), p.predicted_peak_bytes()) << text;
      }
      EXPECT_EQ(measured, p.last_peak_bytes()) << text;  // Planned's window reads the caller's peak
      const auto& pool = p.host_pool();
      EXPECT_GE(pool->peak_bytes(), sim.host_peak_bytes) << text;
      EXPECT_LE(pool->peak_bytes(), sim.host_peak_bytes + 512 * 8 * depth) << text;
      EXPECT_EQ(pool->in_use_bytes(), 0);
    }
    return (*net->planned)->predicted_peak_bytes();
  };
  const uint64_t count = drawn_plans(24);
  if (const char* one = std::getenv("REMAT_DRAWN_PLAN"); one != nullptr && *one != '\0') {
    run(one, int64_t{1} << 40);  // a plan's text alone, to look into
    return;
  }
  for (uint64_t seed = 1; seed <= count && !HasFailure(); ++seed)
    run(drawn_plan(chain, seed), int64_t{1} << 40);
  // The budget bounds the plan's predicted peak: a plan above it is refused by name before it runs, and a
  // plan for another chain, or the function's own error, likewise.
  const std::string text = "Fa0 Fa1 Fa2 Fa3 L B3 B2 B1 B0";
  const int64_t kept = run(text, int64_t{1} << 40);
  EXPECT_THROW_WITH(run(text, kept - 1), "remat::Planned", "choose_plan", std::to_string(kept),
                    "above the budget");
  auto refused = [&](const std::function<remat::Plan()>& choose, const std::vector<std::string>& needles) {
    Net bad(w, depth);
    bad->planned = remat::Planned(
        remat::stages_at<BlockImpl>(*bad, {"h"}),
        remat::PlannedOptions(options).choose_plan(
            [choose](const remat::Chain&, const remat::StepContext&, int64_t) { return choose(); }));
    (*bad->planned)->use_profile({{8, 32, w}}, chain);
    step(bad, x);  // its readings step
    try {
      step(bad, x);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      for (const auto& needle : needles)
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([] { return remat::testing::plan_of_text(3, "Fa0 Fa1 Fa2 L B2 B1 B0"); },
          {"remat::Planned", "choose_plan's plan", "not one for the profiled stages"});
  refused([&] { return remat::testing::plan_of_text(depth, "Fk0{kkk} Fa1 Fa2 Fa3 L B3 B2 B1 B0"); },
          {"remat::Planned", "choose_plan's plan", "not one for the profiled stages"});
  refused([]() -> remat::Plan { throw std::runtime_error("no plan today"); },
          {"remat::Planned", "choose_plan threw", "no plan today"});
}

// The same with remat's BertModel (attention under a mask, its dropouts, layer norms): each model plans
// through choose_plan with a plan drawn from its own profile; every step the plain one's bitwise, each held
// at most at its prediction and within 20% below it. Of 200 drawn (REMAT_DRAWN_PLANS=200; REMAT_DRAWN_PEAKS=1
// prints each step's peaks), 148 and the first held it exactly and none above; every one below (up to 16.6%)
// sends something to the host (a group sent, a layer streamed), whose charges are bounds on the CPU
// (docs/planning.md). Before 2026-12-05, 127 and the first: a first layer checkpointed with its input on the
// host (`Fc0@host`) held one hidden state below, Planned taking its input as held by the caller (now read:
// StepReadings::input_held_in_backward; the last plan below). Before (found 2026-12-05 by this test), a
// stage's backward run by the executor held a 4-byte tensor (the root's input of its backward pass) above the
// prediction where it was the step's peak, and `Fc0 Fc1 Fa2 Fa3` was 5,048 bytes below (the forward pass's
// generator state, a tensor the first stage's own shared, charged apart: kept as bytes now). Before
// 2026-12-06, 92 of 200 were exact (the worst 19.8% below): the CPU's copies let go of their sources at once,
// where the model charges what a stage sends as on the device until the next stage's forward is done
// (OffloadOptions::hold_until_waited); the first plan below, 2.5% under its prediction then, is exact now.
TEST_F(PlannedTest, DrawnPlansOfBertsLayersHoldTheirPredictions) {
  using remat::models::BertConfig;
  using remat::models::BertModel;
  const auto config = tiny_bert();
  const TinyBatch in = tiny_bert_batch();
  torch::manual_seed(0);
  BertModel plain(config);
  remat::PlannerOptions offload;
  offload.offload = true;
  const uint64_t count = drawn_plans(8);
  for (uint64_t seed = 0; seed <= count + 1 && !HasFailure(); ++seed) {
    auto text = std::make_shared<std::string>();
    // Seed 0: layer 2 kept on the host, whose copies are in flight through layer 3's forward: the step's
    // peak. The last: every layer checkpointed, the first with its input on the host, which BertModel lets go
    // of once the layers' forward is done (gone from the loss to layer 1's backward).
    const std::string first = "Fa0 Fa1 Fa2@host Fa3 L B3 B2 B1 B0";
    const std::string last = "Fc0@host Fc1 Fc2 Fc3 L Fa3 B3 Fa2 B2 Fa1 B1 Fa0 B0";
    torch::manual_seed(0);
    BertModel bert(config);
    bert->gradient_checkpointing_enable(
        remat::PlannedOptions()
            .budget(int64_t{1} << 40)
            .planner(offload)
            .offload_min_bytes(2048)
            .groups(true)
            .choose_plan([seed, count, text, first, last](const remat::Chain& chain,
                                                          const remat::StepContext&, int64_t) {
              const char* one = std::getenv("REMAT_DRAWN_PLAN");  // a plan's text alone, to look into
              *text = one != nullptr && *one != '\0' ? std::string(one)
                      : seed == 0                    ? first
                      : seed == count + 1            ? last
                                                     : drawn_plan(chain, seed);
              remat::Plan plan = remat::testing::plan_of_text(chain.size(), *text);
              remat::testing::name_groups_and_windows(plan, chain);
              return plan;
            }));
    for (int s = 0; s < 3; ++s) {
      expect_bert_step_as_plain(plain, bert, in, 700 + s, *text + " step " + std::to_string(s));
      if (s == 0) continue;
      const remat::PlannedImpl& p = *bert->planned();
      EXPECT_LE(p.last_peak_bytes(), p.predicted_peak_bytes()) << *text;
      EXPECT_GE(p.last_peak_bytes(), p.predicted_peak_bytes() - p.predicted_peak_bytes() / 5) << *text;
      if (*text == first || *text == last) EXPECT_EQ(p.last_peak_bytes(), p.predicted_peak_bytes()) << *text;
      if (std::getenv("REMAT_DRAWN_PEAKS") != nullptr)  // each step's measured and predicted peak, to count
        std::printf("PEAK %s | %lld %lld\n", text->c_str(), static_cast<long long>(p.last_peak_bytes()),
                    static_cast<long long>(p.predicted_peak_bytes()));
    }
  }
}

namespace {

// A step with two training calls of a GPT before their backward passes (a paired loss): on the token ids `a`
// and on `b`, then one backward pass for both losses or one for each, the first call's first. `peak`: above
// the bytes alive when the blocks were first called (Planned's base), to the end of the last backward pass.
Step two_calls(gpt_example::GPT& gpt, const torch::Tensor& a, const torch::Tensor& b, bool one_backward,
               int64_t* peak) {
  for (auto& p : gpt->parameters())
    p.mutable_grad() = torch::Tensor();
  std::optional<remat::memory::PeakWindow> window;
  auto loss = [&](const torch::Tensor& idx) {
    torch::Tensor x = gpt->embed(idx);
    if (!window) window.emplace();
    const torch::Tensor logits = gpt->head(gpt->blocks(x));
    return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), idx.view({-1}));
  };
  Step s;
  torch::Tensor first = loss(a), second = loss(b);
  if (one_backward) {
    (first + second).backward();
  } else {
    first.backward();
    second.backward();
  }
  *peak = window->peak_over_base();
  s.loss = (first + second).detach();
  for (const auto& p : gpt->parameters())
    s.grads.push_back(p.grad().clone());
  s.next_draw = torch::rand({4});
  return s;
}

}  // namespace

TEST_F(PlannedTest, CallsBeforeOneBackwardPassRunInsideTheFirstCallsStepWhichHoldsTheirPeak) {
  // Each call was planned on its own, its base taken at its call: the first call's step holds the second's,
  // and with a backward pass for each call the second's came after the first call's step was over,
  // unmeasured. The second call now runs inside the first's step, checkpointed and said once; that step ends
  // once the second call's backward pass has, and its plan is made for the step with the second call in it.
  // At the peak of the same two calls with every block checkpointed: every step the plain run's, within the
  // budget and 2% of the prediction, and the planned step's measured peak is the whole step's.
  const gpt_example::GPTConfig c = small_gpt(65, 64, 64);
  torch::manual_seed(3);
  const auto a = torch::randint(0, c.vocab_size, {2, c.block_size});
  const auto b = torch::randint(0, c.vocab_size, {8, c.block_size});
  for (const bool one_backward : {true, false}) {
    SCOPED_TRACE(one_backward ? "one backward pass" : "a backward pass for each call");
    torch::manual_seed(0);
    gpt_example::GPT plain(c);
    int64_t plain_peak = 0, per_block = 0, peak = 0;
    torch::manual_seed(0);
    gpt_example::GPT per(c);
    per->checkpointing = remat::CheckpointOptions();
    two_calls(per, a, b, one_backward, &per_block);
    torch::manual_seed(0);
    gpt_example::GPT gpt(c);
    gpt->gradient_checkpointing_enable(remat::PlannedOptions().budget(per_block));
    std::vector<std::string> said;
    for (int s = 0; s < 2; ++s) {
      torch::manual_seed(100 + s);
      const Step want = two_calls(plain, a, b, one_backward, &plain_peak);
      torch::manual_seed(100 + s);
      remat::detail::compat::WarningCapture capture;
      const Step got = two_calls(gpt, a, b, one_backward, &peak);
      said.insert(said.end(), capture.messages.begin(), capture.messages.end());
      expect_equal(want, got, "step " + std::to_string(s));
      if (s == 0) continue;  // the profiling step
      const remat::PlannedImpl& p = *gpt->planned;
      ASSERT_TRUE(p.is_planned());
      EXPECT_EQ(p.last_peak_bytes(), peak) << p.plan()->to_string();
      EXPECT_LE(peak, per_block + per_block / 50) << p.plan()->to_string();
      const int64_t tolerance = p.predicted_peak_bytes() / 50;
      EXPECT_LE(peak, p.predicted_peak_bytes() + tolerance) << p.plan()->to_string();
      EXPECT_GE(peak, p.predicted_peak_bytes() - tolerance) << p.plan()->to_string();
    }
    ASSERT_EQ(said.size(), 1u);
    EXPECT_NE(said[0].find("earlier training call was alive"), std::string::npos) << said[0];
  }
}

// A budget that a step beginning with the gradients fits but one beginning without them (its backward makes
// them) does not: that step throws before anything runs, naming the gradients, and the plan for steps with
// them stays in force.
TEST_F(PlannedTest, ABudgetThatOnlyStepsWithTheGradientsFitSaysSo) {
  const int64_t w = 32, depth = 4;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({4, 32, 8});
  torch::manual_seed(0);
  Net net(w, depth, false);
  auto with_grads = [&] {
    for (auto& p : net->parameters())
      p.mutable_grad() = torch::zeros_like(p);  // as zero_grad(set_to_none=false) leaves them
  };
  // The least budgets of the two states, from a profile taken with the gradients (remat/planner/step.h).
  net->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(1 << 30));
  with_grads();
  net->loss(x).backward();
  const remat::StepContext ctx = remat::step_context(*(*net->planned)->step_readings());
  std::vector<int64_t> none(depth, 0);
  for (int64_t i = 0; i < depth; ++i)
    for (const auto& p : (*net->h)[i]->parameters())
      none[i] += static_cast<int64_t>(p.nbytes());
  const remat::Chain chain = *(*net->planned)->chain();
  const int64_t least_with = remat::min_step_budget(chain, ctx);
  const int64_t least_without = remat::min_step_budget(chain, remat::context_for_grads(ctx, none));
  ASSERT_GT(least_without, least_with * 11 / 10);
  const int64_t budget = (least_with + least_without) / 2;

  net->planned =
      remat::Planned(remat::stages_at<BlockImpl>(*net, {"h"}), remat::PlannedOptions().budget(budget));
  with_grads();
  net->loss(x).backward();  // the profiling step
  net->loss(x).backward();
  const remat::PlannedImpl& p = **net->planned;
  ASSERT_TRUE(p.is_planned());
  const std::string plan = p.plan()->to_string();
  EXPECT_LE(p.last_peak_bytes(), budget);
  for (auto& q : net->parameters())
    q.mutable_grad() = torch::Tensor();
  try {
    net->loss(x);
    FAIL() << "a budget below the least feasible one for the state was accepted";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    for (const std::string& words :
         {std::string("remat::Planned: the budget of ") + std::to_string(budget) +
              " bytes is below the least",
          std::string("parameter gradients none, which its backward pass makes; the plan in force, ") + plan})
      EXPECT_NE(what.find(words), std::string::npos) << what;
  }
  for (const auto& q : net->parameters())
    EXPECT_FALSE(q.grad().defined());
  with_grads();
  net->loss(x).backward();
  EXPECT_EQ(p.plan()->to_string(), plan);
  EXPECT_LE(p.last_peak_bytes(), budget);
}
