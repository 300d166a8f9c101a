#pragma once
// CPU autocast in the tests, on both LibTorch builds (their autocast calls differ: detail/compat.h).

#include <ATen/autocast_mode.h>

#include "detail/compat.h"

namespace remat::testing {

/// CPU autocast with bfloat16 for the lifetime of the scope, as torch.autocast("cpu") enters it.
class CpuAutocast {
 public:
  CpuAutocast() : was_(detail::compat::autocast_enabled(c10::DeviceType::CPU)) {
    detail::compat::set_autocast_enabled(c10::DeviceType::CPU, true);
    detail::compat::set_autocast_dtype(c10::DeviceType::CPU, c10::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    detail::compat::set_autocast_enabled(c10::DeviceType::CPU, was_);
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool was_;
};

}  // namespace remat::testing
