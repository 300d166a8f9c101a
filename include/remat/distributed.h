#pragma once
/// \file
/// Data-parallel training on c10d, PyTorch's distributed engine (its TCPStore and ProcessGroupGloo), with
/// every remat checkpointing strategy. Start the processes with `remat launch`, `torchrun --no-python`, or
/// any launcher that sets torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
///
///   auto group = remat::distributed::init_process_group();       // reads the environment
///   remat::distributed::DataParallel dp(model.ptr(), group);      // rank 0's weights everywhere
///   auto loss = loss_fn(model->forward(shard));                   // this rank's part of the batch
///   loss.backward();                                              // gradients averaged over the group
///   optimizer.step();
///
/// Gradients are reduced in buckets (about bucket_bytes each; in the first step, parameters in reverse
/// registration order; from the second, as DDP does, in the order their gradients arrived in the first, rank
/// 0's): a bucket's all-reduce starts as soon as its last parameter has its gradient, on c10d's worker
/// threads, and overlaps the rest of the backward pass, recomputation included. This is not c10d::Reducer
/// (DDP's): the Reducer counts a parameter ready on every firing of its gradient accumulator, including the
/// firings with no gradient and the ones inside a kReentrant region's or the plan executor's nested backward
/// passes, and queues its end-of-backward work on whichever backward pass (possibly a nested one) marks the
/// last bucket. Here a parameter is ready once per step, on its first defined gradient, and the step ends
/// with the user's outermost backward pass.

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
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
  /// "gloo" (CPU tensors, and CUDA tensors through host copies). "nccl" is not built into this version:
  /// asking for it throws.
  TORCH_ARG(std::string, backend) = "gloo";
  /// How long the rendezvous and each collective may wait for the other ranks before failing.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
};

/// The reduction of ProcessGroup::all_reduce.
enum class ReduceOp { kSum, kMin, kMax };

/// A group of processes (c10d's ProcessGroupGloo over a TCPStore rendezvous). Shared by the DataParallel
/// wrappers built on it; the connections close when the last owner lets go.
class ProcessGroup {
 public:
  /// This process's rank in [0, size()).
  int rank() const;
  /// Number of processes in the group (WORLD_SIZE).
  int size() const;
  /// LOCAL_RANK (the rank among this machine's processes), or rank() when the launcher did not set it.
  int local_rank() const;
  /// "gloo".
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
  /// Starts a sum all-reduce of `tensors` (in place) on c10d's worker threads and returns at once; the
  /// tensors must stay untouched until wait() returns.
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
/// backend for an unsupported one, and naming the address, the world size and the timeout when the other
/// ranks do not arrive in time.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});

/// For remat::PlannedOptions::agree (remat/planned.h): all-reduces the numbers a plan is made from
/// (remat::plan_figures, remat/step.h) to their maximum over `group`, so that remat::Planned makes the same
/// plan on every rank, one that fits every rank's measured memory and its slowest measured link:
///
///   remat::PlannedOptions().budget(b).agree(remat::distributed::same_plan_on_every_rank(group))
///
/// A collective at each planning step: every rank must see the same input shapes in the same order. Throws
/// c10::Error naming remat::distributed::same_plan_on_every_rank for a null group, and as all_reduce does.
std::function<void(std::vector<torch::Tensor>&)> same_plan_on_every_rank(std::shared_ptr<ProcessGroup> group);

/// How DataParallel reduces.
struct DataParallelOptions {
  /// Target size of a gradient bucket in bytes (DDP's default, 25 MiB). A parameter larger than this is a
  /// bucket of its own. Must be > 0.
  TORCH_ARG(int64_t, bucket_bytes) = 25 << 20;
  /// false: every parameter that requires grad must get a gradient in every synced backward pass, or that
  /// backward() throws naming the ones that got none (after reducing the others, so every rank stays in
  /// step). true: a parameter may go without; it is reduced as zero where unused, and keeps no gradient when
  /// no rank used it.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Copy rank 0's parameters and buffers to every rank at construction.
  TORCH_ARG(bool, broadcast_parameters) = true;
};

/// What the gradient reduction did, summed over the synced steps since construction or reset_stats().
struct DataParallelStats {
  int64_t steps = 0;            ///< synced backward passes reduced
  int64_t buckets = 0;          ///< buckets of one step
  int64_t bytes_per_step = 0;   ///< gradient bytes all-reduced per step
  int64_t buckets_early = 0;    ///< buckets launched during the backward pass, before its end
  double wait_seconds = 0;      ///< time the backward pass's end spent waiting for all-reduces (exposed)
  double finalize_seconds = 0;  ///< all of the end-of-step work (launching the rest, waiting, copying back)
};

/// Averages a module's gradients across a ProcessGroup during backward(). One per module; the module is
/// used as usual (module->forward, any remat checkpointing, the plan executor) and the optimizer steps it.
///
/// Memory: the buckets hold one copy of the gradients for the DataParallel's lifetime, and the gradients
/// live in them: after its first reduction a parameter's .grad() shares its bucket's storage (a plain tensor,
/// not a view, so optimizers may detach_() and zero_() it), backward accumulates into it in place, and
/// reducing copies nothing. A gradient that is set to none or replaced (zero_grad(true), assignment) is
/// copied back into the bucket at the next reduction.
///
/// Every rank must run the same model through the same kind of step. A parameter must get its gradient in
/// one backward pass per step: a parameter used by two kReentrant regions (or two plan stages) gets one
/// gradient from each nested pass, and the second, arriving after its bucket's all-reduce started, makes
/// backward() throw naming it (use CheckpointMode::kNonReentrant, or keep the shared use in one region).
class DataParallel {
 public:
  /// Wraps `module`; a collective (every rank constructs it, in the same order as other collectives).
  /// Checks that every rank's module has the same parameters and buffers (names, shapes, dtypes) and
  /// throws c10::Error on every rank naming the first difference if not; then, with
  /// broadcast_parameters, copies rank 0's parameters and buffers everywhere. Throws c10::Error for a null
  /// module or group, a bad bucket_bytes, or a module without parameters that require grad.
  DataParallel(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
               DataParallelOptions options = {});
  template <typename M>
  DataParallel(const torch::nn::ModuleHolder<M>& module, std::shared_ptr<ProcessGroup> group,
               DataParallelOptions options = {})
      : DataParallel(std::static_pointer_cast<torch::nn::Module>(module.ptr()), std::move(group),
                     std::move(options)) {}
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// While alive, backward() accumulates gradients locally without reducing them (gradient accumulation:
  /// the first synced backward afterwards reduces the sums). Nests; restores the previous setting.
  class NoSync {
   public:
    NoSync(NoSync&& other) noexcept;
    NoSync& operator=(NoSync&&) = delete;
    NoSync(const NoSync&) = delete;
    ~NoSync();

   private:
    friend class DataParallel;
    struct State;
    NoSync(std::shared_ptr<State> state, bool previous);
    std::shared_ptr<State> state_;
    bool previous_ = true;
  };
  /// See NoSync.
  NoSync no_sync();

  /// The wrapped module.
  torch::nn::Module& module();
  const std::shared_ptr<ProcessGroup>& group() const;
  const DataParallelOptions& options() const;
  /// The buckets: parameter names in launch order.
  std::vector<std::vector<std::string>> buckets() const;

  /// Statistics of the synced steps (see DataParallelStats).
  DataParallelStats stats() const;
  void reset_stats();

  /// Median milliseconds, over `repeats`, of all-reducing buffers the size of every bucket with nothing
  /// else running: the communication a step would expose if none of it overlapped the backward pass. A
  /// collective. Throws c10::Error when repeats < 1.
  double time_all_reduce(int64_t repeats = 5);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

/// How `launch` starts processes (torchrun's flags).
struct LaunchOptions {
  /// Processes on this machine (--nproc-per-node), >= 1.
  TORCH_ARG(int64_t, nproc_per_node) = 1;
  /// Machines (--nnodes), >= 1; every machine runs `launch` with the same options but its node_rank.
  TORCH_ARG(int64_t, nnodes) = 1;
  /// This machine's index in [0, nnodes) (--node-rank).
  TORCH_ARG(int64_t, node_rank) = 0;
  /// Where rank 0 hosts the store (--master-addr).
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  /// Its port (--master-port); 0 picks a free port (single machine only).
  TORCH_ARG(int64_t, master_port) = 29500;
  /// When not empty, each process's stdout and stderr go to LOG_DIR/rank_<RANK>.log instead of this
  /// process's.
  TORCH_ARG(std::string, log_dir) = "";
  /// After one process fails, how long the others may run on (to notice the failure and say so) before
  /// they are stopped. torchrun stops them at once (0).
  TORCH_ARG(std::chrono::milliseconds, failure_grace) = std::chrono::milliseconds(0);
};

/// Runs `command` (a program and its arguments, found on PATH when it has no '/') as nproc_per_node local
/// processes with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
/// MASTER_ADDR, MASTER_PORT) and waits for them. When one fails, the others are stopped (after
/// failure_grace: SIGTERM, then SIGKILL 10 s later). Returns 0 when every process exits 0, else the first
/// failure's exit status (128 + signal number for a signal). Throws c10::Error naming the option for bad
/// options or an empty command, and when a process cannot be started.
int launch(const LaunchOptions& options, const std::vector<std::string>& command);

}  // namespace remat::distributed
