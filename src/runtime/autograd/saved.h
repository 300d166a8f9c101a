#pragma once
// What remat's saved-tensor hooks record of a tensor autograd saves, so that they can check, when they hand
// it back, what autograd checks of the tensors it keeps itself: that it was not written in place since.
// Autograd does not check tensors that hooks hand back (saved_variable.cpp checks versions only without
// hooks), so remat's hooks that hand back a tensor they did not copy (an Offload's tensors left on the
// device, a recompute's collected tensors) check it here and raise autograd's own error.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "detail/compat.h"

#include <cstdint>
#include <memory>
#include <typeinfo>
#include <vector>

namespace remat::detail {

/// A tensor's version counter (0 for an inference tensor, which has none).
int64_t version_of(const at::Tensor& t);

/// A saved tensor as autograd saved it: its view (dtype, sizes, strides), its version, and what autograd's
/// error names (its grad_fn, held weakly, with its type for when it is gone, as a recompute's graph is, and
/// its output number).
struct SavedAs {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  ///< strided tensors only (empty for others)
  int64_t version = 0;
  compat::WeakNode grad_fn;
  const std::type_info* grad_fn_type = nullptr;
  uint32_t output_nr = 0;

  static SavedAs of(const at::Tensor& t);

  /// Throws autograd's error (c10::Error: "one of the variables needed for gradient computation has been
  /// modified by an inplace operation: [type sizes], which is output n of Node, is at version now; expected
  /// version v instead", then `why`, what handed it back) when `now` is not the version saved.
  void check_version(int64_t now, c10::Device device, const char* why) const;
  /// check_version with t's version and device.
  void check_unmodified(const at::Tensor& t, const char* why) const {
    check_version(version_of(t), t.device(), why);
  }
};

}  // namespace remat::detail
