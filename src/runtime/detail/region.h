#pragma once
// What the checkpoint runtime (both modes) and the plan executor share about running a region again: RNG
// states and their replay, autocast, module buffers, the one recompute set-up, the shape/dtype/device of
// tensors for the determinism check, and the leaves a recomputed graph reaches. Implemented in region.cpp.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include "detail/restore.h"

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
  bool empty() const { return !cpu.defined(); }
  /// True when the generators are in exactly this state now.
  bool matches_current() const;
  /// True when both hold the same states (byte for byte).
  bool same_as(const RngState& other) const;
};

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
/// pass's, and module state the recompute writes is restored on exit (StateRestore over `modules` and
/// `inputs`). Grad mode is left to the caller.
class RecomputeScope {
 public:
  RecomputeScope(const RngState& replay, const std::vector<c10::DeviceIndex>& cuda_devices,
                 const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                 const std::vector<at::Tensor>& inputs, const AutocastState& autocast);
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  RngReplay rng_;
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

/// A leaf a recomputed graph reaches (a parameter) and the autograd node that accumulates its gradient.
struct Leaf {
  at::Tensor variable;
  torch::autograd::Node* accumulator;
};

/// The leaves requiring grad that the graph of `outputs` reaches, not in `declared`: parameters a region uses
/// without declaring them. Only nodes with sequence numbers >= first_sequence_nr (created by the recompute)
/// are followed, so the walk stays inside the region.
std::vector<Leaf> undeclared_leaves(const std::vector<at::Tensor>& outputs,
                                    const std::unordered_set<c10::TensorImpl*>& declared,
                                    uint64_t first_sequence_nr);

/// Under torch::autograd::grad (called from a node's backward), when the caller asked for one of `leaves`,
/// which cannot get its gradient there: warns once per message and shape, "<what>: the region uses
/// parameters it does not declare (shapes ...) ... <advice>". Does nothing outside a graph task.
void warn_undeclared_asked(const std::vector<Leaf>& leaves, const char* what, const char* advice);

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
