// The remat command. It parses arguments, calls the library and prints; the logic lives in the library
// (remat/bench.h, remat/planner.h, remat/profile.h).

#include <ATen/Parallel.h>
#include <remat/bench.h>
#include <remat/distributed.h>
#include <remat/memory.h>
#include <remat/planner.h>
#include <remat/profile.h>
#include <remat/units.h>
#include <torch/cuda.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "table.h"

namespace {

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string mib(int64_t bytes) {
  return remat::format_mib(bytes);
}

// "equal" (bit for bit), "equal (1.2e-07)" (relative difference, float summation order), or "DIFFER (...)".
std::string grads_text(const remat::BenchRow& r) {
  if (r.max_grad_diff == 0) return "equal";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s (%.1e)", r.grads_equal ? "equal" : "DIFFER", r.max_grad_diff_relative);
  return buf;
}

void progress(const std::string& message) {
  std::cerr << "remat: " << message << std::endl;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  if (!out) throw std::invalid_argument("cannot write '" + path + "'");
  out << text;
}

// Options every model-taking command shares.
struct ModelArgs {
  std::string model = "bert", variant = "small", placement = "each-op", device = "cpu", granularity = "layer";
  std::string keep;  // remat::keep tags for Fk, comma-separated
  int64_t layers = 12, hidden = 768, heads = 12, intermediate = 3072, seq = 128, vocab = 30522, batch = 0;
  int64_t depth = 16, width = 1024, calls = 1000, adds = 100, blocks = 3;
  double dropout = 0.1;
  uint64_t seed = 0;

  void add(CLI::App* app) {
    app->add_option("--model", model, "bert, cifar, heavy, forum-cnn, mlp or resnet")
        ->check(CLI::IsMember({"bert", "cifar", "heavy", "forum-cnn", "mlp", "resnet"}))
        ->capture_default_str();
    app->add_option("--layers", layers, "bert: encoder layers")
        ->check(CLI::Range(1, 1000))
        ->capture_default_str();
    app->add_option("--hidden", hidden, "bert: hidden size")
        ->check(CLI::Range(1, 1 << 16))
        ->capture_default_str();
    app->add_option("--heads", heads, "bert: attention heads")
        ->check(CLI::Range(1, 1024))
        ->capture_default_str();
    app->add_option("--intermediate", intermediate, "bert: feed-forward size")
        ->check(CLI::Range(1, 1 << 18))
        ->capture_default_str();
    app->add_option("--seq", seq, "bert: sequence length")
        ->check(CLI::Range(1, 1 << 16))
        ->capture_default_str();
    app->add_option("--vocab", vocab, "bert: vocabulary size")
        ->check(CLI::Range(1, 1 << 24))
        ->capture_default_str();
    app->add_option("--dropout", dropout, "bert: dropout probability")
        ->check(CLI::Range(0.0, 0.99))
        ->capture_default_str();
    app->add_option("--batch", batch, "rows per batch (0: the model's default)")
        ->check(CLI::Range(0, 1 << 24));
    app->add_option("--depth", depth, "mlp: residual blocks")
        ->check(CLI::Range(1, 100000))
        ->capture_default_str();
    app->add_option("--width", width, "mlp: block width")
        ->check(CLI::Range(1, 1 << 18))
        ->capture_default_str();
    app->add_option("--blocks", blocks, "resnet: BasicBlocks per layer (layer1..layer3)")
        ->check(CLI::Range(1, 1000))
        ->capture_default_str();
    app->add_option("--calls", calls, "heavy: calls of the function")
        ->check(CLI::Range(1, 1000000))
        ->capture_default_str();
    app->add_option("--adds", adds, "heavy: additions per call")
        ->check(CLI::Range(1, 100000))
        ->capture_default_str();
    app->add_option("--variant", variant, "forum-cnn: small or full")
        ->check(CLI::IsMember({"small", "full"}))
        ->capture_default_str();
    app->add_option("--placement", placement, "forum-cnn: each-op, conv-relu, all-convs or heads")
        ->check(CLI::IsMember({"each-op", "conv-relu", "all-convs", "heads"}))
        ->capture_default_str();
    app->add_option("--device", device, "cpu or cuda")
        ->check(CLI::IsMember({"cpu", "cuda"}))
        ->capture_default_str();
    app->add_option("--seed", seed, "seed of weights and inputs")->capture_default_str();
    app->add_option("--granularity", granularity,
                    "bert: the chain's stages, per layer or per piece of a layer (sublayer: attention core, "
                    "projections, feed-forward halves)")
        ->check(CLI::IsMember({"layer", "sublayer"}))
        ->capture_default_str();
    app->add_option("--keep", keep,
                    "remat::keep tags (comma-separated, e.g. matmul): also profile each stage keeping those "
                    "calls' outputs, so that plans may keep a layer's matrix multiplications (Fk)");
  }

  /// Profiling options with the --keep tags.
  remat::ProfileOptions profile_options(int64_t repeats = 3) const {
    return remat::ProfileOptions().warmup(1).repeats(repeats).keep(split(keep));
  }

  remat::WorkloadConfig config(int64_t batch_override = -1) const {
    return remat::WorkloadConfig()
        .model(model)
        .layers(layers)
        .hidden(hidden)
        .heads(heads)
        .intermediate(intermediate)
        .seq(seq)
        .vocab(vocab)
        .dropout(dropout)
        .batch(batch_override >= 0 ? batch_override : batch)
        .granularity(granularity == "sublayer" ? remat::Granularity::kSublayer : remat::Granularity::kLayer)
        .depth(depth)
        .width(width)
        .calls(calls)
        .adds(adds)
        .blocks(blocks)
        .variant(variant)
        .placement(placement)
        .device(torch::Device(device))
        .seed(seed);
  }

  std::unique_ptr<remat::Workload> make(int64_t batch_override = -1) const {
    if (device == "cuda") {
      TORCH_CHECK(torch::cuda::is_available(), "--device cuda: no CUDA device is available");
    } else {
      remat::memory::track_cpu();
    }
    return remat::make_workload(config(batch_override));
  }
};

int64_t size_arg(const std::string& text, const char* flag) {
  try {
    return remat::parse_size(text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(flag) + ": " + e.what());
  }
}

// ------------------------------------------------------------------------------------------------------------
// bench

struct BenchArgs {
  ModelArgs model;
  std::string strategies = "none,all,sqrt,optimal:overhead=0.5", json, csv, save_chain, chain;
  int64_t steps = 5, warmup = 2, nproc = 1;
  bool data_parallel = false;     // --nproc given (even 1): train through DataParallel
  bool predict = false;           // --predict: profile a chain for every row's predicted time
  std::vector<std::string> argv;  // the command line, for --nproc's processes
};

// One process of `remat bench --nproc N` (or of a launcher that set torchrun's environment): this rank's
// share of the batch, data parallel; rank 0 prints.
int run_bench_rank(const BenchArgs& a) {
  auto group = remat::distributed::init_process_group();
  const int n = group->size(), rank = group->rank();
  // The machine's cores shared among its processes (torchrun gives each one thread by default).
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE")) {
    const int procs = std::max(1, std::atoi(local));
    at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / procs));
  }
  int64_t global = a.model.batch;
  if (global == 0) global = a.model.make()->input().size(0);  // the model's default batch
  TORCH_CHECK(global % n == 0, "--batch ", global, " does not split evenly over ", n, " processes");
  ModelArgs mine = a.model;
  mine.seed = a.model.seed + static_cast<uint64_t>(rank);  // each rank its own rows
  auto w = mine.make(global / n);
  auto say = [rank](const std::string& m) {
    if (rank == 0) progress(m);
  };
  say(w->description() + " on each of " + std::to_string(n) + " processes");
  const auto profile = a.model.profile_options();
  // BERT's pooler takes no part in its forward(): let parameters go without a gradient.
  const auto result = remat::bench_data_parallel(
      *w, split(a.strategies), *group,
      remat::MeasureOptions().warmup(a.warmup).steps(a.steps).device(torch::Device(a.model.device)),
      remat::distributed::DataParallelOptions().find_unused_parameters(true), &profile, say);
  if (rank != 0) return 0;
  double none_ms = 0;
  for (const auto& r : result.rows)
    if (r.strategy == "none") none_ms = r.median_ms;
  std::cout << w->description() << " per process; " << n << " processes (Gloo, loopback), global batch "
            << global << "\ngradients: " << mib(result.gradient_bytes) << " MiB per step in "
            << result.buckets << " buckets; all-reduce of them alone: " << fixed(result.all_reduce_ms, 1)
            << " ms; " << a.steps << " timed steps after " << a.warmup << " warm-up\n\n";
  remat::cli::Table t({"strategy", "peak MiB (max rank)", "median ms", "time/none", "buckets early",
                       "exposed all-reduce ms", "hidden", "grads across ranks"});
  nlohmann::ordered_json j;
  j["model"] = w->description();
  j["world_size"] = n;
  j["global_batch"] = global;
  j["gradient_bytes"] = result.gradient_bytes;
  j["buckets"] = result.buckets;
  j["all_reduce_ms"] = result.all_reduce_ms;
  j["rows"] = nlohmann::ordered_json::array();
  for (const auto& r : result.rows) {
    const int64_t peak = *std::max_element(r.peak_bytes.begin(), r.peak_bytes.end());
    t.add({r.strategy, mib(peak), fixed(r.median_ms, 1), none_ms > 0 ? fixed(r.median_ms / none_ms, 2) : "-",
           fixed(r.buckets_early, 1) + "/" + std::to_string(result.buckets),
           fixed(r.exposed_all_reduce_ms, 1), n > 1 ? fixed(100 * r.hidden_fraction, 0) + "%" : "-",
           r.grads_equal_across_ranks ? "equal" : "DIFFER"});
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
  t.print(std::cout);
  std::cout << "\npeak: bytes over the base during a step, the largest rank's (gradient buckets included); "
               "buckets early: per step, those whose all-reduce began during backward; exposed: the wait for "
               "all-reduces at the end of backward; hidden: the share of the all-reduce time spent behind "
               "backward\n";
  if (!a.json.empty()) write_file(a.json, j.dump(2) + "\n");
  return 0;
}

int run_bench(const BenchArgs& a) {
  if (std::getenv("REMAT_BENCH_RANK") != nullptr) return run_bench_rank(a);
  if (a.data_parallel) {
    // The same command in N processes with torchrun's environment; they run run_bench_rank.
    TORCH_CHECK(a.save_chain.empty() && a.csv.empty(), "--nproc: --save-chain and --csv are not supported");
    ::setenv("REMAT_BENCH_RANK", "1", 1);
    std::vector<std::string> command = a.argv;
    command[0] = "/proc/self/exe";
    return remat::distributed::launch(
        remat::distributed::LaunchOptions().nproc_per_node(a.nproc).master_port(0).failure_grace(
            std::chrono::seconds(30)),
        command);
  }
  auto w = a.model.make();
  progress(w->description());
  const auto profile = a.model.profile_options();
  std::optional<remat::Chain> chain;
  if (!a.chain.empty()) {
    chain = remat::load_chain(a.chain);
    TORCH_CHECK(chain->size() == static_cast<int64_t>(w->stages().size()), "remat bench --chain: '", a.chain,
                "' has ", chain->size(), " stages, but ", w->description(), " has ", w->stages().size());
  } else if (!a.save_chain.empty() || a.predict) {
    progress("profiling " + w->description());
    chain = remat::profile_workload(*w, &profile);
    if (!a.save_chain.empty()) {
      remat::save_chain(*chain, a.save_chain);
      progress("chain written to " + a.save_chain);
    }
  }
  const auto rows = remat::bench(
      *w, split(a.strategies),
      remat::MeasureOptions().warmup(a.warmup).steps(a.steps).device(torch::Device(a.model.device)), &profile,
      progress, chain ? &*chain : nullptr);
  const auto& none = rows.front().stats;
  std::cout << w->description() << "\n"
            << "base (parameters + gradients + inputs): " << remat::format_bytes(none.base_bytes) << "; "
            << a.steps << " timed steps after " << a.warmup << " warm-up\n\n";
  const std::optional<double> none_predicted = rows.front().predicted_time_ms;
  auto predicted_ratio = [&](const remat::BenchRow& r) -> std::string {
    if (!r.predicted_time_ms || !none_predicted || *none_predicted <= 0) return "-";
    return fixed(*r.predicted_time_ms / *none_predicted, 2);
  };
  remat::cli::Table t({"strategy", "peak MiB", "kept MiB", "median ms", "fwd ms", "peak/none", "time/none",
                       "grads", "predicted peak MiB", "predicted ms", "predicted time/none"});
  for (const auto& r : rows) {
    t.add({r.strategy, mib(r.stats.peak_bytes), mib(r.stats.after_forward_bytes), fixed(r.stats.median_ms, 1),
           fixed(r.stats.median_forward_ms, 1),
           fixed(double(r.stats.peak_bytes) / double(none.peak_bytes), 3),
           fixed(r.stats.median_ms / none.median_ms, 2), grads_text(r),
           r.plan ? mib(r.plan->predicted.peak_bytes - w->input().nbytes()) : std::string("-"),
           r.predicted_time_ms ? fixed(*r.predicted_time_ms, 1) : std::string("-"), predicted_ratio(r)});
  }
  t.print(std::cout);
  std::cout << "\npeak: bytes over the base during a step; kept: alive after the forward pass; predicted: "
               "the plan's simulate() figures on the profiled chain (peak without the input; time of the "
               "chain's stages, per_call_time_ms for 'all'); --predict profiles a chain for 'none' and 'all' "
               "alone\n";

  nlohmann::ordered_json j;
  j["model"] = w->description();
  j["base_bytes"] = none.base_bytes;
  j["rows"] = nlohmann::ordered_json::array();
  std::ostringstream csv;
  csv << "strategy,peak_bytes,after_forward_bytes,median_ms,peak_ratio,time_ratio,grads_equal,max_grad_diff,"
         "predicted_peak_bytes\n";
  for (const auto& r : rows) {
    nlohmann::ordered_json row;
    row["strategy"] = r.strategy;
    row["peak_bytes"] = r.stats.peak_bytes;
    row["after_forward_bytes"] = r.stats.after_forward_bytes;
    row["median_ms"] = r.stats.median_ms;
    row["step_ms"] = r.stats.step_ms;
    row["forward_ms"] = r.stats.median_forward_ms;
    row["peak_ratio"] = double(r.stats.peak_bytes) / double(none.peak_bytes);
    row["time_ratio"] = r.stats.median_ms / none.median_ms;
    row["grads_equal"] = r.grads_equal;
    row["max_grad_diff"] = r.max_grad_diff;
    row["max_grad_diff_relative"] = r.max_grad_diff_relative;
    if (r.plan) {
      row["predicted_peak_bytes"] = r.plan->predicted.peak_bytes - int64_t(w->input().nbytes());
      row["plan"] = r.plan->to_string();
    }
    if (r.predicted_time_ms) {
      row["predicted_ms"] = *r.predicted_time_ms;
      if (none_predicted && *none_predicted > 0)
        row["predicted_time_ratio"] = *r.predicted_time_ms / *none_predicted;
    }
    j["rows"].push_back(row);
    csv << r.strategy << "," << r.stats.peak_bytes << "," << r.stats.after_forward_bytes << ","
        << r.stats.median_ms << "," << double(r.stats.peak_bytes) / double(none.peak_bytes) << ","
        << r.stats.median_ms / none.median_ms << "," << (r.grads_equal ? 1 : 0) << "," << r.max_grad_diff
        << "," << (r.plan ? r.plan->predicted.peak_bytes - int64_t(w->input().nbytes()) : 0) << "\n";
  }
  if (!a.json.empty()) write_file(a.json, j.dump(2) + "\n");
  if (!a.csv.empty()) write_file(a.csv, csv.str());
  return 0;
}

// ------------------------------------------------------------------------------------------------------------
// profile

struct ProfileArgs {
  ModelArgs model;
  std::string optimizer = "none", json;
  int64_t repeats = 5;
};

int run_profile(const ProfileArgs& a) {
  auto w = a.model.make();
  progress("profiling " + w->description());
  const auto options = a.model.profile_options(a.repeats);
  const remat::Chain chain = remat::profile_workload(*w, &options);
  std::cout << w->description() << "\n\n";
  std::vector<std::string> columns{"stage",     "fwd ms",      "bwd ms",     "output MiB",
                                   "saved MiB", "fwd tmp MiB", "bwd tmp MiB"};
  const bool keep = !chain.keep.empty();
  if (keep) columns.insert(columns.end(), {"Fk kept MiB", "Fk bwd ms"});
  remat::cli::Table t(columns);
  const size_t shown = 40;
  for (size_t i = 0; i < chain.stages.size(); ++i) {
    if (chain.stages.size() > shown && i == shown / 2) {
      t.add({"... (" + std::to_string(chain.stages.size() - shown) + " more)"});
      i = chain.stages.size() - shown / 2;
    }
    const auto& s = chain.stages[i];
    std::vector<std::string> row{s.name,
                                 fixed(s.fwd_ms, 3),
                                 fixed(s.bwd_ms, 3),
                                 mib(s.output_bytes),
                                 mib(s.saved_bytes),
                                 mib(s.fwd_tmp_bytes),
                                 mib(s.bwd_tmp_bytes)};
    if (keep && s.has_keep()) row.insert(row.end(), {mib(*s.keep_saved_bytes), fixed(*s.keep_bwd_ms, 3)});
    t.add(row);
  }
  t.print(std::cout);

  int64_t params = 0, trainable = 0;
  for (const auto& p : w->module().parameters()) {
    params += p.nbytes();
    if (p.requires_grad()) trainable += p.nbytes();
  }
  const int64_t optimizer = a.optimizer == "adam"           ? 2 * trainable
                            : a.optimizer == "sgd-momentum" ? trainable
                                                            : 0;
  const int64_t input = chain.input_bytes;
  const int64_t activations = remat::no_checkpoint(chain).predicted.peak_bytes - input;
  const int64_t least = remat::min_feasible_budget(chain) - input;
  const int64_t per_layer = remat::checkpoint_all(chain).predicted.peak_bytes - input;
  const int64_t total = params + trainable + optimizer + input + activations;
  auto pct = [&](int64_t b) { return fixed(100.0 * double(b) / double(total), 1) + "%"; };
  std::cout << "\nmemory of one training step (predicted from the profile)\n";
  remat::cli::Table m({"part", "MiB", "share"});
  m.add({"parameters", mib(params), pct(params)});
  m.add({"gradients", mib(trainable), pct(trainable)});
  m.add({"optimizer state (" + a.optimizer + ")", mib(optimizer), pct(optimizer)});
  m.add({"inputs", mib(input), pct(input)});
  m.add({"activations and transients, peak", mib(activations), pct(activations)});
  m.print(std::cout);
  const int64_t saving = activations - least;
  std::cout << "\nverdict: checkpointing can save at most " << remat::format_bytes(saving) << " ("
            << fixed(100.0 * double(saving) / double(total), 1)
            << "% of the step's memory): activations go from " << remat::format_bytes(activations)
            << " to at least " << remat::format_bytes(least) << "; checkpointing every stage alone gives "
            << remat::format_bytes(per_layer) << ".\n";
  const int64_t weights = params + trainable + optimizer;
  if (weights > activations) {
    std::cout << "the weights dominate: parameters, gradients and optimizer state are "
              << remat::format_bytes(weights) << " (" << pct(weights)
              << "), which checkpointing does not touch; checkpointing one layer at a time "
              << "cannot help here. Reduce the weights instead (fewer or smaller layers, lower precision, "
              << "sharding).\n";
  } else {
    std::cout
        << "activations dominate: checkpointing is the right tool; `remat plan --budget SIZE` picks what to "
           "checkpoint.\n";
  }
  if (!a.json.empty()) {
    remat::save_chain(chain, a.json);
    std::cout << "chain written to " << a.json << "\n";
  }
  return 0;
}

// ------------------------------------------------------------------------------------------------------------
// plan

struct PlanArgs {
  ModelArgs model;
  std::string chain, budget, planner = "optimal", out, step;
  int64_t slots = 500;
  bool json = false;
};

int run_plan_command(const PlanArgs& a) {
  const bool needs_budget = a.planner == "optimal" || a.planner == "revolve";
  if (needs_budget && a.budget.empty())
    throw std::invalid_argument("--planner " + a.planner + " needs --budget SIZE");
  const int64_t budget = a.budget.empty() ? 0 : size_arg(a.budget, "--budget");
  remat::Chain chain;
  std::optional<remat::Chain> step;
  if (!a.step.empty()) {
    step = remat::load_chain(a.step);
    if (step->size() < 3)
      throw std::invalid_argument("--step " + a.step +
                                  ": a step chain has the prefix, at least one stage and the " +
                                  "suffix, got " + std::to_string(step->size()) + " stages");
  }
  if (!a.chain.empty()) {
    chain = remat::load_chain(a.chain);
    if (step && step->size() != chain.size() + 2)
      throw std::invalid_argument("--step " + a.step + " has " + std::to_string(step->size()) +
                                  " stages, but the chain has " + std::to_string(chain.size()) +
                                  " (a step chain has the chain's stages plus the prefix and the suffix)");
  } else if (step) {
    chain.input_bytes = step->stages.front().output_bytes;
    chain.stages.assign(step->stages.begin() + 1, step->stages.end() - 1);
    remat::validate(chain);
  } else {
    auto w = a.model.make();
    progress("profiling " + w->description());
    const auto profile = a.model.profile_options(5);
    chain = remat::profile_workload(*w, &profile);
  }
  remat::PlannerOptions options;
  options.slots = a.slots;
  const auto t0 = std::chrono::steady_clock::now();
  const remat::Plan plan = remat::make_plan(chain, a.planner, budget, options);
  const double planning_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::cerr << "remat: planned " << chain.size() << " stages in " << fixed(planning_ms, 1) << " ms\n";
  const remat::Plan none = remat::no_checkpoint(chain);
  const double overhead = plan.predicted.time_ms / none.predicted.time_ms - 1;
  if (!a.out.empty()) write_file(a.out, remat::to_json(plan) + "\n");
  if (a.json) {
    nlohmann::ordered_json j;
    j["planner"] = plan.planner;
    j["budget_bytes"] = budget;
    j["predicted_peak_bytes"] = plan.predicted.peak_bytes;
    j["predicted_time_ms"] = plan.predicted.time_ms;
    j["forward_calls"] = plan.predicted.forward_calls;
    j["ops"] = nlohmann::ordered_json::array();
    for (const auto& op : plan.ops)
      j["ops"].push_back(
          op.kind == remat::OpKind::kLoss ? "L" : remat::op_name(op.kind) + std::to_string(op.stage));
    j["num_stages"] = chain.size();
    if (!plan.keep.empty()) j["keep"] = plan.keep;
    j["baseline_peak_bytes"] = none.predicted.peak_bytes;
    j["baseline_time_ms"] = none.predicted.time_ms;
    j["time_overhead"] = overhead;
    j["min_feasible_budget_bytes"] = remat::min_feasible_budget(chain);
    if (step) j["step_predicted_peak_bytes"] = remat::simulate(*step, remat::step_plan(plan)).peak_bytes;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "planner " << plan.planner << " on " << chain.size() << " stages";
  if (budget > 0) std::cout << ", budget " << remat::format_bytes(budget);
  std::cout << "\n";
  std::string text = plan.to_string();
  if (text.size() > 2000)
    text = text.substr(0, 2000) + " ... (" + std::to_string(plan.ops.size()) + " operations)";
  std::cout << "schedule: " << text << "\n";
  std::cout << "  Fc = forward keeping its input (a checkpoint), Fn = forward keeping nothing, Fa = forward "
               "keeping "
               "everything for backward, L = loss, B = backward\n";
  std::cout << "predicted peak: " << remat::format_bytes(plan.predicted.peak_bytes)
            << " (without checkpointing " << remat::format_bytes(none.predicted.peak_bytes)
            << "; the least possible " << remat::format_bytes(remat::min_feasible_budget(chain)) << ")\n";
  if (step) {
    std::cout
        << "predicted peak of the whole step (prefix, chain, suffix and loss, the model's input included): "
        << remat::format_bytes(remat::simulate(*step, remat::step_plan(plan)).peak_bytes)
        << " (without checkpointing "
        << remat::format_bytes(remat::simulate(*step, remat::step_plan(none)).peak_bytes) << ")\n";
  }
  std::cout << "predicted time: " << fixed(plan.predicted.time_ms, 2) << " ms per step, "
            << fixed(100 * overhead, 1) << "% over no checkpointing\n";
  int64_t recomputed = 0;
  for (int64_t c : plan.predicted.forward_calls)
    recomputed += c > 1;
  std::cout << "stages recomputed: " << recomputed << " of " << chain.size() << "\n";
  return 0;
}

// ------------------------------------------------------------------------------------------------------------
// max-batch, sweep, demo

struct MaxBatchArgs {
  ModelArgs model;
  std::string budget, strategies = "none,all,sqrt,optimal";
};

int run_max_batch(const MaxBatchArgs& a) {
  if (a.model.model == "heavy") throw std::invalid_argument("--model heavy has no batch dimension");
  const int64_t budget = size_arg(a.budget, "--budget");
  const auto profile = a.model.profile_options(5);
  const auto rows = remat::max_batch([&](int64_t b) { return a.model.make(b); }, budget, split(a.strategies),
                                     progress, &profile);
  std::cout << "largest batch whose activation peak (inputs included) fits " << remat::format_bytes(budget)
            << "\n\n";
  remat::cli::Table t({"strategy", "batch", "predicted peak MiB", "measured peak MiB", "confirmed"});
  for (const auto& r : rows) {
    t.add({r.strategy, std::to_string(r.batch), mib(r.predicted_peak_bytes), mib(r.measured_peak_bytes),
           r.batch == 0 ? "nothing fits" : (r.confirmed ? "yes" : "no")});
  }
  t.print(std::cout);
  const bool any_fits = std::any_of(rows.begin(), rows.end(), [](const auto& r) { return r.batch > 0; });
  if (!any_fits) {
    std::cerr << "remat: max-batch: not even a batch of 1 fits " << remat::format_bytes(budget)
              << " with any strategy (" << a.strategies << ")\n";
    return 1;
  }
  return 0;
}

struct SweepArgs {
  ModelArgs model;
  std::string chain, csv, title, plot, measured, frontier;
  int64_t budgets = 20;
};

// Runs scripts/plot_tradeoff.py (REMAT_PLOT_SCRIPT, or the one of the source tree this binary was built from)
// with REMAT_PYTHON (default python3, which needs matplotlib).
void draw_plot(const std::vector<std::string>& args) {
  const char* env_script = std::getenv("REMAT_PLOT_SCRIPT");
  const std::string script = env_script ? env_script : REMAT_PLOT_SCRIPT;
  TORCH_CHECK(std::ifstream(script).good(), "remat sweep --plot: the plotting script '", script,
              "' is not there; set REMAT_PLOT_SCRIPT to scripts/plot_tradeoff.py of remat's sources");
  const char* env_python = std::getenv("REMAT_PYTHON");
  std::vector<std::string> argv{env_python ? env_python : "python3", script};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& x : argv)
    cargv.push_back(x.data());
  cargv.push_back(nullptr);
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, cargv[0], nullptr, nullptr, cargv.data(), ::environ);
  TORCH_CHECK(err == 0, "remat sweep --plot: cannot run '", argv[0], "': ", std::strerror(err));
  int status = 0;
  waitpid(pid, &status, 0);
  TORCH_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "remat sweep --plot: '", argv[0], " ", script,
              "' failed (exit status ", WIFEXITED(status) ? WEXITSTATUS(status) : -1,
              "); it needs matplotlib");
}

int run_sweep(const SweepArgs& a) {
  remat::Chain chain;
  std::string title;
  if (!a.chain.empty()) {
    chain = remat::load_chain(a.chain);
    title = a.title.empty() ? a.chain : a.title;
  } else {
    auto w = a.model.make();
    progress("profiling " + w->description());
    const auto profile = a.model.profile_options(5);
    chain = remat::profile_workload(*w, &profile);
    title = w->description();
  }
  progress("planning at " + std::to_string(a.budgets) + " budgets");
  const auto points = remat::sweep(chain, a.budgets);
  std::ostringstream csv;
  csv << "# " << title
      << "\nkind,name,budget_bytes,predicted_peak_bytes,predicted_time_ms,overhead,input_bytes\n";
  for (const auto& p : points) {
    csv << p.kind << "," << p.name << "," << p.budget_bytes << "," << p.predicted_peak_bytes << ","
        << p.predicted_time_ms << "," << p.overhead << "," << p.input_bytes << "\n";
  }
  const std::string csv_path = !a.csv.empty() ? a.csv : (a.plot.empty() ? "" : a.plot + ".csv");
  if (!csv_path.empty()) {
    write_file(csv_path, csv.str());
    std::cerr << "remat: trade-off curve written to " << csv_path << " (scripts/plot_tradeoff.py " << csv_path
              << " draws it)\n";
  }
  if (!a.plot.empty()) {
    std::vector<std::string> args{csv_path, "-o", a.plot};
    if (!a.frontier.empty()) args.insert(args.end(), {"--frontier", a.frontier});
    if (!a.measured.empty()) args.insert(args.end(), {"--measured", a.measured});
    draw_plot(args);
  }
  remat::cli::Table t({"kind", "name", "budget MiB", "peak MiB", "time ms", "overhead"});
  for (const auto& p : points) {
    t.add({p.kind, p.name, p.budget_bytes ? mib(p.budget_bytes) : "-", mib(p.predicted_peak_bytes),
           fixed(p.predicted_time_ms, 2), fixed(100 * p.overhead, 1) + "%"});
  }
  t.print(std::cout);
  return 0;
}

int run_demo(const ModelArgs& model, int64_t steps) {
  auto w = model.make();
  progress("demo: " + w->description() + ", " + std::to_string(steps) + " timed steps each");
  const auto rows = remat::bench(
      *w, {"none", "all"}, remat::MeasureOptions().warmup(1).steps(steps).device(torch::Device(model.device)),
      nullptr, progress);
  std::cout << "The gradient checkpointing experiment of a BERT encoder, scaled to this machine\n"
            << w->description() << "\n\n";
  remat::cli::Table t({"", "before backward MiB", "after backward MiB", "peak MiB", "activations MiB",
                       "median step ms", "time vs none", "gradients"});
  const char* names[] = {"without checkpointing", "gradient_checkpointing_enable()"};
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& s = rows[i].stats;
    t.add({names[i], mib(s.base_bytes + s.after_forward_bytes), mib(s.base_bytes + s.after_backward_bytes),
           mib(s.base_bytes + s.peak_bytes), mib(s.peak_bytes), fixed(s.median_ms, 1),
           fixed(s.median_ms / rows[0].stats.median_ms, 2),
           i == 0 ? "-" : (rows[i].grads_equal ? "equal" : "DIFFER")});
  }
  t.print(std::cout);
  const double cut = 1.0 - double(rows[1].stats.peak_bytes) / double(rows[0].stats.peak_bytes);
  std::cout
      << "\nper-layer checkpointing cuts peak activation memory by " << fixed(100 * cut, 1) << "% for "
      << fixed(100 * (rows[1].stats.median_ms / rows[0].stats.median_ms - 1), 1) << "% more step time.\n"
      << "Memory is remat's exact meter: before/after backward and peak include parameters, gradients and "
         "inputs ("
      << remat::format_bytes(rows[0].stats.base_bytes) << "); activations are the peak above them.\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's LibTorch runs one thread unless OMP_NUM_THREADS says otherwise: use every core by default.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  }
  CLI::App app{"remat: gradient checkpointing for LibTorch, measured"};
  app.require_subcommand(1);

  BenchArgs bench;
  auto* bench_cmd = app.add_subcommand(
      "bench", "Train a model under checkpointing strategies: peak memory, step time, gradients");
  bench.model.add(bench_cmd);
  bench_cmd
      ->add_option("--strategy", bench.strategies,
                   "comma-separated: none, all, all-reentrant, all-no-early-stop, plan-all, selective, sqrt, "
                   "uniform:K, "
                   "balanced:K, "
                   "balanced-time:K, revolve:S, optimal:SIZE, "
                   "optimal:as=P, optimal:overhead=F, optimal:time=R")
      ->capture_default_str();
  bench_cmd->add_option("--steps", bench.steps, "timed steps (median reported)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  bench_cmd->add_option("--warmup", bench.warmup, "untimed steps first")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  bench_cmd->add_option("--json", bench.json, "also write the results as JSON to this file");
  bench_cmd->add_option("--csv", bench.csv, "also write the results as CSV to this file");
  bench_cmd->add_option("--save-chain", bench.save_chain,
                        "also write the model's profiled chain to this file");
  bench_cmd->add_option(
      "--chain", bench.chain,
      "plan on this chain (remat profile --json, --save-chain) instead of profiling the model");
  bench_cmd->add_flag(
      "--predict", bench.predict,
      "profile the model's chain even when no strategy needs it, to predict every row's time");
  bench_cmd
      ->add_option(
          "--nproc", bench.nproc,
          "train data parallel (remat::distributed::DataParallel) in this many local processes (Gloo "
          "over loopback), the batch split across them; 1 measures DataParallel's own cost")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();

  std::vector<std::string> launch_command;
  int64_t nproc_per_node = 1, nnodes = 1, node_rank = 0, master_port = 29500;
  std::string master_addr = "127.0.0.1", log_dir;
  auto* launch_cmd = app.add_subcommand(
      "launch",
      "Run a program in N processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)");
  launch_cmd->add_option("--nproc-per-node", nproc_per_node, "processes on this machine")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  launch_cmd->add_option("--nnodes", nnodes, "machines")->check(CLI::Range(1, 100000))->capture_default_str();
  launch_cmd->add_option("--node-rank", node_rank, "this machine's index")->capture_default_str();
  launch_cmd->add_option("--master-addr", master_addr, "rank 0's address")->capture_default_str();
  launch_cmd->add_option("--master-port", master_port, "rank 0's port (0: a free one, one machine only)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  launch_cmd->add_option("--log-dir", log_dir, "write each rank's output to LOG_DIR/rank_<RANK>.log");
  launch_cmd->add_option("command", launch_command, "the program and its arguments (after --)")->required();
  launch_cmd->prefix_command();

  ProfileArgs profile;
  auto* profile_cmd =
      app.add_subcommand("profile", "Measure a model as a chain of stages; say what checkpointing can save");
  profile.model.add(profile_cmd);
  profile_cmd
      ->add_option("--optimizer", profile.optimizer, "count optimizer state: none, sgd-momentum or adam")
      ->check(CLI::IsMember({"none", "sgd-momentum", "adam"}))
      ->capture_default_str();
  profile_cmd->add_option("--repeats", profile.repeats, "timed runs per stage")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  profile_cmd->add_option("--json", profile.json, "write the chain (docs/chain-format.md) to this file");

  PlanArgs plan;
  auto* plan_cmd =
      app.add_subcommand("plan", "The schedule for a memory budget, its predicted peak and time");
  plan.model.add(plan_cmd);
  plan_cmd->add_option("--chain", plan.chain,
                       "read the chain from this JSON file instead of profiling --model");
  plan_cmd->add_option("--budget", plan.budget,
                       "memory budget: bytes, or with a unit (512MiB, 1.5GiB, 300MB)");
  plan_cmd
      ->add_option("--planner", plan.planner,
                   "optimal, revolve, revolve:S, sqrt, uniform:K, balanced:K, balanced-time:K, all or none")
      ->capture_default_str();
  plan_cmd->add_option("--slots", plan.slots, "optimal: memory discretisation")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  plan_cmd->add_option(
      "--step", plan.step,
      "the whole step as a chain of n+2 stages (prefix, the chain's stages, suffix with the loss: "
      "remat::profile_step's .step, saved with remat::save_chain): also predict the step's peak; "
      "without --chain, the chain is its stages 1..n");
  plan_cmd->add_flag("--json", plan.json, "print one JSON object");
  plan_cmd->add_option("--out", plan.out, "also write the plan (remat::to_json) to this file");

  MaxBatchArgs maxb;
  auto* maxb_cmd = app.add_subcommand("max-batch", "The largest batch that fits a budget, per strategy");
  maxb.model.add(maxb_cmd);
  maxb_cmd->add_option("--budget", maxb.budget, "activation memory budget (inputs included)")->required();
  maxb_cmd->add_option("--strategy", maxb.strategies, "comma-separated: none, all, sqrt, uniform:K, optimal")
      ->capture_default_str();

  SweepArgs sw;
  auto* sweep_cmd = app.add_subcommand(
      "sweep", "The optimal planner's memory/time trade-off over budgets, baselines as points");
  sw.model.add(sweep_cmd);
  sweep_cmd->add_option("--chain", sw.chain,
                        "read the chain from this JSON file instead of profiling --model");
  sweep_cmd->add_option("--budgets", sw.budgets, "budgets from the minimum to no checkpointing")
      ->check(CLI::Range(2, 10000))
      ->capture_default_str();
  sweep_cmd->add_option("--csv", sw.csv, "write the curve as CSV to this file");
  sweep_cmd->add_option("--title", sw.title, "title of the curve (default: the model or the chain file)");
  sweep_cmd->add_option(
      "--plot", sw.plot,
      "draw the curve to this PNG (scripts/plot_tradeoff.py; REMAT_PYTHON with matplotlib)");
  sweep_cmd->add_option("--measured", sw.measured,
                        "with --plot: overlay the measured points of bench/compare.py's compare.json");
  sweep_cmd->add_option(
      "--frontier", sw.frontier,
      "with --plot: draw the frontier of bench/compare.py --frontier's compare.json (PyTorch's "
      "options, remat's planner measured at their peaks, the floor)");

  ModelArgs demo;
  int64_t demo_steps = 3;
  auto* demo_cmd =
      app.add_subcommand("demo", "BERT with and without gradient_checkpointing_enable(): memory and time");
  demo.model = "bert";
  demo.add(demo_cmd);
  demo_cmd->add_option("--steps", demo_steps, "timed steps per setting")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();

  try {
    app.parse(argc, argv);
    bench.argv.assign(argv, argv + argc);
    bench.data_parallel = bench_cmd->count("--nproc") > 0;
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*bench_cmd) return run_bench(bench);
    if (*launch_cmd) {
      for (const auto& extra : launch_cmd->remaining())
        launch_command.push_back(extra);
      return remat::distributed::launch(remat::distributed::LaunchOptions()
                                            .nproc_per_node(nproc_per_node)
                                            .nnodes(nnodes)
                                            .node_rank(node_rank)
                                            .master_addr(master_addr)
                                            .master_port(master_port)
                                            .log_dir(log_dir),
                                        launch_command);
    }
    if (*profile_cmd) return run_profile(profile);
    if (*plan_cmd) return run_plan_command(plan);
    if (*maxb_cmd) return run_max_batch(maxb);
    if (*sweep_cmd) return run_sweep(sw);
    if (*demo_cmd) return run_demo(demo, demo_steps);
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    std::cerr << "remat: " << msg.substr(0, msg.find('\n')) << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::cerr << "remat: " << msg.substr(0, msg.find('\n')) << "\n";
    return 1;
  }
  return 0;
}
