// remat sweep: the optimal planner's trade-off curve (remat::sweep), as a table, CSV and a plot drawn by
// scripts/plot_tradeoff.py.

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iostream>

#include "common.h"

namespace remat::cli {
namespace {

struct SweepArgs {
  ModelArgs model;
  std::string chain, csv, title, plot, measured, frontier, exclude;
  int64_t budgets = 20;
};

// Runs scripts/plot_tradeoff.py (REMAT_PLOT_SCRIPT, or the one of the source tree this binary was built from)
// with REMAT_PYTHON (default python3, which needs matplotlib).
void draw_plot(const std::vector<std::string>& args) {
  const char* env_script = std::getenv("REMAT_PLOT_SCRIPT");
  const std::string script = env_script ? env_script : built_plot_script();
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

int run(const SweepArgs& a) {
  Chain chain;
  std::string title;
  if (!a.chain.empty()) {
    chain = load_chain(a.chain);
    title = a.title.empty() ? a.chain : a.title;
  } else {
    auto w = a.model.make();
    progress("profiling " + w->description());
    const auto profile = a.model.profile_options(5);
    chain = profile_workload(*w, &profile);
    title = w->description();
  }
  progress("planning at " + std::to_string(a.budgets) + " budgets");
  const auto points = sweep(chain, a.budgets, planner_options(a.exclude));
  const std::string csv_path = !a.csv.empty() ? a.csv : (a.plot.empty() ? "" : a.plot + ".csv");
  if (!csv_path.empty()) {
    write_file(csv_path, sweep_csv(points, title));
    std::cerr << "remat: trade-off curve written to " << csv_path << " (scripts/plot_tradeoff.py " << csv_path
              << " draws it)\n";
  }
  if (!a.plot.empty()) {
    std::vector<std::string> args{csv_path, "-o", a.plot};
    if (!a.frontier.empty()) args.insert(args.end(), {"--frontier", a.frontier});
    if (!a.measured.empty()) args.insert(args.end(), {"--measured", a.measured});
    draw_plot(args);
  }
  Table t({"kind", "name", "budget MiB", "peak MiB", "time ms", "overhead"});
  for (const auto& p : points) {
    t.add({p.kind, p.name, p.budget_bytes ? mib(p.budget_bytes) : "-", mib(p.predicted_peak_bytes),
           fixed(p.predicted_time_ms, 2), fixed(100 * p.overhead, 1) + "%"});
  }
  t.print(std::cout);
  return 0;
}

}  // namespace

Subcommand add_sweep(CLI::App& app) {
  auto a = std::make_shared<SweepArgs>();
  auto* cmd = app.add_subcommand(
      "sweep", "The optimal planner's memory/time trade-off over budgets, baselines as points");
  a->model.add(cmd);
  cmd->add_option("--chain", a->chain, "read the chain from this JSON file instead of profiling --model");
  cmd->add_option("--budgets", a->budgets, "budgets from the minimum to no checkpointing")
      ->check(CLI::Range(2, 10000))
      ->capture_default_str();
  cmd->add_option("--csv", a->csv, "write the curve as CSV to this file");
  add_exclude(cmd, a->exclude);
  cmd->add_option("--title", a->title, "title of the curve (default: the model or the chain file)");
  cmd->add_option("--plot", a->plot,
                  "draw the curve to this PNG (scripts/plot_tradeoff.py; REMAT_PYTHON with matplotlib)");
  cmd->add_option("--measured", a->measured,
                  "with --plot: overlay the measured points of bench/compare.py's compare.json");
  cmd->add_option("--frontier", a->frontier,
                  "with --plot: draw the frontier of bench/compare.py --frontier's compare.json (PyTorch's "
                  "options, remat's planner measured at their peaks, the floor)");
  return {cmd, [a] { return run(*a); }};
}

}  // namespace remat::cli
