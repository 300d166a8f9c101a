// Plan: text, JSON, and simulate() charging exactly the model of plan.h.
#include <gtest/gtest.h>

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>

namespace {

using remat::OpKind;

remat::Plan parse(int64_t n, const std::string& text) {
  remat::Plan p;
  p.num_stages = n;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(' ', at);
    if (end == std::string::npos) end = text.size();
    p.ops.push_back(remat::parse_op(text.substr(at, end - at), p.policies));
    at = end + 1;
  }
  return p;
}

remat::Chain two_stage() {
  remat::Chain c;
  c.input_bytes = 10;
  c.stages.push_back({"s0", 1.0, 2.0, 100, 150, 7, 11});
  c.stages.push_back({"s1", 3.0, 5.0, 20, 60, 13, 17});
  return c;
}

TEST(Plan, ToStringAndParseOp) {
  const auto p = parse(2, "Fc0 Fa1 L B1 Fa0 B0");
  EXPECT_EQ(p.to_string(), "Fc0 Fa1 L B1 Fa0 B0");
  EXPECT_EQ(p.count(OpKind::kForwardAll), 2);
  EXPECT_THROW(remat::parse_op("F3"), std::invalid_argument);
  EXPECT_THROW(remat::parse_op("Fa"), std::invalid_argument);
  EXPECT_THROW(remat::parse_op("B-1"), std::invalid_argument);
}

TEST(Plan, SimulateChargesTheModelExactly) {
  const auto c = two_stage();
  const auto sim = remat::simulate(c, parse(2, "Fc0 Fa1 L B1 Fa0 B0"));
  // Fc0: 10 + 100 + 7 = 117; then {a0, a1}: 110. Fa1: 110 + 60 + 13 = 183; then 170.
  // L: 170 + 20 = 190. B1: 190 + d_1 (100) + 17 = 307; frees abar_2, d_2, a_1: 10 + 100 = 110.
  // Fa0: 110 + 150 + 7 = 267; then 260. B0: 260 + d_0 (10) + 11 = 281.
  EXPECT_EQ(sim.peak_bytes, 307);
  EXPECT_EQ(sim.peak_op, 3);
  EXPECT_DOUBLE_EQ(sim.time_ms, 1 + 3 + 2 + 5 + 1);
  EXPECT_EQ(sim.forward_calls, (std::vector<int64_t>{2, 1}));
}

TEST(Plan, ForwardsWithoutSavingCostTheirOwnTime) {
  auto c = two_stage();
  c.stages[0].fwd_nosave_ms = 0.25;  // Fn and Fc cost this; Fa keeps costing fwd_ms
  const auto sim = remat::simulate(c, parse(2, "Fc0 Fa1 L B1 Fa0 B0"));
  EXPECT_DOUBLE_EQ(sim.time_ms, 0.25 + 3 + 2 + 5 + 1);
}

TEST(Plan, ForwardsWithoutSavingHoldTheirOwnTransient) {
  auto c = two_stage();
  const auto plan = parse(2, "Fc0 Fa1 L B1 Fa0 B0");
  c.stages[0].fwd_nosave_tmp_bytes = 250;  // Fc0: 10 + 100 + 250; Fa0 keeps fwd_tmp_bytes (267, as above)
  auto sim = remat::simulate(c, plan);
  EXPECT_EQ(sim.peak_bytes, 360);
  EXPECT_EQ(sim.peak_op, 0);
  EXPECT_EQ(sim.op_peak_bytes[4], 267);
  c.stages[0].fwd_nosave_tmp_bytes = 0;  // less than fwd_tmp_bytes: Fc0 at 110, the peak B1's again
  sim = remat::simulate(c, plan);
  EXPECT_EQ(sim.op_peak_bytes[0], 110);
  EXPECT_EQ(sim.peak_bytes, 307);
}

TEST(Plan, PerCallTimeChargesTheMeasuredCheckpointCosts) {
  auto c = two_stage();
  // Unset: a checkpointed stage costs a forward without saving plus a full recompute and its backward.
  EXPECT_DOUBLE_EQ(remat::per_call_time_ms(c, {}), 1 + 2 + 3 + 5);
  EXPECT_DOUBLE_EQ(remat::per_call_time_ms(c, {1}), 1 + 2 + (3 + 3 + 5));
  c.stages[1].checkpoint_fwd_ms = 2.5;
  c.stages[1].checkpoint_bwd_ms = 6.5;  // early stopping: less than fwd_ms + bwd_ms
  EXPECT_DOUBLE_EQ(remat::per_call_time_ms(c, {1}), 1 + 2 + 2.5 + 6.5);
  EXPECT_THROW(remat::per_call_time_ms(c, {2}), std::invalid_argument);
  EXPECT_THROW(remat::per_call_time_ms(c, {1, 1}), std::invalid_argument);
}

TEST(Plan, CheckPlanNamesTheOperationAndWhatIsMissing) {
  auto expect_bad = [](int64_t n, const std::string& text, const std::string& needle) {
    try {
      remat::check_plan(parse(n, text));
      ADD_FAILURE() << "accepted: " << text;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_bad(2, "Fa1 L B1 B0", "operation 0 (Fa1) needs a_1");
  expect_bad(2, "Fa0 Fa1 B1 L B0", "operation 2 (B1) comes before the loss");
  expect_bad(2, "Fa0 Fa1 L B0", "needs d_1");
  expect_bad(2, "Fa0 Fc1 L B1", "needs abar_2");
  expect_bad(2, "Fa0 Fa1 L L B1 B0", "comes a second time");
  expect_bad(2, "Fa0 Fa1 L B1", "ends before d_0");
  expect_bad(2, "Fa0 Fa1 L B1 B0 Fa0", "runs after stage 0's backward");
  expect_bad(2, "Fa0 Fa0 Fa1 L B1 B0", "already held");
  expect_bad(2, "Fa0 Fa5 L", "names stage 5");
}

TEST(Plan, SimulateRejectsAChainOfAnotherSize) {
  EXPECT_THROW(remat::simulate(two_stage(), parse(3, "Fa0 Fa1 Fa2 L B2 B1 B0")), std::invalid_argument);
}

TEST(Plan, JsonRoundTrip) {
  const auto c = two_stage();
  const remat::Plan p = remat::optimal(c, 400);
  const remat::Plan q = remat::plan_from_json(remat::to_json(p));
  EXPECT_EQ(q.ops, p.ops);
  EXPECT_EQ(q.num_stages, 2);
  EXPECT_EQ(q.planner, "optimal");
  EXPECT_EQ(q.budget_bytes, 400);
  EXPECT_EQ(q.predicted.peak_bytes, p.predicted.peak_bytes);
  EXPECT_EQ(q.predicted.forward_calls, p.predicted.forward_calls);
  EXPECT_THROW(remat::plan_from_json(R"({"num_stages": 2, "ops": ["Fa0", "X"]})"), std::invalid_argument);
  EXPECT_THROW(remat::plan_from_json(R"({"num_stages": 2, "ops": ["Fa0", "Fa1", "L", "B1"]})"),
               std::invalid_argument);
  EXPECT_THROW(remat::plan_from_json("nope"), std::invalid_argument);
}

}  // namespace

namespace {
TEST(PlanKeep, FkChargesWhatItKeepsAndItsBackwardTheRecompute) {
  auto c = two_stage();
  c.keep = {"matmul"};
  c.stages[1].keep_saved_bytes = 35;  // of saved_bytes 60: output 20 and 15 kept
  c.stages[1].keep_fwd_ms = 3.5;
  c.stages[1].keep_bwd_ms = 6.0;
  const auto p = parse(2, "Fa0 Fk1 L B1 B0");
  EXPECT_EQ(p.to_string(), "Fa0 Fk1 L B1 B0");
  EXPECT_EQ(remat::parse_op("Fk12").kind, OpKind::kForwardKeep);
  const auto sim = remat::simulate(c, p);
  // Fa0: 10 + 150 + 7 = 167, then 160. Fk1: 160 + 35 + 13 = 208, then 195. L: 195 + 20 = 215.
  // B1 recomputes the other 25 bytes: 215 + 25 + d_1 (100) + 17 = 357; frees 35, d_2: 260. B0: 260 + 10 + 11.
  EXPECT_EQ(sim.peak_bytes, 357);
  EXPECT_EQ(sim.peak_op, 3);
  EXPECT_DOUBLE_EQ(sim.time_ms, 1 + 3.5 + 6.0 + 2);
  EXPECT_EQ(sim.forward_calls, (std::vector<int64_t>{1, 1}));
  // Its forward without saving measured: Fk1 holds above what it keeps at most the less of that (10 bytes:
  // 160 + 35 + 10) and what Fa1 would hold beyond it (25 + 13 = 38: 160 + 35 + 38).
  auto m = c;
  m.stages[1].fwd_nosave_tmp_bytes = 10;
  EXPECT_EQ(remat::simulate(m, p).op_peak_bytes[1], 205);
  m.stages[1].fwd_nosave_tmp_bytes = 100;
  EXPECT_EQ(remat::simulate(m, p).op_peak_bytes[1], 233);
  // Stage 0 has no keep_ fields: Fk0 cannot be charged.
  try {
    remat::simulate(c, parse(2, "Fk0 Fa1 L B1 B0"));
    ADD_FAILURE() << "Fk0 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("operation 0 (Fk0) runs stage 0 ('s0') with kept calls"),
              std::string::npos)
        << e.what();
  }
  remat::check_plan(parse(2, "Fk0 Fa1 L B1 B0"));  // valid without a chain
}

TEST(PlanKeep, KeepTagsTravelThroughJsonAndAreRequired) {
  auto c = two_stage();
  c.keep = {"matmul"};
  for (auto& s : c.stages) {
    s.keep_saved_bytes = s.output_bytes;
    s.keep_fwd_ms = s.fwd_ms;
    s.keep_bwd_ms = s.fwd_ms + s.bwd_ms;
  }
  const remat::Chain back = remat::chain_from_json(remat::to_json(c));
  EXPECT_EQ(back.keep, c.keep);
  EXPECT_EQ(back.stages[1].keep_saved_bytes, 20);
  EXPECT_EQ(back.stages[1].keep_bwd_ms, 8.0);
  remat::Plan p = parse(2, "Fk0 Fk1 L B1 B0");
  p.keep = {"matmul"};
  EXPECT_EQ(remat::plan_from_json(remat::to_json(p)).keep, p.keep);
  p.keep.clear();
  EXPECT_THROW(remat::plan_from_json(remat::to_json(p)), std::invalid_argument);
  // A stage with some keep_ fields, or keep_ fields without the chain's tags, is invalid.
  auto partial = c;
  partial.stages[0].keep_bwd_ms.reset();
  EXPECT_THROW(remat::validate(partial), std::invalid_argument);
  auto untagged = c;
  untagged.keep.clear();
  EXPECT_THROW(remat::validate(untagged), std::invalid_argument);
  auto below = c;
  below.stages[0].keep_saved_bytes = 99;  // < output_bytes 100
  EXPECT_THROW(remat::validate(below), std::invalid_argument);
  EXPECT_THROW(remat::chain_from_json(R"({"input_bytes": 1, "keep": [1], "stages": [{"fwd_ms": 1, "bwd_ms": 1,
      "output_bytes": 1, "saved_bytes": 1}]})"),
               std::invalid_argument);
}

// Fk under an operator-level policy: the chain's costs under it, the name in the plan's text and JSON.
TEST(PlanPolicy, FkUnderAPolicyChargesItsCostsAndTravelsByName) {
  auto c = two_stage();
  c.policies = {"matmuls", "attention_core"};
  for (auto& s : c.stages) {
    s.policies.push_back({"matmuls", s.output_bytes + 10, s.fwd_ms + 0.5, s.fwd_ms + s.bwd_ms});
    s.policies.push_back({"attention_core", s.output_bytes + 20, s.fwd_ms, s.bwd_ms + 1.0});
  }
  const auto p = parse(2, "Fa0 Fk1[attention_core] L B1 B0");
  EXPECT_EQ(p.policies, std::vector<std::string>{"attention_core"});
  EXPECT_EQ(p.ops[1].policy, 0);
  EXPECT_EQ(p.to_string(), "Fa0 Fk1[attention_core] L B1 B0");
  const auto sim = remat::simulate(c, p);
  // Fk1 keeps 20 + 20 = 40: 160 + 40 + 13 = 213, then 200; L: 220; B1 recomputes the other 20: 220 + 20 + 100
  // + 17.
  EXPECT_EQ(sim.peak_bytes, 357);
  EXPECT_DOUBLE_EQ(sim.time_ms, 1 + 3.0 + (5.0 + 1.0) + 2);
  // JSON both ways: the names in the ops, and the list.
  const auto back = remat::plan_from_json(remat::to_json(p));
  EXPECT_EQ(back.ops, p.ops);
  EXPECT_EQ(back.policies, p.policies);
  EXPECT_NE(remat::to_json(p).find("\"Fk1[attention_core]\""), std::string::npos);
  const remat::Chain cb = remat::chain_from_json(remat::to_json(c));
  EXPECT_EQ(cb.policies, c.policies);
  ASSERT_EQ(cb.stages[1].policies.size(), 2u);
  EXPECT_EQ(cb.stages[1].policies[1].saved_bytes, 40);
  EXPECT_EQ(cb.stages[1].policies[0].fwd_ms, 3.5);
  // A chain not profiled under the plan's policy cannot charge it.
  auto other = c;
  other.policies = {"matmuls", "recompute_pointwise"};
  for (auto& s : other.stages)
    s.policies[1].policy = "recompute_pointwise";
  try {
    remat::simulate(other, p);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("policy 'attention_core', which the chain was not profiled under"),
              std::string::npos)
        << e.what();
  }
  // parse_op alone cannot resolve a name; a malformed one is not an operation.
  EXPECT_THROW(remat::parse_op("Fk1[matmuls]"), std::invalid_argument);
  std::vector<std::string> names;
  EXPECT_THROW(remat::parse_op("Fa1[matmuls]", names), std::invalid_argument);
  EXPECT_THROW(remat::parse_op("Fk1[a b]", names), std::invalid_argument);
  EXPECT_EQ(remat::parse_op("Fk1[x]", names).policy, 0);
  EXPECT_EQ(remat::parse_op("Fk0[y]", names).policy, 1);
  EXPECT_EQ(remat::parse_op("Fk0[x]", names).policy, 0);
  // A plan naming a policy index it does not have is invalid.
  auto broken = p;
  broken.policies.clear();
  EXPECT_THROW(remat::check_plan(broken), std::invalid_argument);
}

TEST(PlanPolicy, ValidationOfPolicyCosts) {
  auto c = two_stage();
  c.policies = {"matmuls"};
  c.stages[0].policies.push_back({"matmuls", 120, 1.0, 3.0});
  EXPECT_NO_THROW(remat::validate(c));  // stage 1 was not profiled under it: no Fk[matmuls] there
  auto wrong = c;
  wrong.stages[0].policies[0].policy = "other";
  EXPECT_THROW(remat::validate(wrong), std::invalid_argument);
  auto below = c;
  below.stages[0].policies[0].saved_bytes = 99;
  EXPECT_THROW(remat::validate(below), std::invalid_argument);
  auto twice = c;
  twice.policies = {"matmuls", "matmuls"};
  twice.stages[0].policies.push_back({"matmuls", 120, 1.0, 3.0});
  EXPECT_THROW(remat::validate(twice), std::invalid_argument);
  auto unnamed = c;
  unnamed.policies = {"no good"};
  unnamed.stages[0].policies[0].policy = "no good";
  EXPECT_THROW(remat::validate(unnamed), std::invalid_argument);
}
}  // namespace
