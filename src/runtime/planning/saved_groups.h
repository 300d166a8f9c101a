#pragma once
// The profiler's measuring of a stage's saved groups (saved_groups.cpp): the operator calls of its forward
// pass whose outputs autograd saves, named as a region's policy names them (OpCall::call), with what keeping
// each call holds and what it costs to run. A plan's group assignment (Fk3{khr}) runs the stage under
// remat::group_policy over these names.

#include <remat/planner/chain.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace remat::detail {

/// Runs fn(leaf) `repeats` times with grad and returns, in the order the calls start, every group found: an
/// asked call (remat/policy.h: the calls a region's policy is asked about) that is not inside another group,
/// whose outputs are storages of its own (none of `alive`, nor fn's output), none written in place later in
/// the pass, whether or not autograd saves them (outputs with no bytes on leaf's device left out), and made
/// by a recompute that stops early at autograd's last save in the pass (not the innermost call open at that
/// save, nor any after it; a call enclosing it is). Its bytes are those of its outputs plus what autograd saved
/// inside it that is neither an input's nor an output's storage (what a kept call holds, see remat/policy.h);
/// with `offload_min_bytes` >= 0, its stays_bytes those of them an Offload would keep on the device, were the
/// group sent (not detail::sendable; before 2026-12-05 such a call was no group); its recompute_ms the median
/// of its time (the calls inside it included), `sync` called around each; its fwd_peak_before_bytes the peak
/// of one more forward, plain (grad on, nothing held), from its start until the call began, above the bytes
/// alive before it (memory::PeakWindow on leaf's device). Choose among them with remat::fit_groups.
std::vector<SavedGroup> measure_saved_groups(const std::function<at::Tensor(const at::Tensor&)>& fn,
                                             const at::Tensor& leaf, const std::vector<at::Tensor>& alive,
                                             int64_t offload_min_bytes, int64_t repeats,
                                             const std::function<void()>& sync);

}  // namespace remat::detail
