// The NCCL backend of remat::distributed::ProcessGroup: c10d's ProcessGroupNCCL, compiled only where the
// LibTorch is a CUDA build whose headers carry it and nccl.h is found (PyPI's torch wheel brings both; the
// build defines USE_C10D_NCCL for this file alone, as LibTorch's own build does for c10d).
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <c10/cuda/CUDAFunctions.h>

#include <chrono>

#include "distributed/nccl.h"

namespace remat::distributed::detail {

c10::intrusive_ptr<::remat::detail::compat::C10dBackend> make_nccl(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
    int device) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace remat::distributed::detail
