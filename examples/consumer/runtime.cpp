// Builds against an installed remat's runtime alone (remat::runtime: checkpointing, the profiler, the plan
// executor, and the planner it depends on; no models) and checks that a planned step trains like a plain one.
#include <remat/memory.h>
#include <remat/planner/planner.h>
#include <remat/profile.h>
#include <remat/sequential.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <iostream>

int main() {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(32, 64), torch::nn::GELU(), torch::nn::Linear(64, 64),
                            torch::nn::GELU(), torch::nn::Linear(64, 32));
  auto x = torch::randn({16, 32});

  seq->forward(x).pow(2).sum().backward();
  std::vector<torch::Tensor> plain;
  for (auto& p : seq->parameters()) {
    plain.push_back(p.grad().clone());
    p.mutable_grad() = torch::Tensor();
  }

  const remat::Chain chain = remat::profile_chain(seq, x);
  const remat::Plan plan = remat::optimal(chain, remat::min_feasible_budget(chain));
  remat::CheckpointedSequential model(seq, plan);
  model->forward(x).pow(2).sum().backward();

  size_t i = 0;
  for (auto& p : seq->parameters()) {
    if (!torch::allclose(p.grad(), plain[i++], 1e-6, 1e-6)) {
      std::cerr << "consumer_runtime: gradient " << i - 1 << " differs\n";
      return 1;
    }
  }
  std::cout << "consumer_runtime: ok; plan " << plan.to_string() << "\n";
  return 0;
}
