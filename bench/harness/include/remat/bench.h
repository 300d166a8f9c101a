#pragma once
/// \file
/// The benchmark harness (private: built for the remat command, bench/ and the tests, not installed): a
/// model, its input and loss (a Workload), trained under checkpointing strategies and measured with the exact
/// meter. The remat command is a thin layer over this header.
///
///   remat::memory::track_cpu();
///   auto w = remat::make_workload(remat::WorkloadConfig().model("bert").layers(12).seq(128).batch(8));
///   auto rows = remat::bench(*w, {"none", "all", "sqrt", "optimal:overhead=0.5"});
///   for (auto& r : rows) std::cout << r.strategy << " " << r.stats.peak_bytes << "\n";
///
/// Strategies are the strings of remat/planner/strategy.h, with one meaning everywhere. Here "none" trains
/// the plain model; "all" and its variants (all-reentrant, all-no-early-stop, all-keep-TAG) run through the
/// model's own per-layer checkpointing (gradient_checkpointing_enable with per_layer_options); every other
/// strategy is a plan over the model's stages, run by the plan executor ("plan-all" is "all"'s schedule
/// there). A model that does not tag TAG runs all-keep-TAG as "all". "optimal" and "revolve" need a budget:
/// spell it (optimal:300MiB) or give a time target (optimal:overhead=0.5).

#include <remat/measure.h>
#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/report.h>
#include <remat/planner/strategy.h>
#include <remat/profile.h>
#include <remat/sequential.h>
#include <remat/version.h>
#if REMAT_HAS_DISTRIBUTED
#include <remat/distributed.h>
#endif
#include <torch/arg.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace remat {

/// Which model to build, and its size.
struct WorkloadConfig {
  /// "bert", "cifar", "heavy", "forum-cnn", "mlp" or "resnet".
  TORCH_ARG(std::string, model) = "bert";
  /// bert: encoder layers, hidden size, heads, feed-forward size, sequence length, vocabulary, dropout.
  TORCH_ARG(int64_t, layers) = 12;
  TORCH_ARG(int64_t, hidden) = 768;
  TORCH_ARG(int64_t, heads) = 12;
  TORCH_ARG(int64_t, intermediate) = 3072;
  TORCH_ARG(int64_t, seq) = 128;
  TORCH_ARG(int64_t, vocab) = 30522;
  TORCH_ARG(double, dropout) = 0.1;
  /// Rows (bert: sequences) per batch; 0 means the model's default (bert 8, mlp 64, cifar 64, forum-cnn 100,
  /// resnet 64).
  TORCH_ARG(int64_t, batch) = 0;
  /// mlp: blocks and width.
  TORCH_ARG(int64_t, depth) = 16;
  TORCH_ARG(int64_t, width) = 1024;
  /// resnet: BasicBlocks per layer (layer1..layer3; remat::models::ResNet).
  TORCH_ARG(int64_t, blocks) = 3;
  /// heavy: calls of the function and additions per call.
  TORCH_ARG(int64_t, calls) = 1000;
  TORCH_ARG(int64_t, adds) = 100;
  /// forum-cnn: "small" or "full", and the checkpoint placement.
  TORCH_ARG(std::string, variant) = "small";
  TORCH_ARG(std::string, placement) = "each-op";
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  /// bert: the chain's stages, per layer or per piece of a layer (kSublayer: five per layer, see
  /// BertModel::stages). Other models have layers only.
  TORCH_ARG(Granularity, granularity) = Granularity::kLayer;
  /// Seed of the weights and inputs.
  TORCH_ARG(uint64_t, seed) = 0;
};

/// A model ready to train under strategies.
class Workload {
 public:
  virtual ~Workload() = default;
  /// "bert 12x768 (12 heads, ffn 3072), seq 128, batch 8" and the like.
  virtual std::string description() const = 0;
  /// The model (its parameters are what the gradients are compared on).
  virtual torch::nn::Module& module() = 0;
  /// The input of the model's chain of stages (token ids for bert).
  virtual torch::Tensor input() const = 0;
  /// The model as a chain of stages (embeddings and layers, blocks, calls...).
  virtual std::vector<StageFn> stages() = 0;
  /// Turns per-layer checkpointing (the model's gradient_checkpointing_enable) on with `options`, or off.
  virtual void set_per_layer(std::optional<CheckpointOptions> options) = 0;
  /// The model's output with the current setting (plain or per-layer).
  virtual torch::Tensor forward() = 0;
  /// The chain stages (indices into stages()) that set_per_layer() checkpoints one remat::checkpoint call
  /// each, for predicting its time (per_call_time_ms); empty when they are not single stages (bert at
  /// Granularity::kSublayer, and the models whose per-layer setting is not one call per stage).
  virtual std::vector<int64_t> per_layer_stages() const { return {}; }
  /// The loss of an output: the mean of its squares (in float); HeavyChain's is its output itself, as in its
  /// article (a linear loss keeps its 100,000 gradient contributions exact in float).
  virtual torch::Tensor loss_of(const torch::Tensor& output) const;
};

/// The models make_workload builds: "bert", "cifar", "heavy", "forum-cnn", "mlp", "resnet".
const std::vector<std::string>& workload_models();

/// Builds the workload. Throws c10::Error naming the field and value for an unknown model or a bad size.
std::unique_ptr<Workload> make_workload(const WorkloadConfig& config);

/// One measured strategy.
struct BenchRow {
  std::string strategy;               ///< as given (see the top of this file)
  StepStats stats;                    ///< measured (bytes over parameters + gradients + inputs)
  double max_grad_diff = 0;           ///< largest |grad - grad of "none"| over all parameters
  double max_grad_diff_relative = 0;  ///< max_grad_diff / largest |grad of "none"|
  /// max_grad_diff <= 1e-4 * (1 + largest |grad of "none"|): recomputing may sum float contributions in
  /// another order, which changes the last bits; a missing or wrong contribution is O(1).
  bool grads_equal = true;
  std::optional<Plan> plan;  ///< for plan strategies: the plan and its prediction
  /// The plan's predicted peak over the base (its chain's input left out, as the measured peak leaves it):
  /// comparable to stats.peak_bytes (bytes). Set for plan strategies.
  std::optional<int64_t> predicted_peak_bytes;
  /// The step time the chain predicts (milliseconds), when bench had a chain: simulate()'s time for "none"
  /// and plan strategies, per_call_time_ms() over Workload::per_layer_stages() for "all"; unset otherwise
  /// (the other per-layer strategies, or no per-layer stages).
  std::optional<double> predicted_time_ms;
};

/// Progress messages (for stderr).
using Progress = std::function<void(const std::string&)>;
/// Progress of counted work, for a progress bar: `done` units of `total`, the last one's words.
using CountedProgress = std::function<void(int64_t done, int64_t total, const std::string& what)>;

/// Parses a strategy (remat::parse_strategy), as c10::Error naming remat::bench and the string when it is not
/// one.
Strategy bench_strategy(const std::string& strategy);

/// The per-layer CheckpointOptions of a strategy that runs through the model's own checkpointing ("all" and
/// its variants: kReentrant for all-reentrant, early_stop(false) for all-no-early-stop, keep({TAG}) for
/// all-keep-TAG, policy(remat::policy::preset(NAME)) for all-policy-NAME); nullopt for every other strategy.
/// Throws c10::Error for a NAME that is no preset.
std::optional<CheckpointOptions> per_layer_options(const Strategy& strategy);
/// per_layer_options(bench_strategy(strategy)). Throws as bench_strategy.
std::optional<CheckpointOptions> per_layer_options(const std::string& strategy);

/// Resolves a plan strategy against a chain (remat::plan_strategy). Returns nullopt for "none", "all" and
/// the other per-layer strategies (per_layer_options), which the model runs itself. Throws c10::Error naming
/// the strategy when it is unknown or malformed, or needs a budget ("optimal", "revolve"), and
/// InfeasibleBudget when its budget is below the minimum.
std::optional<Plan> plan_for(const std::string& strategy, const Chain& chain);

/// Measures every strategy (and "none" first, as the reference, if it is not listed): median step time and
/// peak bytes with MeasureOptions, then one more step under a fixed seed to compare gradients with "none".
/// Plan strategies use `chain` when given, or profile the model once. `steps`, when given, is called after
/// each step (warm-up and timed, of every strategy), and `progress` then no longer says each round of steps.
/// Throws what plan_for and the steps throw.
std::vector<BenchRow> bench(Workload& workload, const std::vector<std::string>& strategies,
                            const MeasureOptions& measure = {}, const ProfileOptions* profile = nullptr,
                            const Progress& progress = {}, const Chain* chain = nullptr,
                            const CountedProgress& steps = {});

/// The workload's chain, profiled (ProfileOptions defaults when null).
Chain profile_workload(Workload& workload, const ProfileOptions* profile = nullptr);

/// The rows as JSON (what `remat bench --json` writes): {"model": description, "base_bytes": N, "rows":
/// [{"strategy", "peak_bytes", "after_forward_bytes", "median_ms", "step_ms", "forward_ms", "peak_ratio",
/// "time_ratio", "grads_equal", "max_grad_diff", "max_grad_diff_relative", and for plans
/// "predicted_peak_bytes" and "plan", with a predicted time "predicted_ms" and "predicted_time_ratio"}]}.
/// Ratios are to the first row
/// ("none").
std::string bench_json(const std::string& description, const std::vector<BenchRow>& rows);

/// The rows as CSV (`remat bench --csv`): strategy, peak_bytes, after_forward_bytes, median_ms, peak_ratio,
/// time_ratio, grads_equal, max_grad_diff, predicted_peak_bytes (0 without a plan).
std::string bench_csv(const std::vector<BenchRow>& rows);

/// The largest batch that fits a memory budget under a strategy.
struct MaxBatch {
  std::string strategy;              ///< as given
  int64_t batch = 0;                 ///< 0 when not even batch 1 fits
  int64_t predicted_peak_bytes = 0;  ///< at that batch, from the scaled profile
  int64_t measured_peak_bytes = 0;   ///< one real step at that batch (bytes over the base)
  bool confirmed = false;            ///< measured <= budget
};

/// Profiles the workload at two batch sizes, scales the chain linearly in the batch, finds the largest batch
/// whose predicted peak fits `budget_bytes` for each strategy, and confirms it with one real step (stepping
/// the batch down while the step does not fit): "none" and the per-layer strategies as the model runs them
/// (plain, and its per-layer checkpointing; predicted by their plans), the others through the plan
/// executor. "optimal" and "revolve" plan within `budget_bytes` (their predicted peak is then the least any
/// schedule needs, and the plan's). `make` builds the workload for a batch; `profile` the profiling options
/// (defaults when null; its keep tags let "optimal" keep matrix multiplications). Throws c10::Error for a
/// strategy that is not one (bench_strategy).
std::vector<MaxBatch> max_batch(const std::function<std::unique_ptr<Workload>(int64_t)>& make,
                                int64_t budget_bytes, const std::vector<std::string>& strategies,
                                const Progress& progress = {}, const ProfileOptions* profile = nullptr);

#if REMAT_HAS_DISTRIBUTED
/// One strategy trained data-parallel: what every rank measured.
struct DataParallelBenchRow {
  std::string strategy;
  std::vector<int64_t> peak_bytes;  ///< per rank: bytes over its base during a step (buckets included)
  double median_ms = 0;             ///< median step time, the slowest rank's (forward + backward + reduction)
  double exposed_all_reduce_ms =
      0;                       ///< per step, the slowest rank's wait for all-reduces at the end of backward
  double hidden_fraction = 0;  ///< 1 - exposed / all_reduce_ms, in [0, 1]: communication behind backward
  double buckets_early = 0;    ///< per step, rank 0's buckets whose all-reduce began before backward's end
  bool grads_equal_across_ranks = true;  ///< after the last step, every rank's gradients are the same
  std::optional<Plan> plan;              ///< for plan strategies
};

/// What bench_data_parallel measured, and the figures every row shares.
struct DataParallelBench {
  int world_size = 1;
  int64_t gradient_bytes = 0;  ///< all-reduced per step
  int64_t buckets = 0;
  double all_reduce_ms = 0;  ///< median time of all-reducing every bucket with nothing else running
  std::vector<DataParallelBenchRow> rows;
};

/// Trains `workload` (this rank's share of the batch) under each strategy, as bench() does, with a
/// distributed::DataParallel over `group` (a collective: every rank calls it with the same strategies, and
/// its own workload of the same model). Plan strategies profile the chain first, before the DataParallel
/// exists (`chain` when given). `options` are the DataParallel's. Throws what bench() throws and what the
/// collectives throw.
DataParallelBench bench_data_parallel(Workload& workload, const std::vector<std::string>& strategies,
                                      distributed::ProcessGroup& group, const MeasureOptions& measure = {},
                                      const distributed::DataParallelOptions& options = {},
                                      const ProfileOptions* profile = nullptr, const Progress& progress = {},
                                      const Chain* chain = nullptr);

/// The result as JSON (`remat bench --nproc N --json`): {"model", "world_size", "global_batch",
/// "gradient_bytes", "buckets", "all_reduce_ms", "rows": [{"strategy", "peak_bytes" (per rank), "median_ms",
/// "exposed_all_reduce_ms", "hidden_fraction", "buckets_early", "grads_equal_across_ranks", "plan"}]}.
std::string bench_json(const std::string& description, int64_t global_batch, const DataParallelBench& result);

/// `remat bench --nproc N`: runs `argv` (this program and its arguments) again in `nproc` local processes
/// with torchrun's environment (remat::distributed::launch, a free port, 30 s grace after a failure) and
/// REMAT_BENCH_RANK set, so that each knows it is a rank (is_bench_rank). Returns the launch's exit status.
int relaunch_as_ranks(int64_t nproc, std::vector<std::string> argv);

/// Whether this process was started by relaunch_as_ranks.
bool is_bench_rank();

/// For one rank of N on this machine: shares its cores among the local processes (LOCAL_WORLD_SIZE; torchrun
/// gives each one thread by default) and returns this rank's rows of `global_batch`. Throws c10::Error when
/// the batch does not split evenly over `world_size` processes.
int64_t rank_share(int64_t global_batch, int world_size);
#endif

}  // namespace remat
