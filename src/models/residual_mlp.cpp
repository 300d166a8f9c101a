#include "remat/models/residual_mlp.h"

#include <torch/nn/functional/activation.h>

#include "kept.h"

namespace remat::models {

ResidualBlockImpl::ResidualBlockImpl(int64_t width, int64_t hidden, double dropout)
    : fc1(register_module("fc1", torch::nn::Linear(width, hidden))),
      fc2(register_module("fc2", torch::nn::Linear(hidden, width))),
      drop(register_module("drop", torch::nn::Dropout(dropout))) {}

torch::Tensor ResidualBlockImpl::forward(const torch::Tensor& x) {
  return x + drop(detail::kept_linear(fc2, torch::gelu(detail::kept_linear(fc1, x))));
}

ResidualMlpImpl::ResidualMlpImpl(const ResidualMlpOptions& options) : options_(options) {
  TORCH_CHECK(options.depth() >= 1, "remat::models::ResidualMlp: depth must be >= 1, got ", options.depth());
  TORCH_CHECK(options.width() >= 1, "remat::models::ResidualMlp: width must be >= 1, got ", options.width());
  TORCH_CHECK(options.hidden() >= 0, "remat::models::ResidualMlp: hidden must be >= 0, got ",
              options.hidden());
  TORCH_CHECK(options.dropout() >= 0 && options.dropout() < 1,
              "remat::models::ResidualMlp: dropout must be in [0, 1), got ", options.dropout());
  const int64_t hidden = options.hidden() > 0 ? options.hidden() : 4 * options.width();
  blocks_ = register_module("blocks", torch::nn::Sequential());
  for (int64_t i = 0; i < options.depth(); ++i) {
    blocks_->push_back(ResidualBlock(options.width(), hidden, options.dropout()));
  }
}

torch::Tensor ResidualMlpImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == options_.width(),
              "remat::models::ResidualMlp: input must be [batch, ", options_.width(), "], got ", x.sizes());
  torch::Tensor h = x;
  for (const auto& block : *blocks_) {
    auto b = ResidualBlock(std::dynamic_pointer_cast<ResidualBlockImpl>(block.ptr()));
    h = checkpointing_enabled_ ? remat::checkpoint(b, h, checkpoint_options_) : b->forward(h);
  }
  return h;
}

}  // namespace remat::models
