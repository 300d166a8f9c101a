#pragma once
// The options of the Offload an offloaded stage runs under (stage_offload.cpp), one piece for the plan
// executor (executor.cpp) and the profiler's measuring of a stage's offload costs (profile.cpp), so that both
// keep the same tensors on the device.

#include <remat/executor.h>
#include <remat/offload.h>

#include <vector>

namespace remat::detail {

/// `base` with the stage module's parameters and buffers (alive anyway) and `also` (tensors the executor
/// holds anyway, such as the stage's input) added to keep_on_device.
OffloadOptions stage_offload_options(OffloadOptions base, const StageFn& stage, std::vector<at::Tensor> also);

}  // namespace remat::detail
