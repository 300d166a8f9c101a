// A CIFAR-style ResNet (resnet.h), trained a few steps on random data, checkpointed each way remat offers,
// with the step's peak memory and time beside the plain run's.
//
//   build/examples/example_resnet [batch] [steps]
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>

#include "resnet.h"

using resnet_example::Way;

int main(int argc, char** argv) {
  const int64_t batch = argc > 1 ? std::atoll(argv[1]) : 32;
  const int64_t steps = argc > 2 ? std::atoll(argv[2]) : 3;
  if (batch < 1 || steps < 1) {
    std::cerr << "example_resnet: batch and steps must be >= 1, got " << batch << " and " << steps << "\n";
    return 2;
  }
  remat::memory::track_cpu();
  torch::manual_seed(0);
  resnet_example::ResNet net;
  const auto x = torch::randn({batch, 3, 32, 32});
  const auto labels = torch::randint(10, {batch});
  torch::optim::Adam adam(net->parameters(), 1e-3);

  // The chain (layer1..layer3) profiled where it sits: the stem and the head with the loss around it.
  const auto stages = remat::stages_at(*net, {"layer1", "layer2", "layer3"});
  const remat::StepProfile profile = remat::profile_step(resnet_example::stem_stage(net), stages,
                                                         resnet_example::head_stage(net, labels), x);
  const int64_t floor = remat::min_feasible_budget(profile.chain);
  const int64_t top = remat::no_checkpoint(profile.chain).predicted.peak_bytes;
  const std::vector<int64_t> balanced = remat::balanced_starts(profile.chain, 3, remat::Balance::kMemory);

  struct Row {
    std::string name;
    Way way;
    std::vector<int64_t> starts;
    std::optional<remat::Plan> plan;
  };
  std::vector<Row> rows = {{"none", Way::kNone, {}, {}},
                           {"per block (module, kNonReentrant)", Way::kPerBlockModule, {}, {}},
                           {"per block (module, kReentrant)", Way::kPerBlockReentrant, {}, {}},
                           {"per block (AnyModule)", Way::kPerBlockAny, {}, {}},
                           {"per block (lambda, no modules)", Way::kPerBlockLambda, {}, {}},
                           {"checkpoint_sequential(3)", Way::kSequential, {}, {}},
                           {"segments balanced by memory (3)", Way::kSegments, balanced, {}}};
  for (double f : {0.0, 0.5}) {
    const int64_t budget = floor + static_cast<int64_t>(f * static_cast<double>(top - floor));
    rows.push_back({f == 0 ? "optimal at its floor" : "optimal halfway",
                    Way::kPlan,
                    {},
                    remat::optimal(profile.chain, budget)});
  }

  std::cout << "ResNet (3x3 BasicBlocks, 16/32/64 channels), batch " << batch << ", " << steps
            << " Adam steps each\n"
            << std::left << std::setw(36) << "way" << std::right << std::setw(12) << "peak MiB"
            << std::setw(12) << "predicted" << std::setw(10) << "ms" << std::setw(8) << "x none"
            << "  loss\n";
  double none_ms = 0;
  for (const Row& row : rows) {
    torch::Tensor loss;
    auto stats = remat::measure_step(
        *net,
        [&] {
          loss = torch::nn::functional::cross_entropy(
              resnet_example::forward(net, x, row.way, 3, row.starts, row.plan ? &*row.plan : nullptr),
              labels);
          return loss;
        },
        remat::MeasureOptions().warmup(1).steps(steps));
    adam.step();
    if (row.way == Way::kNone) none_ms = stats.median_ms;
    std::string predicted = "-";
    if (row.plan) {
      const auto sim = remat::simulate(profile.step, remat::step_plan(*row.plan));
      std::ostringstream os;
      os << std::fixed << std::setprecision(1)
         << static_cast<double>(sim.peak_bytes - static_cast<int64_t>(x.nbytes())) / (1 << 20);
      predicted = os.str();
    }
    std::cout << std::left << std::setw(36) << row.name << std::right << std::fixed << std::setprecision(1)
              << std::setw(12) << static_cast<double>(stats.peak_bytes) / (1 << 20) << std::setw(12)
              << predicted << std::setw(10) << stats.median_ms << std::setw(8) << std::setprecision(2)
              << stats.median_ms / none_ms << "  " << std::setprecision(4) << loss.item<double>() << "\n";
  }
  return 0;
}
