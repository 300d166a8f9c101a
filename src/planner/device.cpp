// Budgets that name the device (remat/planner/device.h).

#include "remat/planner/device.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>
#include <string>

#include "remat/planner/units.h"

namespace remat {

int64_t device_margin(int64_t total_bytes) {
  return std::max<int64_t>(int64_t{256} << 20, static_cast<int64_t>(std::ceil(0.02 * total_bytes)));
}

int64_t bandwidth_probe_bytes(int64_t largest_bytes, bool cpu_device) {
  if (largest_bytes < 0) {
    throw std::invalid_argument("remat::bandwidth_probe_bytes: largest_bytes must be >= 0, got " +
                                std::to_string(largest_bytes));
  }
  constexpr int64_t kLeast = int64_t{1} << 20, kMost = int64_t{64} << 20;
  return cpu_device ? kMost : std::min(std::max(largest_bytes, kLeast), kMost);
}

int64_t lost_to_fragmentation(int64_t reserved_then, int64_t allocated_then, int64_t peak_over_then,
                              int64_t reserved_now) {
  return std::max<int64_t>(0, reserved_now - std::max(reserved_then, allocated_then + peak_over_then));
}

std::string describe_room(const DeviceRoom& room) {
  return "the device's " + format_bytes(room.free_bytes) + " free + " + format_bytes(room.cached_bytes) +
         " cached by its allocator - " + format_bytes(room.lost_bytes) +
         " lost to fragmentation, less a margin of " + format_bytes(device_margin(room.total_bytes));
}

int64_t device_budget(const DeviceRoom& room, double fraction) {
  const std::string who = "remat::device_budget";
  if (!(fraction > 0 && fraction <= 1))
    throw std::invalid_argument(who + ": the fraction must be in (0, 1], got " + std::to_string(fraction));
  if (room.free_bytes < 0 || room.cached_bytes < 0 || room.total_bytes <= 0 || room.lost_bytes < 0 ||
      room.free_bytes + room.cached_bytes > room.total_bytes)
    throw std::invalid_argument(
        who + ": the device's readings are not a device's: free " + std::to_string(room.free_bytes) +
        ", cached " + std::to_string(room.cached_bytes) + ", total " + std::to_string(room.total_bytes) +
        ", lost " + std::to_string(room.lost_bytes) + " bytes");
  const int64_t usable = std::max<int64_t>(0, room.free_bytes + room.cached_bytes - room.lost_bytes);
  const auto share = static_cast<int64_t>(std::floor(fraction * static_cast<double>(usable)));
  return std::max<int64_t>(0, share - device_margin(room.total_bytes));
}

std::optional<double> parse_device_fraction(const std::string& text) {
  std::string t;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) t += static_cast<char>(std::tolower(c));
  if (t == "auto") return 1.0;
  if (t.empty() || t.back() != '%') return std::nullopt;
  const std::string number = t.substr(0, t.size() - 1);
  size_t used = 0;
  double n = 0;
  try {
    n = std::stod(number, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != number.size() || !std::isfinite(n) || n <= 0 || n > 100)
    throw std::invalid_argument("remat: the device budget '" + text +
                                "' is not a percentage in (0%, 100%] (or \"auto\")");
  return n / 100;
}

int64_t budget_that_would_fit(const OutOfMemory& oom) {
  if (oom.free_bytes < 0) return -1;
  const int64_t cached = oom.reserved_bytes >= 0 && oom.allocated_bytes >= 0
                             ? std::max<int64_t>(0, oom.reserved_bytes - oom.allocated_bytes)
                             : 0;
  const int64_t capacity = oom.held_bytes + oom.free_bytes + cached;
  const int64_t short_by = std::max<int64_t>(
      0, oom.held_bytes + std::max<int64_t>(0, oom.request_bytes) - oom.predicted_peak_bytes);
  return std::min(oom.budget_bytes, capacity - short_by);
}

std::string describe_out_of_memory(const OutOfMemory& oom, const std::string& last) {
  auto both = [](int64_t bytes) { return format_bytes(bytes) + " (" + std::to_string(bytes) + " bytes)"; };
  std::string s =
      oom.who + ": out of memory " + oom.where + ", in a step that ran the plan " + oom.plan + "\n";
  s += "  its predicted peak: " + both(oom.predicted_peak_bytes) +
       " above the step's base, for a budget of " + both(oom.budget_bytes) + oom.budget_words + "\n";
  s += "  the step held " + format_bytes(oom.held_bytes) + " above its base when " +
       (oom.request_bytes >= 0 ? format_bytes(oom.request_bytes) + " more could not be had"
                               : std::string("an allocation failed")) +
       "\n";
  if (oom.reserved_bytes >= 0 && oom.allocated_bytes >= 0 && oom.free_bytes >= 0)
    s += "  the caching allocator reserved " +
         format_bytes(std::max<int64_t>(0, oom.reserved_bytes - oom.allocated_bytes)) + " beyond the " +
         format_bytes(oom.allocated_bytes) + " its tensors occupied; the device had " +
         format_bytes(oom.free_bytes) + " free\n";
  else
    s += "  (the allocator's reserved and free bytes are not read on this device)\n";
  const int64_t fits = budget_that_would_fit(oom);
  if (fits < 0 && oom.free_bytes < 0)
    s += "  the budget that would have fit is not known: this device does not report what it had free";
  else if (fits > 0)
    s += "  a budget that would have fit: " + both(fits) +
         ": what the device could give the step, less what the step needed beyond its prediction";
  else
    s += "  no budget would have fit: the step ran out before it held more than it needed beyond its "
         "prediction";
  if (!last.empty()) s += "\n  " + last;
  return s;
}

}  // namespace remat
