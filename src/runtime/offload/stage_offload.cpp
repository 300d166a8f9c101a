// The options of the Offload an offloaded stage runs under (offload/stage_offload.h).

#include "offload/stage_offload.h"

#include <utility>

namespace remat::detail {

OffloadOptions stage_offload_options(OffloadOptions base, const StageFn& stage,
                                     std::vector<at::Tensor> also) {
  std::vector<at::Tensor> keep = base.keep_on_device();
  if (stage.module) {
    for (const auto& p : stage.module->parameters())
      keep.push_back(p);
    for (const auto& b : stage.module->buffers())
      keep.push_back(b);
  }
  for (auto& t : also)
    keep.push_back(std::move(t));
  return base.keep_on_device(std::move(keep));
}

}  // namespace remat::detail
