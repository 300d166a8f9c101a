#pragma once
// The one writer of plans' JSON (plan.cpp), for the reports too, and the offload cost of an operation's way
// and what its forward holds above what it leaves, for simulate() and the step's model (private to the
// planner library).

#include <remat/planner/chain.h>
#include <remat/planner/plan.h>

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

namespace remat::detail {

/// The offload cost of the way `op` runs stage op.stage of `chain` (Fa: Stage::offload; Fc:
/// checkpoint_offload; Fk: its keep tags', its policy's, named in `plan`, or its group assignment's), or none
/// (Fn, a stage out of range, a policy the chain lacks).
std::optional<OffloadCost> way_offload(const Chain& chain, const Plan& plan, const Op& op);

/// The policy cost of the way `op` runs stage op.stage of `chain`: Fk under a policy `plan` names and the
/// chain profiled (Fk[name]), else null (Fa, Fc, Fn, the keep tags, a group assignment, a stage out of range,
/// a policy the chain lacks).
const PolicyCost* way_policy(const Chain& chain, const Plan& plan, const Op& op);

/// What stage s's forward run as `kind` holds above what it leaves (`left`: abar for Fa, what Fk keeps, the
/// output for Fn and Fc) at its peak, as plan.h charges it (bytes): fwd_tmp_bytes for a forward that saves
/// everything, Stage::keep_fwd_tmp_bytes(left) for one that saves part, Stage::nosave_tmp_bytes() for one
/// that saves nothing. `unsaved`: of `left`, what Fa does not save (a group assignment's
/// group_unsaved_bytes()); `group_peak`: a group assignment's group_forward_peak_bytes() (-1: unmeasured),
/// which where measured stands in for the nosave_tmp_bytes() bound: its peak less `left`, within that bound.
inline int64_t forward_tmp_bytes(const Stage& s, OpKind kind, int64_t left, int64_t unsaved = 0,
                                 int64_t group_peak = -1) {
  if (kind == OpKind::kForwardAll) return s.fwd_tmp_bytes;
  if (kind == OpKind::kForwardKeep) {
    const int64_t bound = s.keep_fwd_tmp_bytes(left, unsaved);
    return group_peak >= 0 ? std::max<int64_t>(0, std::min(bound, group_peak - left)) : bound;
  }
  return s.nosave_tmp_bytes();
}

/// group_forward_peak_bytes() of the assignment that keeps or sends stage s's group g where held(g): the
/// one sum behind it and the per-layer program's enumeration (bytes; -1 where a held group's
/// fwd_peak_after_bytes is not measured, or none is held).
template <class Held>
int64_t forward_part_way_bytes(const Stage& s, const Held& held) {
  int64_t peak = s.output_bytes + s.nosave_tmp_bytes();
  bool any = false;
  for (size_t g = 0; g < s.groups.size(); ++g) {
    if (!held(g)) continue;
    const int64_t after = s.groups[g].fwd_peak_after_bytes;
    if (after < 0) return -1;
    int64_t by_then = 0;  // the groups held that the forward has let go of by then
    for (size_t h = 0; h < s.groups.size(); ++h)
      if (held(h) && s.groups[h].fwd_peak_after_bytes >= after) by_then += s.groups[h].bytes;
    peak = std::max(peak, after + by_then);
    any = true;
  }
  return any ? peak : -1;
}

/// What stage s's backward holds of what it saved after Fk with keep tags or a group assignment, which kept
/// `kept` bytes (its output included; Choice::held, group_cost()'s saved_bytes), `unsaved` of them bytes Fa
/// does not save: what Fa saves, or what it kept less those where that is more (its recompute then makes
/// nothing again). simulate() and the per-layer program (stage_need(), group_choices()) alike (bytes).
inline int64_t kept_saved_at_backward(const Stage& s, int64_t kept, int64_t unsaved) {
  return std::max(s.saved_bytes, kept - unsaved);
}

/// group_recompute_peak_bytes() of the assignment that keeps or sends stage s's group g where held(g): the
/// one sum behind it and the per-layer program's enumeration, which holds its assignments as digits (bytes;
/// -1 where no group's fwd_peak_before_bytes is measured).
template <class Held>
int64_t recompute_part_way_bytes(const Stage& s, const Held& held) {
  int64_t peak = -1, after = 0;  // after: the groups kept or sent from g on
  for (size_t g = s.groups.size(); g-- > 0;) {
    if (held(g)) after += s.groups[g].bytes;
    if (s.groups[g].fwd_peak_before_bytes >= 0)
      peak = std::max(peak, s.groups[g].fwd_peak_before_bytes + after);
  }
  return peak;
}

/// What a stage streamed with a window of `window` bytes (a plan's `Fa3@stream`) holds beside its forward's
/// measured peak (OffloadCost::stream_fwd_bytes, each copy waited for at once), as simulate() and the
/// per-layer planner charge it (bytes): its copies in flight, at most the window, and of them only tensors
/// that leave the device (`cost.bytes`): its input and output, which may be in flight too, are held through
/// its forward anyway. (A Linear-ReLU layer saves only those two: charged the whole window, its forward was
/// predicted a hidden state above what it held.)
inline int64_t stream_forward_window_bytes(const OffloadCost& cost, int64_t window) {
  return window < cost.bytes ? window : cost.bytes;
}

/// The plan's JSON object (what remat::to_json(plan) prints): the one writer of plans.
nlohmann::ordered_json plan_json(const Plan& plan);

}  // namespace remat::detail
