// A picture of the step, as data (remat/planner/timeline.h): the step's course operation by operation, as
// step_peak_bytes() and plan_step() predict it. Plain C++.
#include <gtest/gtest.h>

#include <remat/planner/planner.h>
#include <remat/planner/step.h>
#include <remat/planner/timeline.h>

#include <algorithm>
#include <random>

#include "planner_support.h"

namespace {

TEST(Timeline, IsTheStepsPredictedCourseOperationByOperation) {
  std::mt19937 rng(7);
  const remat::Chain chain = random_keep_chain(rng, 5, 1000);
  remat::StepContext ctx;
  ctx.rest_peak_bytes = 3000;
  ctx.rest_ms = 4;
  ctx.rest_grads_bytes = 500;
  ctx.stage_grads_bytes = {100, 100, 100, 100, 100};
  ctx.before_saved_bytes = 700;
  const int64_t budget = (remat::min_step_budget(chain, ctx, "per-layer") +
                          remat::step_peak_bytes(chain, ctx, remat::no_checkpoint(chain))) /
                         2;
  const remat::StepPlan planned = remat::plan_step(chain, ctx, budget, "per-layer");
  const remat::StepTimeline t = remat::step_timeline(chain, ctx, planned.plan);
  // The step's operations: the part before the chain, the plan's, the rest of the step around the loss.
  ASSERT_EQ(t.points.size(), planned.plan.ops.size() + 4);
  EXPECT_EQ(t.points.front().op, "before");
  EXPECT_EQ(t.points.back().op, "B(before)");
  EXPECT_EQ(t.plan, planned.plan.to_string());
  size_t plan_op = 0;
  for (const remat::StepPoint& p : t.points) {
    if (p.stage == -1 || p.stage == chain.size()) continue;
    EXPECT_EQ(p.op, remat::op_text(planned.plan, planned.plan.ops[plan_op])) << plan_op;
    ++plan_op;
  }
  // Its peak is the step's predicted peak, and it ends at the step's predicted time.
  int64_t peak = 0;
  for (const remat::StepPoint& p : t.points)
    peak = std::max(peak, p.peak_bytes);
  EXPECT_EQ(peak, planned.step_peak_bytes);
  EXPECT_EQ(t.peak_bytes, planned.step_peak_bytes);
  EXPECT_NEAR(t.time_ms, planned.step_time_ms, 1e-9);
  for (size_t k = 1; k < t.points.size(); ++k)
    EXPECT_EQ(t.points[k].start_ms, t.points[k - 1].end_ms);
  // Each stage's way is its first forward's, without the stage's number.
  ASSERT_EQ(t.ways.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const remat::Op& first = planned.plan.ops[i];
    ASSERT_EQ(first.stage, static_cast<int64_t>(i));
    EXPECT_EQ(t.ways[i], first.kind == remat::OpKind::kForwardAll          ? "Fa"
                         : first.kind == remat::OpKind::kForwardCheckpoint ? "Fc"
                                                                           : "Fk");
  }
  const std::string json = remat::step_timeline_json(t, budget);
  EXPECT_NE(json.find("\"budget_bytes\": " + std::to_string(budget)), std::string::npos) << json;
  EXPECT_NE(json.find("\"op\": \"B(after)\""), std::string::npos);
}

}  // namespace
