#pragma once
// A progress bar on stderr for long work (profiling, planning sweeps, benchmarks): drawn in place while
// stderr is a terminal and erased when the work ends; nothing is drawn when stderr is a file or a pipe (as
// tqdm and cargo do), so logs keep only the command's "remat: ..." lines. REMAT_PROGRESS=0 turns it off on a
// terminal, REMAT_PROGRESS=1 on anywhere.

#include <remat/profile.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace remat::cli {

/// Whether bars are drawn: stderr is a terminal whose TERM is not "dumb", unless REMAT_PROGRESS says 0 or 1.
bool progress_bars_enabled();

/// One bar's line: "<what> [#######.......]  45% 54/120 <detail>, 12 s, about 15 s left" (width: the bar's
/// characters). The estimate assumes the remaining units take as long as the finished ones on average.
std::string progress_line(const std::string& what, int64_t done, int64_t total, const std::string& detail,
                          double elapsed_s, int width = 24);

class ProgressBar {
 public:
  explicit ProgressBar(std::string what);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  /// Redraws the bar (at most ten times a second, and at the end).
  void update(int64_t done, int64_t total, const std::string& detail);
  /// Erases the bar's line (drawn again at the next update).
  void clear();

 private:
  std::string what_;
  bool enabled_;  // progress_bars_enabled() when the bar was made
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

/// Minutes and seconds as tqdm writes a time on its bars: "00:03", "12:45", "1:02:03".
std::string clock_time(double seconds);

/// For the life of one long call made on this thread (a plan: BERT-large's profile with offloading and groups
/// plans for seconds), where bars are drawn (progress_bars_enabled()): once the call has run `after`, shows
/// "<what>: 00:03" (the time it has run) on stderr, redrawn every quarter second by a thread of its own, and
/// erases it when destroyed. Where bars are not drawn, nothing and no thread. The Python package's
/// remat.progress.planning_wait, on the command.
class PlanningWait {
 public:
  explicit PlanningWait(std::string what, std::chrono::milliseconds after = std::chrono::milliseconds(500));
  ~PlanningWait();
  PlanningWait(const PlanningWait&) = delete;
  PlanningWait& operator=(const PlanningWait&) = delete;

 private:
  void draw(std::chrono::milliseconds after);
  std::string what_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  std::thread thread_;
};

/// Erases whichever bar is drawn, before a line is printed on stderr.
void clear_progress_bar();

/// A ProfileOptions::progress that draws a bar while profiling and, when it ends, prints on stderr where the
/// time went: "remat: profiled N stages in T s (forward and backward a s, checkpointed b s, ...)".
std::function<void(const ProfileProgress&)> profile_progress(const std::string& what);

}  // namespace remat::cli
