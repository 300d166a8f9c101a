// remat demo: BERT with and without gradient_checkpointing_enable() (remat::bench with "none" and "all").

#include <iostream>

#include <remat/planner/units.h>

#include "common.h"

namespace remat::cli {
namespace {

int run(const ModelArgs& model, int64_t steps) {
  auto w = model.make();
  progress("demo: " + w->description() + ", " + std::to_string(steps) + " timed steps each");
  const auto rows =
      bench(*w, {"none", "all"}, MeasureOptions().warmup(1).steps(steps).device(torch::Device(model.device)),
            nullptr, progress);
  std::cout << "The gradient checkpointing experiment of a BERT encoder, scaled to this machine\n"
            << w->description() << "\n\n";
  Table t({"", "before backward MiB", "after backward MiB", "peak MiB", "activations MiB", "median step ms",
           "time vs none", "gradients"});
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
      << format_bytes(rows[0].stats.base_bytes) << "); activations are the peak above them.\n";
  return 0;
}

struct DemoArgs {
  ModelArgs model;
  int64_t steps = 3;
};

}  // namespace

Subcommand add_demo(CLI::App& app) {
  auto a = std::make_shared<DemoArgs>();
  auto* cmd =
      app.add_subcommand("demo", "BERT with and without gradient_checkpointing_enable(): memory and time");
  a->model.model = "bert";
  a->model.add(cmd);
  cmd->add_option("--steps", a->steps, "timed steps per setting")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  return {cmd, [a] { return run(a->model, a->steps); }};
}

}  // namespace remat::cli
