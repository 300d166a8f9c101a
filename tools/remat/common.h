#pragma once
// What the remat command's subcommands share: the options that pick a model, number formatting, and the shape
// of a subcommand (its CLI11 options and what it runs). Each subcommand lives in <name>_command.cpp, parses
// its arguments and calls the library.

#include <remat/bench.h>

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "table.h"

namespace remat::cli {

/// The plotting script of the source tree this binary was built from (scripts/plot_tradeoff.py).
const char* built_plot_script();
/// The step-picture script of the source tree this binary was built from (python/remat/plot_step.py).
const char* built_step_plot_script();
/// Runs a plotting script (`env_var`'s path, or `built`) with REMAT_PYTHON (default python3, which needs
/// matplotlib) and `args`. Throws c10::Error naming `who` when the script is missing or fails.
void run_plot_script(const std::string& who, const char* env_var, const std::string& built,
                     const std::vector<std::string>& args);

/// A subcommand: its CLI11 app (options added) and what it runs once the command line is parsed (the exit
/// status).
struct Subcommand {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

Subcommand add_bench(CLI::App& app, const std::vector<std::string>& argv);
Subcommand add_launch(CLI::App& app);
Subcommand add_profile(CLI::App& app);
Subcommand add_plan(CLI::App& app);
Subcommand add_max_batch(CLI::App& app);
Subcommand add_sweep(CLI::App& app);
Subcommand add_demo(CLI::App& app);

/// The options every model-taking command shares (--model and its sizes, --device, --seed, --granularity,
/// --keep).
struct ModelArgs {
  std::string model = "bert", variant = "small", placement = "each-op", device = "cpu", granularity = "layer";
  std::string keep;         // remat::keep tags for Fk, comma-separated
  std::string policies;     // policy presets for Fk[name], comma-separated
  std::string offload_min;  // --offload-min-bytes: profile for offloading (SIZE; empty: not)
  int64_t layers = 12, hidden = 768, heads = 12, intermediate = 3072, seq = 128, vocab = 30522, batch = 0;
  int64_t depth = 16, width = 1024, calls = 1000, adds = 100, blocks = 3;
  double dropout = 0.1;
  uint64_t seed = 0;

  /// Adds the options to `app`.
  void add(CLI::App* app);
  /// Profiling options with the --keep tags, the --policy presets and --offload-min-bytes, and a progress bar
  /// (progress_bar.h) that says where the time went when profiling ends.
  ProfileOptions profile_options(int64_t repeats = 3) const;
  /// The workload's configuration; batch_override >= 0 replaces --batch.
  WorkloadConfig config(int64_t batch_override = -1) const;
  /// The workload (the CPU meter installed, or a clear error when --device cuda has no device).
  std::unique_ptr<Workload> make(int64_t batch_override = -1) const;
};

/// "%.*f".
std::string fixed(double v, int digits);
/// Bytes as MiB with one decimal (remat::format_mib).
std::string mib(int64_t bytes);
/// Prints "remat: <message>" on stderr (progress of long runs).
void progress(const std::string& message);
/// The comma-separated items of `text` (empty ones dropped).
std::vector<std::string> split(const std::string& text);
/// Writes `text` to `path`, or throws std::invalid_argument "cannot write '<path>'".
void write_file(const std::string& path, const std::string& text);
/// remat::parse_size, its error prefixed with the flag's name.
int64_t size_arg(const std::string& text, const char* flag);

/// Adds --exclude (operations the planner may not use: Fk, Fk[tags], Fk[NAME]) to `app`, into `exclude`.
void add_exclude(CLI::App* app, std::string& exclude);
/// Planner options with those exclusions (and `slots`).
PlannerOptions planner_options(const std::string& exclude, int64_t slots = PlannerOptions().slots);

}  // namespace remat::cli
