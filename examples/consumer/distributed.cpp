// Builds against an installed remat's data parallel (find_package(remat COMPONENTS distributed):
// remat::distributed, with the runtime it depends on) and trains one checkpointed step on a group of one
// process.
#include <remat/checkpoint.h>
#include <remat/distributed.h>

#include <torch/nn/modules/linear.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include <unistd.h>

int main() {
  // A group of one: this process is rank 0 and hosts the rendezvous on a port of its own.
  const std::string port = std::to_string(20000 + getpid() % 20000);
  setenv("RANK", "0", 1), setenv("WORLD_SIZE", "1", 1), setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", port.c_str(), 1);
  torch::manual_seed(0);
  torch::nn::Linear fc(8, 8);
  auto group = remat::distributed::init_process_group();
  remat::distributed::DataParallel dp(fc, group);
  remat::checkpoint([&](const torch::Tensor& t) { return fc(t); }, torch::randn({4, 8})).sum().backward();
  std::cout << "consumer (remat::distributed): a data-parallel step on " << group->size() << " process\n";
  return fc->weight.grad().defined() ? 0 : 1;
}
