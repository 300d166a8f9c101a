#pragma once
// The version differences that need c10 alone (part of compat.h, which includes this file; the meter library
// includes it on its own).

#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <cstddef>

namespace remat::detail::compat {

/// c10::Allocator as remat's CPU meter derives from it: LibTorch 2.3 made allocate() non-const and added the
/// pure virtual copy_data(). Derived allocators implement allocate_bytes().
class AllocatorBase : public c10::Allocator {
 public:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  c10::DataPtr allocate(size_t n) override {
    return allocate_bytes(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t n) const override {
    return allocate_bytes(n);
  }
#endif

 protected:
  virtual c10::DataPtr allocate_bytes(size_t n) const = 0;
};

}  // namespace remat::detail::compat
