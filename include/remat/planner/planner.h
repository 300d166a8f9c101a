#pragma once
/// \file
/// Planners: given a chain (remat/planner/chain.h), return a Plan (remat/planner/plan.h). They all have one
/// shape, take the chain and budget as plain data, and fill plan.predicted through simulate(). No torch
/// headers.
///
///   remat::Chain chain = remat::profile_chain(seq, x);              // or load_chain("model.json")
///   remat::Plan plan = remat::optimal(chain, 256 << 20);            // fastest schedule within 256 MiB
///   std::cout << plan.predicted.peak_bytes << " bytes, " << plan.predicted.time_ms << " ms\n";
///
/// Baselines: no_checkpoint (keep everything), checkpoint_all (every stage is a checkpoint, like per-layer
/// torch.utils.checkpoint), uniform (like checkpoint_sequential), sqrt_n (Chen et al. 2016). optimal is the
/// persistent dynamic program of Beaumont, Eyraud-Dubois, Herrmann, Joly and Shilova (2019), multi-level;
/// revolve is Griewank and Walther's binomial checkpointing for long homogeneous chains.

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace remat {

/// Options of optimal().
struct PlannerOptions {
  /// Memory is discretised into this many slots: unit = floor(budget / slots) bytes, and every size becomes
  /// ceil(size / unit) slots, so a schedule that fits in slots fits in bytes. Time and table memory grow
  /// linearly with it. At least 1.
  int64_t slots = 500;
  /// Also simulate the baselines (exactly, in bytes) and return one when it fits the budget and is faster
  /// than the dynamic program's schedule, which can happen when rounding to slots costs a little memory.
  bool compare_baselines = true;
  /// Operations the planner may not use: "Fk" (no Fk at all), "Fk[tags]" (no Fk with the remat::keep tags),
  /// "Fk[NAME]" (no Fk under policy NAME; names the chain does not have are ignored). optimal() and
  /// min_feasible_budget() honour it; the baselines and revolve use no Fk. Throws std::invalid_argument (from
  /// the planner) for any other text.
  std::vector<std::string> exclude;
  /// The per-layer planner (per_layer(), plan_step()'s "per-layer") may also offload a stage: run it as Fa,
  /// Fk or Fc with what it saves sent to host memory (Fa3@host, ...; see remat/planner/plan.h), where the
  /// chain has the stage's OffloadCost for that way and both bandwidths. Planners that recompute across
  /// stages (optimal(), min_feasible_budget(), plan_step()'s "optimal") refuse it (std::invalid_argument).
  bool offload = false;
  /// With offload: the most host memory the plan may hold (bytes; Simulation::host_peak_bytes); -1: no bound.
  int64_t max_host_bytes = -1;
  /// The per-layer planner may run a stage that has saved groups (Stage::groups) under a group assignment
  /// (Fk3{khr}: each group kept, sent to the host, or recomputed; 'h' only with offload), choosing among
  /// every assignment for the least time within the budget. The other planners ignore groups.
  bool groups = true;
  /// The threads the per-layer planner (per_layer(), per_layer_min_budget(), plan_step()'s "per-layer") makes,
  /// sorts and filters a stage's candidates on, the caller's among them: 0, the cores this process may run on
  /// (its CPU affinity on Linux), at most 8; 1, the caller's thread alone. The plan is the same for any count
  /// (the candidates are merged in one total order); only the planning time changes. Throws std::invalid_argument
  /// (from the planner) below 0 or above 1024. The other planners run on the caller's thread.
  int threads = 0;
};

/// Thrown when no schedule fits the budget. what() states the minimum.
class InfeasibleBudget : public std::invalid_argument {
 public:
  InfeasibleBudget(const std::string& what, int64_t budget_bytes, int64_t min_bytes)
      : std::invalid_argument(what), budget_bytes_(budget_bytes), min_bytes_(min_bytes) {}
  int64_t budget_bytes() const { return budget_bytes_; }
  /// The smallest budget for which a schedule exists (bytes).
  int64_t min_bytes() const { return min_bytes_; }

 private:
  int64_t budget_bytes_;
  int64_t min_bytes_;
};

/// A planner by name, in the one strategy grammar of remat/planner/strategy.h ("none", "all", "sqrt",
/// "uniform:K", "balanced:K", "balanced-time:K", "optimal", "optimal:SIZE", "revolve", "revolve:S", ...):
/// plan_strategy(parse_strategy(planner), chain, budget_bytes, options). budget_bytes is the budget of
/// "optimal" and "revolve". Throws std::invalid_argument for an unknown or malformed name (naming it), and
/// what the planner throws (InfeasibleBudget when nothing fits).
Plan make_plan(const Chain& chain, const std::string& planner, int64_t budget_bytes,
               const PlannerOptions& options = {});

/// Checks PlannerOptions::exclude's texts as the planners read them ("Fk", "Fk[tags]", "Fk[NAME]" with NAME a
/// policy name), before any chain is at hand: remat::Planned and Python's remat.enable check at construction
/// what would otherwise fail at the first plan. Throws std::invalid_argument naming `who` and the first text
/// that is none of these.
void check_exclude(const std::vector<std::string>& exclude, const char* who);

}  // namespace remat

// Every planner, so that this header gives them all as it always has.
#include <remat/planner/baselines.h>
#include <remat/planner/optimal.h>
#include <remat/planner/per_layer.h>
#include <remat/planner/revolve.h>
