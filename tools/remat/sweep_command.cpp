// remat sweep: the optimal planner's trade-off curve (remat::sweep), as a table, CSV and a plot drawn by
// scripts/plot_tradeoff.py.

#include <fstream>
#include <iostream>

#include "common.h"
#include "progress_bar.h"

namespace remat::cli {
namespace {

struct SweepArgs {
  ModelArgs model;
  std::string chain, csv, title, plot, measured, frontier, exclude;
  int64_t budgets = 20;
};

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
  std::vector<SweepPoint> points;
  {
    ProgressBar bar("remat: planning");
    points = sweep(chain, a.budgets, planner_options(a.exclude),
                   [&](int64_t done, int64_t total) { bar.update(done, total, "budgets"); });
  }
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
    run_plot_script("remat sweep --plot", "REMAT_PLOT_SCRIPT", built_plot_script(), args);
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
