// A CIFAR-style ResNet (resnet.h), trained a few steps on random data, checkpointed each way remat offers,
// with the step's peak memory and time beside the plain run's.
//
//   build/examples/example_resnet [batch] [steps] [rounds]
#include <algorithm>
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
  const int64_t rounds = argc > 3 ? std::atoll(argv[3]) : 1;
  if (batch < 1 || steps < 1 || rounds < 1) {
    std::cerr << "example_resnet: batch, steps and rounds must be >= 1, got " << batch << ", " << steps
              << " and " << rounds << "\n";
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
    std::optional<remat::Plan> plan;     // what kPlan executes
    std::optional<remat::Plan> predict;  // the plan whose simulate() figure is shown (the same schedule)
  };
  const remat::Chain& chain = profile.chain;
  std::vector<Row> rows = {{"none", Way::kNone, {}, {}, remat::no_checkpoint(chain)},
                           {"per block (module, kNonReentrant)", Way::kPerBlockModule, {}, {}},
                           {"per block (module, kReentrant)", Way::kPerBlockReentrant, {}, {}},
                           {"per block (AnyModule)", Way::kPerBlockAny, {}, {}},
                           {"per block (lambda, no modules)", Way::kPerBlockLambda, {}, {}},
                           {"checkpoint_sequential(3)", Way::kSequential, {}, {}, remat::uniform(chain, 3)},
                           {"segments balanced by memory (3)",
                            Way::kSegments,
                            balanced,
                            {},
                            remat::balanced(chain, 3, remat::Balance::kMemory)}};
  for (double f : {0.0, 0.25, 0.5}) {
    const int64_t budget = floor + static_cast<int64_t>(f * static_cast<double>(top - floor));
    std::ostringstream name;
    name << "optimal, floor + " << static_cast<int>(f * 100) << "% of the range";
    const remat::Plan plan = remat::optimal(chain, budget);
    rows.push_back({name.str(), Way::kPlan, {}, plan, plan});
  }

  // Rounds interleave the ways, so that a slow moment of the machine hits every way alike; the time ratio
  // is taken against "none" of the same round, and medians over rounds are reported.
  std::vector<std::vector<double>> ms(rows.size()), ratio(rows.size());
  std::vector<int64_t> peak(rows.size(), 0);
  for (int64_t round = 0; round < rounds; ++round) {
    for (size_t r = 0; r < rows.size(); ++r) {
      const Row& row = rows[r];
      auto stats = remat::measure_step(
          *net,
          [&] {
            return torch::nn::functional::cross_entropy(
                resnet_example::forward(net, x, row.way, 3, row.starts, row.plan ? &*row.plan : nullptr),
                labels);
          },
          remat::MeasureOptions().warmup(1).steps(steps));
      adam.step();
      ms[r].push_back(stats.median_ms);
      ratio[r].push_back(stats.median_ms / ms[0].back());
      peak[r] = std::max(peak[r], stats.peak_bytes);
    }
  }

  std::cout << "ResNet (3x3 BasicBlocks, 16/32/64 channels), batch " << batch << "; " << rounds
            << " rounds of " << steps << " steps per way, medians\n"
            << std::left << std::setw(36) << "way" << std::right << std::setw(12) << "peak MiB"
            << std::setw(12) << "predicted" << std::setw(10) << "ms" << std::setw(8) << "x none"
            << "\n";
  for (size_t r = 0; r < rows.size(); ++r) {
    std::string predicted = "-";
    if (rows[r].predict) {
      const auto sim = remat::simulate(profile.step, remat::step_plan(*rows[r].predict));
      std::ostringstream os;
      os << std::fixed << std::setprecision(1)
         << static_cast<double>(sim.peak_bytes - static_cast<int64_t>(x.nbytes())) / (1 << 20);
      predicted = os.str();
    }
    std::cout << std::left << std::setw(36) << rows[r].name << std::right << std::fixed
              << std::setprecision(1) << std::setw(12) << static_cast<double>(peak[r]) / (1 << 20)
              << std::setw(12) << predicted << std::setw(10) << remat::median(ms[r]) << std::setw(8)
              << std::setprecision(2) << remat::median(ratio[r]) << "\n";
  }
  return 0;
}
