// remat max-batch: the largest batch that fits a budget, per strategy (remat::max_batch).

#include <algorithm>
#include <iostream>

#include <remat/planner/units.h>

#include "common.h"

namespace remat::cli {
namespace {

struct MaxBatchArgs {
  ModelArgs model;
  std::string budget, strategies = "none,all,sqrt,optimal";
};

int run(const MaxBatchArgs& a) {
  if (a.model.model == "heavy") throw std::invalid_argument("--model heavy has no batch dimension");
  const int64_t budget = size_arg(a.budget, "--budget");
  const auto profile = a.model.profile_options(5);
  const auto rows =
      max_batch([&](int64_t b) { return a.model.make(b); }, budget, split(a.strategies), progress, &profile);
  std::cout << "largest batch whose activation peak (inputs included) fits " << format_bytes(budget)
            << "\n\n";
  Table t({"strategy", "batch", "predicted peak MiB", "measured peak MiB", "confirmed"});
  for (const auto& r : rows) {
    t.add({r.strategy, std::to_string(r.batch), mib(r.predicted_peak_bytes), mib(r.measured_peak_bytes),
           r.batch == 0 ? "nothing fits" : (r.confirmed ? "yes" : "no")});
  }
  t.print(std::cout);
  if (std::none_of(rows.begin(), rows.end(), [](const auto& r) { return r.batch > 0; })) {
    std::cerr << "remat: max-batch: not even a batch of 1 fits " << format_bytes(budget)
              << " with any strategy (" << a.strategies << ")\n";
    return 1;
  }
  return 0;
}

}  // namespace

Subcommand add_max_batch(CLI::App& app) {
  auto a = std::make_shared<MaxBatchArgs>();
  auto* cmd = app.add_subcommand("max-batch", "The largest batch that fits a budget, per strategy");
  a->model.add(cmd);
  cmd->add_option("--budget", a->budget, "activation memory budget (inputs included)")->required();
  cmd->add_option("--strategy", a->strategies,
                  std::string("comma-separated strategies (optimal and revolve plan within the budget): ") +
                      kStrategyWords)
      ->capture_default_str();
  return {cmd, [a] { return run(*a); }};
}

}  // namespace remat::cli
