// Out of memory in a planned step (out_of_memory.h).

#include "planning/out_of_memory.h"

#include <utility>

namespace remat::detail {
namespace {
thread_local OutOfMemoryWords current;
}  // namespace

bool is_out_of_memory(const c10::Error& e) {
  return dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr ||
         e.msg().find("DefaultCPUAllocator: can't allocate memory") != std::string::npos;
}

OutOfMemoryScope::OutOfMemoryScope(OutOfMemoryWords words)
    : before_(std::exchange(current, std::move(words))) {}

OutOfMemoryScope::~OutOfMemoryScope() {
  current = std::move(before_);
}

const OutOfMemoryWords& current_out_of_memory_words() {
  return current;
}

}  // namespace remat::detail
