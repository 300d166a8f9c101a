#pragma once
/// \file
/// The largest batch (batch.cpp): a profile at another batch size, made from profiles at two sizes, and the
/// search for the largest size a predicate accepts. Memory and time are close to linear in the batch; what is
/// not (parameters, their gradients) is the same at both sizes and so stays as it is. One piece of code for
/// the C++ benchmark harness (`remat max-batch`) and the Python package (remat.max_batch). No torch headers.
///
///   remat::Chain c = remat::chain_at_batch(chain2, 2, chain4, 4, 48);        // the chain at batch 48
///   int64_t b = remat::largest_batch([&](int64_t b) { return fits(b); }, 1 << 16);

#include <cstdint>
#include <functional>

#include <remat/planner/chain.h>
#include <remat/planner/step.h>

namespace remat {

/// The chain at `batch`, each figure on the line through its values in `a` (profiled at batch_a) and `b`
/// (at batch_b): bytes rounded to the nearest byte and at least 0, times at least 0; each stage's saved bytes
/// kept between its output's and all it saves, as a profile has them. The chain's input is the line's too.
/// Figures only one profile has (a policy's offloading, a stream's peaks) are left out; the bandwidths are
/// the mean of both measurements. Throws std::invalid_argument naming remat::chain_at_batch when the
/// profiles are not of one chain (stage count or names, policies, keep tags, groups' calls, offloaded inputs
/// or outputs differ), when batch_a == batch_b, or when a batch is < 1.
Chain chain_at_batch(const Chain& a, int64_t batch_a, const Chain& b, int64_t batch_b, int64_t batch);

/// The step context at `batch`, as chain_at_batch() does for the chain (bytes on the line through both,
/// rounded, at least 0; rest_ms at least 0). The measured every-stage-checkpointed peak is kept only at
/// batch_a and batch_b (-1 elsewhere: a peak is the step's largest moment, and which moment is largest
/// changes with the batch, so it is not on a line). Throws std::invalid_argument naming
/// remat::context_at_batch when the contexts differ in input_in_base or in their number of stages, when
/// batch_a == batch_b, or when a batch is < 1.
StepContext context_at_batch(const StepContext& a, int64_t batch_a, const StepContext& b, int64_t batch_b,
                             int64_t batch);

/// The largest batch in [1, limit] that `fits` accepts, for a `fits` that accepts every batch below one it
/// accepts: fits(1), then doubling, then bisection (about 2 log2 of the answer calls). 0 when fits(1) is
/// false. Throws std::invalid_argument naming remat::largest_batch for limit < 1; what `fits` throws passes
/// through.
int64_t largest_batch(const std::function<bool(int64_t)>& fits, int64_t limit);

}  // namespace remat
