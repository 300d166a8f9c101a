// Builds against remat's planner library alone (remat::planner, no LibTorch): a chain from JSON, a strategy
// from its string, the plan, its prediction and its JSON read back.
#include <remat/planner/chain.h>  // the path before include/remat/planner/: a forwarding header that keeps working
#include <remat/planner/planner.h>
#include <remat/planner/report.h>
#include <remat/planner/strategy.h>

#include <iostream>

int main() {
  const remat::Chain chain = remat::chain_from_json(R"({"input_bytes": 1000, "stages": [
    {"name": "l0", "fwd_ms": 1, "bwd_ms": 2, "output_bytes": 1000, "saved_bytes": 4000},
    {"name": "l1", "fwd_ms": 1, "bwd_ms": 2, "output_bytes": 1000, "saved_bytes": 4000},
    {"name": "l2", "fwd_ms": 1, "bwd_ms": 2, "output_bytes": 1000, "saved_bytes": 4000},
    {"name": "l3", "fwd_ms": 1, "bwd_ms": 2, "output_bytes": 1000, "saved_bytes": 4000}]})");
  const remat::Plan none = remat::make_plan(chain, "none", 0);
  const remat::Plan plan = remat::plan_strategy(remat::parse_strategy("optimal:overhead=0.5"), chain);
  if (plan.predicted.peak_bytes >= none.predicted.peak_bytes) {
    std::cerr << "planner_consumer: the plan saves nothing (" << plan.predicted.peak_bytes << " bytes)\n";
    return 1;
  }
  const remat::PlanSummary summary = remat::summarize_plan(chain, plan);
  const remat::Plan back = remat::plan_from_json(remat::to_json(summary));
  if (back.ops != plan.ops) {
    std::cerr << "planner_consumer: the plan's JSON does not read back\n";
    return 1;
  }
  std::cout << "planner_consumer: ok; " << plan.to_string() << " peaks at " << plan.predicted.peak_bytes
            << " bytes (" << none.predicted.peak_bytes << " without checkpointing)\n";
  return 0;
}
