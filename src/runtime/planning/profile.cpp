#include "remat/profile.h"

#include "remat/offload.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_set>

#include "checkpoint/region.h"
#include "detail/compat.h"
#include "offload/stage_offload.h"
#include "planning/profile.h"
#include "planning/saved_groups.h"
#include "remat/checkpoint.h"
#include "remat/measure.h"
#include "remat/memory.h"
#include "remat/planner/device.h"
#include "remat/planner/report.h"

namespace remat {
namespace detail {
namespace {
std::atomic<int> profiler_count{0};
}
ProfilerRunning::ProfilerRunning() {
  profiler_count.fetch_add(1, std::memory_order_acq_rel);
}
ProfilerRunning::~ProfilerRunning() {
  profiler_count.fetch_sub(1, std::memory_order_acq_rel);
}
bool profiler_running() {
  return profiler_count.load(std::memory_order_acquire) > 0;
}
}  // namespace detail

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// What offloading one way of running a stage frees, from its run with and without an Offload: what left the
// device (`freed`, at most what that way keeps beyond its output, `kept` - `output_bytes`); never its input
// (the executor holds it); its output when the copies exceed what left by its size (saved by the stage:
// copied, and held for the next stage all the same). Bytes.
OffloadCost offload_cost(int64_t kept, int64_t freed, int64_t copied, int64_t output_bytes) {
  OffloadCost c;
  c.bytes = std::max<int64_t>(0, std::min(freed, kept - output_bytes));
  c.input = false;
  c.output = copied - c.bytes >= output_bytes;
  return c;
}

// Hands ProfileOptions::progress each finished run of one stage, with the time since the last (so that
// summing by phase accounts for all of profiling's time).
class Reporter {
 public:
  Reporter(const std::function<void(const ProfileProgress&)>& progress, int64_t stages, int64_t total)
      : progress_(progress), stages_(stages), total_(total), start_(Clock::now()), last_(start_) {}
  void operator()(const std::string& phase, const std::string& stage) {
    if (!progress_) return;
    const auto now = Clock::now();
    ProfileProgress p;
    p.done = ++done_;
    p.total = total_;
    p.stages = stages_;
    p.phase = phase;
    p.stage = stage;
    p.phase_ms = std::chrono::duration<double, std::milli>(now - last_).count();
    p.elapsed_ms = std::chrono::duration<double, std::milli>(now - start_).count();
    last_ = now;
    progress_(p);
  }

 private:
  const std::function<void(const ProfileProgress&)>& progress_;
  int64_t stages_, total_, done_ = 0;
  Clock::time_point start_, last_;
};

// Puts back the parameters' gradients, the buffers and the global RNG as they were.
class Restore {
 public:
  Restore(const std::vector<StageFn>& stages, c10::Device device) {
    std::unordered_set<c10::TensorImpl*> seen;
    for (const auto& s : stages) {
      if (!s.module) continue;
      modules_.push_back(s.module);
      for (auto& p : s.module->parameters()) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) grads_.emplace_back(p, p.grad());
      }
    }
    std::vector<c10::DeviceIndex> cuda;
    if (device.is_cuda()) cuda.push_back(device.index() < 0 ? 0 : device.index());
    rng_ = detail::RngState::capture(cuda);
    buffers_.emplace(modules_);
    // A stage without its module may update state nobody declared: watch for it (this costs about a
    // microsecond per operator, so only then).
    for (const auto& s : stages) {
      if (!s.module) {
        state_.emplace(std::vector<std::shared_ptr<torch::nn::Module>>{}, std::vector<torch::Tensor>{});
        break;
      }
    }
  }
  ~Restore() {
    state_.reset();
    buffers_.reset();
    rng_.restore();
    for (auto& [p, g] : grads_)
      p.mutable_grad() = g;
  }
  // Pre-allocates zeroed gradients, as after a first training step.
  void zero_grads() {
    torch::NoGradGuard no_grad;
    for (auto& [p, g] : grads_) {
      if (p.requires_grad()) p.mutable_grad() = torch::zeros_like(p);
    }
  }

 private:
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> grads_;
  detail::RngState rng_;
  std::optional<detail::BufferRestore> buffers_;
  std::optional<detail::StateRestore> state_;
};

}  // namespace

// While a stage's backward runs with its parameters' gradients pre-allocated: the peak it would have reached
// had it made them (.grad undefined before it, as after zero_grad(); Stage::bwd_grads_tmp_bytes), above the
// bytes alive when made. Each parameter's gradient, once accumulated into the one pre-allocated, is freed
// where, made, it would stay alive (taken as the .grad): a hook marks that moment (AfterAccumulated). So that
// backward's count is this one plus the gradients accumulated so far, and its peak the most, over the
// stretches between hooks, of each stretch's peak plus what was accumulated before it. (Before, found
// 2026-12-07, a gradient was counted as made from the moment it was handed over, while still alive in this
// count: a backward's peak right after a large gradient was handed over held that gradient twice. LibTorch
// 1.13 has no hook after the accumulation, and still counts so: its figure is high by up to the largest
// gradient where the peak is there.) The hooks go with it (python/remat/profile.py's _GradsPeak is its twin).
namespace {
class GradsPeak {
 public:
  GradsPeak(c10::Device device, const std::vector<torch::Tensor>& params)
      : device_(device), base_(device), stretch_(std::make_unique<memory::PeakWindow>(device)) {
    for (const torch::Tensor& p : params) {
      const int64_t nbytes = static_cast<int64_t>(p.nbytes());
      hooks_.push_back(std::make_unique<detail::compat::AfterAccumulated>(p, [this, nbytes] {
        close_stretch();
        made_ += nbytes;
      }));
    }
  }
  GradsPeak(const GradsPeak&) = delete;
  GradsPeak& operator=(const GradsPeak&) = delete;
  int64_t peak_over_base() {
    close_stretch();
    return most_;
  }

 private:
  // A stretch's window is opened at its start, so that its peak over that start is never below it; the start
  // is read against the base, below which the count may be (what the backward let go of: a window kept from
  // the base and restarted, whose peak reads no lower than its base, read such a stretch at the base: found
  // 2026-12-07, a backward's last stretch, every gradient made, read 32 KiB high).
  void close_stretch() {
    most_ = std::max(most_, start_ + stretch_->peak_over_base() + made_);
    stretch_.reset();
    start_ = base_.active_over_base();
    stretch_ = std::make_unique<memory::PeakWindow>(device_);
  }
  c10::Device device_;
  memory::PeakWindow base_;
  std::unique_ptr<memory::PeakWindow> stretch_;
  int64_t start_ = 0, made_ = 0, most_ = 0;
  std::vector<std::unique_ptr<detail::compat::AfterAccumulated>> hooks_;
};
}  // namespace

static Chain profile_stages(const std::vector<StageFn>& stages, const torch::Tensor& sample_input,
                            const ProfileOptions& options, const char* kWho) {
  TORCH_CHECK(!stages.empty(), kWho, ": no stages");
  TORCH_CHECK(sample_input.defined(), kWho, ": the sample input is an undefined tensor");
  TORCH_CHECK(options.warmup() >= 0, kWho, ": warmup must be >= 0, got ", options.warmup());
  TORCH_CHECK(options.repeats() >= 1, kWho, ": repeats must be >= 1, got ", options.repeats());
  TORCH_CHECK(options.offload_min_bytes() >= -1, kWho,
              ": offload_min_bytes must be >= 0 (bytes), or -1 not to profile offloading, got ",
              options.offload_min_bytes());
  for (size_t p = 0; p < options.policies().size(); ++p) {
    TORCH_CHECK(!options.policies()[p].empty(), kWho, ": policy ", p,
                " of ProfileOptions::policies is empty");
    for (size_t q = 0; q < p; ++q)
      TORCH_CHECK(options.policies()[q].name() != options.policies()[p].name(), kWho,
                  ": two policies are named '", options.policies()[p].name(),
                  "'; a chain tells them apart by name");
  }
  const c10::Device device = sample_input.device();
  if (device.is_cpu()) memory::track_cpu();
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index() < 0 ? -1 : device.index());
  };

  Restore restore(stages, device);
  restore.zero_grads();
  detail::ProfilerRunning profiling;  // its gradients are put back: data parallel must not reduce them
  at::AutoGradMode grad_mode(true);

  Chain chain;
  chain.input_bytes = static_cast<int64_t>(sample_input.nbytes());
  const size_t n = stages.size();
  // What offloading a stage's forward frees: the forward under an Offload with its copies waited for, what it
  // left alive on the device less what the same run left without one (bytes), and what the Offload copied.
  struct Away {
    int64_t freed = 0, copied = 0;
  };
  struct Per {
    std::vector<torch::Tensor> params;  // those that require grad
    bool input_grad = false;
    CheckpointOptions per_call;
    std::vector<double> fwd, bwd, nosave, ckpt_fwd, ckpt_bwd, keep_fwd, keep_bwd;
    int64_t keep_saved = 0;
    // Its forward without saving: the peak above its output, under no-grad (as the plan executor runs Fn and
    // Fc).
    int64_t nosave_tmp = 0;
    std::vector<std::vector<double>> policy_fwd, policy_bwd;  // per policy of options.policies()
    std::vector<int64_t> policy_saved;
    std::vector<std::optional<int64_t>> policy_bwd_tmp;  // per policy, its backward's peak (when measured)
    std::vector<std::optional<int64_t>> policy_bwd_grads_tmp;  // that peak had it made the gradients
    // Offloading profiled: the stage run as Fk (keep tags) and under each policy inside an Offload.
    std::optional<Away> keep_away;
    std::vector<std::optional<Away>> policy_away;
  };
  std::vector<Per> per(n);
  for (auto& p : per) {
    p.policy_fwd.resize(options.policies().size());
    p.policy_bwd.resize(options.policies().size());
    p.policy_saved.assign(options.policies().size(), 0);
    p.policy_bwd_tmp.assign(options.policies().size(), std::nullopt);
    p.policy_bwd_grads_tmp.assign(options.policies().size(), std::nullopt);
    p.policy_away.resize(options.policies().size());
  }
  chain.stages.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const StageFn& stage = stages[i];
    chain.stages[i].name = stage.name.empty() ? "stage" + std::to_string(i) : stage.name;
    if (stage.module) {
      for (const auto& p : stage.module->parameters()) {
        if (p.requires_grad()) per[i].params.push_back(p);
      }
      per[i].per_call.modules({stage.module});
    }
  }
  auto targets_of = [&](size_t i, const torch::Tensor& leaf) {
    std::vector<torch::Tensor> targets = per[i].params;
    if (per[i].input_grad) targets.push_back(leaf);
    return targets;
  };
  auto leaf_of = [&](size_t i, const torch::Tensor& x) {
    torch::Tensor leaf = x.detach();
    if (per[i].input_grad) leaf.requires_grad_(true);
    return leaf;
  };

  // A stage's backward from `out` with d_{i+1} = ones, as the executor runs it: the output and d handed over
  // by move, so that each is freed once the nodes that need it are done (hold_output: the output held through
  // it instead, as where the rest of the step holds the chain's output: Stage::bwd_output_freed_bytes).
  // Returns its time; *peak gets its peak above what was alive before it (d included), and *grads_peak the
  // peak it would have reached had it made the gradients of `params` (pre-allocated here; GradsPeak).
  auto timed_backward = [&](torch::Tensor out, const std::vector<torch::Tensor>& targets, int64_t* peak,
                            const std::vector<torch::Tensor>* params = nullptr, int64_t* grads_peak = nullptr,
                            bool hold_output = false) {
    torch::Tensor d = torch::ones_like(out);
    sync();
    memory::PeakWindow scope(device);
    std::optional<GradsPeak> made;
    if (grads_peak) made.emplace(device, *params);
    const auto t0 = Clock::now();
    const torch::Tensor held = hold_output ? out : torch::Tensor();
    detail::backward_from(std::move(out), std::move(d), targets, /*keep_graph=*/false, /*create_graph=*/false,
                          /*accumulate=*/true);
    sync();
    const double ms = ms_since(t0);
    if (peak) *peak = scope.peak_over_base();
    if (grads_peak) *grads_peak = made->peak_over_base();
    return ms;
  };
  // Stage i's backward peaks above what was alive before it, its input's gradient apart (the plan charges
  // that apart): {with the gradients pre-allocated, had it made them} (bwd_tmp_bytes, bwd_grads_tmp_bytes and
  // a policy's), and its time; with its output let go of as it begins, as the executor runs a kept stage's
  // backward, or held through it (hold_output).
  struct BackwardPeaks {
    double ms = 0;
    int64_t tmp = 0, grads_tmp = 0;
  };
  auto measured_backward = [&](size_t i, torch::Tensor out, const torch::Tensor& leaf,
                               const std::vector<torch::Tensor>& targets, bool hold_output = false) {
    BackwardPeaks b;
    int64_t peak = 0, grads_peak = 0;
    b.ms = timed_backward(std::move(out), targets, &peak, &per[i].params, &grads_peak, hold_output);
    // A stage whose input takes no gradient (the chain's input where the sample needs none) makes none, and
    // the step's model charges one at its backward all the same: its peaks less its input's bytes too, as the
    // Python profiler takes them.
    const int64_t d_in = !per[i].input_grad      ? static_cast<int64_t>(leaf.nbytes())
                         : leaf.grad().defined() ? static_cast<int64_t>(leaf.grad().nbytes())
                                                 : 0;
    b.tmp = std::max<int64_t>(0, peak - d_in);
    b.grads_tmp = std::max<int64_t>(0, grads_peak - d_in);
    return b;
  };

  // Each repeat runs the stages in the order of a training step, so that what is in the caches when a
  // stage runs is what a step leaves there (timing a stage over and over on its own predicted a plain step
  // short, with the caches warmer than a step leaves them): a forward pass without saving (Fn, which also
  // produces the stages' inputs on the first run), then from the last stage to the first its forward with
  // saving and its backward (Fa, B: the peak of the executor's checkpoint-every-stage plan, far below a plain
  // step's), then every stage under remat::checkpoint and the backward pass through them (per-call
  // checkpointing, whose recompute stops early).
  std::vector<torch::Tensor> xs(n + 1);
  xs[0] = sample_input.detach();
  const bool profile_offload = options.offload_min_bytes() >= 0;
  const int64_t checkpoint_passes =
      1 + (options.keep().empty() ? 0 : 1) + static_cast<int64_t>(options.policies().size());
  const int64_t stages_n = static_cast<int64_t>(n);
  Reporter report(options.progress(), stages_n,
                  (options.warmup() + options.repeats()) * stages_n * (2 + 2 * checkpoint_passes) +
                      (profile_offload ? stages_n + 1 : 0) + (options.groups() ? stages_n : 0));
  for (int64_t r = 0; r < options.warmup() + options.repeats(); ++r) {
    const bool measure = r == options.warmup();
    const bool keep = r >= options.warmup();
    for (size_t i = 0; i < n; ++i) {
      torch::NoGradGuard no_grad;
      sync();
      memory::PeakWindow scope(device);
      const auto t0 = Clock::now();
      torch::Tensor out = stages[i].fn(xs[i]);
      sync();
      const double f = ms_since(t0);
      TORCH_CHECK(out.defined(), kWho, ": stage ", i, " ('", chain.stages[i].name,
                  "') returned an undefined tensor");
      if (measure) {
        per[i].nosave_tmp =
            std::max(per[i].nosave_tmp, scope.peak_over_base() - static_cast<int64_t>(out.nbytes()));
      }
      if (r == 0) {
        xs[i + 1] = out;
        const bool floating =
            at::isFloatingType(xs[i].scalar_type()) || at::isComplexType(xs[i].scalar_type());
        per[i].input_grad = floating && (i > 0 || sample_input.requires_grad());
      }
      if (keep) per[i].nosave.push_back(f);
      report("forward without saving", chain.stages[i].name);
    }
    for (size_t i = n; i-- > 0;) {
      Stage& s = chain.stages[i];
      torch::Tensor leaf = leaf_of(i, xs[i]);
      sync();
      memory::PeakWindow fwd_scope(device);
      const auto t0 = Clock::now();
      torch::Tensor out = stages[i].fn(leaf);
      sync();
      const double f = ms_since(t0);
      TORCH_CHECK(out.defined(), kWho, ": stage ", i, " ('", s.name, "') returned an undefined tensor");
      const int64_t fa_alive = fwd_scope.active_over_base();  // Fa@host's reference below
      if (measure) {
        s.output_bytes = static_cast<int64_t>(out.nbytes());
        s.saved_bytes = std::max(s.output_bytes, fa_alive);
        s.fwd_tmp_bytes = std::max<int64_t>(0, fwd_scope.peak_over_base() - s.saved_bytes);
      }
      const std::vector<torch::Tensor> targets = targets_of(i, leaf);
      double b = 0;
      // Whether it has a backward (Stage::has_backward): one whose output needs no gradient made no graph.
      if (measure) s.has_backward = out.requires_grad();
      if (out.requires_grad() && !targets.empty()) {
        if (measure) {
          const BackwardPeaks peaks = measured_backward(i, std::move(out), leaf, targets);
          b = peaks.ms;
          s.bwd_tmp_bytes = peaks.tmp;
          s.bwd_grads_tmp_bytes = peaks.grads_tmp;
          // Again with the output held through it, as where the rest of the step holds the chain's output
          // (a loss that saves it): how much lower the executor's run peaks (the larger of the two drops,
          // with the gradients pre-allocated and made), which the step's model charges back there.
          const torch::Tensor again = leaf_of(i, xs[i]);
          const BackwardPeaks held = measured_backward(i, stages[i].fn(again), again, targets_of(i, again),
                                                       /*hold_output=*/true);
          s.bwd_output_freed_bytes = std::clamp<int64_t>(
              std::max(held.tmp - peaks.tmp, held.grads_tmp - peaks.grads_tmp), 0, s.output_bytes);
        } else {
          b = timed_backward(std::move(out), targets, nullptr);
        }
      }
      if (keep) per[i].fwd.push_back(f), per[i].bwd.push_back(b);
      report("forward and backward", s.name);
      // Offloading: the same forward under remat::Offload, its copies waited for; what stays on the device.
      // Then as Fk (the keep tags) and under each policy, what their checkpoints keep sent there.
      if (measure && profile_offload) {
        // `without`: what the run leaves alive without an Offload when already measured in the same
        // conditions (Fa's, by the forward above), or null to measure it first. Fk's and each policy's are
        // measured again here, the stage alone: in their checkpointed passes a region shares the RNG state
        // of the region before it (5056 bytes on the CPU), which a stage run alone under an Offload holds.
        auto away = [&](const std::function<torch::Tensor(const torch::Tensor&)>& run,
                        const int64_t* without) {
          Away a;
          int64_t alive[2] = {without ? *without : 0, 0};
          for (int offloading = without ? 1 : 0; offloading < 2; ++offloading) {
            torch::Tensor probe = leaf_of(i, xs[i]);
            sync();
            memory::PeakWindow scope(device);
            torch::Tensor out;
            {
              std::optional<Offload> offload;
              if (offloading) {
                // As the executor opens it: its input, which the executor holds, stays (Fa@host, Fk@host).
                offload.emplace(detail::stage_offload_options(
                    OffloadOptions().min_bytes(options.offload_min_bytes()), stages[i], {probe}));
              }
              out = run(probe);
              if (offload) {
                offload->close();
                offload->finish_copies();
                a.copied = offload->stats().offloaded_bytes;
              }
            }
            sync();
            alive[offloading] = scope.active_over_base();
          }
          a.freed = std::max<int64_t>(0, alive[0] - alive[1]);
          return a;
        };
        const Away all = away(stages[i].fn, &fa_alive);
        s.offload = offload_cost(s.saved_bytes, all.freed, all.copied, s.output_bytes);
        // Streamed (Fa@stream): the forward under an Offload that waits for each copy at once (window 0),
        // then its backward with each tensor brought back where it is used: each one's peak above the bytes
        // before it (the backward's also had it made its gradients); the window the runtime holds beside
        // them, the largest tensor the stage sends, and what it brings back ahead with it.
        {
          torch::Tensor probe = leaf_of(i, xs[i]);
          Offload streamed(detail::stage_offload_options(
              OffloadOptions().min_bytes(options.offload_min_bytes()).window(0), stages[i], {probe}));
          sync();
          memory::PeakWindow scope(device);
          torch::Tensor out = stages[i].fn(probe);
          streamed.close();
          streamed.finish_copies();
          sync();
          const int64_t fwd = scope.peak_over_base();
          const int64_t largest = streamed.stats().largest_bytes;
          // What the runtime brings back ahead of its backward with that window (its input and output
          // perhaps found on the device).
          const int64_t ahead = largest > 0 ? streamed.ahead_bytes(largest, {probe, out}) : 0;
          const std::vector<torch::Tensor> targets = targets_of(i, probe);
          if (out.requires_grad() && !targets.empty() && largest > 0) {
            int64_t bwd = 0, grads_bwd = 0;
            timed_backward(std::move(out), targets, &bwd, &per[i].params, &grads_bwd);
            s.offload->stream_fwd_bytes = std::max<int64_t>(0, fwd);
            s.offload->stream_bwd_bytes = std::max<int64_t>(0, bwd);
            s.offload->stream_bwd_grads_bytes = std::max<int64_t>(0, grads_bwd);
            s.offload->window_bytes = largest;
            s.offload->ahead_bytes = std::min(ahead, largest);
          }
        }
        if (!options.keep().empty()) {
          per[i].keep_away = away(
              [&](const torch::Tensor& t) {
                return checkpoint(stages[i].fn, t, CheckpointOptions(per[i].per_call).keep(options.keep()));
              },
              nullptr);
        }
        for (size_t q = 0; q < options.policies().size(); ++q) {
          per[i].policy_away[q] = away(
              [&](const torch::Tensor& t) {
                return checkpoint(stages[i].fn, t,
                                  CheckpointOptions(per[i].per_call).policy(options.policies()[q]));
              },
              nullptr);
        }
        // Fc@host: the input the executor holds for the stage's recompute, saved under an Offload as the
        // executor saves it; offered when it goes (at least offload_min_bytes).
        Offload held(detail::stage_offload_options(OffloadOptions().min_bytes(options.offload_min_bytes()),
                                                   stages[i], {}));
        const torch::autograd::SavedVariable input(xs[i].detach(), /*is_output=*/false);
        held.close();
        if (held.stats().offloaded > 0) s.checkpoint_offload = OffloadCost{0, true, false};
        report("offloading", s.name);
      }
    }
    // Every stage under remat::checkpoint, then the backward pass through them: with the per-call options
    // (variant -2), again keeping the calls options.keep() names (-1, Fk) when it names any, and under each
    // of options.policies() (p >= 0, Fk[name]).
    auto checkpoint_pass = [&](int64_t variant, auto record) {
      std::vector<torch::Tensor> leaves(n), outs(n);
      std::vector<double> cf(n, 0);
      const std::string phase = variant == -2 ? std::string("checkpointed")
                                : variant == -1
                                    ? std::string("kept calls")
                                    : "policy " + options.policies()[static_cast<size_t>(variant)].name();
      for (size_t i = 0; i < n; ++i) {
        leaves[i] = leaf_of(i, xs[i]);
        CheckpointOptions o = per[i].per_call;
        if (variant == -1) o.keep(options.keep());
        if (variant >= 0) o.policy(options.policies()[static_cast<size_t>(variant)]);
        sync();
        // What the region holds, its generators' states included: not shared with the stage before's region,
        // as it would not be where that stage runs another way.
        if (variant > -2 && measure) detail::unshare_next_cpu_state();
        memory::PeakWindow scope(device);
        const auto t0 = Clock::now();
        outs[i] = checkpoint(stages[i].fn, leaves[i], o);
        sync();
        cf[i] = ms_since(t0);
        if (variant > -2 && measure) {
          const int64_t kept = std::max(static_cast<int64_t>(outs[i].nbytes()), scope.active_over_base());
          (variant == -1 ? per[i].keep_saved : per[i].policy_saved[static_cast<size_t>(variant)]) = kept;
        }
        report(phase, chain.stages[i].name);
      }
      for (size_t i = n; i-- > 0;) {
        const std::vector<torch::Tensor> targets = targets_of(i, leaves[i]);
        double cb = 0;
        if (outs[i].requires_grad() && !targets.empty()) {
          if (variant >= 0 && measure) {
            // Above what it keeps, its output and d: the recompute of what it does not keep included.
            const BackwardPeaks peaks = measured_backward(i, std::move(outs[i]), leaves[i], targets);
            cb = peaks.ms;
            per[i].policy_bwd_tmp[static_cast<size_t>(variant)] = peaks.tmp;
            per[i].policy_bwd_grads_tmp[static_cast<size_t>(variant)] = peaks.grads_tmp;
          } else {
            cb = timed_backward(std::move(outs[i]), targets, nullptr);
          }
        }
        outs[i] = leaves[i] = torch::Tensor();
        if (keep) record(per[i], cf[i], cb);
        report(phase, chain.stages[i].name);
      }
    };
    checkpoint_pass(-2, [](Per& p, double f, double b) { p.ckpt_fwd.push_back(f), p.ckpt_bwd.push_back(b); });
    if (!options.keep().empty()) {
      checkpoint_pass(-1,
                      [](Per& p, double f, double b) { p.keep_fwd.push_back(f), p.keep_bwd.push_back(b); });
    }
    for (size_t q = 0; q < options.policies().size(); ++q) {
      checkpoint_pass(static_cast<int64_t>(q), [q](Per& p, double f, double b) {
        p.policy_fwd[q].push_back(f), p.policy_bwd[q].push_back(b);
      });
    }
  }
  if (options.groups()) {
    for (size_t i = 0; i < n; ++i) {
      Stage& s = chain.stages[i];
      const torch::Tensor leaf = leaf_of(i, xs[i]);
      // Alive anyway: what an offloaded stage keeps on the device (its module's parameters and buffers, its
      // input).
      const std::vector<torch::Tensor> alive =
          detail::stage_offload_options(OffloadOptions(), stages[i], {leaf}).keep_on_device();
      s.groups = fit_groups(detail::measure_saved_groups(
          stages[i].fn, leaf, alive, options.offload_min_bytes(), options.repeats(), sync));
      report("groups", s.name);
    }
  }
  chain.keep = options.keep();
  chain.holds_outputs = true;  // the plan executor holds a kept stage's output as the root of its backward
  if (profile_offload) {
    int64_t largest = 0;
    for (const Stage& s : chain.stages)
      largest = std::max(largest, s.saved_bytes);
    const OffloadBandwidth bw = offload_bandwidth(device, bandwidth_probe_bytes(largest, device.is_cpu()));
    chain.to_host_gb_per_s = bw.to_host_gb_per_s;
    chain.to_device_gb_per_s = bw.to_device_gb_per_s;
    // A CPU device's copies are made at once, on the thread that computes (Offload): no computation hides
    // them.
    chain.copies_at_once = device.is_cpu();
    report("bandwidth", "");
  }
  for (const Policy& policy : options.policies())
    chain.policies.push_back(policy.name());
  for (size_t i = 0; i < n; ++i) {
    Stage& s = chain.stages[i];
    s.fwd_ms = median(per[i].fwd);
    s.bwd_ms = median(per[i].bwd);
    s.fwd_nosave_ms = median(per[i].nosave);
    s.fwd_nosave_tmp_bytes = per[i].nosave_tmp;
    s.checkpoint_fwd_ms = median(per[i].ckpt_fwd);
    s.checkpoint_bwd_ms = median(per[i].ckpt_bwd);
    if (!options.keep().empty()) {
      // As measured, as a policy's: the tags may keep more than Fa does (a product Fa frees), and the region
      // holds its generator state.
      s.keep_saved_bytes = per[i].keep_saved;
      s.keep_fwd_ms = median(per[i].keep_fwd);
      s.keep_bwd_ms = median(per[i].keep_bwd);
      if (const auto& a = per[i].keep_away)
        s.keep_offload = offload_cost(*s.keep_saved_bytes, a->freed, a->copied, s.output_bytes);
    }
    for (size_t q = 0; q < options.policies().size(); ++q) {
      PolicyCost c;
      c.policy = options.policies()[q].name();
      // As measured: a policy may keep more than Fa does (a Linear then a ReLU: the policy keeps the product,
      // which Fa frees, ReLU saving its output).
      c.saved_bytes = per[i].policy_saved[q];
      c.fwd_ms = median(per[i].policy_fwd[q]);
      c.bwd_ms = median(per[i].policy_bwd[q]);
      c.bwd_tmp_bytes = per[i].policy_bwd_tmp[q];
      c.bwd_grads_tmp_bytes = per[i].policy_bwd_grads_tmp[q];
      if (const auto& a = per[i].policy_away[q])
        c.offload = offload_cost(c.saved_bytes, a->freed, a->copied, s.output_bytes);
      s.policies.push_back(std::move(c));
    }
  }
  validate(chain);
  return chain;
}

Chain profile_chain(const std::vector<StageFn>& stages, const torch::Tensor& sample_input,
                    const ProfileOptions& options) {
  return profile_stages(stages, sample_input, options, "remat::profile_chain");
}

StepProfile profile_step(const StageFn& prefix, const std::vector<StageFn>& stages, const StageFn& suffix,
                         const torch::Tensor& model_input, const ProfileOptions& options) {
  TORCH_CHECK(!stages.empty(), "remat::profile_step: no stages");
  std::vector<StageFn> all;
  all.reserve(stages.size() + 2);
  all.push_back(prefix);
  all.insert(all.end(), stages.begin(), stages.end());
  all.push_back(suffix);
  if (all.front().name.empty()) all.front().name = "prefix";
  if (all.back().name.empty()) all.back().name = "suffix";
  StepProfile result;
  result.step = profile_stages(all, model_input, options, "remat::profile_step");
  result.chain = chain_of_step(result.step);  // with the step's keep tags
  return result;
}

torch::Tensor chain_input(const StageFn& prefix, const torch::Tensor& model_input) {
  TORCH_CHECK(model_input.defined(), "remat::chain_input: the model input is an undefined tensor");
  std::vector<c10::DeviceIndex> cuda;
  if (model_input.is_cuda()) cuda.push_back(std::max<c10::DeviceIndex>(0, model_input.device().index()));
  const detail::RngState rng = detail::RngState::capture(cuda);
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    detail::StateRestore state({}, {model_input});
    out = prefix.fn(model_input);
  }
  rng.restore();
  TORCH_CHECK(out.defined(), "remat::chain_input: the prefix ('", prefix.name,
              "') returned an undefined tensor");
  return out;
}

Chain profile_chain(torch::nn::Sequential& seq, const torch::Tensor& sample_input,
                    const ProfileOptions& options) {
  return profile_chain(stages_of(seq), sample_input, options);
}

}  // namespace remat
