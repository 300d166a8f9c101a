#pragma once
// Out of memory in a step remat::Planned planned (out_of_memory.cpp): remat's words added to the error, as
// the planner library words them (remat::describe_out_of_memory, the Python package's words too).

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace remat::detail {

// Adds remat's words to an out-of-memory error raised `where` ("in the forward pass").
using OutOfMemoryWords = std::function<void(c10::Error&, const std::string& where)>;

// Whether `e` is an out-of-memory error: c10::OutOfMemoryError (CUDA's caching allocator, remat's CPU test
// limits) or the CPU allocator's "can't allocate memory".
bool is_out_of_memory(const c10::Error& e);

// While alive, the plans run_plan starts on this thread carry `words` into their backward pass, whose
// out-of-memory errors get them (remat::Planned around its planned steps). Nests.
class OutOfMemoryScope {
 public:
  explicit OutOfMemoryScope(OutOfMemoryWords words);
  ~OutOfMemoryScope();
  OutOfMemoryScope(const OutOfMemoryScope&) = delete;
  OutOfMemoryScope& operator=(const OutOfMemoryScope&) = delete;

 private:
  OutOfMemoryWords before_;
};

// The words of the innermost OutOfMemoryScope on this thread (empty without one).
const OutOfMemoryWords& current_out_of_memory_words();

}  // namespace remat::detail
