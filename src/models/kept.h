#pragma once
// The matrix multiplications and convolutions of remat's models, marked for selective checkpointing: inside a
// checkpoint with CheckpointOptions().keep({remat::kMatmul}) (or kConv) their outputs are kept and not
// recomputed; elsewhere they are the plain calls.

#include <remat/checkpoint.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

namespace remat::models::detail {

/// lin(x), tagged remat::kMatmul.
inline torch::Tensor kept_linear(torch::nn::Linear& lin, const torch::Tensor& x) {
  return remat::keep(
      kMatmul, [&lin](const torch::Tensor& t) { return lin(t); }, x);
}

/// conv(x), tagged remat::kConv.
inline torch::Tensor kept_conv(torch::nn::Conv2d& conv, const torch::Tensor& x) {
  return remat::keep(
      kConv, [&conv](const torch::Tensor& t) { return conv(t); }, x);
}

/// torch::matmul(a, b), tagged remat::kMatmul. Pass contiguous operands (or transposes of contiguous ones):
/// matmul then saves views of them, which the recompute rebuilds, rather than copies, which would be kept.
inline torch::Tensor kept_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  return remat::keep(kMatmul,
                     [](const std::vector<torch::Tensor>& v) {
                       return std::vector<torch::Tensor>{torch::matmul(v[0], v[1])};
                     },
                     {a, b})[0];
}

}  // namespace remat::models::detail
