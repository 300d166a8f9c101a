#pragma once
// What remat::Offload (offload.cpp) sends to the host, for the profiler's measuring of saved groups too.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace remat::detail {

/// Whether a remat::Offload with that min_bytes sends `t` to the host, its storage not kept on the device
/// (OffloadOptions::keep_on_device): strided, dense, at least min_bytes, not a leaf that requires grad, no
/// conjugate or negative bit. The profiler's measuring of saved groups asks it too.
bool sendable(const at::Tensor& t, int64_t min_bytes);

}  // namespace remat::detail
