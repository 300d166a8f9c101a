#pragma once
// StateRestore: a recompute writes no module state, declared or not (restore.cpp, through a dispatcher
// fallback).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <vector>

namespace remat::detail {

class BufferRestore;  // checkpoint/region.h

/// While alive (around a recompute): every tensor that existed before the scope, requires no gradient and
/// that an operator writes in place (BatchNorm's running statistics and `num_batches_tracked`, any buffer or
/// captured tensor updated in place) is copied just before its first write, and written back through
/// .data() on destruction, so a recompute leaves no trace in module state whether or not the module was
/// declared. It watches the operators through a dispatcher fallback that is active on this thread only while
/// a StateRestore is alive. `inputs` (the region's arguments) are not restored: an in-place op on them is the
/// region's own work. Where the fallback cannot be installed (another library holds its dispatch key),
/// `modules`' buffers are copied and written back instead, with a warning that undeclared ones are not.
class StateRestore {
 public:
  StateRestore(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
               const std::vector<at::Tensor>& inputs);
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

}  // namespace remat::detail
