// Builds against an installed remat and checks that a checkpointed step trains like a plain one.
#include <remat/remat.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <iostream>

int main() {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::GELU(), torch::nn::Linear(64, 32));
  auto x = torch::randn({16, 32});

  model->forward(x).pow(2).sum().backward();
  std::vector<torch::Tensor> plain;
  for (auto& p : model->parameters()) {
    plain.push_back(p.grad().clone());
    p.mutable_grad() = torch::Tensor();
  }

  const int64_t before = remat::memory::active_bytes();
  auto loss = remat::checkpoint(model, x).pow(2).sum();
  const int64_t kept = remat::memory::active_bytes() - before;
  loss.backward();

  size_t i = 0;
  for (auto& p : model->parameters()) {
    if (!torch::allclose(p.grad(), plain[i++], 1e-6, 1e-6)) {
      std::cerr << "consumer: gradient " << i - 1 << " differs\n";
      return 1;
    }
  }
  std::cout << "consumer: remat " << REMAT_VERSION_STRING << " ok; " << kept << " bytes kept for backward\n";
  return 0;
}
