#pragma once
/// \file
/// Offloading what autograd saves to host memory, and bringing it back for the backward pass: the C++ side of
/// the Python package's remat.offload (PyTorch's torch.autograd.graph.save_on_cpu, with a reusable host pool,
/// copies on a side stream, and prefetching).
///
///   auto pool = std::make_shared<remat::HostPool>(8LL << 30);   // reused across steps; pinned with CUDA
///   torch::Tensor loss;
///   {
///     remat::Offload offload(remat::OffloadOptions().pool(pool).min_bytes(1 << 20).keep_on_device(params));
///     loss = model->forward(x).sum();      // saved tensors of 1 MiB or more go to the host
///   }
///   loss.backward();                       // each comes back when the backward pass asks for it
///
/// While an Offload is alive on a thread (and in the backward passes started inside it), each tensor autograd
/// saves there of at least min_bytes (dense: contiguous or a permutation of it, such as a transposed query;
/// not a leaf that requires grad such as a parameter, not one of keep_on_device) is copied to a block of the
/// host pool, and the saved tensor holds that block instead of the device tensor: on a GPU on a side stream
/// after the producing stream's work (events order them; the device tensor is held until its copy has
/// completed), on the CPU at once. Bytes saved by several operators, each through a view of its own (an input
/// three projections save), are copied once, as are bytes saved within bytes saved whole before them (one
/// entry, brought back once; a part saved before its whole has its own copy); a storage that another saved
/// tensor keeps on the device (one not offloaded: a view with gaps, a small one) is not offloaded at all,
/// since copying it would free nothing. Unpacking in the backward pass copies it back (waiting for its copy
/// first, never reading it early) and holds the device copy until autograd drops the saved tensor; then the
/// block returns to the pool. A tensor whose storage another holder kept on the device (the stage before,
/// whose output it is) and that was not written since is handed out as it is instead: no second copy on the
/// device.
///
/// Inside a remat::checkpoint region (kNonReentrant) the region's own hooks are the innermost and take what
/// its operators save. An Offload around a checkpoint gets what the checkpoint itself saves (its inputs) and,
/// once the region's forward pass is done, what it keeps for the backward pass: the outputs of its kept calls
/// (CheckpointOptions::keep tags, and the calls its policy keeps), with what autograd saved inside them; an
/// Offload inside a region, what the region's operators save.
///
/// A tensor written in place while its copy to the host is in flight is an error (c10::Error naming it) when
/// the copy completes, never a gradient computed from half-copied values; autograd's own version check does
/// not see saved tensors behind hooks. On the CPU the copy is made at once, so the host holds the values
/// saved. A saved tensor the Offload leaves on the device (below min_bytes, a view with gaps, over the pool's
/// bound, a storage another saved tensor keeps there) and that is written in place after it was saved raises
/// autograd's own error when it is needed (c10::Error: "one of the variables needed for gradient computation
/// has been modified by an inplace operation: [CPUFloatType [64, 256]], which is output 0 of
/// SigmoidBackward0, ..."), as the plain run does. Conjugate and negative views stay on the device with their
/// bits.
///
/// Tested on the CPU with both LibTorch builds (the CPU as the device; the pool's blocks are memory remat's
/// CPU meter does not count, so that it reads the device's bytes), including copies carried out late on
/// purpose (OffloadOptions::copy_delay); the CUDA path (side stream, events, pinned blocks) follows the same
/// code and has not run on a GPU yet.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace remat {

namespace detail {
class OffloadState;
class HookScope;
}  // namespace detail

/// Host memory for offloaded tensors, in blocks reused by size (sizes rounded up to 512 bytes). Thread-safe.
class HostPool {
 public:
  /// max_bytes: the most it allocates (bytes; -1: no bound). pin: page-locked blocks, which copies from a GPU
  /// need to overlap computation; default: when CUDA is available. Throws c10::Error for max_bytes < -1.
  explicit HostPool(int64_t max_bytes = -1, std::optional<bool> pin = std::nullopt);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  /// A block (a uint8 tensor on the CPU) of at least nbytes, or an undefined tensor when max_bytes does not
  /// allow one.
  at::Tensor take(int64_t nbytes);
  /// Returns a block taken from this pool, for reuse.
  void give(const at::Tensor& block);
  /// Allocates blocks of block_bytes until nbytes are free for take()s of that size. Throws c10::Error beyond
  /// max_bytes.
  void reserve(int64_t nbytes, int64_t block_bytes);
  /// Frees the blocks not in use.
  void release();

  int64_t reserved_bytes() const;  ///< allocated (bytes)
  int64_t in_use_bytes() const;    ///< taken and not given back (bytes)
  int64_t peak_bytes() const;      ///< the most in use at once since construction or reset_peak() (bytes)
  void reset_peak();
  int64_t max_bytes() const { return max_bytes_; }
  bool pinned() const { return pin_; }

 private:
  at::Tensor allocate(int64_t size);  // mu_ held
  mutable std::mutex mu_;
  int64_t max_bytes_;
  bool pin_;
  std::map<int64_t, std::vector<at::Tensor>> free_;
  int64_t reserved_ = 0, in_use_ = 0, peak_ = 0;
};

/// Options of Offload, builder style.
class OffloadOptions {
 public:
  /// Saved tensors smaller than this stay on the device (bytes; default 1 MiB).
  OffloadOptions& min_bytes(int64_t bytes) {
    min_bytes_ = bytes;
    return *this;
  }
  /// The host pool (default: a new unbounded one per Offload).
  OffloadOptions& pool(std::shared_ptr<HostPool> pool) {
    pool_ = std::move(pool);
    return *this;
  }
  /// Tensors whose storages are never offloaded (a model's parameters and buffers: alive anyway).
  OffloadOptions& keep_on_device(std::vector<at::Tensor> tensors) {
    keep_on_device_ = std::move(tensors);
    return *this;
  }
  /// For tests on the CPU: a copy is carried out only when waited for or when this many later copies have
  /// started, and it holds its source weakly, so that reading a copy early or releasing its source first
  /// shows (wrong values, or an error). 0 (the default): at once.
  OffloadOptions& copy_delay(int copies) {
    copy_delay_ = copies;
    return *this;
  }
  /// On the CPU, where each copy is made at once: whether its source is held on the device all the same until
  /// the copy is waited for (finish_copies(), a window's bound, the tensor brought back), as a GPU holds it
  /// while a copy that outlasts the work beside it is in flight. The plan executor (remat::run_plan, so
  /// remat::Planned) turns it on, so that on the CPU the device's bytes are what a plan's model charges
  /// (what a stage sends stays on the device until the copy is waited for, after the next stage's forward)
  /// and its tests check that charge; before (2026-12-06) a plan's peak beside a copy in flight read up to a
  /// stage's sent bytes below its prediction on the CPU. The values are copied at once either way, so a
  /// write in place after the copy is no error. No effect on a GPU or with copy_delay. Default false: let go
  /// of at once.
  OffloadOptions& hold_until_waited(bool hold) {
    hold_until_waited_ = hold;
    return *this;
  }
  /// Streaming (a plan's Fa3@stream): at most this many bytes of copies to the host in flight (past it the
  /// oldest is waited for, its device bytes released; 0: each copy waited for at once), and in the backward
  /// pass, when a tensor is needed back, the tensors saved before it brought back ahead, nearest first, while
  /// those brought back and not yet asked for (wherever they were saved: a tensor saved by two operators is
  /// asked for at the later one's backward) stay within this many bytes beside it; prefetch() then brings
  /// back only the last saved up to this many bytes. -1
  /// (the default): copies waited for only by finish_copies(), nothing brought back ahead but by prefetch(),
  /// which brings back everything.
  OffloadOptions& window(int64_t bytes) {
    window_ = bytes;
    return *this;
  }
  int64_t min_bytes() const { return min_bytes_; }
  int64_t window() const { return window_; }
  const std::shared_ptr<HostPool>& pool() const { return pool_; }
  const std::vector<at::Tensor>& keep_on_device() const { return keep_on_device_; }
  int copy_delay() const { return copy_delay_; }
  bool hold_until_waited() const { return hold_until_waited_; }

 private:
  int64_t min_bytes_ = int64_t{1} << 20;
  std::shared_ptr<HostPool> pool_;
  std::vector<at::Tensor> keep_on_device_;
  int copy_delay_ = 0;
  bool hold_until_waited_ = false;
  int64_t window_ = -1;
};

/// What an Offload did.
struct OffloadStats {
  int64_t offloaded = 0;        ///< tensors copied to the host
  int64_t offloaded_bytes = 0;  ///< their bytes
  int64_t kept_on_device = 0;   ///< tensors the pool's bound left on the device
  int64_t brought_back = 0;     ///< copies back to the device
  int64_t prefetched = 0;       ///< of them, started by prefetch() before the backward pass asked
  /// Tensors found still on the device when they were needed back (another holder kept their storage there,
  /// such as the stage before, whose output they are; not written since): handed out as they are, no copy.
  int64_t found_on_device = 0;
  int64_t largest_bytes = 0;  ///< the largest tensor copied to the host (bytes): what a window must hold
  /// Device bytes allocated beyond the copies brought back so that each starts at its saved tensor's
  /// alignment (modulo 256 on CUDA, whose cuBLASLt picks algorithms by it; 64 elsewhere): a tensor saved at
  /// an offset into its storage comes back in a block up to the offset's residue larger (bytes; 0 for whole
  /// tensors).
  int64_t alignment_bytes = 0;
};

/// Sends what autograd saves to host memory while it is open (see the top of this file). A scope on the
/// thread that constructs it: open from construction until close() or destruction, in any order with other
/// remat scopes (an Offload replaced by the next step's before it is destroyed: the newer one takes what is
/// saved from then on); ended on another thread, it is closed (nothing more goes to it) with a warning. The
/// tensors stay offloaded until autograd drops them.
class Offload {
 public:
  /// Opens the scope. Throws c10::Error naming remat::Offload for min_bytes < 0, copy_delay < 0 or window <
  /// -1, and when saved-tensor hooks cannot reach remat (another autograd engine is the default: PyTorch's
  /// Python one).
  explicit Offload(OffloadOptions options = {});
  ~Offload();
  Offload(const Offload&) = delete;
  Offload& operator=(const Offload&) = delete;

  /// Ends the scope (idempotent): nothing saved afterwards is offloaded. The object stays usable.
  void close();
  /// Waits for the copies to the host in flight and releases their device tensors.
  void finish_copies();
  /// Starts bringing back every tensor this Offload holds on the host (ahead of the backward pass).
  void prefetch();
  /// Streaming: the bytes prefetch() would copy back now with a window of `window` bytes, starting nothing
  /// (the last tensors saved, newest first, while they fit in it): the most of it whichever storages of
  /// `maybe_found` (a stage's input and output, which may still be on the device then, and are found there,
  /// not copied) are found. A plan charges it ahead of a streamed stage's backward and in flight past its
  /// forward (OffloadCost::ahead_bytes). Throws c10::Error naming remat::Offload::ahead_bytes for a window
  /// below 0 or more than 15 tensors in `maybe_found`.
  int64_t ahead_bytes(int64_t window, const std::vector<at::Tensor>& maybe_found = {}) const;
  OffloadStats stats() const;
  const std::shared_ptr<HostPool>& pool() const;

 private:
  std::shared_ptr<detail::OffloadState> state_;
  std::unique_ptr<detail::HookScope> scope_;
};

/// The bandwidth of copies between a device and host memory (GB/s, 10^9 bytes per second).
struct OffloadBandwidth {
  double to_host_gb_per_s = 0;
  double to_device_gb_per_s = 0;
};

/// Measures it as Offload copies: nbytes (at least 64 KiB) each way between `device` and a host block (pinned
/// for CUDA), the median of `repeats` after one copy to warm up, the device synchronized around each. On the
/// CPU, a copy between two of its buffers. Throws c10::Error naming remat::offload_bandwidth for repeats < 1.
OffloadBandwidth offload_bandwidth(c10::Device device, int64_t nbytes = int64_t{64} << 20, int repeats = 3);

}  // namespace remat
