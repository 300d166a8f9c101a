// The benchmark harness, data parallel: each strategy trained through remat::distributed::DataParallel on
// every rank, and `remat bench --nproc N`'s relaunch of itself as N ranks.

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include "harness.h"

namespace remat {

#if REMAT_HAS_DISTRIBUTED
DataParallelBench bench_data_parallel(Workload& w, const std::vector<std::string>& strategies,
                                      distributed::ProcessGroup& group, const MeasureOptions& measure,
                                      const distributed::DataParallelOptions& options,
                                      const ProfileOptions* profile, const Progress& progress,
                                      const Chain* given) {
  constexpr const char* who = "remat::bench_data_parallel";
  TORCH_CHECK(!strategies.empty(), who, ": no strategies");
  const std::vector<Strategy> parsed = harness::parse_all(strategies);
  const std::vector<std::optional<Plan>> plans = harness::plans_for(w, parsed, profile, progress, given);
  harness::allocate_grads(w);
  distributed::DataParallel dp(
      w.module().shared_from_this(),
      std::shared_ptr<distributed::ProcessGroup>(&group, [](distributed::ProcessGroup*) {}), options);
  DataParallelBench out;
  out.world_size = group.size();
  const auto st = dp.stats();
  out.gradient_bytes = st.bytes_per_step;
  out.buckets = st.buckets;
  out.all_reduce_ms = dp.time_all_reduce(5);
  std::vector<at::Tensor> max_of(1), sum_of(1);
  for (size_t k = 0; k < strategies.size(); ++k) {
    if (progress) progress("data parallel over " + std::to_string(group.size()) + ": " + strategies[k]);
    harness::Runner runner{w, plans[k], plans[k] ? w.stages() : std::vector<StageFn>{}};
    harness::configure(w, parsed[k], plans[k]);
    auto loss = [&] { return runner.step_loss(); };
    if (measure.warmup() > 0)
      measure_step(w.module(), loss, MeasureOptions(measure).steps(measure.warmup()).warmup(0));
    group.barrier();
    dp.reset_stats();
    const StepStats s = measure_step(w.module(), loss, MeasureOptions(measure).warmup(0));
    const auto d = dp.stats();
    DataParallelBenchRow row;
    row.strategy = strategies[k];
    row.plan = plans[k];
    // Per rank peaks (each rank fills its slot of a sum), and the slowest rank's times.
    sum_of[0] = torch::zeros({group.size()}, torch::kLong);
    sum_of[0][group.rank()] = s.peak_bytes;
    group.all_reduce(sum_of);
    for (int r = 0; r < group.size(); ++r)
      row.peak_bytes.push_back(sum_of[0][r].item<int64_t>());
    const double exposed = d.steps > 0 ? d.wait_seconds * 1e3 / double(d.steps) : 0.0;
    row.buckets_early = d.steps > 0 ? double(d.buckets_early) / double(d.steps) : 0.0;
    max_of[0] = torch::tensor({s.median_ms, exposed}, torch::kDouble);
    group.all_reduce(max_of, distributed::ReduceOp::kMax);
    row.median_ms = max_of[0][0].item<double>();
    row.exposed_all_reduce_ms = max_of[0][1].item<double>();
    row.hidden_fraction = out.all_reduce_ms > 0
                              ? std::clamp(1.0 - row.exposed_all_reduce_ms / out.all_reduce_ms, 0.0, 1.0)
                              : 1.0;
    // The gradients after the last step agree across ranks (one parameter at a time: a copy of all of them
    // would add the model's size twice over).
    for (const auto& p : w.module().parameters()) {
      if (!p.grad().defined()) continue;
      std::vector<at::Tensor> hi{p.grad().clone()}, lo{p.grad().clone()};
      group.all_reduce(hi, distributed::ReduceOp::kMax);
      group.all_reduce(lo, distributed::ReduceOp::kMin);
      if (!at::equal(hi[0], lo[0])) row.grads_equal_across_ranks = false;
    }
    out.rows.push_back(std::move(row));
  }
  w.set_per_layer(std::nullopt);
  return out;
}

std::string bench_json(const std::string& description, int64_t global_batch,
                       const DataParallelBench& result) {
  nlohmann::ordered_json j;
  j["model"] = description;
  j["world_size"] = result.world_size;
  j["global_batch"] = global_batch;
  j["gradient_bytes"] = result.gradient_bytes;
  j["buckets"] = result.buckets;
  j["all_reduce_ms"] = result.all_reduce_ms;
  j["rows"] = nlohmann::ordered_json::array();
  for (const auto& r : result.rows) {
    nlohmann::ordered_json row;
    row["strategy"] = r.strategy;
    row["peak_bytes"] = r.peak_bytes;
    row["median_ms"] = r.median_ms;
    row["exposed_all_reduce_ms"] = r.exposed_all_reduce_ms;
    row["hidden_fraction"] = r.hidden_fraction;
    row["buckets_early"] = r.buckets_early;
    row["grads_equal_across_ranks"] = r.grads_equal_across_ranks;
    if (r.plan) row["plan"] = r.plan->to_string();
    j["rows"].push_back(row);
  }
  return j.dump(2) + "\n";
}

namespace {
constexpr const char* kRankVariable = "REMAT_BENCH_RANK";
}  // namespace

int relaunch_as_ranks(int64_t nproc, std::vector<std::string> argv) {
  TORCH_CHECK(!argv.empty(), "remat::relaunch_as_ranks: no command");
  ::setenv(kRankVariable, "1", 1);
  argv[0] = "/proc/self/exe";  // this very program, wherever it was started from
  return distributed::launch(distributed::LaunchOptions().nproc_per_node(nproc).master_port(0).failure_grace(
                                 std::chrono::seconds(30)),
                             argv);
}

bool is_bench_rank() {
  return std::getenv(kRankVariable) != nullptr;
}

int64_t rank_share(int64_t global_batch, int world_size) {
  // The machine's cores shared among its processes (torchrun gives each one thread by default).
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE")) {
    const int procs = std::max(1, std::atoi(local));
    at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / procs));
  }
  TORCH_CHECK(world_size >= 1 && global_batch % world_size == 0, "remat::rank_share: a global batch of ",
              global_batch, " does not split evenly over ", world_size, " processes");
  return global_batch / world_size;
}
#endif

}  // namespace remat
