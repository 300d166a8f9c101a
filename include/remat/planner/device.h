#pragma once
/// \file
/// A budget that names the device instead of bytes (device.cpp): "auto" or "90%", turned into bytes from what
/// the device has free when a training step begins. One rule for the C++ library (PlannedOptions::fit_device)
/// and the Python package (budget="auto"). No torch headers.
///
///   std::optional<double> f = remat::parse_device_fraction("90%");   // 0.9; "auto" is 1.0; "300MiB": none
///   remat::DeviceRoom room{free, cached, total, lost};                   // read by the runtime
///   int64_t budget = remat::device_budget(room, *f);                   // bytes, above the step's base

#include <cstdint>
#include <optional>
#include <string>

namespace remat {

/// What a device has for a training step, in bytes, read by the runtime when the step begins (after what the
/// step's base holds is allocated) and, for lost_bytes, when its first step has run.
struct DeviceRoom {
  /// Free on the device (CUDA's cudaMemGetInfo): neither this process's caching allocator nor any other
  /// holds it.
  int64_t free_bytes = 0;
  /// Cached by this process's caching allocator beyond what tensors occupy (reserved - allocated): the step's
  /// tensors reuse it.
  int64_t cached_bytes = 0;
  /// The device's capacity.
  int64_t total_bytes = 0;
  /// What the allocator lost to fragmentation in the profiling step: its reserved bytes at the step's end
  /// beyond the most the step's tensors occupied at once (never negative). 0 before it is measured.
  int64_t lost_bytes = 0;
};

/// The margin device_budget() keeps free (bytes): 2% of the device's capacity, at least 256 MiB, for what no
/// reading shows (the CUDA context and libraries' workspaces allocated later, other processes' growth).
int64_t device_margin(int64_t total_bytes);

/// The bytes a profiler copies to measure a device's link to the host (Chain::to_host_gb_per_s and
/// to_device_gb_per_s), given the largest tensor or stage it would send (`largest_bytes`): that, at least
/// 1 MiB and at most 64 MiB; on a CPU device 64 MiB whatever the sizes, as a buffer the caches hold reads
/// faster than a step's copies run (41 GB/s at 6 MiB on the CI machine, where a compiled GPT-2's copies ran
/// at 12; 64 MiB read 10-13). Both profilers measure with it. Throws std::invalid_argument naming
/// remat::bandwidth_probe_bytes for a negative largest_bytes.
int64_t bandwidth_probe_bytes(int64_t largest_bytes, bool cpu_device);

/// What a caching allocator lost to fragmentation in a step (bytes, >= 0): its reserved bytes now beyond what
/// it needed, which is what it had reserved when the step began, or what tensors occupied then plus the
/// step's peak above that (peak_over_then), whichever is more. The runtimes read the four numbers.
int64_t lost_to_fragmentation(int64_t reserved_then, int64_t allocated_then, int64_t peak_over_then,
                              int64_t reserved_now);

/// `room` for people, as the messages of both languages give it: "the device's 1.20 GiB free + 4.00 KiB
/// cached by its allocator - 0 B lost to fragmentation, less a margin of 256.0 MiB".
std::string describe_room(const DeviceRoom& room);

/// The budget for a step on a device with `room` (bytes, above the step's base): `fraction` of what the step
/// can use (free_bytes + cached_bytes - lost_bytes), less device_margin(total_bytes); at least 0. Throws
/// std::invalid_argument naming remat::device_budget for a fraction outside (0, 1], or negative or
/// inconsistent readings (free + cached above total).
int64_t device_budget(const DeviceRoom& room, double fraction);

/// The fraction a device budget names: "auto" is 1.0 (all the device has free, less the margin), "N%" is
/// N / 100 for 0 < N <= 100 ("90%", "12.5%"). nullopt for any other text (a size such as "300MiB" is bytes,
/// not a device budget). Throws std::invalid_argument naming the text for a percentage outside (0, 100].
std::optional<double> parse_device_fraction(const std::string& text);

/// What a runtime knew when a step it planned ran out of device memory (bytes; -1 where it was not known),
/// for describe_out_of_memory() and budget_that_would_fit(): remat::Planned (C++) and the Python package fill
/// it in.
struct OutOfMemory {
  std::string who;                   ///< "remat::Planned", "remat.enable"
  std::string where;                 ///< where it ran out: "in layer 2's forward"
  std::string plan;                  ///< the plan the step ran (Plan::to_string())
  int64_t budget_bytes = 0;          ///< the budget the plan was made for
  std::string budget_words;          ///< how a device budget's bytes were made ("" for a budget in bytes)
  int64_t predicted_peak_bytes = 0;  ///< the plan's predicted step peak above the step's base
  int64_t held_bytes = 0;            ///< what the step held above its base when the allocation failed
  int64_t request_bytes = -1;        ///< the allocation that failed
  int64_t free_bytes = -1;           ///< free on the device then (-1: the device does not report it)
  int64_t reserved_bytes = -1;       ///< the caching allocator's reserved bytes then
  int64_t allocated_bytes = -1;      ///< of those, occupied by tensors
};

/// The budget that would have fit (bytes, <= 0 when none would; -1 when free_bytes is not known): what the
/// device could give the step (held_bytes + free_bytes + what the allocator held beyond its tensors, reserved
/// - allocated), less what the step needed at that point beyond its predicted peak (held + request -
/// predicted, when positive); at most budget_bytes.
int64_t budget_that_would_fit(const OutOfMemory& oom);

/// remat's words for `oom` (lines, the first naming who and where, then the plan, its predicted peak against
/// the budget, what the step held and the failed allocation, the allocator's reserve and the free bytes, the
/// budget that would have fit), the same in both languages; `last`, when not empty, is a last line (the
/// runtime's: what was done about it, or how to plan for the budget that would have fit).
std::string describe_out_of_memory(const OutOfMemory& oom, const std::string& last = "");

}  // namespace remat
