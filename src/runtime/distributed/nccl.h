#pragma once
// The NCCL backend's factory (nccl.cpp), declared apart from c10d's NCCL headers, which need USE_C10D_NCCL
// and nccl.h: process_group.cpp calls it where the build has NCCL (REMAT_HAS_NCCL).

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

#include "detail/compat.h"

namespace remat::distributed::detail {

/// A c10d::ProcessGroupNCCL over `store` on CUDA device `device` (made current), collectives timing out after
/// `timeout`. Its communicators are made at the first collective.
c10::intrusive_ptr<::remat::detail::compat::C10dBackend> make_nccl(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
    int device);

}  // namespace remat::distributed::detail
