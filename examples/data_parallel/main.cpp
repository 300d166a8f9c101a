// Data-parallel training of a checkpointed BERT encoder: every process trains on its own rows of the batch,
// remat::distributed::DataParallel averages the gradients during backward (overlapping the recomputation).
//
//   remat launch --nproc-per-node 2 -- ./example_data_parallel        # or:
//   torchrun --nproc-per-node 2 --no-python ./example_data_parallel
//   ./example_data_parallel                                            # starts 2 processes of itself
#include <remat/distributed.h>
#include <remat/models.h>
#include <torch/optim/adam.h>

#include <cstdlib>
#include <iostream>
#include <string>

namespace dist = remat::distributed;

int train() {
  auto group = dist::init_process_group();  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  const int rank = group->rank(), world = group->size();

  // The same model on every rank (DataParallel copies rank 0's weights anyway).
  torch::manual_seed(0);
  remat::models::BertModel bert(remat::models::BertConfig()
                                    .vocab_size(1000)
                                    .hidden_size(128)
                                    .num_hidden_layers(4)
                                    .num_attention_heads(4)
                                    .intermediate_size(512));
  bert->gradient_checkpointing_enable();  // every layer a checkpoint
  // forward() leaves BERT's pooler unused: allow parameters without a gradient.
  dist::DataParallel dp(bert, group, dist::DataParallelOptions().find_unused_parameters(true));
  torch::optim::Adam optimizer(bert->parameters(), torch::optim::AdamOptions(1e-3));

  const int64_t global_batch = 16, seq = 64, per_rank = global_batch / world;
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(100 + step);  // the whole batch, the same on every rank; each takes its rows
    const auto ids = torch::randint(0, 1000, {global_batch, seq}, torch::kLong);
    const auto mine = ids.narrow(0, rank * per_rank, per_rank);
    optimizer.zero_grad();
    auto loss = bert->forward(mine).pow(2).mean();
    loss.backward();  // the gradients are the group's average when this returns
    optimizer.step();
    if (rank == 0)
      std::cout << "step " << step << " loss (rank 0's rows) " << loss.item<double>() << std::endl;
  }

  // Every rank holds the same weights: their checksums agree.
  double sum = 0;
  for (const auto& p : bert->parameters())
    sum += p.sum().item<double>();
  std::vector<torch::Tensor> lo{torch::tensor({sum}, torch::kDouble)}, hi{lo[0].clone()};
  group->all_reduce(lo, dist::ReduceOp::kMin);
  group->all_reduce(hi, dist::ReduceOp::kMax);
  const bool same = lo[0].item<double>() == hi[0].item<double>();
  if (rank == 0) {
    const auto stats = dp.stats();
    std::cout << world << " processes, " << stats.steps << " synced steps, " << stats.buckets
              << " bucket(s) of " << stats.bytes_per_step / 1024 << " KiB in all; weights "
              << (same ? "identical" : "DIFFER") << " on every rank" << std::endl;
  }
  return same ? 0 : 1;
}

int main() {
  if (std::getenv("RANK") == nullptr) {  // no launcher: be one, with 2 processes of this program
    return dist::launch(dist::LaunchOptions().nproc_per_node(2).master_port(0), {"/proc/self/exe"});
  }
  try {
    return train();
  } catch (const c10::Error& e) {
    std::cerr << "rank " << std::getenv("RANK") << ": " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
