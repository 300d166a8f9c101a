// The one strategy grammar (remat/strategy.h): every word parsed to its meaning, every malformed string an
// error naming it, and the plan each strategy resolves to equal to the planner it names.
#include <gtest/gtest.h>

#include <remat/planner/planner.h>
#include <remat/planner/strategy.h>

#include <sstream>
#include <string>

#include "planner_support.h"

namespace {

using remat::OptimalBudget;
using remat::parse_strategy;
using remat::plan_strategy;
using remat::StrategyKind;

TEST(Strategy, ParsesEveryWord) {
  EXPECT_EQ(parse_strategy("none").kind, StrategyKind::kNone);
  const auto all = parse_strategy("all");
  EXPECT_EQ(all.kind, StrategyKind::kPerLayer);
  EXPECT_FALSE(all.reentrant);
  EXPECT_TRUE(all.early_stop);
  EXPECT_TRUE(all.keep.empty());
  EXPECT_TRUE(parse_strategy("all-reentrant").reentrant);
  EXPECT_FALSE(parse_strategy("all-no-early-stop").early_stop);
  EXPECT_EQ(parse_strategy("all-keep-matmul").keep, std::vector<std::string>{"matmul"});
  EXPECT_EQ(parse_strategy("all-keep-conv").keep, std::vector<std::string>{"conv"});
  EXPECT_EQ(parse_strategy("all-policy-matmuls").policy, "matmuls");
  EXPECT_TRUE(parse_strategy("all-policy-matmuls").per_layer());
  const auto excluded = parse_strategy("optimal:300MiB/no-Fk[matmuls]/no-Fk");
  EXPECT_EQ(excluded.exclude, (std::vector<std::string>{"Fk[matmuls]", "Fk"}));
  EXPECT_EQ(excluded.budget_bytes, 300 << 20);
  EXPECT_EQ(excluded.text, "optimal:300MiB/no-Fk[matmuls]/no-Fk");
  EXPECT_EQ(parse_strategy("plan-all").kind, StrategyKind::kPlanAll);
  EXPECT_EQ(parse_strategy("selective").kind, StrategyKind::kSelective);
  EXPECT_EQ(parse_strategy("sqrt").kind, StrategyKind::kSqrt);
  const auto u = parse_strategy("uniform:4");
  EXPECT_EQ(u.kind, StrategyKind::kUniform);
  EXPECT_EQ(u.count, 4);
  EXPECT_EQ(parse_strategy("balanced:3").kind, StrategyKind::kBalanced);
  EXPECT_EQ(parse_strategy("balanced-time:2").kind, StrategyKind::kBalancedTime);
  EXPECT_EQ(parse_strategy("revolve:0").count, 0);
  EXPECT_EQ(parse_strategy("revolve").count, -1);
  EXPECT_EQ(parse_strategy("optimal").budget, OptimalBudget::kGiven);
  const auto bytes = parse_strategy("optimal:1.5KiB");
  EXPECT_EQ(bytes.budget, OptimalBudget::kBytes);
  EXPECT_EQ(bytes.budget_bytes, 1536);
  const auto as = parse_strategy("optimal:as=uniform:3");
  EXPECT_EQ(as.budget, OptimalBudget::kAs);
  ASSERT_TRUE(as.as);
  EXPECT_EQ(as.as->kind, StrategyKind::kUniform);
  EXPECT_EQ(parse_strategy("optimal:overhead=0.5").factor, 0.5);
  EXPECT_EQ(parse_strategy("optimal:time=1.2").budget, OptimalBudget::kTime);
  EXPECT_EQ(parse_strategy("optimal:overhead=0.5").text, "optimal:overhead=0.5");
}

TEST(Strategy, WhatEachKindNeeds) {
  EXPECT_FALSE(parse_strategy("none").needs_chain());
  EXPECT_FALSE(parse_strategy("all-reentrant").needs_chain());
  EXPECT_TRUE(parse_strategy("all").per_layer());
  EXPECT_FALSE(parse_strategy("plan-all").per_layer());
  EXPECT_TRUE(parse_strategy("plan-all").needs_chain());
  EXPECT_TRUE(parse_strategy("optimal").needs_budget());
  EXPECT_TRUE(parse_strategy("revolve").needs_budget());
  EXPECT_FALSE(parse_strategy("optimal:1MiB").needs_budget());
  EXPECT_FALSE(parse_strategy("revolve:3").needs_budget());
  EXPECT_TRUE(parse_strategy("per-layer").needs_budget());
  EXPECT_FALSE(parse_strategy("per-layer:1MiB").needs_budget());
  EXPECT_TRUE(parse_strategy("per-layer").needs_chain());
  EXPECT_FALSE(parse_strategy("per-layer").per_layer());  // a plan, not "all"'s own per-layer calls
}

// The list in help texts and the parser agree: every word of kStrategyWords parses once its placeholders are
// filled in.
TEST(Strategy, EveryListedWordParses) {
  std::string list = remat::kStrategyWords;
  list = list.substr(0, list.find(';'));  // the modifiers come after the words
  std::stringstream words(list);
  int parsed = 0;
  for (std::string w; std::getline(words, w, ',');) {
    w.erase(0, w.find_first_not_of(' '));
    for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{{"TAG", "matmul"},
                                                                                   {"SIZE", "1MiB"},
                                                                                   {":K", ":2"},
                                                                                   {":S", ":2"},
                                                                                   {"=P", "=sqrt"},
                                                                                   {"=F", "=0.5"},
                                                                                   {"=R", "=1.1"}}) {
      const size_t at = w.find(from);
      if (at != std::string::npos) w.replace(at, from.size(), to);
    }
    EXPECT_NO_THROW(parse_strategy(w)) << w;
    ++parsed;
  }
  EXPECT_EQ(parsed, 21);
}

TEST(Strategy, MalformedStringsNameThemselvesAndWhatWasExpected) {
  EXPECT_THROW_WITH_STD(parse_strategy("fastest"), "remat::parse_strategy", "unknown strategy 'fastest'",
                        "uniform:K", "optimal:overhead=F");
  EXPECT_THROW_WITH_STD(parse_strategy("uniform:x"), "'uniform:x'", "whole number");
  EXPECT_THROW_WITH_STD(parse_strategy("uniform:"), "'uniform:'", "whole number");
  EXPECT_THROW_WITH_STD(parse_strategy("uniform:2.5"), "'uniform:2.5'", "whole number");
  EXPECT_THROW_WITH_STD(parse_strategy("uniform:-1"), "'uniform:-1'", "whole number");
  EXPECT_THROW_WITH_STD(parse_strategy("uniform:0"), "'uniform:0'", "must be >= 1");
  EXPECT_THROW_WITH_STD(parse_strategy("balanced-time:0"), "'balanced-time:0'", "must be >= 1");
  EXPECT_THROW_WITH_STD(parse_strategy("revolve:x"), "'revolve:x'", "snapshots");
  EXPECT_THROW_WITH_STD(parse_strategy("optimal:lots"), "'optimal:lots'",
                        "a size, as=P, overhead=F or time=R");
  EXPECT_THROW_WITH_STD(parse_strategy("optimal:overhead=-1"), "'optimal:overhead=-1'", "non-negative");
  EXPECT_THROW_WITH_STD(parse_strategy("optimal:time=fast"), "'optimal:time=fast'", "non-negative number");
  EXPECT_THROW_WITH_STD(parse_strategy("optimal:as=optimal"), "'optimal:as=optimal'", "needs a budget");
  EXPECT_THROW_WITH_STD(parse_strategy("optimal:as=fastest"), "unknown strategy 'fastest'");
  EXPECT_THROW_WITH_STD(parse_strategy("all-keep-"), "'all-keep-'", "remat::keep tag");
  EXPECT_THROW_WITH_STD(parse_strategy(""), "unknown strategy ''");
  EXPECT_THROW_WITH_STD(parse_strategy("all-policy-"), "'all-policy-'", "a policy's name");
  EXPECT_THROW_WITH_STD(parse_strategy("optimal:1MiB/fast"), "expected /no-Fk or /no-Fk[NAME]", "'/fast'");
  EXPECT_THROW_WITH_STD(parse_strategy("optimal:1MiB/no-Fk[]"), "expected /no-Fk or /no-Fk[NAME]");
  EXPECT_THROW_WITH_STD(parse_strategy("per-layer:lots"), "'per-layer:lots'", "expected a size");
}

TEST(Strategy, EachStrategyIsThePlannerItNames) {
  const remat::Chain chain = remat::uniform_chain(9, 1.0, 2.0, 1000, 3000);
  auto plan = [&](const std::string& s, int64_t budget = -1) {
    return plan_strategy(parse_strategy(s), chain, budget);
  };
  EXPECT_EQ(plan("none").ops, remat::no_checkpoint(chain).ops);
  // "all" means per-layer checkpointing everywhere: as a plan, checkpoint_all, as "plan-all" is.
  EXPECT_EQ(plan("all").ops, remat::checkpoint_all(chain).ops);
  EXPECT_EQ(plan("all-reentrant").ops, remat::checkpoint_all(chain).ops);
  EXPECT_EQ(plan("plan-all").ops, remat::checkpoint_all(chain).ops);
  EXPECT_EQ(plan("sqrt").ops, remat::sqrt_n(chain).ops);
  EXPECT_EQ(plan("uniform:3").ops, remat::uniform(chain, 3).ops);
  EXPECT_EQ(plan("uniform:3").planner, "uniform:3");
  EXPECT_EQ(plan("balanced:3").ops, remat::balanced(chain, 3, remat::Balance::kMemory).ops);
  EXPECT_EQ(plan("balanced-time:3").ops, remat::balanced(chain, 3, remat::Balance::kTime).ops);
  EXPECT_EQ(plan("revolve:2").ops, remat::revolve(chain, 2).ops);
  EXPECT_EQ(plan("revolve", 8000).ops, remat::revolve_within(chain, 8000).ops);
  EXPECT_EQ(plan("optimal", 8000).ops, remat::optimal(chain, 8000).ops);
  EXPECT_EQ(plan("optimal", 8000).planner, "optimal");
  const remat::Plan sized = plan("optimal:20KiB");
  EXPECT_LE(sized.predicted.peak_bytes, 20 * 1024);
  EXPECT_EQ(sized.planner, "optimal:20KiB");
  EXPECT_EQ(sized.ops, remat::optimal(chain, 20 * 1024).ops);
  const remat::Plan as = plan("optimal:as=uniform:3");
  EXPECT_LE(as.predicted.peak_bytes, remat::uniform(chain, 3).predicted.peak_bytes);
  EXPECT_LE(as.predicted.time_ms, remat::uniform(chain, 3).predicted.time_ms);
  const auto none = remat::no_checkpoint(chain), all = remat::checkpoint_all(chain);
  EXPECT_LE(plan("optimal:overhead=0.5").predicted.time_ms,
            none.predicted.time_ms + 0.5 * (all.predicted.time_ms - none.predicted.time_ms) + 1e-9);
  EXPECT_LT(plan("optimal:overhead=0.5").predicted.peak_bytes, none.predicted.peak_bytes);
  EXPECT_LE(plan("optimal:time=1.2").predicted.time_ms, 1.2 * none.predicted.time_ms + 1e-9);
  EXPECT_EQ(plan("per-layer", 16000).ops, remat::per_layer(chain, 16000).ops);
  EXPECT_EQ(plan("per-layer", 16000).planner, "per-layer");
  EXPECT_EQ(plan("per-layer:20KiB").ops, remat::per_layer(chain, 20 * 1024).ops);
  EXPECT_EQ(plan("per-layer:20KiB").planner, "per-layer:20KiB");
  // make_plan is the two steps in one.
  EXPECT_EQ(remat::make_plan(chain, "optimal:as=uniform:3", 0).ops, as.ops);
}

TEST(Strategy, BudgetsAndRefusals) {
  const remat::Chain chain = remat::uniform_chain(9, 1.0, 2.0, 1000, 3000);
  EXPECT_THROW_WITH_STD(plan_strategy(parse_strategy("optimal"), chain), "remat::plan_strategy",
                        "'optimal' plans within a budget, and none was given");
  EXPECT_THROW_WITH_STD(plan_strategy(parse_strategy("revolve"), chain), "'revolve' plans within a budget");
  EXPECT_THROW_WITH_STD(plan_strategy(parse_strategy("per-layer"), chain),
                        "'per-layer' plans within a budget");
  EXPECT_THROW(plan_strategy(parse_strategy("per-layer"), chain, 10), remat::InfeasibleBudget);
  EXPECT_THROW(plan_strategy(parse_strategy("optimal:10B"), chain), remat::InfeasibleBudget);
  EXPECT_THROW(plan_strategy(parse_strategy("optimal"), chain, 10), remat::InfeasibleBudget);
  EXPECT_THROW_WITH_STD(plan_strategy(parse_strategy("uniform:12"), chain), "strategy 'uniform:12'",
                        "segments must be in [1, 9]");
  EXPECT_THROW_WITH_STD(plan_strategy(parse_strategy("selective"), chain), "'selective'",
                        "this chain has none");
  EXPECT_THROW_WITH_STD(plan_strategy(parse_strategy("all-keep-matmul"), chain), "'all-keep-matmul'",
                        "keep tag 'matmul'", "this chain has none");
}

TEST(Strategy, SelectiveCheckpointsTheAttentionCoresOnly) {
  remat::Chain chain = remat::uniform_chain(4, 1.0, 2.0, 1000, 3000);
  chain.stages[1].name = "layer0.attention_core";
  chain.stages[3].name = "layer1.attention_core";
  const remat::Plan p = plan_strategy(parse_strategy("selective"), chain);
  EXPECT_EQ(p.ops, remat::checkpoint_stages(4, {1, 3}).ops);
  EXPECT_EQ(p.planner, "selective");
  EXPECT_EQ(p.predicted.forward_calls, (std::vector<int64_t>{1, 2, 1, 2}));
}

TEST(Strategy, KeepingEveryLayersMatmulsIsEveryStageAsFk) {
  remat::Chain chain = remat::uniform_chain(3, 1.0, 2.0, 100, 1000);
  chain.keep = {"matmul"};
  for (auto& s : chain.stages) {
    s.keep_saved_bytes = 300;
    s.keep_fwd_ms = 1.0;
    s.keep_bwd_ms = 2.5;
  }
  const remat::Plan p = plan_strategy(parse_strategy("all-keep-matmul"), chain);
  EXPECT_EQ(p.to_string(), "Fk0 Fk1 Fk2 L B2 B1 B0");
  EXPECT_EQ(p.keep, chain.keep);
  EXPECT_EQ(p.predicted.time_ms, 3 * (1.0 + 2.5));
  EXPECT_THROW_WITH_STD(plan_strategy(parse_strategy("all-keep-conv"), chain), "keep tag 'conv'",
                        "this chain has 'matmul'");
  chain.stages[1].keep_saved_bytes.reset(), chain.stages[1].keep_fwd_ms.reset(),
      chain.stages[1].keep_bwd_ms.reset();
  EXPECT_THROW_WITH_STD(plan_strategy(parse_strategy("all-keep-matmul"), chain), "stage 1",
                        "no keep_ fields");
}

TEST(Strategy, PoliciesPerLayerAndExclusions) {
  remat::Chain chain = remat::uniform_chain(3, 1.0, 2.0, 100, 1000);
  chain.policies = {"matmuls"};
  for (auto& st : chain.stages)
    st.policies.push_back({"matmuls", 300, 1.0, 2.5});
  const remat::Plan p = plan_strategy(parse_strategy("all-policy-matmuls"), chain);
  EXPECT_EQ(p.to_string(), "Fk0[matmuls] Fk1[matmuls] Fk2[matmuls] L B2 B1 B0");
  EXPECT_EQ(p.policies, chain.policies);
  EXPECT_THROW_WITH_STD(plan_strategy(parse_strategy("all-policy-attention_core"), chain),
                        "needs a chain profiled under policy 'attention_core'");
  // At a budget where Fk[matmuls] is the fastest schedule, /no-Fk[matmuls] plans without it.
  const int64_t budget = p.predicted.peak_bytes;
  EXPECT_GT(plan_strategy(parse_strategy("optimal"), chain, budget).count(remat::OpKind::kForwardKeep), 0);
  for (const char* s : {"optimal/no-Fk[matmuls]", "optimal/no-Fk"})
    EXPECT_EQ(plan_strategy(parse_strategy(s), chain, budget).count(remat::OpKind::kForwardKeep), 0) << s;
}

}  // namespace
