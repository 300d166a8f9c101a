#pragma once
// What differs between the LibTorch versions remat supports (Debian's 1.13, the 2.x of PyPI's wheel), in one
// place, so that the rest of the code reads as if there were one LibTorch. The part that needs c10 alone is
// in compat_c10.h, included here: the meter library (libremat_meter, loaded into Python processes) links c10
// only and includes that part alone (ATen's headers, which the rest needs, require C++20 in PyPI's 2.15).

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "detail/compat_c10.h"

namespace remat::detail::compat {

#if TORCH_VERSION_MAJOR >= 2 && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 4)
// 2.4 and later: one entry point per device type.
inline bool autocast_enabled(c10::DeviceType device) {
  return at::autocast::is_autocast_enabled(device);
}
inline void set_autocast_enabled(c10::DeviceType device, bool on) {
  at::autocast::set_autocast_enabled(device, on);
}
inline c10::ScalarType autocast_dtype(c10::DeviceType device) {
  return at::autocast::get_autocast_dtype(device);
}
inline void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
  at::autocast::set_autocast_dtype(device, dtype);
}
#else
// 1.13: separate CPU and GPU functions.
inline bool autocast_enabled(c10::DeviceType device) {
  return device == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
inline void set_autocast_enabled(c10::DeviceType device, bool on) {
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(on);
  } else {
    at::autocast::set_enabled(on);
  }
}
inline c10::ScalarType autocast_dtype(c10::DeviceType device) {
  return device == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                        : at::autocast::get_autocast_gpu_dtype();
}
inline void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
}
#endif

/// Whether the operator carries LibTorch 2.x's `pointwise` tag; false in 1.13, which has no operator tags.
inline bool has_pointwise_tag(const c10::OperatorHandle& op) {
#if TORCH_VERSION_MAJOR >= 2
  return op.hasTag(at::Tag::pointwise);
#else
  (void)op;
  return false;
#endif
}

/// A c10::DebugInfoKind no other code uses, for remat's thread state. 1.13's kinds are an enum of a few
/// values (any other value of its uint8_t is a kind of its own; remat takes 0xA7), later ones are
/// identified by the address of a string_view. Chosen from the type rather than a version number.
template <typename Kind = c10::DebugInfoKind>
Kind private_debug_info_kind() {
  if constexpr (std::is_enum_v<Kind>) {
    return static_cast<Kind>(0xA7);
  } else {
    static constexpr std::string_view kName = "remat::detail::ThreadState";
    return Kind(&kName);
  }
}

/// The shape recorded in an autograd node's input metadata (the shape of the forward output whose gradient
/// the input receives). 2.x exposes it; in 1.13 it is private, and a zero tensor of that shape is made
/// (used on error paths only). Chosen by whether the accessor is reachable rather than a version number.
template <typename Meta>
auto input_shape(const Meta& meta, int) -> decltype(meta.shape_as_dim_vector(), std::vector<int64_t>()) {
  std::vector<int64_t> shape;
  for (const auto& s : meta.shape_as_dim_vector())
    shape.push_back(s.expect_int());
  return shape;
}
template <typename Meta>
std::vector<int64_t> input_shape(const Meta& meta, long) {
  return meta.zeros_like().sizes().vec();
}

/// Collects the warnings (TORCH_WARN) raised on this thread while alive, instead of printing them.
class WarningCapture : public c10::WarningHandler {
 public:
#if TORCH_VERSION_MAJOR >= 2
  WarningCapture() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~WarningCapture() override {
    c10::WarningUtils::set_warning_handler(previous_);
  }
  void process(const c10::Warning& warning) override {
    messages.push_back(warning.msg());
  }
#else
  WarningCapture() : previous_(c10::Warning::get_warning_handler()) {
    c10::Warning::set_warning_handler(this);
  }
  ~WarningCapture() override {
    c10::Warning::set_warning_handler(previous_);
  }
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    messages.push_back(msg);
  }
#endif
  WarningCapture(const WarningCapture&) = delete;
  WarningCapture& operator=(const WarningCapture&) = delete;

  std::vector<std::string> messages;

 private:
  c10::WarningHandler* previous_;
};

/// An autograd node of type N (derived from torch::autograd::Node), owned as the engine owns nodes: by
/// std::shared_ptr with LibTorch's non-recursive deleter in 1.13, by c10::intrusive_ptr in 2.x. Chosen from
/// the type of Edge::function rather than a version number.
template <typename Ptr>
struct NodeOwner {
  template <typename N, typename... Args>
  static c10::intrusive_ptr<N> make(Args&&... args) {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  }
};
template <>
struct NodeOwner<std::shared_ptr<torch::autograd::Node>> {
  template <typename N, typename... Args>
  static std::shared_ptr<N> make(Args&&... args) {
    // deleteNode is found by argument-dependent lookup when make is instantiated (only with 1.13's headers).
    return std::shared_ptr<N>(new N(std::forward<Args>(args)...), [](N* node) { deleteNode(node); });
  }
};
template <typename N, typename... Args>
auto make_node(Args&&... args) {
  using Ptr = std::decay_t<decltype(std::declval<torch::autograd::Edge>().function)>;
  return NodeOwner<Ptr>::template make<N>(std::forward<Args>(args)...);
}

/// A weak reference to an autograd node, of the pointer type that owns nodes in this version
/// (std::weak_ptr in 1.13, c10::weak_intrusive_ptr in 2.x); empty by default.
template <typename Ptr>
struct WeakOf;
template <>
struct WeakOf<std::shared_ptr<torch::autograd::Node>> {
  using type = std::weak_ptr<torch::autograd::Node>;
};
template <typename N>
struct WeakOf<c10::intrusive_ptr<N>> {
  using type = c10::weak_intrusive_ptr<N>;
};
class WeakNode {
 public:
  using Ptr = std::decay_t<decltype(std::declval<torch::autograd::Edge>().function)>;
  WeakNode() = default;
  explicit WeakNode(const Ptr& node) : weak_(node) {}
  /// Whether the node is still alive.
  bool alive() const { return weak_ && !weak_->expired(); }
  /// The node, or null when it is gone (or none was given).
  Ptr lock() const { return weak_ ? weak_->lock() : Ptr(); }

 private:
  std::optional<typename WeakOf<Ptr>::type> weak_;
};

}  // namespace remat::detail::compat

namespace remat::detail::compat {

/// While alive, runs `fn` each time a gradient of the leaf `param` has been accumulated into its .grad, the
/// gradient handed over let go of by then where the accumulation added it into a .grad there already
/// (kExact). LibTorch 2.1 on: the tensor's post-accumulate-grad hook, whose one slot (Python's hooks' too)
/// is taken over and given back, any hook there run after fn. 1.13 has no such hook: fn runs as the gradient
/// is handed over, before its accumulation, while it is still alive (kExact false).
class AfterAccumulated {
 public:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  static constexpr bool kExact = true;
  AfterAccumulated(const torch::Tensor& param, std::function<void()> fn) : param_(param) {
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(param_);
    slot = std::make_unique<Hook>(std::move(fn), std::move(slot));
  }
  ~AfterAccumulated() {
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(param_);
    if (auto* mine = dynamic_cast<Hook*>(slot.get())) slot = std::move(mine->before);
  }
#else
  static constexpr bool kExact = false;
  AfterAccumulated(const torch::Tensor& param, std::function<void()> fn)
      : param_(param), hook_(param_.register_hook([f = std::move(fn)](const torch::Tensor&) { f(); })) {}
  ~AfterAccumulated() {
    param_.remove_hook(hook_);
  }
#endif
  AfterAccumulated(const AfterAccumulated&) = delete;
  AfterAccumulated& operator=(const AfterAccumulated&) = delete;

 private:
  torch::Tensor param_;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  struct Hook : torch::autograd::PostAccumulateGradHook {
    Hook(std::function<void()> f, std::unique_ptr<torch::autograd::PostAccumulateGradHook> b)
        : fn(std::move(f)), before(std::move(b)) {}
    void operator()(const torch::autograd::Variable& t) override {
      fn();
      if (before) (*before)(t);
    }
    std::function<void()> fn;
    std::unique_ptr<torch::autograd::PostAccumulateGradHook> before;
  };
#else
  unsigned hook_;
#endif
};

}  // namespace remat::detail::compat

namespace c10d {
class Backend;
class ProcessGroup;
}  // namespace c10d

namespace remat::detail::compat {

/// The c10d class ProcessGroupGloo and ProcessGroupNCCL derive from, whose collectives remat calls: Backend
/// from 2.0 on, ProcessGroup in 1.13 (declared here; its header comes with the backend's).
#if TORCH_VERSION_MAJOR >= 2
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

}  // namespace remat::detail::compat
