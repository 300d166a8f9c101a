#pragma once
/// \file
/// A picture of a planned step, as data (timeline.cpp): each operation of the step with its predicted start,
/// end and peak, each stage's way, the budget. What Python's LayerPlan.plot and `python -m remat plot`, and
/// the command's `remat plan --plot`, draw (scripts/plot_step.py). No torch headers.
///
///   remat::StepTimeline t = remat::step_timeline(chain, context, plan);
///   std::string json = remat::step_timeline_json(t, budget_bytes);   // for scripts/plot_step.py

#include <cstdint>
#include <string>
#include <vector>

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/step.h>

namespace remat {

/// One operation of a planned step.
struct StepPoint {
  /// The operation as a plan writes it, with the chain's stage numbers ("Fc3", "Fk2[matmuls]@host", "B3",
  /// "L"), or "before" / "after" (their forward) and "B(before)" / "B(after)" for what surrounds the chain.
  std::string op;
  /// The chain's stage it runs (-1: the part before the chain; the chain's size: the rest of the step; -2 for
  /// the loss, which is no stage's).
  int64_t stage = 0;
  bool backward = false;   ///< a backward operation (B), not a forward or the loss
  double start_ms = 0;     ///< predicted start (milliseconds from the step's start)
  double end_ms = 0;       ///< predicted end (milliseconds)
  int64_t peak_bytes = 0;  ///< the step's predicted peak during it, above the step's base (bytes)
};

/// A planned step's predicted course: what step_peak_bytes() computes, operation by operation.
struct StepTimeline {
  std::string plan;                ///< Plan::to_string() of the chain's plan
  std::vector<std::string> names;  ///< per stage: the chain's stage name
  /// Per stage: how its first forward runs it ("Fa", "Fc", "Fk[matmuls]", "Fk{khr}", with "@host" or
  /// "@stream"; "Fn" when a schedule runs it without saving first).
  std::vector<std::string> ways;
  std::vector<StepPoint> points;  ///< in the order they run
  int64_t peak_bytes = 0;         ///< step_peak_bytes(chain, context, plan) (bytes)
  double time_ms = 0;             ///< the plan's predicted time plus the rest of the step's (milliseconds)
};

/// The step's predicted course under `plan` (a plan for `chain`, any planner's), as simulate() runs
/// step_plan(plan) on step_chain(). The part before the chain runs in no time here (the step context has no
/// time for it), and the rest of the step's time (context.rest_ms, measured whole) falls on its forward.
/// Throws as step_peak_bytes().
StepTimeline step_timeline(const Chain& chain, const StepContext& context, const Plan& plan);

/// The timeline as JSON: {"plan": "...", "peak_bytes": N, "time_ms": x, "budget_bytes": N (-1: none),
/// "stages": [{"name": "...", "way": "Fc"}, ...], "points": [{"op": "Fc0", "stage": 0, "backward": false,
/// "start_ms": x, "end_ms": x, "peak_bytes": N}, ...]} (docs/chain-format.md).
std::string step_timeline_json(const StepTimeline& timeline, int64_t budget_bytes = -1);

}  // namespace remat
