// Must not compile: a std::shared_ptr<torch::nn::Module> (what Sequential's operator[] returns) has no
// forward. The compile_fail_base_module_pointer test expects remat's one static_assert, naming what
// remat::checkpoint accepts, instead of a page of template notes.
#include <remat/checkpoint.h>
#include <torch/nn/modules/container/sequential.h>

torch::Tensor run(torch::nn::Sequential& seq, const torch::Tensor& x) {
  return remat::checkpoint(seq[0], x);
}
