#pragma once
/// \file
/// The per-layer planner (per_layer.cpp): each stage kept, kept in part, checkpointed or offloaded on its
/// own, exactly, with no recomputation across stages. No torch headers.

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>

#include <cstdint>
#include <vector>

namespace remat {

/// The fastest per-layer plan within budget_bytes: each stage on its own is kept whole (Fa), kept under one
/// of its Fk variants (Fk[NAME] for the chain's policies, Fk for its keep tags; options.exclude removes
/// them), or checkpointed (Fc, recomputed right before its backward), with no recomputation across stages:
/// what per-layer torch.utils.checkpoint (non-reentrant, with or without a selective checkpointing policy)
/// and remat::checkpoint per layer run, so that a plan can be applied layer by layer through a model's own
/// checkpointing hooks. An exact dynamic program over Pareto frontiers (O(n * frontier * choices); the
/// frontier of a chain of equal layers stays small). plan.predicted.peak_bytes is simulate()'s;
/// plan.predicted.time_ms counts a checkpointed stage as run per call (Stage::per_call_fwd_ms() +
/// per_call_bwd_ms()), a kept one as fwd_ms + bwd_ms and an Fk one as its variant's fwd_ms + bwd_ms.
/// With options.offload, a stage may also run offloaded (Fa@host, Fk@host, Fk[NAME]@host, Fc@host: what it
/// saves, or a checkpointed stage's input, copied to host memory from its own forward on, on one link with
/// the other stages' copies, waited for when the next stage's forward ends, and brought back while the stage
/// after it runs its backward), its time the choice's plus the copies' time that the forwards and the
/// backward do not hide (Chain::transfer_ms; simulate()'s model, remat/planner/plan.h), its host bytes
/// bounded by options.max_host_bytes; the same program, exact (the tests compare it with an exhaustive
/// search). Throws InfeasibleBudget (stating per_layer_min_budget()) when no per-layer plan fits, and
/// std::invalid_argument for an invalid chain, a negative budget, an unknown exclusion, or offload on a chain
/// without bandwidths (not profiled for offloading).
///
///   remat::Plan plan = remat::per_layer(chain, 300 << 20);   // "Fa0 Fk1[matmuls] Fc2 L Fa2 B2 B1 B0"
Plan per_layer(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options = {});
/// The least predicted peak of any per-layer plan (bytes): the smallest budget per_layer() accepts. At least
/// min_feasible_budget(), which may recompute across stages. Throws as per_layer().
int64_t per_layer_min_budget(const Chain& chain, const PlannerOptions& options = {});

}  // namespace remat
