// remat plan: the schedule a strategy gives for a chain (profiled, or read from JSON), with its predicted
// peak and time beside the baselines (remat::plan_strategy, remat::summarize_plan).

#include <algorithm>
#include <chrono>
#include <iostream>

#include <remat/planner/timeline.h>
#include <remat/planner/units.h>

#include "common.h"
#include "progress_bar.h"

namespace remat::cli {
namespace {

struct PlanArgs {
  ModelArgs model;
  std::string chain, budget, planner = "optimal", out, step, exclude, max_host, plot;
  int64_t slots = 500;
  int threads = 0;
  bool json = false, offload = false;
};

int run(const PlanArgs& a) {
  const Strategy strategy = parse_strategy(a.planner);
  if (strategy.needs_budget() && a.budget.empty())
    throw std::invalid_argument("--planner " + a.planner + " needs --budget SIZE");
  const int64_t budget = a.budget.empty() ? -1 : size_arg(a.budget, "--budget");
  Chain chain;
  std::optional<Chain> step;
  if (!a.step.empty()) step = load_chain(a.step);
  if (!a.chain.empty()) {
    chain = load_chain(a.chain);
  } else if (step) {
    chain = chain_of_step(*step);
  } else {
    auto w = a.model.make();
    progress("profiling " + w->description());
    auto profile = a.model.profile_options(5);
    // --offload plans offloading: the model is profiled for it (1 MiB and larger saved tensors by default).
    if (a.offload && profile.offload_min_bytes() < 0) profile.offload_min_bytes(int64_t{1} << 20);
    chain = profile_workload(*w, &profile);
  }
  if (step && step->size() != chain.size() + 2) {
    throw std::invalid_argument("--step " + a.step + " has " + std::to_string(step->size()) +
                                " stages, but the chain has " + std::to_string(chain.size()) +
                                " (a step chain has the chain's stages plus the prefix and the suffix)");
  }
  PlannerOptions options = planner_options(a.exclude, a.slots);
  options.offload = a.offload;
  options.threads = a.threads;
  if (!a.max_host.empty()) {
    if (!a.offload)
      throw std::invalid_argument("--max-host bounds what offloading holds; it needs --offload");
    options.max_host_bytes = size_arg(a.max_host, "--max-host");
  }
  const auto t0 = std::chrono::steady_clock::now();
  const Plan plan = [&] {
    const PlanningWait wait("remat: planning");
    return plan_strategy(strategy, chain, budget, options);
  }();
  const double planning_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::cerr << "remat: planned " << chain.size() << " stages in " << fixed(planning_ms, 1) << " ms\n";
  PlanSummary s = summarize_plan(chain, plan, step ? &*step : nullptr);
  if (budget >= 0) s.requested_budget_bytes = budget;
  if (!a.out.empty()) write_file(a.out, to_json(plan) + "\n");
  if (!a.plot.empty()) {
    // The chain alone (the command has no step context): its timeline and the plain chain's, as JSON beside
    // the picture, drawn by the Python package's plot_step.py (matplotlib only).
    const StepContext alone;
    const std::string data = a.plot + ".json", plain = a.plot + ".plain.json";
    write_file(data, step_timeline_json(step_timeline(chain, alone, plan), budget) + "\n");
    write_file(plain, step_timeline_json(step_timeline(chain, alone, no_checkpoint(chain))) + "\n");
    run_plot_script("remat plan --plot", "REMAT_STEP_PLOT_SCRIPT", built_step_plot_script(),
                    {data, "--compare", plain, "-o", a.plot});
    progress("the step's picture drawn to " + a.plot + " (its data: " + data + ")");
  }
  if (a.json) {
    std::cout << to_json(s) << "\n";
    return 0;
  }
  std::cout << "planner " << plan.planner << " on " << chain.size() << " stages";
  if (budget > 0) std::cout << ", budget " << format_bytes(budget);
  std::cout << "\n";
  std::string text = plan.to_string();
  if (text.size() > 2000)
    text = text.substr(0, 2000) + " ... (" + std::to_string(plan.ops.size()) + " operations)";
  std::cout << "schedule: " << text << "\n";
  std::cout
      << "  Fc = forward keeping its input (a checkpoint), Fn = forward keeping nothing, Fa = forward "
         "keeping "
         "everything for backward, Fk = forward keeping its kept calls' outputs (Fk3[matmuls]: those policy "
         "matmuls keeps), L = loss, B = backward; @host: what the stage saves goes to host memory\n";
  std::cout << "predicted peak: " << format_bytes(plan.predicted.peak_bytes) << " (without checkpointing "
            << format_bytes(s.baseline_peak_bytes) << "; the least possible "
            << format_bytes(s.min_feasible_budget_bytes) << ")\n";
  if (step) {
    std::cout
        << "predicted peak of the whole step (prefix, chain, suffix and loss, the model's input included): "
        << format_bytes(*s.step_peak_bytes) << " (without checkpointing "
        << format_bytes(*s.step_baseline_peak_bytes) << ")\n";
  }
  std::cout << "predicted time: " << fixed(plan.predicted.time_ms, 2) << " ms per step, "
            << fixed(100 * s.time_overhead, 1) << "% over no checkpointing\n";
  std::cout << "stages recomputed: " << s.stages_recomputed << " of " << chain.size() << "\n";
  const int64_t offloaded =
      std::count_if(plan.ops.begin(), plan.ops.end(), [](const Op& op) { return op.offload; });
  if (offloaded > 0) {
    std::cout << "stages offloaded: " << offloaded << " of " << chain.size() << ", holding "
              << format_bytes(plan.predicted.host_peak_bytes) << " of host memory; copies not hidden by "
              << "computation: " << fixed(plan.predicted.transfer_ms, 2) << " ms\n";
  }
  if (s.stages_fk > 0) {
    std::cout << "stages run as Fk (their kept calls' outputs kept, the rest recomputed in their backward): "
              << s.stages_fk << " of " << chain.size() << "\n";
  }
  return 0;
}

}  // namespace

Subcommand add_plan(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "The schedule for a memory budget, its predicted peak and time");
  a->model.add(cmd);
  cmd->add_option("--chain", a->chain, "read the chain from this JSON file instead of profiling --model");
  cmd->add_option("--budget", a->budget, "memory budget: bytes, or with a unit (512MiB, 1.5GiB, 300MB)");
  cmd->add_option("--planner", a->planner, std::string("a strategy: ") + kStrategyWords)
      ->capture_default_str();
  cmd->add_option("--slots", a->slots, "optimal: memory discretisation")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cmd->add_option(
      "--step", a->step,
      "the whole step as a chain of n+2 stages (prefix, the chain's stages, suffix with the loss: "
      "remat::profile_step's .step, saved with remat::save_chain): also predict the step's peak; "
      "without --chain, the chain is its stages 1..n");
  add_exclude(cmd, a->exclude);
  cmd->add_flag("--offload", a->offload,
                "per-layer: the planner may also offload a stage to host memory (Fa3@host, Fk3[NAME]@host, "
                "Fc3@host; a --chain must have been profiled for offloading, a --model is profiled for it: "
                "saved tensors of --offload-min-bytes, 1MiB by default)");
  cmd->add_option("--max-host", a->max_host, "with --offload: the most host memory the plan may hold (SIZE)");
  cmd->add_option("--threads", a->threads,
                  "per-layer: the threads it plans on (0: the cores this process may run on, at most 8; the "
                  "plan is the same for any count)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "print one JSON object (the plan's JSON and the figures beside it)");
  cmd->add_option("--out", a->out, "also write the plan (remat::to_json) to this file");
  cmd->add_option(
      "--plot", a->plot,
      "also draw the planned chain's memory over time beside the plain chain's (PNG, SVG or PDF; "
      "its data, remat/planner/timeline.h's JSON, beside it as FILE.json and FILE.plain.json; needs "
      "python3 with matplotlib, or REMAT_PYTHON)");
  return {cmd, [a] { return run(*a); }};
}

}  // namespace remat::cli
