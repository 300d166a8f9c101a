// The remat command. It parses arguments, calls the library and prints; the logic lives in the library.

#include <remat/measure.h>
#include <remat/memory.h>
#include <remat/models/residual_mlp.h>
#include <remat/units.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#include "table.h"

namespace {

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

int run_demo(int64_t layers, int64_t width, int64_t batch, int64_t steps) {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  remat::models::ResidualMlp model(remat::models::ResidualMlpOptions().depth(layers).width(width));
  auto x = torch::randn({batch, width});
  auto loss_fn = [&] { return model->forward(x).pow(2).mean(); };
  std::cerr << "remat demo: " << layers << "-layer residual MLP, width " << width << ", batch " << batch
            << ", " << steps << " timed steps each\n";

  auto options = remat::MeasureOptions().warmup(2).steps(steps);
  model->gradient_checkpointing_disable();
  const auto plain = remat::measure_step(*model, loss_fn, options);
  model->gradient_checkpointing_enable();
  const auto ckpt = remat::measure_step(*model, loss_fn, options);

  remat::cli::Table table({"strategy", "peak activations (MiB)", "kept after forward (MiB)",
                           "median step (ms)", "peak vs none", "time vs none"});
  auto row = [&](const std::string& name, const remat::StepStats& s) {
    table.add({name, remat::format_mib(s.peak_bytes), remat::format_mib(s.after_forward_bytes),
               fixed(s.median_ms, 1), fixed(double(s.peak_bytes) / plain.peak_bytes, 2),
               fixed(s.median_ms / plain.median_ms, 2)});
  };
  row("none", plain);
  row("per layer", ckpt);
  table.print(std::cout);
  std::cout << "\nper-layer checkpointing cuts peak activation memory by "
            << fixed(100.0 * (1.0 - double(ckpt.peak_bytes) / plain.peak_bytes), 1) << "% for "
            << fixed(100.0 * (ckpt.median_ms / plain.median_ms - 1.0), 1) << "% more step time\n"
            << "(peak over parameters + gradients + inputs: " << remat::format_bytes(plain.base_bytes)
            << ", measured exactly by remat's CPU meter)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"remat: gradient checkpointing for LibTorch, measured"};
  app.require_subcommand(1);

  auto* demo = app.add_subcommand("demo",
                                  "Train a few steps of a 12-layer model without and with per-layer "
                                  "checkpointing; print peak activation memory and step time");
  int64_t layers = 12, width = 256, batch = 256, steps = 5;
  demo->add_option("--layers", layers, "number of residual blocks")->check(CLI::Range(1, 100000));
  demo->add_option("--width", width, "features per block")->check(CLI::Range(1, 1 << 20));
  demo->add_option("--batch", batch, "rows per batch")->check(CLI::Range(1, 1 << 24));
  demo->add_option("--steps", steps, "timed steps per strategy")->check(CLI::Range(1, 10000));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*demo) return run_demo(layers, width, batch, steps);
  } catch (const c10::Error& e) {
    std::cerr << "remat: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "remat: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
