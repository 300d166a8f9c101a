// Must not compile: what a ModuleList's operator[] hands out is a std::shared_ptr<torch::nn::Module>, which
// has no forward. The compile_fail_module_list_element test expects remat's static_assert as the first error,
// before the error the assignment of its result would otherwise add, and its text to name the element form.
#include <remat/checkpoint.h>
#include <torch/nn/modules/container/modulelist.h>

torch::Tensor run(torch::nn::ModuleList& list, torch::Tensor x) {
  for (size_t i = 0; i < list->size(); ++i)
    x = remat::checkpoint((*list)[i], x);
  return x;
}
