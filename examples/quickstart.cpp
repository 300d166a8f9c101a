// Checkpoint a model's blocks and see what it saves, exactly.
#include <remat/models.h>
#include <remat/remat.h>

#include <iostream>

int main() {
  remat::memory::track_cpu();  // count every tensor byte from here on
  torch::manual_seed(0);
  remat::models::ResidualMlp model(remat::models::ResidualMlpOptions().depth(12).width(256));
  auto x = torch::randn({128, 256});

  for (bool checkpointing : {false, true}) {
    checkpointing ? model->gradient_checkpointing_enable() : model->gradient_checkpointing_disable();
    remat::memory::PeakScope scope;  // the peak above what is alive now (weights, inputs)
    auto loss = model->forward(x).pow(2).mean();
    const int64_t kept = scope.active_over_base();
    loss.backward();
    std::cout << (checkpointing ? "checkpointed: " : "plain:        ") << remat::format_bytes(kept)
              << " kept for backward, peak " << remat::format_bytes(scope.peak_over_base()) << "\n";
  }

  // A region of your own: a lambda, several inputs, dropout inside (same mask in the recompute).
  torch::nn::Linear fc(256, 256);
  auto a = torch::randn({8, 256}, torch::requires_grad()), b = torch::randn({8, 256});
  auto outs = remat::checkpoint(
      [&](const std::vector<torch::Tensor>& in) {
        return std::vector<torch::Tensor>{torch::dropout(torch::gelu(fc(in[0] + in[1])), 0.1, true)};
      },
      {a, b});
  outs[0].sum().backward();
  std::cout << "fc got a gradient: " << std::boolalpha << fc->weight.grad().defined() << "\n";
  return fc->weight.grad().defined() ? 0 : 1;
}
