// The version check of remat's saved-tensor hooks (autograd/saved.h).

#include "autograd/saved.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/csrc/autograd/function.h>

#include <sstream>
#include <string>

namespace remat::detail {

int64_t version_of(const at::Tensor& t) {
  return t.is_inference() ? 0 : static_cast<int64_t>(t._version());
}

SavedAs SavedAs::of(const at::Tensor& t) {
  SavedAs s;
  s.dtype = t.scalar_type();
  s.sizes = t.sizes().vec();
  if (t.defined() && t.layout() == at::kStrided) s.strides = t.strides().vec();
  s.version = version_of(t);
  const auto& fn = t.grad_fn();
  if (fn) {
    s.grad_fn = compat::WeakNode(fn);
    s.grad_fn_type = &typeid(*fn);
    s.output_nr = t.output_nr();
  }
  return s;
}

void SavedAs::check_version(int64_t now, c10::Device device, const char* why) const {
  if (now == version) return;
  std::ostringstream msg;
  // Autograd's own words (saved_variable.cpp), so that the error reads as the plain run's does.
  msg << "one of the variables needed for gradient computation has been modified by an inplace operation: ["
      << at::empty({0}, at::TensorOptions().dtype(dtype).device(device)).toString() << " "
      << c10::IntArrayRef(sizes) << "]";
  if (grad_fn_type != nullptr) {
    std::string name;
    if (auto fn = grad_fn.lock()) {
      name = fn->name();
    } else {  // the graph is gone: the generated node's class name, as name() gives it
      name = c10::demangle(grad_fn_type->name());
      const std::string generated = "torch::autograd::generated::";
      if (name.rfind(generated, 0) == 0) name = name.substr(generated.size());
    }
    msg << ", which is output " << output_nr << " of " << name << ",";
  }
  msg << " is at version " << now << "; expected version " << version << " instead. (" << why
      << " hands saved tensors back through saved-tensor hooks, where autograd does not check their "
         "versions; "
         "remat does.) Clone the tensor before the in-place operation, or make that operation out of place";
  TORCH_CHECK(false, msg.str());
}

}  // namespace remat::detail
