// Kept calls (checkpoint/kept.h): how a checkpoint keeps a call's outputs from the forward pass and hands
// them back in its recompute, with what autograd saved inside the call.

#include "checkpoint/kept.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include "autograd/hooks.h"
#include "detail/compat.h"

namespace remat::detail {
namespace {

// The grad_fn of a kept output handed back by a recompute: the call did not run, so there is no graph to
// differentiate; running it throws c10::Error with `msg`.
struct NoGraph final : torch::autograd::Node {
  NoGraph(std::string msg, torch::autograd::edge_list&& next) : Node(std::move(next)), msg(std::move(msg)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*grads*/) override {
    TORCH_CHECK(false, msg);
  }
  std::string msg;
};

KeptCall::Saved recipe_of(const at::Tensor& t, const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& outputs) {
  KeptCall::Saved s;
  auto alias = [&](const std::vector<at::Tensor>& of, int64_t& index) {
    if (!t.has_storage()) return false;
    for (size_t i = 0; i < of.size(); ++i) {
      if (of[i].defined() && of[i].has_storage() && t.is_alias_of(of[i]) && !t.is_sparse()) {
        index = static_cast<int64_t>(i);
        s.sizes = t.sizes().vec();
        s.strides = t.strides().vec();
        s.offset = t.storage_offset() - of[i].storage_offset();
        s.conj = t.is_conj();
        s.neg = t.is_neg();
        return true;
      }
    }
    return false;
  };
  if (!alias(outputs, s.output) && !alias(inputs, s.input)) s.held = t.detach();
  return s;
}

}  // namespace

KeptCall make_kept_call(std::string tag, const std::vector<at::Tensor>& inputs,
                        const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& captured) {
  KeptCall call;
  call.tag = std::move(tag);
  call.num_inputs = inputs.size();
  for (const auto& t : captured)
    call.saved.push_back(recipe_of(t, inputs, outputs));
  for (const auto& o : outputs) {
    call.outputs.push_back(o.detach());
    call.output_requires_grad.push_back(o.requires_grad());
    call.output_versions.push_back(version_of(o));
  }
  return call;
}

void send_away(KeptCall& call, HookSource& sink) {
  if (!call.held() || !call.away.empty()) return;
  auto send = [&](at::Tensor& t) {
    std::shared_ptr<torch::autograd::SavedVariableHooks> hooks = sink.make_hooks();
    hooks->call_pack_hook(t);
    call.away.push_back(std::move(hooks));
    t = at::Tensor();
  };
  for (at::Tensor& o : call.outputs) {
    call.counters.push_back(o.is_inference() ? c10::VariableVersion(c10::VariableVersion::DISABLED)
                                             : torch::autograd::impl::version_counter(o));
    send(o);
  }
  for (auto& sv : call.saved)
    if (sv.held.defined()) send(sv.held);
}

std::vector<at::Tensor> hand_back(KeptCall& call, const std::vector<at::Tensor>& inputs,
                                  const std::function<void(const at::Tensor&)>& save, const std::string& who,
                                  const std::string& no_graph_message) {
  const bool away = !call.away.empty();
  for (size_t o = 0; o < call.outputs.size(); ++o) {
    const int64_t now = !away ? version_of(call.outputs[o])
                        : call.counters[o].enabled()
                            ? static_cast<int64_t>(call.counters[o].current_version())
                            : 0;
    TORCH_CHECK(now == call.output_versions[o], who, ": output ", o,
                " was modified in place after the call; a kept output must not be written to");
  }
  // The frame lets go of them when this returns, and as well when a save below ends the recompute (a
  // recompute that stops early at its last saved tensor throws from that save): before 2026-12-04 such a
  // call's outputs stayed held through the stage's backward (dropout's output and mask, kept and handed back
  // last: two hidden states above the prediction of a group assignment that keeps it).
  struct ReleaseOnExit {
    KeptCall& call;
    ~ReleaseOnExit() { call.release(); }
  } release_on_exit{call};
  // Sent away: back from the hooks (from host memory when an Offload sent them there).
  std::vector<at::Tensor> kept_outputs = call.outputs;
  size_t next = 0;
  if (away) {
    for (at::Tensor& o : kept_outputs)
      o = call.away.at(next++)->call_unpack_hook();
  }
  {
    at::NoGradGuard no_grad;
    for (const auto& sv : call.saved) {
      if (sv.held.defined() || (away && sv.input < 0 && sv.output < 0)) {
        save(away ? call.away.at(next++)->call_unpack_hook() : sv.held);
        continue;
      }
      // Detached: a view of the recompute's own tensor would hold its graph (and through it every leaf the
      // graph reaches, such as a kept output only read by a copy) for as long as backward holds the view.
      const at::Tensor base = (sv.input >= 0 ? inputs.at(sv.input) : kept_outputs.at(sv.output)).detach();
      TORCH_CHECK(base.has_storage(), who, ": input ", sv.input, " has no storage in the recompute");
      at::Tensor view = base.as_strided(sv.sizes, sv.strides, base.storage_offset() + sv.offset);
      // The view's bits, which as_strided takes from the base: the values it was saved with.
      if (view.is_conj() != sv.conj) view = view.conj();
      if (view.is_neg() != sv.neg) view = view._neg_view();
      save(view);
    }
  }
  // Outputs that required grad get a grad_fn that holds nothing, so that the operations after the call
  // record their graph and save what they save. Not requires_grad_() on a leaf: its gradient accumulator
  // would hold the output until the recompute's graph dies (a projection that only feeds a copy, kept
  // through the rest of the layer's recompute). The recompute's graph is not run, unless fn takes a gradient
  // in it, and one through a kept output is an error (the call did not run to record its graph).
  std::vector<at::Tensor> outputs;
  decltype(compat::make_node<NoGraph>(std::string(), torch::autograd::edge_list())) no_graph;
  for (size_t o = 0; o < kept_outputs.size(); ++o) {
    at::Tensor out = kept_outputs[o].detach();
    if (call.output_requires_grad[o]) {
      // Edges to the call's inputs, so that a gradient towards them reaches this node and its message.
      if (!no_graph) {
        std::vector<at::Tensor> defined;
        for (const auto& x : inputs)
          if (x.defined()) defined.push_back(x);
        no_graph = compat::make_node<NoGraph>(no_graph_message, torch::autograd::collect_next_edges(defined));
      }
      const uint32_t nr = no_graph->add_input_metadata(out);
      torch::autograd::impl::set_gradient_edge(out, torch::autograd::Edge(no_graph, nr));
    }
    outputs.push_back(std::move(out));
  }
  // The frame lets go of them here (release_on_exit): an output the recompute only reads (a projection the
  // next operation copies) is freed as soon as the recompute is done with it. A later recompute
  // (retain_graph) runs the call again.
  return outputs;
}

}  // namespace remat::detail
