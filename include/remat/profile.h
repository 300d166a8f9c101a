#pragma once
/// \file
/// Measuring a real model as a Chain (remat/planner/chain.h): every field with the exact meter, times as
/// medians.
///
///   remat::memory::track_cpu();
///   remat::Chain chain = remat::profile_chain(seq, x);                   // a Sequential
///   remat::Chain bert_chain = remat::profile_chain(bert->stages(ids, mask), ids);  // any list of stages
///   remat::save_chain(chain, "model.json");
///
/// For stage i, on the output of the previous stages: output_bytes is its output's size; saved_bytes is what
/// running it with grad leaves alive (its output plus what its autograd graph keeps; its input and parameters
/// are not counted, they are alive anyway); fwd_tmp_bytes is the peak above that during the forward;
/// fwd_nosave_tmp_bytes is the peak above its output during its forward without saving, under no-grad (as
/// the plan executor runs Fn and Fc);
/// bwd_tmp_bytes is the peak during its backward above its input, saved tensors, output gradient and input
/// gradient (the parameter gradients' temporaries are in it: .grad is pre-allocated, as after the first
/// step; a first stage whose sample input needs no gradient makes none, and its peaks are taken less the
/// input's bytes all the same, which the step's model charges), and bwd_grads_tmp_bytes, from the same run,
/// the peak it would have reached had it made those gradients (.grad undefined before it, as after
/// zero_grad()): from a hook on each parameter, which gets its gradient before it is accumulated;
/// has_backward is false for a stage whose output needs no gradient (a first stage frozen on a sample that
/// needs none: every later stage's input is taken as needing one). Times are
/// medians of `repeats` timed runs after `warmup` untimed ones, each run taking the stages in the order of a
/// training step (so that the caches hold what a step leaves there): a forward pass without saving
/// (fwd_nosave_ms), then from the last stage to the first its forward with saving and its backward (fwd_ms,
/// bwd_ms), then every stage under remat::checkpoint and the backward pass through them (checkpoint_fwd_ms,
/// checkpoint_bwd_ms), and with ProfileOptions::keep the same keeping the kept calls' outputs (keep_fwd_ms,
/// keep_bwd_ms; keep_saved_bytes is what that leaves alive). The peak memory of profiling is that of
/// checkpointing every stage plus one stage's saved tensors, not that of a plain step. The model is left as
/// it was: gradients, buffers (BatchNorm statistics) and the global RNG are restored.

#include <remat/planner/chain.h>
#include <remat/sequential.h>
#include <torch/arg.h>
#include <torch/types.h>

#include <functional>
#include <string>

namespace remat {

/// How far remat::profile_chain has come, handed to ProfileOptions::progress after each run of one stage.
struct ProfileProgress {
  /// Runs of one stage finished (a forward, a forward and backward, a recompute and backward).
  int64_t done = 0;
  int64_t total = 0;  ///< the runs this profile makes in all (fixed when it begins; done reaches it last)
  /// What the run just finished measured: "forward without saving", "forward and backward",
  /// "checkpointed", "kept calls" (ProfileOptions::keep), "policy NAME", "offloading" (the offload costs and
  /// stream figures of one stage), "groups" (one stage's saved groups), "bandwidth" (the copies' bandwidth).
  std::string phase;
  double phase_ms = 0;    ///< that run's wall-clock time (ms); summed by phase, where profiling's time goes
  double elapsed_ms = 0;  ///< since profiling began (ms)
  std::string stage;      ///< the stage's name ("" for bandwidth)
  int64_t stages = 0;     ///< the stages profiled
};

struct ProfileOptions {
  /// Untimed runs of each stage first (>= 0).
  TORCH_ARG(int64_t, warmup) = 1;
  /// Timed runs of each stage; the median is kept (>= 1).
  TORCH_ARG(int64_t, repeats) = 5;
  /// remat::keep tags (e.g. {remat::kMatmul}): also measure every stage as Fk runs it, under
  /// remat::checkpoint keeping those calls' outputs (Stage::keep_saved_bytes, keep_fwd_ms, keep_bwd_ms;
  /// Chain::keep), so that the planners can keep a layer's matrix multiplications and recompute only the
  /// rest. One more pass per run. Empty (the default): no Fk.
  TORCH_ARG(std::vector<std::string>, keep) = {};
  /// Operator-level policies (remat/policy.h, e.g. {remat::policy::matmuls()}): also measure every stage as
  /// Fk[name] runs it, under remat::checkpoint with that policy (Stage::policies; Chain::policies), so that
  /// the planners can choose per stage among keeping everything, each policy and checkpointing, on models
  /// with no remat::keep tags. One more pass per policy and run. Names must differ.
  TORCH_ARG(std::vector<Policy>, policies) = {};
  /// Also profile for offloading (>= 0: remat::Offload's min_bytes; -1, the default: no): what each stage run
  /// as Fa frees on the device when what it saves goes to host memory (Stage::offload: its bytes; whether its
  /// output was copied too, which the executor holds anyway; its input, a leaf of the executor's, is never
  /// offloaded), and the copies'
  /// bandwidth each way (Chain::to_host_gb_per_s, to_device_gb_per_s; remat::offload_bandwidth() on the
  /// largest stage's saved bytes, 1 to 64 MiB); and the stage's stream figures
  /// (OffloadCost::stream_fwd_bytes, stream_bwd_bytes: its forward's and backward's peaks above the bytes
  /// before each, run under an Offload with window 0; stream_bwd_grads_bytes: that backward's had it made its
  /// gradients; window_bytes: the largest tensor it sends), so that the
  /// per-layer planner may stream it (Fa3@stream). Two more forwards and one more backward per stage.
  TORCH_ARG(int64_t, offload_min_bytes) = -1;
  /// Also measure each stage's saved groups (Stage::groups), so that the planners can assign each to be kept,
  /// sent to the host or recomputed (a plan's Fk3{khr}, run under remat::group_policy; see
  /// remat::group_cost): the operator calls a region's policy is asked about (remat/policy.h), whether or not
  /// autograd saves their outputs (one kept or sent is a call the recompute skips), outermost first (a call
  /// inside one found is not one), with storages of their own, not written in place later; each with what
  /// keeping it holds (its outputs and what autograd saved inside it beyond its inputs' and outputs'
  /// storages, bytes), with offload_min_bytes >= 0 what of that an Offload would keep on the device were it
  /// sent (SavedGroup::stays_bytes), and its time (median of `repeats` runs, ms); then remat::fit_groups
  /// keeps at most kMaxGroups, the products, convolutions and attention kernels first, then the largest.
  /// `repeats` more forwards per stage, each holding every output of the stage's asked calls until it is read
  /// (more than the stage saves). Needs remat's dispatcher fallback, as policies do.
  TORCH_ARG(bool, groups) = false;
  /// Called after each run of one stage (remat::ProfileProgress), on the profiling thread; a progress bar,
  /// or a sum of where the time goes. What it throws propagates (the model is put back first). Empty (the
  /// default): nothing is called.
  TORCH_ARG(std::function<void(const ProfileProgress&)>, progress) = nullptr;
};

/// Profiles the stages on `sample_input` (the chain's input a_0). Needs remat::memory::track_cpu() for a CPU
/// input (it calls it). Throws c10::Error naming remat::profile_chain when stages is empty, the input is
/// undefined, warmup < 0 or repeats < 1, a policy is empty or two share a name, or a stage returns an
/// undefined tensor.
Chain profile_chain(const std::vector<StageFn>& stages, const torch::Tensor& sample_input,
                    const ProfileOptions& options = {});

/// Profiles the modules of a Sequential (stages_of(seq)).
Chain profile_chain(torch::nn::Sequential& seq, const torch::Tensor& sample_input,
                    const ProfileOptions& options = {});

/// A chain profiled where it sits in a model (a ResNet's layer1..layer3 between its stem and its head).
struct StepProfile {
  Chain chain;  ///< the chain's stages alone; input_bytes is the prefix's output (the chain's input)
  Chain step;  ///< the whole step: stage 0 the prefix, then the chain's stages, last the suffix (to the loss)
};

/// Profiles `stages` inside a model: `prefix` maps the model's input to the chain's input, `suffix` the
/// chain's output to the loss (one scalar); each is profiled as one stage. The step's predicted peak for a
/// plan over the chain is simulate(result.step, step_plan(plan)).peak_bytes (remat/planner/plan.h),
/// comparable to a meter's peak over a step that includes the model's input. Nothing of the model changes:
/// gradients, the RNG and every tensor a stage updates in place (BatchNorm statistics, declared or not) are
/// put back. Throws as profile_chain, naming remat::profile_step.
StepProfile profile_step(const StageFn& prefix, const std::vector<StageFn>& stages, const StageFn& suffix,
                         const torch::Tensor& model_input, const ProfileOptions& options = {});

/// The chain's input for a model input: runs `prefix` under NoGradGuard and returns its output, leaving the
/// model as it was (in train mode too: BatchNorm statistics the prefix updates are written back) and the
/// global RNG where it was. For profile_chain on a chain inside a model. Throws c10::Error naming
/// remat::chain_input when the input is undefined or the prefix returns an undefined tensor.
torch::Tensor chain_input(const StageFn& prefix, const torch::Tensor& model_input);

}  // namespace remat
