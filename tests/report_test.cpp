// What remat plan, remat profile and remat sweep report (remat/report.h): a plan beside its baselines and its
// JSON, the memory of a step and the verdict, the trade-off curve.
#include <gtest/gtest.h>

#include <remat/planner/planner.h>
#include <remat/planner/report.h>
#include <remat/planner/strategy.h>

#include <algorithm>
#include <string>

#include "planner_support.h"

namespace {

// Three stages: a_0 = 100, each stage's output 100 and saved 1000 bytes, 1 ms forward and 2 ms backward.
remat::Chain three() {
  return remat::uniform_chain(3, 1.0, 2.0, 100, 1000);
}

TEST(PlanSummary, FiguresAreThoseOfThePlannersAndSimulate) {
  const remat::Chain chain = three();
  const remat::Plan plan = remat::checkpoint_all(chain);
  const remat::PlanSummary s = remat::summarize_plan(chain, plan);
  const remat::Plan none = remat::no_checkpoint(chain);
  EXPECT_EQ(s.plan.ops, plan.ops);
  EXPECT_EQ(s.plan.predicted.peak_bytes, plan.predicted.peak_bytes);
  EXPECT_EQ(s.baseline_peak_bytes, none.predicted.peak_bytes);
  EXPECT_EQ(s.baseline_time_ms, 9.0);
  EXPECT_DOUBLE_EQ(s.time_overhead, plan.predicted.time_ms / 9.0 - 1);
  EXPECT_DOUBLE_EQ(s.time_overhead, 3.0 / 9.0);  // every forward once more
  EXPECT_EQ(s.min_feasible_budget_bytes, remat::min_feasible_budget(chain));
  EXPECT_EQ(s.stages_recomputed, 3);
  EXPECT_EQ(remat::summarize_plan(chain, none).stages_recomputed, 0);
  EXPECT_FALSE(s.step_peak_bytes.has_value());
}

TEST(PlanSummary, TheWholeStepAroundTheChain) {
  const remat::Chain chain = three();
  remat::Chain step = remat::uniform_chain(5, 1.0, 2.0, 100, 1000);
  step.input_bytes = 40;
  step.stages[0].saved_bytes = 5000;  // the prefix keeps much for its backward
  const remat::Plan plan = remat::checkpoint_all(chain);
  const remat::PlanSummary s = remat::summarize_plan(chain, plan, &step);
  ASSERT_TRUE(s.step_peak_bytes && s.step_baseline_peak_bytes);
  EXPECT_EQ(*s.step_peak_bytes, remat::simulate(step, remat::step_plan(plan)).peak_bytes);
  EXPECT_EQ(*s.step_baseline_peak_bytes,
            remat::simulate(step, remat::step_plan(remat::no_checkpoint(chain))).peak_bytes);
  EXPECT_GT(*s.step_peak_bytes, s.plan.predicted.peak_bytes);  // the prefix's 5000 bytes are held under it
  const remat::Chain wrong = remat::uniform_chain(4, 1.0, 2.0, 100, 1000);
  EXPECT_THROW_WITH_STD(remat::summarize_plan(chain, plan, &wrong),
                        "the step has 4 stages, but the chain has 3");
}

TEST(PlanSummary, JsonHasThePlansOwnKeysAndTheFiguresAndReadsBack) {
  remat::Chain chain = three();
  chain.keep = {"matmul"};
  for (auto& st : chain.stages) {
    st.keep_saved_bytes = 300;
    st.keep_fwd_ms = 1.0;
    st.keep_bwd_ms = 2.5;
  }
  // At the peak of keeping every stage's kept outputs, the fastest schedule keeps some (Fk).
  const int64_t budget = remat::make_plan(chain, "all-keep-matmul", 0).predicted.peak_bytes;
  const remat::Plan plan = remat::optimal(chain, budget);
  ASSERT_GT(plan.count(remat::OpKind::kForwardKeep), 0) << plan.to_string();
  const std::string json = remat::to_json(remat::summarize_plan(chain, plan));
  for (const char* key : {"\"num_stages\"", "\"planner\"", "\"budget_bytes\"", "\"ops\"", "\"predicted\"",
                          "\"keep\"", "\"predicted_peak_bytes\"", "\"predicted_time_ms\"",
                          "\"forward_calls\"", "\"baseline_peak_bytes\"", "\"baseline_time_ms\"",
                          "\"time_overhead\"", "\"min_feasible_budget_bytes\"", "\"stages_recomputed\""})
    EXPECT_NE(json.find(key), std::string::npos) << key << " in " << json;
  EXPECT_EQ(json.find("step_predicted_peak_bytes"), std::string::npos);
  // One writer: the summary's JSON is the plan's JSON with more keys, and reads back as the plan.
  const remat::Plan back = remat::plan_from_json(json);
  EXPECT_EQ(back.ops, plan.ops);
  EXPECT_EQ(back.keep, plan.keep);
  EXPECT_EQ(back.planner, plan.planner);
  EXPECT_EQ(back.budget_bytes, budget);
  EXPECT_EQ(back.predicted.peak_bytes, plan.predicted.peak_bytes);
  EXPECT_EQ(remat::to_json(back), remat::to_json(plan));
}

TEST(ChainOfStep, IsTheStagesBetweenPrefixAndSuffix) {
  remat::Chain step = remat::uniform_chain(4, 1.0, 2.0, 100, 1000);
  step.stages[0].output_bytes = 70;
  step.stages[1].name = "inner0";
  const remat::Chain inner = remat::chain_of_step(step);
  ASSERT_EQ(inner.size(), 2);
  EXPECT_EQ(inner.input_bytes, 70);
  EXPECT_EQ(inner.stages[0].name, "inner0");
  EXPECT_THROW_WITH_STD(remat::chain_of_step(remat::uniform_chain(2, 1, 1, 1, 1)), "remat::chain_of_step",
                        "got 2 stages");
}

TEST(MemoryBreakdown, AddsUpThePartsOfAStep) {
  const remat::Chain chain = three();
  const auto m = remat::memory_breakdown(chain, 4000, 3000, remat::Optimizer::kAdam);
  EXPECT_EQ(m.parameters, 4000);
  EXPECT_EQ(m.gradients, 3000);
  EXPECT_EQ(m.optimizer, 6000);  // Adam: two buffers per trainable byte
  EXPECT_EQ(m.optimizer_name, "adam");
  EXPECT_EQ(m.inputs, 100);
  EXPECT_EQ(m.activations, remat::no_checkpoint(chain).predicted.peak_bytes - 100);
  EXPECT_EQ(m.least_activations, remat::min_feasible_budget(chain) - 100);
  EXPECT_EQ(m.per_layer_activations, remat::checkpoint_all(chain).predicted.peak_bytes - 100);
  EXPECT_EQ(m.total(), 4000 + 3000 + 6000 + 100 + m.activations);
  EXPECT_EQ(m.saving(), m.activations - m.least_activations);
  EXPECT_GT(m.saving(), 0);
  EXPECT_DOUBLE_EQ(m.percent(m.total()), 100.0);
  EXPECT_EQ(remat::memory_breakdown(chain, 4000, 3000, remat::Optimizer::kSgdMomentum).optimizer, 3000);
  EXPECT_EQ(remat::memory_breakdown(chain, 4000, 3000, remat::Optimizer::kNone).optimizer, 0);
}

TEST(MemoryBreakdown, TheVerdictSaysWhatDominates) {
  const remat::Chain chain = three();
  const auto heavy_weights = remat::memory_breakdown(chain, 1 << 20, 1 << 20, remat::Optimizer::kAdam);
  EXPECT_TRUE(heavy_weights.weights_dominate());
  const std::string w = heavy_weights.verdict();
  EXPECT_NE(w.find("checkpointing can save at most"), std::string::npos) << w;
  EXPECT_NE(w.find("the weights dominate"), std::string::npos) << w;
  const auto light_weights = remat::memory_breakdown(chain, 10, 10, remat::Optimizer::kNone);
  EXPECT_FALSE(light_weights.weights_dominate());
  EXPECT_NE(light_weights.verdict().find("activations dominate"), std::string::npos);
  EXPECT_THROW_WITH_STD(remat::memory_breakdown(chain, 10, 20, remat::Optimizer::kNone),
                        "remat::memory_breakdown", "trainable_bytes (20) <= parameter_bytes (10)");
  EXPECT_THROW_WITH_STD(remat::parse_optimizer("rmsprop"), "unknown optimizer 'rmsprop'", "adam");
  EXPECT_EQ(remat::parse_optimizer("sgd-momentum"), remat::Optimizer::kSgdMomentum);
}

TEST(Sweep, CurveIsMonotoneAndBaselinesArePoints) {
  const remat::Chain chain = remat::uniform_chain(12, 1.0, 2.0, 1000, 4000);
  const auto points = remat::sweep(chain, 10);
  ASSERT_EQ(points.size(), 10u + 3 + 7);
  for (size_t i = 1; i < 10; ++i) {
    EXPECT_GE(points[i].budget_bytes, points[i - 1].budget_bytes);
    EXPECT_LE(points[i].predicted_time_ms, points[i - 1].predicted_time_ms + 1e-9);
    EXPECT_LE(points[i].predicted_peak_bytes, points[i].budget_bytes);
  }
  EXPECT_EQ(points[9].overhead, 0.0);
  EXPECT_EQ(points[10].name, "none");
  EXPECT_THROW_WITH_STD(remat::sweep(chain, 1), "remat::sweep", "budgets must be >= 2");
  const std::string csv = remat::sweep_csv(points, "twelve");
  EXPECT_EQ(csv.rfind("# twelve\nkind,name,budget_bytes,predicted_peak_bytes,predicted_time_ms,overhead,"
                      "input_bytes\noptimal,optimal,",
                      0),
            0u)
      << csv;
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 2 + 20);
}

}  // namespace
