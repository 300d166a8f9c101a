// Must not compile: a module whose forward takes one tensor, called with an int. The
// compile_fail_wrong_arguments test expects remat's static_assert.
#include <remat/checkpoint.h>
#include <torch/nn/modules/linear.h>

torch::Tensor run(torch::nn::Linear& fc, const torch::Tensor& x) {
  return remat::checkpoint(fc, x, 3);
}
