#pragma once
/// \file
/// Data-parallel training (data_parallel.cpp): gradients reduced in buckets over a process group.

#include <remat/distributed/process_group.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace remat::distributed {

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

}  // namespace remat::distributed
