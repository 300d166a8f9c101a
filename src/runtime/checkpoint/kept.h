#pragma once
// A call whose outputs a kNonReentrant checkpoint keeps from the forward pass, and hands back in its
// recompute instead of running the call again: a remat::keep call whose tag the checkpoint lists, or an
// operator call its policy keeps (kept.cpp; used by non_reentrant.cpp and op_policy.cpp).

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "autograd/saved.h"
#include "checkpoint/region.h"

namespace remat::detail {

/// One kept call: its outputs, and how to give back in the recompute each tensor autograd saved inside it.
struct KeptCall {
  struct Saved {
    // A view of input `input` (>= 0) or of output `output` (>= 0) with these sizes, strides and storage
    // offset relative to it, and its conjugate and negative bits (a conj() or imag() view's); otherwise
    // `held` itself.
    int64_t input = -1, output = -1;
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
    bool conj = false, neg = false;
    at::Tensor held;
  };
  std::string tag;  // the remat::keep tag, or the operator's name
  size_t num_inputs = 0;
  std::vector<at::Tensor> outputs;  // detached; empty once released
  std::vector<bool> output_requires_grad;
  std::vector<int64_t> output_versions;
  std::vector<Saved> saved;
  RngState rng_after;  // where the generators stood after the call, when it drew random numbers
  // Sent away (send_away): the saved-tensor hooks holding each output, then each Saved::held, in order (the
  // tensors themselves are let go); and the outputs' version counters, for the check that they were not
  // written since.
  std::vector<std::shared_ptr<torch::autograd::SavedVariableHooks>> away;
  std::vector<c10::VariableVersion> counters;

  /// Whether its outputs are still held (not handed back or released).
  bool held() const { return !outputs.empty(); }
  /// Lets go of the outputs and what was kept of the saved tensors.
  void release() { outputs.clear(), saved.clear(), away.clear(), counters.clear(); }
};

class HookSource;

/// Hands a held call's outputs and held saved tensors to `sink`'s saved-tensor hooks (an enclosing Offload's,
/// which may send them to host memory) and lets go of them; hand_back() unpacks them. Once the region's
/// forward pass is done: nothing may write them in place any more without the version check seeing it.
void send_away(KeptCall& call, HookSource& sink);

/// The record of a call that ran with `inputs`, returned `outputs`, and during which autograd saved
/// `captured`: outputs detached, each saved tensor as a view of an input or an output where it is one.
KeptCall make_kept_call(std::string tag, const std::vector<at::Tensor>& inputs,
                        const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& captured);

/// In a recompute: checks that no kept output was written since (c10::Error naming `who` and the call),
/// saves through `save` what autograd saved inside the call (views rebuilt on the recompute's `inputs`),
/// and returns the outputs with a grad_fn that holds nothing (a gradient through it throws c10::Error with
/// `no_graph_message`), so that the operations after the call record their graph. Releases the call. `save`
/// may throw (a recompute that stops early).
std::vector<at::Tensor> hand_back(KeptCall& call, const std::vector<at::Tensor>& inputs,
                                  const std::function<void(const at::Tensor&)>& save, const std::string& who,
                                  const std::string& no_graph_message);

}  // namespace remat::detail
