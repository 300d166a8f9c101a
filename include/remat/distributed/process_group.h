#pragma once
/// \file
/// A process group on c10d (process_group.cpp): joining it from torchrun's environment, its collectives, and
/// agreeing on one plan on every rank.

#include <torch/arg.h>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace remat::distributed {

/// How init_process_group connects.
struct InitOptions {
  /// "gloo" (CPU tensors, and CUDA tensors through host copies) or "nccl" (CUDA tensors, each rank on CUDA
  /// device LOCAL_RANK; where the build has it: has_nccl()). On NCCL, the CPU tensors given to all_reduce and
  /// broadcast go to the rank's device and back; all_reduce_async takes CUDA tensors only.
  TORCH_ARG(std::string, backend) = "gloo";
  /// How long the rendezvous and each collective may wait for the other ranks before failing.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
};

/// The reduction of ProcessGroup::all_reduce.
enum class ReduceOp { kSum, kMin, kMax };

/// A group of processes (c10d's ProcessGroupGloo or ProcessGroupNCCL over a TCPStore rendezvous). Shared by
/// the DataParallel wrappers built on it; the connections close when the last owner lets go.
class ProcessGroup {
 public:
  /// This process's rank in [0, size()).
  int rank() const;
  /// Number of processes in the group (WORLD_SIZE).
  int size() const;
  /// LOCAL_RANK (the rank among this machine's processes), or rank() when the launcher did not set it.
  int local_rank() const;
  /// "gloo" or "nccl".
  const std::string& backend() const;
  /// The collective timeout.
  std::chrono::milliseconds timeout() const;

  /// Reduces every tensor in place across the group (dense, same shapes and dtypes on every rank; a
  /// collective: every rank calls it in the same order). Throws c10::Error naming the operation and this
  /// rank when a peer fails or the timeout passes.
  void all_reduce(std::vector<torch::Tensor>& tensors, ReduceOp op = ReduceOp::kSum);
  /// Copies `root`'s tensors into every rank's (in place). Throws as all_reduce does, and for a bad root.
  void broadcast(std::vector<torch::Tensor>& tensors, int root = 0);
  /// Waits until every rank has called it. Throws as all_reduce does.
  void barrier();

  /// An all-reduce (sum) in flight.
  class Work {
   public:
    virtual ~Work() = default;
    /// Blocks until done; throws c10::Error naming the failure (a peer died, the timeout passed).
    virtual void wait() = 0;
    /// Whether it has finished (successfully or not) without blocking.
    virtual bool completed() = 0;
  };
  /// Starts a sum all-reduce of `tensors` (in place) on c10d's worker threads (NCCL: its stream) and returns
  /// at once; the tensors must stay untouched until wait() returns. On NCCL, wait() makes the current CUDA
  /// stream wait for the reduction (work queued after it on that stream sees the result; the host does not
  /// wait). Throws c10::Error naming the device for a tensor not on CUDA under NCCL, and for more than one
  /// tensor there (c10d's NCCL group reduces one per call; all_reduce and broadcast loop over them).
  std::shared_ptr<Work> all_reduce_async(std::vector<torch::Tensor> tensors);

  struct Impl;
  explicit ProcessGroup(std::shared_ptr<Impl> impl);

 private:
  std::shared_ptr<Impl> impl_;
};

/// Joins the group described by torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and
/// LOCAL_RANK when present. Rank 0 hosts the TCPStore at MASTER_ADDR:MASTER_PORT. Gloo binds to loopback when
/// MASTER_ADDR is a loopback address, to GLOO_SOCKET_IFNAME when that is set, and to this machine's
/// hostname otherwise. Throws c10::Error naming the variable for a missing or malformed one, naming the
/// backend for an unsupported one (or "nccl" where the build has no NCCL, or LOCAL_RANK has no CUDA device),
/// and naming the address, the world size and the timeout when the other ranks do not arrive in time.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});

/// Whether this build has the NCCL backend: a CUDA LibTorch whose headers carry c10d's ProcessGroupNCCL, and
/// nccl.h (PyPI's torch wheel has both; Debian's LibTorch is a CPU build).
bool has_nccl();

/// For remat::PlannedOptions::agree (remat/planned.h): all-reduces the numbers a plan is made from
/// (remat::plan_figures, remat/planner/step.h) to their maximum over `group`, so that remat::Planned makes
/// the same plan on every rank, one that fits every rank's measured memory and its slowest measured link:
///
///   remat::PlannedOptions().budget(b).agree(remat::distributed::same_plan_on_every_rank(group))
///
/// A collective at each planning step: every rank must see the same input shapes in the same order. Throws
/// c10::Error naming remat::distributed::same_plan_on_every_rank for a null group, and as all_reduce does.
std::function<void(std::vector<torch::Tensor>&)> same_plan_on_every_rank(std::shared_ptr<ProcessGroup> group);

}  // namespace remat::distributed
