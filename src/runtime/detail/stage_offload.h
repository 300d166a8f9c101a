#pragma once
// The options of the Offload an offloaded stage runs under, one piece for the plan executor (executor.cpp)
// and the profiler's measuring of a stage's offload costs (profile.cpp), so that both keep the same tensors
// on the device.

#include <remat/offload.h>
#include <remat/sequential.h>

#include <vector>

namespace remat::detail {

/// Whether a remat::Offload with that min_bytes sends `t` to the host, its storage not kept on the device
/// (OffloadOptions::keep_on_device): strided, dense, at least min_bytes, not a leaf that requires grad, no
/// conjugate or negative bit. The profiler's measuring of saved groups asks it too.
bool sendable(const at::Tensor& t, int64_t min_bytes);

/// `base` with the stage module's parameters and buffers (alive anyway) and `also` (tensors the executor
/// holds anyway, such as the stage's input) added to keep_on_device.
OffloadOptions stage_offload_options(OffloadOptions base, const StageFn& stage, std::vector<at::Tensor> also);

}  // namespace remat::detail
