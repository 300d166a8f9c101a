// Profile -> plan -> execute: the fastest schedule that fits a memory budget.
#include <remat/models.h>
#include <remat/remat.h>

#include <iostream>

int main() {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  remat::models::ResidualMlp mlp(remat::models::ResidualMlpOptions().depth(16).width(256));
  auto& blocks = mlp->blocks();
  auto x = torch::randn({64, 256});

  remat::Chain chain = remat::profile_chain(blocks, x);  // 1. measure every stage
  const int64_t none = remat::no_checkpoint(chain).predicted.peak_bytes;
  remat::Plan plan = remat::optimal(chain, none / 3);  // 2. plan for a third of it
  remat::CheckpointedSequential model(blocks, plan);   // 3. execute
  auto step = remat::measure_step(*model, [&] { return model->forward(x).pow(2).mean(); });

  std::cout << "schedule: " << plan.to_string() << "\n"
            << "predicted peak " << remat::format_bytes(plan.predicted.peak_bytes - int64_t(x.nbytes()))
            << ", measured " << remat::format_bytes(step.peak_bytes) << " (without checkpointing "
            << remat::format_bytes(none - int64_t(x.nbytes())) << ")\n";
  model->replan(chain, none / 2);  // a new budget is one call
  std::cout << "with half the memory instead: " << model->plan().to_string() << "\n";
  return model->forward_calls() == plan.predicted.forward_calls ? 0 : 1;
}
