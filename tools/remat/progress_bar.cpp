// The remat command's progress bars (progress_bar.h).

#include "progress_bar.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"

namespace remat::cli {
namespace {
ProgressBar* drawn_bar = nullptr;

std::string seconds(double s) {
  if (s < 100) return fixed(s, s < 10 ? 1 : 0) + " s";
  const auto m = static_cast<int64_t>(s / 60);
  return std::to_string(m) + " min " + std::to_string(static_cast<int64_t>(s) - 60 * m) + " s";
}
}  // namespace

bool progress_bars_enabled() {
  if (const char* forced = std::getenv("REMAT_PROGRESS"); forced && *forced)
    return std::strcmp(forced, "0") != 0;
  const char* term = std::getenv("TERM");
  return isatty(STDERR_FILENO) == 1 && !(term && std::strcmp(term, "dumb") == 0);
}

std::string progress_line(const std::string& what, int64_t done, int64_t total, const std::string& detail,
                          double elapsed_s, int width) {
  const double f = total > 0 ? std::min(1.0, std::max(0.0, double(done) / double(total))) : 0.0;
  const int full = static_cast<int>(std::floor(f * width));
  std::string line = what + " [" + std::string(full, '#') + std::string(width - full, '.') + "] ";
  const int percent = static_cast<int>(std::floor(100 * f));
  line += (percent < 10    ? "  "
           : percent < 100 ? " "
                           : "") +
          std::to_string(percent) + "% " + std::to_string(done) + "/" + std::to_string(total);
  if (!detail.empty()) line += " " + detail;
  line += ", " + seconds(elapsed_s);
  if (done > 0 && done < total)
    line += ", about " + seconds(elapsed_s * double(total - done) / double(done)) + " left";
  return line;
}

ProgressBar::ProgressBar(std::string what)
    : what_(std::move(what)),
      enabled_(progress_bars_enabled()),
      start_(std::chrono::steady_clock::now()),
      last_(start_ - std::chrono::seconds(1)) {}

ProgressBar::~ProgressBar() {
  clear();
}

void ProgressBar::update(int64_t done, int64_t total, const std::string& detail) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (done < total && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  if (drawn_bar && drawn_bar != this) drawn_bar->clear();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  std::cerr << "\r\033[K" << progress_line(what_, done, total, detail, elapsed) << std::flush;
  drawn_ = true;
  drawn_bar = this;
}

void ProgressBar::clear() {
  if (!drawn_) return;
  std::cerr << "\r\033[K" << std::flush;
  drawn_ = false;
  if (drawn_bar == this) drawn_bar = nullptr;
}

std::string clock_time(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds));
  const int64_t h = s / 3600, m = s / 60 % 60, sec = s % 60;
  char text[32];
  if (h > 0)
    std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", static_cast<long long>(h),
                  static_cast<long long>(m), static_cast<long long>(sec));
  else
    std::snprintf(text, sizeof text, "%02lld:%02lld", static_cast<long long>(m), static_cast<long long>(sec));
  return text;
}

PlanningWait::PlanningWait(std::string what, std::chrono::milliseconds after) : what_(std::move(what)) {
  if (progress_bars_enabled()) thread_ = std::thread([this, after] { draw(after); });
}

PlanningWait::~PlanningWait() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void PlanningWait::draw(std::chrono::milliseconds after) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  if (wake_.wait_until(lock, start + after, [this] { return done_; })) return;
  for (auto next = start + after; !done_; next += std::chrono::milliseconds(250)) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cerr << "\r\033[K" << what_ << ": " << clock_time(elapsed) << std::flush;
    wake_.wait_until(lock, next + std::chrono::milliseconds(250), [this] { return done_; });
  }
  std::cerr << "\r\033[K" << std::flush;
}

void clear_progress_bar() {
  if (drawn_bar) drawn_bar->clear();
}

std::function<void(const ProfileProgress&)> profile_progress(const std::string& what) {
  struct State {
    std::unique_ptr<ProgressBar> bar;
    std::vector<std::pair<std::string, double>> phases;  // in order of first appearance, ms
  };
  auto state = std::make_shared<State>();
  return [state, what](const ProfileProgress& p) {
    if (!state->bar) state->bar = std::make_unique<ProgressBar>(what);
    // A phase's sum; "policy NAME" and the other phases each their own.
    auto it = std::find_if(state->phases.begin(), state->phases.end(),
                           [&](const auto& e) { return e.first == p.phase; });
    if (it == state->phases.end()) {
      state->phases.emplace_back(p.phase, 0.0);
      it = std::prev(state->phases.end());
    }
    it->second += p.phase_ms;
    state->bar->update(p.done, p.total, p.phase + (p.stage.empty() ? "" : " (" + p.stage + ")"));
    if (p.done < p.total) return;
    state->bar.reset();
    std::string words;
    for (const auto& [phase, ms] : state->phases)
      words += (words.empty() ? "" : ", ") + phase + " " + fixed(ms / 1e3, 1) + " s";
    progress("profiled " + std::to_string(p.stages) + " stages in " + fixed(p.elapsed_ms / 1e3, 1) + " s (" +
             words + ")");
    state->phases.clear();
  };
}

}  // namespace remat::cli
