// A GPT written as LibTorch users write it (gpt.h: nanoGPT's model, blocks in a ModuleList), trained on
// random token ids with AdamW, checkpointed without editing its blocks: per block on what the ModuleList
// hands out, in both modes and under each operator-level policy preset, and as sequential segments over the
// ModuleList. First it checks that every way gives the plain run's loss, gradients and next random draw,
// bitwise (dropout on); then it measures each way's peak memory and step time, in rounds that alternate the
// ways.
//
//   build/examples/example_gpt [layers width heads block batch steps rounds [budget MiB ...]]
//   build/examples/example_gpt 6 384 6 256 8 3 3      # the nanoGPT Shakespeare size (docs/BENCHMARKS.md)
//
// Budgets after the seven numbers add planned ways at those budgets (MiB above the bytes alive when the
// blocks start), beside the three between per block's peak and plain's.
//
// Exits 1 when a way differs from the plain run.
#include <remat/measure.h>
#include <remat/memory.h>
#include <remat/policy.h>
#include <remat/sequential.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gpt.h"

using gpt_example::BlockImpl;
using gpt_example::GPT;

namespace {

struct Way {
  std::string name;
  std::optional<remat::CheckpointOptions> per_block;  // GPTImpl::checkpointing
  int64_t segments = 0;                               // > 0: checkpoint_sequential over the ModuleList
  double budget_fraction =
      0;  // > 0: planned in place, budget = per block's peak + this x (plain's - per block's)
  int64_t budget_bytes = 0;  // > 0: planned in place at this budget
  bool planned() const { return budget_fraction > 0 || budget_bytes > 0; }
};

int64_t plain_peak = 0, per_block_peak = 0;  // the steps' peaks over what was alive when they began (bytes)

int64_t budget_of(const Way& way) {
  if (way.budget_bytes > 0) return way.budget_bytes;
  return per_block_peak +
         static_cast<int64_t>(way.budget_fraction * static_cast<double>(plain_peak - per_block_peak));
}

// The Planned modules of one model, one per planned way, each made at its way's first use.
struct PlannedWays {
  std::map<std::string, remat::Planned> made;
  remat::Planned get(GPT& gpt, const Way& way) {
    auto it = made.find(way.name);
    if (it == made.end()) {
      gpt->gradient_checkpointing_enable(remat::PlannedOptions().budget(budget_of(way)));  // the one line
      it = made.emplace(way.name, gpt->planned).first;
    }
    return it->second;
  }
};

// The loss of one forward pass under `way`.
torch::Tensor loss_of(GPT& gpt, PlannedWays& planned, const Way& way, const torch::Tensor& idx,
                      const torch::Tensor& targets) {
  gpt->checkpointing = way.per_block;
  gpt->planned = nullptr;
  if (way.planned()) gpt->planned = planned.get(gpt, way);
  if (way.segments == 0) return gpt->loss(idx, targets);
  // The ModuleList's blocks as stages, given their type; the embedding and the head around them.
  const auto stages = remat::stages_at<BlockImpl>(*gpt, {"h"});
  const auto logits = gpt->head(remat::checkpoint_sequential(stages, way.segments, gpt->embed(idx)));
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), targets.view({-1}));
}

struct Outcome {
  std::vector<torch::Tensor> losses, next_draws, grads;
};

// Two steps from the same weights and the same seeds (a planned way profiles in the first and runs its plan
// in the second); the gradients set to none before each.
Outcome two_steps(const gpt_example::GPTConfig& config, const Way& way, const torch::Tensor& idx,
                  const torch::Tensor& targets) {
  torch::manual_seed(0);
  GPT gpt(config);
  PlannedWays planned;
  Outcome o;
  for (int s = 0; s < 2; ++s) {
    for (auto& p : gpt->parameters())
      p.mutable_grad() = torch::Tensor();
    torch::manual_seed(1 + s);
    remat::memory::PeakScope scope;
    o.losses.push_back(loss_of(gpt, planned, way, idx, targets));
    o.losses.back().backward();
    if (way.name == "none") plain_peak = std::max(plain_peak, scope.peak_over_base());
    if (way.name == "per block (kNonReentrant)")
      per_block_peak = std::max(per_block_peak, scope.peak_over_base());
    for (const auto& p : gpt->parameters())
      o.grads.push_back(p.grad().clone());
    o.next_draws.push_back(torch::rand({8}));
  }
  return o;
}

bool equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> a{2, 64, 4, 64, 4, 1, 1};  // layers width heads block batch steps rounds
  for (int i = 1; i < argc && i <= static_cast<int>(a.size()); ++i)
    a[i - 1] = std::atoll(argv[i]);
  std::vector<double> budgets_mib;
  for (int i = static_cast<int>(a.size()) + 1; i < argc; ++i) {
    budgets_mib.push_back(std::atof(argv[i]));
    if (!(budgets_mib.back() > 0)) {
      std::cerr << "example_gpt: a budget must be a positive number of MiB, got '" << argv[i] << "'\n";
      return 2;
    }
  }
  if (std::any_of(a.begin(), a.end(), [](int64_t v) { return v < 1; }) || a[1] % a[2] != 0) {
    std::cerr << "example_gpt: every argument must be >= 1 and the width a multiple of the heads\n";
    return 2;
  }
  gpt_example::GPTConfig config;
  config.n_layer = a[0], config.n_embd = a[1], config.n_head = a[2], config.block_size = a[3];
  const int64_t batch = a[4], steps = a[5], rounds = a[6];
  remat::memory::track_cpu();
  torch::manual_seed(42);
  const auto idx = torch::randint(config.vocab_size, {batch, config.block_size});
  const auto targets = torch::randint(config.vocab_size, {batch, config.block_size});

  using remat::CheckpointOptions;
  // Half as many segments as blocks (at least two where there are two blocks): the last one is not
  // checkpointed.
  const int64_t segments = std::min(config.n_layer, std::max<int64_t>(2, (config.n_layer + 1) / 2));
  std::vector<Way> ways = {
      {"none", std::nullopt},
      {"per block (kNonReentrant)", CheckpointOptions()},
      {"per block (kReentrant)", CheckpointOptions().mode(remat::CheckpointMode::kReentrant)},
      {"per block, policy matmuls", CheckpointOptions().policy(remat::policy::matmuls())},
      {"per block, policy attention_core", CheckpointOptions().policy(remat::policy::attention_core())},
      {"per block, policy recompute_pointwise",
       CheckpointOptions().policy(remat::policy::recompute_pointwise())},
      {"checkpoint_sequential(" + std::to_string(segments) + ") over the ModuleList", std::nullopt, segments},
      {"planned in place, budget 1/4 of the way", std::nullopt, 0, 0.25},
      {"planned in place, budget 1/2 of the way", std::nullopt, 0, 0.5},
      {"planned in place, budget 3/4 of the way", std::nullopt, 0, 0.75},
  };
  for (const double mib : budgets_mib) {
    std::ostringstream name;
    name << "planned in place, budget " << std::fixed << std::setprecision(1) << mib << " MiB";
    ways.push_back({name.str(), std::nullopt, 0, 0, static_cast<int64_t>(mib * (1 << 20))});
  }

  // Every way against the plain run, bitwise.
  const Outcome plain = two_steps(config, ways[0], idx, targets);
  int failures = 0;
  for (size_t w = 1; w < ways.size(); ++w) {
    Outcome o;
    try {
      o = two_steps(config, ways[w], idx, targets);
    } catch (const c10::Error& e) {
      if (!ways[w].planned()) throw;
      // A budget below the least feasible one: refused at planning, named; the way is left out.
      std::cout << ways[w].name << ": " << e.what_without_backtrace() << "\n";
      ways.erase(ways.begin() + static_cast<std::ptrdiff_t>(w));
      --w;
      continue;
    }
    const bool same =
        equal(o.losses, plain.losses) && equal(o.next_draws, plain.next_draws) && equal(o.grads, plain.grads);
    if (!same) {
      std::cerr << "example_gpt: " << ways[w].name << " differs from the plain run\n";
      ++failures;
    }
  }
  if (failures > 0) return 1;
  std::cout << "every way, two steps (a planned way profiles in the first): losses, "
            << plain.grads.size() / 2
            << " gradients and the next random draw equal to the plain run's, bitwise\n\n";

  // Peak memory and time, the ways alternated in each round; ratios against "none" of the same round.
  torch::manual_seed(0);
  GPT gpt(config);
  PlannedWays planned;
  torch::optim::AdamW adamw(gpt->parameters(), torch::optim::AdamWOptions(6e-4).weight_decay(0.1));
  std::vector<std::vector<double>> ms(ways.size()), ratio(ways.size());
  std::vector<int64_t> peak(ways.size(), 0), kept(ways.size(), 0);
  // A planned way's first training step profiles its stages in place: timed here, against the plain
  // step's median below.
  std::vector<double> first_ms(ways.size(), 0);
  for (size_t w = 0; w < ways.size(); ++w) {
    if (!ways[w].planned()) continue;
    const auto t0 = std::chrono::steady_clock::now();
    loss_of(gpt, planned, ways[w], idx, targets).backward();
    first_ms[w] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    gpt->zero_grad();
  }
  for (int64_t round = 0; round < rounds; ++round) {
    for (size_t w = 0; w < ways.size(); ++w) {
      const auto stats = remat::measure_step(
          *gpt, [&] { return loss_of(gpt, planned, ways[w], idx, targets); },
          remat::MeasureOptions().warmup(1).steps(steps));
      adamw.step();
      ms[w].push_back(stats.median_ms);
      ratio[w].push_back(stats.median_ms / ms[0].back());
      peak[w] = std::max(peak[w], stats.peak_bytes);
      kept[w] = std::max(kept[w], stats.after_forward_bytes);
    }
  }
  std::cout << "GPT " << config.n_layer << " layers x " << config.n_embd << " (" << config.n_head
            << " heads), block " << config.block_size << ", batch " << batch << ", dropout " << config.dropout
            << ", AdamW; " << rounds << " rounds of " << steps << " steps per way, medians\n"
            << std::left << std::setw(46) << "way" << std::right << std::setw(10) << "peak MiB"
            << std::setw(10) << "kept MiB" << std::setw(10) << "ms" << std::setw(8) << "x none\n";
  for (size_t w = 0; w < ways.size(); ++w) {
    std::cout << std::left << std::setw(46) << ways[w].name << std::right << std::fixed
              << std::setprecision(1) << std::setw(10) << static_cast<double>(peak[w]) / (1 << 20)
              << std::setw(10) << static_cast<double>(kept[w]) / (1 << 20) << std::setw(10)
              << remat::median(ms[w]) << std::setw(8) << std::setprecision(2) << remat::median(ratio[w])
              << "\n";
  }
  for (size_t w = 0; w < ways.size(); ++w) {
    if (!ways[w].planned()) continue;
    const remat::PlannedImpl& p = *planned.get(gpt, ways[w]);
    std::cout << "\n"
              << ways[w].name << ": budget " << std::setprecision(1)
              << static_cast<double>(budget_of(ways[w])) / (1 << 20) << " MiB, predicted "
              << static_cast<double>(p.predicted_peak_bytes()) / (1 << 20) << " MiB, last step "
              << static_cast<double>(p.last_peak_bytes()) / (1 << 20)
              << " MiB (both above the bytes alive when the blocks start); profiling step "
              << std::setprecision(0) << first_ms[w] << " ms = " << std::setprecision(2)
              << first_ms[w] / remat::median(ms[0]) << " plain steps; plan "
              << (p.plan() ? p.plan()->to_string() : "none") << "\n";
  }
  return 0;
}
