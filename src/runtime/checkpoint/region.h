#pragma once
// What the checkpoint runtime (both modes) and the plan executor share about running a region again: RNG
// states and their replay, autocast, module buffers, the one recompute set-up, the shape/dtype/device of
// tensors for the determinism check, and the leaves a recomputed graph reaches. Implemented in region.cpp.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include "autograd/thread_state.h"
#include "checkpoint/restore.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace remat::detail {

/// The CPU generator's state and that of the CUDA generators of `cuda_devices`.
struct RngState {
  at::Tensor cpu;
  std::vector<std::pair<c10::DeviceIndex, at::Tensor>> cuda;

  /// Captures the current states. Consecutive captures with no random draw between them share one tensor.
  static RngState capture(const std::vector<c10::DeviceIndex>& cuda_devices);
  void restore() const;
  bool empty() const { return !cpu.defined() && !digested && cpu_bytes.empty(); }
  /// True when the generators are in exactly this state now (the CPU generator's by its digest, once
  /// digested).
  bool matches_current() const;
  /// Keeps the CPU generator's state as a 64-bit digest of its bytes and lets go of the tensor: for a state
  /// only compared with later (matches_current), not restored. A state shared with another capture (a
  /// neighbour's start) stays alive there.
  void digest();
  uint64_t cpu_digest = 0;
  bool digested = false;
  /// Keeps the CPU generator's state as plain bytes outside any tensor and lets go of the tensor; restore()
  /// and matches_current() read the bytes. For a state held to a backward pass that no figure of the step's
  /// model counts: where the generators stood after a kept call that drew random numbers
  /// (KeptCall::rng_after, held as the Python package holds it: remat/selective.py's _rng_after), and where
  /// they stood as the executor's forward pass began (put back should a stage throw); not among the CPU
  /// device's tensor bytes. A state shared with another capture (a neighbour's start) stays alive there.
  void hold_as_bytes();
  std::vector<uint8_t> cpu_bytes;
  /// True when both hold the same states (byte for byte).
  bool same_as(const RngState& other) const;
};

/// The next capture on this thread makes a CPU state tensor of its own, shared with no earlier capture: the
/// profiler measures each stage's region so (a region's start shares the state the region before it ended in
/// when nothing drew between them, so that a stage measured after another would be measured without its own).
void unshare_next_cpu_state();

/// Throws c10::Error naming `who` (and `what`, the region) when the generators are not in `end`, the state
/// the forward pass left them in: the recompute drew other random numbers than the forward pass, so its
/// dropout masks differ. Nothing is checked when `end` is empty (preserve_rng_state off).
void check_rng_replayed(const RngState& end, const char* who, const std::string& what);

/// The generators a region's forward pass started and ended in, for its recomputes to replay. Empty (nothing
/// replayed, nothing checked) when the region does not preserve the RNG state or drew no random number.
struct RngRecord {
  RngState start, end;

  /// At the start of the forward pass: captures the generators (those of `cuda_devices` too).
  void begin(const std::vector<c10::DeviceIndex>& cuda_devices);
  /// At its end: captures where they stand; a region that drew nothing keeps nothing (its recompute leaves
  /// the generators alone). Does nothing when begin() was not called.
  void finish(const std::vector<c10::DeviceIndex>& cuda_devices);
  bool empty() const { return start.empty(); }
};

/// Autocast (mixed precision) as it stands on this thread, for the CPU and CUDA device types: a recompute
/// re-enters the state of the forward pass, as torch.utils.checkpoint does.
struct AutocastState {
  bool cpu_enabled = false;
  bool cuda_enabled = false;
  bool cache_enabled = true;
  c10::ScalarType cpu_dtype = c10::ScalarType::BFloat16;
  c10::ScalarType cuda_dtype = c10::ScalarType::Half;

  static AutocastState current();
  bool any() const { return cpu_enabled || cuda_enabled; }
};

/// While alive: autocast is in `state` (entered like torch.autocast: nesting counted, the cast cache cleared
/// when the outermost autocast region ends); on destruction the previous state is back.
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastState saved_;
  bool nested_ = false;
};

/// While alive: autocast's cache of casts off (new casts not kept, as the Python package's
/// autocast_cache_off()); on destruction as it was. Both modes' regions (their forward pass and, recorded in
/// their autocast state, their recompute), the plan executor's stages in a training step, kept or not, and
/// remat::Planned's profiling run so: a stage would otherwise leave its weights' low-precision casts in the
/// cache until the caller's autocast region ends (a checkpointed one all of them, a kept one those its graph
/// does not save, and past its backward those it does where the backward runs inside the region).
class AutocastCacheOff {
 public:
  AutocastCacheOff();
  ~AutocastCacheOff();
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool was_;
};

/// The CUDA device indices of the defined CUDA tensors in `tensors`, each once.
std::vector<c10::DeviceIndex> cuda_devices_of(const std::vector<at::Tensor>& tensors);

/// While alive: the generators are at `replay` (when non-empty); on destruction they are put back where they
/// were on construction.
class RngReplay {
 public:
  RngReplay(const RngState& replay, const std::vector<c10::DeviceIndex>& cuda_devices);
  ~RngReplay();
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  RngState saved_;
};

/// Copies of every buffer of `modules` (recursively, each buffer once) on construction, written back on
/// destruction through .data(), so that their autograd version counters are not bumped (a recomputed graph
/// may have saved them).
class BufferRestore {
 public:
  /// With only_on_unwind, the buffers are written back only when the scope is left by an exception (a
  /// region that throws leaves its modules as they were).
  explicit BufferRestore(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                         bool only_on_unwind = false);
  ~BufferRestore();
  BufferRestore(const BufferRestore&) = delete;
  BufferRestore& operator=(const BufferRestore&) = delete;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_;
  bool only_on_unwind_ = false;
  int uncaught_ = 0;
};

/// The one set-up every recompute runs under, in both checkpoint modes and in the plan executor: while alive,
/// the generators are at `replay` (the region's forward-pass state, when non-empty), autocast is the forward
/// pass's, the tensors the forward pass wrote in place and read (`forward_writes`, ForwardWrites::take; null
/// or empty: none) hold the values it found, and module state the recompute writes is restored on exit
/// (StateRestore over `modules` and `inputs`), then those tensors to what the forward pass left. Grad mode is
/// left to the caller.
class RecomputeScope {
 public:
  RecomputeScope(const RngState& replay, const std::vector<c10::DeviceIndex>& cuda_devices,
                 const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                 const std::vector<at::Tensor>& inputs, const AutocastState& autocast,
                 const std::vector<ForwardWrite>* forward_writes = nullptr);
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  RngReplay rng_;
  ForwardValues forward_values_;  // before state_, which leaves its tensors to it: put back after state_'s
  StateRestore state_;
  AutocastScope autocast_;
};

/// The context remat adds to an error raised while a checkpoint's region is recomputed.
inline constexpr char kRecomputeContext[] =
    "remat::checkpoint: while recomputing a checkpointed region in the backward pass";

/// Runs `f` (a checkpoint's recompute); a c10::Error it throws gets kRecomputeContext added.
template <typename F>
void with_recompute_context(F&& f) {
  try {
    f();
  } catch (c10::Error& e) {
    e.add_context(kRecomputeContext);
    throw;
  }
}

/// While alive: on an exception, the generators go back to where they were on construction (a region
/// that throws leaves the RNG as it found it). Does nothing for an empty state.
class RngRollback {
 public:
  explicit RngRollback(const RngState& start);
  ~RngRollback();
  RngRollback(const RngRollback&) = delete;
  RngRollback& operator=(const RngRollback&) = delete;

 private:
  const RngState& start_;
  int uncaught_;
};

/// Where a region's run with grad (a recompute, an executor stage) starts creating autograd nodes. Sequence
/// numbers count per thread, so the thread is part of the mark: a node of this thread numbered before the
/// mark is certainly older than the run; a node of another thread may be the run's (made by a backward pass
/// it started, which autograd may run on a worker thread) or not (the caller's graph, when the run is a
/// recompute on a worker thread), and cannot be told apart by number.
struct NodeMark {
  uint64_t thread = 0;
  uint64_t first_sequence_nr = 0;
  /// The mark of this thread now.
  static NodeMark now();
  enum class Origin { kSince, kBefore, kOtherThread };
  /// Where `node` comes from relative to the mark.
  Origin origin(const torch::autograd::Node& node) const;
};

/// A leaf a recomputed graph reaches (a parameter) and the autograd node that accumulates its gradient.
struct Leaf {
  at::Tensor variable;
  torch::autograd::Node* accumulator;
};

/// What the graph of a region's run reaches beyond the region: the leaves requiring grad that it does not
/// declare, and the tensors computed outside it that it uses without taking them as inputs.
struct RegionReach {
  std::vector<Leaf> undeclared;
  /// "shape [2, 3] (from MulBackward0)" for each tensor that requires grad, was computed outside the region
  /// and reaches it other than through its inputs.
  std::vector<std::string> captured;
};

/// Walks the graph of `outputs` and stops at `stops` (the region's own inputs and the tensors it was found to
/// use, when they lead outside on purpose). Leaves requiring grad not in `declared` are undeclared. With a
/// `mark`, the walk stays inside the run: it follows the nodes made since the mark, reports this thread's
/// older nodes as captured tensors, and neither follows nor reports other threads' nodes (see NodeMark).
/// Without one (every tensor the region uses from outside is among `stops`), it follows every node.
RegionReach region_reach(const std::vector<at::Tensor>& outputs,
                         const std::unordered_set<c10::TensorImpl*>& declared, const NodeMark* mark,
                         const std::unordered_set<const torch::autograd::Node*>& stops = {});

/// Throws c10::Error naming `who` when the region captured tensors that require grad from outside (their
/// gradients cannot flow back through a region run as a nested backward pass): pass them as inputs instead.
void refuse_captured(const RegionReach& reach, const char* who, const char* advice);

/// Under a user pass that returns gradients (torch::autograd::grad) rather than accumulating them: throws
/// c10::Error "<what>: ..." with their shapes and `advice` when the user asked for one of `leaves`, which
/// cannot get its gradient through a nested pass, or asked for a tensor that had no autograd node when the
/// pass started (the engine then captures a placeholder, and whether it is one of `leaves` cannot be told).
void refuse_undeclared_asked(const std::vector<Leaf>& leaves, const UserPass& pass, const char* what,
                             const char* advice);

/// Backpropagates `grad`, taken by move, from `output` to the leaves `targets`: accumulated into their .grad
/// (accumulate) or returned (undefined for a target the graph does not reach). Unlike
/// torch::autograd::backward, nothing outside the engine keeps `grad` alive: it is freed as soon as the
/// first backward node has consumed it, as in one backward pass through per-stage checkpoints. `output` is
/// taken by value too: pass it by move, and its values are freed as soon as the nodes that saved them are
/// done (a stage whose last operation saves its result, ReLU, holds it otherwise for its whole backward).
torch::autograd::variable_list backward_from(at::Tensor output, at::Tensor grad,
                                             const std::vector<at::Tensor>& targets, bool keep_graph,
                                             bool create_graph, bool accumulate);

/// Shape, dtype and device of a tensor.
struct TensorMeta {
  std::vector<int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::kCPU;

  static TensorMeta of(const at::Tensor& t);
  bool operator==(const TensorMeta& o) const {
    return sizes == o.sizes && dtype == o.dtype && device == o.device;
  }
  bool operator!=(const TensorMeta& o) const { return !(*this == o); }
  std::string str() const;
};

}  // namespace remat::detail
