#pragma once
// Whether remat's profiler is running (profile.cpp): the gradients its backward passes accumulate are put
// back afterwards, so remat::distributed neither counts nor reduces them.

namespace remat::detail {

/// Marks the profiler's runs for their lifetime (any thread: a process-wide count).
class ProfilerRunning {
 public:
  ProfilerRunning();
  ~ProfilerRunning();
  ProfilerRunning(const ProfilerRunning&) = delete;
  ProfilerRunning& operator=(const ProfilerRunning&) = delete;
};

/// Whether a ProfilerRunning is alive.
bool profiler_running();

}  // namespace remat::detail
