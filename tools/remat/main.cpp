// The remat command: one subcommand per file (<name>_command.cpp), each parsing its arguments and calling the
// library (remat/planner/planner.h, remat/planner/strategy.h, remat/planner/report.h, remat/profile.h) or the
// benchmark harness (remat/bench.h). Errors are one line on stderr and a non-zero exit.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "common.h"

int main(int argc, char** argv) {
  // Debian's LibTorch runs one thread unless OMP_NUM_THREADS says otherwise: use every core by default.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  }
  CLI::App app{"remat: gradient checkpointing for LibTorch, measured"};
  app.require_subcommand(1);
  const std::vector<std::string> args(argv, argv + argc);
  const std::vector<remat::cli::Subcommand> subcommands{
      remat::cli::add_bench(app, args), remat::cli::add_launch(app),    remat::cli::add_profile(app),
      remat::cli::add_plan(app),        remat::cli::add_max_batch(app), remat::cli::add_sweep(app),
      remat::cli::add_demo(app)};
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (const auto& s : subcommands) {
      if (*s.app) return s.run();
    }
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
