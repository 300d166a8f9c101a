#pragma once
// What the harness's sources share (private to the harness).

#include <remat/bench.h>

#include <optional>
#include <vector>

namespace remat::harness {

/// The loss of a step under a strategy: the model's own forward (plain or per-layer), or the plan executor.
struct Runner {
  Workload& w;
  std::optional<Plan> plan;
  std::vector<StageFn> stages;
  torch::Tensor step_loss() { return w.loss_of(plan ? run_plan(stages, *plan, w.input()) : w.forward()); }
};

/// Sets the model's per-layer checkpointing for a strategy: on with its options for the per-layer ones, off
/// for "none" and the plans.
void configure(Workload& w, const Strategy& strategy, const std::optional<Plan>& plan);

/// Gradients exist after a first step; allocates them up front so that no measured step counts them.
void allocate_grads(Workload& w);

/// Each strategy's plan (nullopt for those the model runs itself), on `given` or on the chain profiled once
/// if a plan needs it (stored in *chain_used when non-null).
std::vector<std::optional<Plan>> plans_for(Workload& w, const std::vector<Strategy>& strategies,
                                           const ProfileOptions* profile, const Progress& progress,
                                           const Chain* given, std::optional<Chain>* chain_used = nullptr);

/// Every strategy string parsed (bench_strategy).
std::vector<Strategy> parse_all(const std::vector<std::string>& strategies);

}  // namespace remat::harness
