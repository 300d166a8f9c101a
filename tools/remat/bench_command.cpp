// remat bench: train a model under checkpointing strategies (remat::bench), or data parallel in N processes
// (remat::bench_data_parallel, the command relaunched as ranks).

#include <remat/distributed.h>
#include <remat/planner/units.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>

#include "common.h"
#include "progress_bar.h"

namespace remat::cli {
namespace {

struct BenchArgs {
  ModelArgs model;
  std::string strategies = "none,all,sqrt,optimal:overhead=0.5", json, csv, save_chain, chain;
  int64_t steps = 5, warmup = 2, nproc = 1;
  bool predict = false;  // --predict: profile a chain for every row's predicted time
};

// "equal" (bit for bit), "equal (1.2e-07)" (relative difference, float summation order), or "DIFFER (...)".
std::string grads_text(const BenchRow& r) {
  if (r.max_grad_diff == 0) return "equal";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s (%.1e)", r.grads_equal ? "equal" : "DIFFER", r.max_grad_diff_relative);
  return buf;
}

MeasureOptions measure_options(const BenchArgs& a) {
  return MeasureOptions().warmup(a.warmup).steps(a.steps).device(torch::Device(a.model.device));
}

// One process of `remat bench --nproc N` (or of a launcher that set torchrun's environment): this rank's
// share of the batch, data parallel; rank 0 prints.
int run_rank(const BenchArgs& a) {
  auto group = distributed::init_process_group();
  const int n = group->size(), rank = group->rank();
  int64_t global = a.model.batch;
  if (global == 0) global = a.model.make()->input().size(0);  // the model's default batch
  const int64_t mine = rank_share(global, n);
  ModelArgs args = a.model;
  args.seed = a.model.seed + static_cast<uint64_t>(rank);  // each rank its own rows
  auto w = args.make(mine);
  auto say = [rank](const std::string& m) {
    if (rank == 0) progress(m);
  };
  say(w->description() + " on each of " + std::to_string(n) + " processes");
  auto profile = a.model.profile_options();
  if (rank != 0) profile.progress(nullptr);  // one bar, rank 0's
  // BERT's pooler takes no part in its forward(): let parameters go without a gradient.
  const auto result =
      bench_data_parallel(*w, split(a.strategies), *group, measure_options(a),
                          distributed::DataParallelOptions().find_unused_parameters(true), &profile, say);
  if (rank != 0) return 0;
  double none_ms = 0;
  for (const auto& r : result.rows)
    if (r.strategy == "none") none_ms = r.median_ms;
  std::cout << w->description() << " per process; " << n << " processes (Gloo, loopback), global batch "
            << global << "\ngradients: " << mib(result.gradient_bytes) << " MiB per step in "
            << result.buckets << " buckets; all-reduce of them alone: " << fixed(result.all_reduce_ms, 1)
            << " ms; " << a.steps << " timed steps after " << a.warmup << " warm-up\n\n";
  Table t({"strategy", "peak MiB (max rank)", "median ms", "time/none", "buckets early",
           "exposed all-reduce ms", "hidden", "grads across ranks"});
  for (const auto& r : result.rows) {
    const int64_t peak = *std::max_element(r.peak_bytes.begin(), r.peak_bytes.end());
    t.add({r.strategy, mib(peak), fixed(r.median_ms, 1), none_ms > 0 ? fixed(r.median_ms / none_ms, 2) : "-",
           fixed(r.buckets_early, 1) + "/" + std::to_string(result.buckets),
           fixed(r.exposed_all_reduce_ms, 1), n > 1 ? fixed(100 * r.hidden_fraction, 0) + "%" : "-",
           r.grads_equal_across_ranks ? "equal" : "DIFFER"});
  }
  t.print(std::cout);
  std::cout << "\npeak: bytes over the base during a step, the largest rank's (gradient buckets included); "
               "buckets early: per step, those whose all-reduce began during backward; exposed: the wait for "
               "all-reduces at the end of backward; hidden: the share of the all-reduce time spent behind "
               "backward\n";
  if (!a.json.empty()) write_file(a.json, bench_json(w->description(), global, result));
  return 0;
}

int run(const BenchArgs& a, bool data_parallel, const std::vector<std::string>& argv) {
  if (is_bench_rank()) return run_rank(a);
  if (data_parallel) {
    TORCH_CHECK(a.save_chain.empty() && a.csv.empty(), "--nproc: --save-chain and --csv are not supported");
    return relaunch_as_ranks(a.nproc, argv);  // the same command in N processes; they run run_rank
  }
  auto w = a.model.make();
  progress(w->description());
  const auto profile = a.model.profile_options();
  std::optional<Chain> chain;
  if (!a.chain.empty()) {
    chain = load_chain(a.chain);
    TORCH_CHECK(chain->size() == static_cast<int64_t>(w->stages().size()), "remat bench --chain: '", a.chain,
                "' has ", chain->size(), " stages, but ", w->description(), " has ", w->stages().size());
  } else if (!a.save_chain.empty() || a.predict) {
    progress("profiling " + w->description());
    chain = profile_workload(*w, &profile);
    if (!a.save_chain.empty()) {
      save_chain(*chain, a.save_chain);
      progress("chain written to " + a.save_chain);
    }
  }
  // Made at the first step (bench profiles first, when it must): its clock and estimate count steps alone.
  std::optional<ProgressBar> bar;
  const auto rows =
      bench(*w, split(a.strategies), measure_options(a), &profile, progress, chain ? &*chain : nullptr,
            [&](int64_t done, int64_t total, const std::string& what) {
              if (!bar) bar.emplace("remat: steps");
              bar->update(done, total, what);
            });
  bar.reset();
  const auto& none = rows.front().stats;
  std::cout << w->description() << "\n"
            << "base (parameters + gradients + inputs): " << format_bytes(none.base_bytes) << "; " << a.steps
            << " timed steps after " << a.warmup << " warm-up\n\n";
  const std::optional<double> none_predicted = rows.front().predicted_time_ms;
  auto predicted_ratio = [&](const BenchRow& r) -> std::string {
    if (!r.predicted_time_ms || !none_predicted || *none_predicted <= 0) return "-";
    return fixed(*r.predicted_time_ms / *none_predicted, 2);
  };
  Table t({"strategy", "peak MiB", "kept MiB", "median ms", "fwd ms", "peak/none", "time/none", "grads",
           "predicted peak MiB", "predicted ms", "predicted time/none"});
  for (const auto& r : rows) {
    t.add({r.strategy, mib(r.stats.peak_bytes), mib(r.stats.after_forward_bytes), fixed(r.stats.median_ms, 1),
           fixed(r.stats.median_forward_ms, 1),
           fixed(double(r.stats.peak_bytes) / double(none.peak_bytes), 3),
           fixed(r.stats.median_ms / none.median_ms, 2), grads_text(r),
           r.predicted_peak_bytes ? mib(*r.predicted_peak_bytes) : std::string("-"),
           r.predicted_time_ms ? fixed(*r.predicted_time_ms, 1) : std::string("-"), predicted_ratio(r)});
  }
  t.print(std::cout);
  std::cout << "\npeak: bytes over the base during a step; kept: alive after the forward pass; predicted: "
               "the plan's simulate() figures on the profiled chain (peak without the input; time of the "
               "chain's stages, per_call_time_ms for 'all'); --predict profiles a chain for 'none' and 'all' "
               "alone\n";
  if (!a.json.empty()) write_file(a.json, bench_json(w->description(), rows));
  if (!a.csv.empty()) write_file(a.csv, bench_csv(rows));
  return 0;
}

}  // namespace

Subcommand add_bench(CLI::App& app, const std::vector<std::string>& argv) {
  auto a = std::make_shared<BenchArgs>();
  auto* cmd = app.add_subcommand(
      "bench", "Train a model under checkpointing strategies: peak memory, step time, gradients");
  a->model.add(cmd);
  cmd->add_option("--strategy", a->strategies, std::string("comma-separated: ") + kStrategyWords)
      ->capture_default_str();
  cmd->add_option("--steps", a->steps, "timed steps (median reported)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cmd->add_option("--warmup", a->warmup, "untimed steps first")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  cmd->add_option("--json", a->json, "also write the results as JSON to this file");
  cmd->add_option("--csv", a->csv, "also write the results as CSV to this file");
  cmd->add_option("--save-chain", a->save_chain, "also write the model's profiled chain to this file");
  cmd->add_option("--chain", a->chain,
                  "plan on this chain (remat profile --json, --save-chain) instead of profiling the model");
  cmd->add_flag("--predict", a->predict,
                "profile the model's chain even when no strategy needs it, to predict every row's time");
  cmd->add_option("--nproc", a->nproc,
                  "train data parallel (remat::distributed::DataParallel) in this many local processes (Gloo "
                  "over loopback), the batch split across them; 1 measures DataParallel's own cost")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  return {cmd, [a, cmd, &argv] { return run(*a, cmd->count("--nproc") > 0, argv); }};
}

}  // namespace remat::cli
