#pragma once
// StateRestore: a recompute writes no module state, declared or not (restore.cpp, through a dispatcher
// fallback).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <utility>
#include <vector>

namespace remat::detail {

class BufferRestore;  // checkpoint/region.h

/// A tensor from before a region's forward pass that the pass wrote in place, and its value before the write
/// (ForwardWrites::take).
using ForwardWrite = std::pair<at::Tensor, at::Tensor>;

/// While alive (around a recompute): every tensor that existed before the scope, requires no gradient and
/// that an operator writes in place (BatchNorm's running statistics and `num_batches_tracked`, any buffer or
/// captured tensor updated in place) is copied just before its first write, and written back through
/// .data() on destruction, so a recompute leaves no trace in module state whether or not the module was
/// declared. It watches the operators through a dispatcher fallback that is active on this thread only while
/// a StateRestore is alive. `inputs` (the region's arguments) are not restored: an in-place op on them is the
/// region's own work. Where the fallback cannot be installed (another library holds its dispatch key),
/// `modules`' buffers are copied and written back instead, with a warning that undeclared ones are not.
/// `left` (null: none): tensors whose values the caller puts back itself after this scope, each with that
/// value (ForwardValues::set()): writes to them through these tensor objects are not copied (a write through
/// another view of their storage still is).
class StateRestore {
 public:
  StateRestore(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
               const std::vector<at::Tensor>& inputs, const std::vector<ForwardWrite>* left = nullptr);
  ~StateRestore();
  StateRestore(const StateRestore&) = delete;
  StateRestore& operator=(const StateRestore&) = delete;

  /// The tensors restored so far (for tests and diagnostics).
  size_t restored_count() const;

  struct Watch;  // what the dispatcher fallback records (restore.cpp)

 private:
  std::unique_ptr<Watch> watch_;
  std::unique_ptr<BufferRestore> fallback_;  // where the fallback cannot be installed
};

/// While alive (around a region's first forward pass, whose recompute comes later): watches the operators as
/// StateRestore does, and copies each tensor from before the scope that requires no gradient, is not one of
/// `inputs` and that an operator writes in place, just before its first write; nothing is written back.
/// take() ends the watch and hands over the copies of the tensors that an operator also read, other than by
/// writing them (an EMA codebook read by a product and then updated; a buffer updated and then read), for the
/// recompute to read the values the forward pass read (RecomputeScope's `forward_writes`). A tensor only
/// written (BatchNorm's running statistics, which batch_norm reads only to update them) needs none: its copy
/// goes at take(). Where remat's dispatcher fallback cannot be installed, nothing is watched: take() is empty
/// and the recompute reads what the forward pass left (before 2026-12-07, every region's recompute did).
class ForwardWrites {
 public:
  explicit ForwardWrites(const std::vector<at::Tensor>& inputs);
  ~ForwardWrites();
  ForwardWrites(const ForwardWrites&) = delete;
  ForwardWrites& operator=(const ForwardWrites&) = delete;

  /// Ends the watch. The copies of the tensors read as well as written, in the order of their first writes.
  std::vector<ForwardWrite> take();

 private:
  std::unique_ptr<StateRestore::Watch> watch_;
};

/// While alive: each tensor of `writes` (ForwardWrites::take) holds the value its region's forward pass found
/// (through .data(): no version moves); on destruction, the value it had on construction. Around a recompute,
/// outside its StateRestore, which leaves these tensors to it (`set()`, StateRestore's `left`): what the
/// recompute writes to them is overwritten here, with no copy of the found value made for it. Holds one copy
/// of each tensor while alive (its value on construction); before 2026-12-07 the StateRestore inside held a
/// second, of the value found.
class ForwardValues {
 public:
  explicit ForwardValues(const std::vector<ForwardWrite>* writes);
  ~ForwardValues();
  ForwardValues(const ForwardValues&) = delete;
  ForwardValues& operator=(const ForwardValues&) = delete;

  /// The tensors it set (those of `writes` not resized since their copy was made), each with the value it
  /// puts back on destruction (its value when the scope began).
  const std::vector<ForwardWrite>& set() const { return now_; }

 private:
  std::vector<ForwardWrite> now_;  // (tensor, its value when the scope began)
};

}  // namespace remat::detail
