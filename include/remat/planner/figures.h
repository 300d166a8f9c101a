#pragma once
/// \file
/// The figures a plan is made from, as numbers processes can reduce to agree on one plan (figures.cpp). No
/// torch headers.

#include <remat/planner/chain.h>
#include <remat/planner/step.h>

#include <cstdint>
#include <vector>

namespace remat {

/// Every figure a plan of a chain within a step context depends on, as two lists in one order: the same
/// order and counts on every process whose chain has the same stages, policies and stage_grads_bytes entries.
/// Encoded so that the elementwise maximum over processes is the figure they agree on, a plan that fits every
/// process's measurements: bytes and milliseconds their largest; a bandwidth, and bytes let go of
/// (StepContext::side_freed_bytes), their smallest (stored negated);
/// an optional time, the keep_ fields or an offload cost absent where any process lacks it (a flag, 1 for
/// absent, then the value, 0 when absent); a flag (input_in_base, input_held_in_backward, holds_outputs, an
/// offload cost's input and output) set where any process set it. remat::Planned's agree option
/// (remat/planned.h) and the Python package's agreement across ranks all-reduce these with a maximum and
/// write them back with set_plan_figures(). Names, keep tags and policy names are not figures: they must
/// already agree.
struct PlanFigures {
  std::vector<int64_t> ints;  ///< bytes, flags
  std::vector<double> reals;  ///< milliseconds, negated bandwidths (GB/s)
};

/// The figures of `chain` and `context` (see PlanFigures).
PlanFigures plan_figures(const Chain& chain, const StepContext& context);

/// Writes `figures` (plan_figures() of a chain of the same structure, reduced by a maximum) back into
/// `chain` and `context`. An offload cost's bytes are lowered to what its way keeps beyond the output where
/// the maxima of different processes' figures would put them above it. Throws std::invalid_argument naming
/// remat::set_plan_figures when the counts differ from plan_figures(chain, context)'s (the processes' chains
/// differ in structure) or a flag is not 0 or 1, and as validate() for what the figures make of the chain;
/// on a throw, `chain` and `context` are unchanged.
void set_plan_figures(Chain& chain, StepContext& context, const PlanFigures& figures);

}  // namespace remat
