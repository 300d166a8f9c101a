// Budgets that name the device (remat/planner/device.h): the one rule both languages fit a device with.

#include <gtest/gtest.h>
#include <remat/planner/device.h>

#include <stdexcept>

namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

TEST(DeviceBudget, IsTheFractionOfWhatTheStepCanUseLessTheMargin) {
  // An 80 GiB card with 60 GiB free and 4 GiB cached by the allocator: 64 GiB usable, 2% of 80 GiB kept.
  remat::DeviceRoom room{60 * kGiB, 4 * kGiB, 80 * kGiB, 0};
  const int64_t margin = remat::device_margin(80 * kGiB);
  EXPECT_EQ(margin, static_cast<int64_t>(0.02 * 80 * kGiB) + 1);  // ceil: 80 GiB * 2% is not whole bytes
  EXPECT_EQ(remat::device_budget(room, 1.0), 64 * kGiB - margin);
  EXPECT_EQ(remat::device_budget(room, 0.5), 32 * kGiB - margin);
  // What the profiling step lost to fragmentation is not the step's.
  room.lost_bytes = 3 * kGiB;
  EXPECT_EQ(remat::device_budget(room, 1.0), 61 * kGiB - margin);
  // A small device keeps at least 256 MiB, and a budget is never negative.
  EXPECT_EQ(remat::device_margin(4 * kGiB), 256 * kMiB);
  EXPECT_EQ(remat::device_budget(remat::DeviceRoom{100 * kMiB, 0, 4 * kGiB, 0}, 1.0), 0);
}

TEST(DeviceBudget, FragmentationIsWhatTheAllocatorReservedBeyondWhatTheStepNeeded) {
  // 2 GiB reserved, 1 GiB of it occupied when the step began: a step peaking 3 GiB above that needed 4 GiB.
  EXPECT_EQ(remat::lost_to_fragmentation(2 * kGiB, kGiB, 3 * kGiB, 5 * kGiB), kGiB);
  EXPECT_EQ(remat::lost_to_fragmentation(2 * kGiB, kGiB, 3 * kGiB, 4 * kGiB), 0);
  // A step that fitted in what was reserved already lost what the allocator reserved on top.
  EXPECT_EQ(remat::lost_to_fragmentation(8 * kGiB, kGiB, kGiB, 9 * kGiB), kGiB);
  EXPECT_EQ(remat::lost_to_fragmentation(8 * kGiB, kGiB, kGiB, 8 * kGiB), 0);
  EXPECT_EQ(
      remat::describe_room(remat::DeviceRoom{3 * kGiB / 2, 4096, 4 * kGiB, 0}),
      "the device's 1.50 GiB free + 4.00 KiB cached by its allocator - 0 B lost to fragmentation, less a "
      "margin of 256.0 MiB");
}

TEST(DeviceBudget, RefusesReadingsNoDeviceGivesAndFractionsOutsideOne) {
  const remat::DeviceRoom room{kGiB, 0, 2 * kGiB, 0};
  for (double f : {0.0, -0.5, 1.5}) {
    try {
      remat::device_budget(room, f);
      ADD_FAILURE() << f;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("remat::device_budget: the fraction"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(remat::device_budget(remat::DeviceRoom{2 * kGiB, kGiB, 2 * kGiB, 0}, 1.0),
               std::invalid_argument);
  EXPECT_THROW(remat::device_budget(remat::DeviceRoom{-1, 0, 2 * kGiB, 0}, 1.0), std::invalid_argument);
  EXPECT_THROW(remat::device_budget(remat::DeviceRoom{0, 0, 0, 0}, 1.0), std::invalid_argument);
}

TEST(DeviceBudget, ParsesAutoAndPercentagesAndLeavesSizesAlone) {
  EXPECT_EQ(remat::parse_device_fraction("auto"), 1.0);
  EXPECT_EQ(remat::parse_device_fraction(" AUTO "), 1.0);
  EXPECT_DOUBLE_EQ(*remat::parse_device_fraction("90%"), 0.9);
  EXPECT_DOUBLE_EQ(*remat::parse_device_fraction("12.5%"), 0.125);
  EXPECT_DOUBLE_EQ(*remat::parse_device_fraction("100%"), 1.0);
  EXPECT_FALSE(remat::parse_device_fraction("300MiB").has_value());
  EXPECT_FALSE(remat::parse_device_fraction("1024").has_value());
  for (const char* bad : {"0%", "150%", "-5%", "x%", "%"}) {
    try {
      remat::parse_device_fraction(bad);
      ADD_FAILURE() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

}  // namespace

namespace {

TEST(DeviceBudget, TheBandwidthIsMeasuredWithTheLargestTensorWithinOneTo64MiBAnd64MiBOnACpu) {
  // Both profilers' rule (Python's profile, C++'s profile_chain).
  constexpr int64_t MiB = int64_t{1} << 20;
  EXPECT_EQ(remat::bandwidth_probe_bytes(0, false), MiB);
  EXPECT_EQ(remat::bandwidth_probe_bytes(6 * MiB, false), 6 * MiB);
  EXPECT_EQ(remat::bandwidth_probe_bytes(300 * MiB, false), 64 * MiB);
  EXPECT_EQ(remat::bandwidth_probe_bytes(6 * MiB, true), 64 * MiB);  // a CPU's caches would hold 6 MiB
  EXPECT_EQ(remat::bandwidth_probe_bytes(300 * MiB, true), 64 * MiB);
  EXPECT_THROW(remat::bandwidth_probe_bytes(-1, false), std::invalid_argument);
}

TEST(OutOfMemoryWords, TheBudgetThatWouldHaveFitIsWhatTheDeviceCouldGiveLessWhatThePredictionMissed) {
  remat::OutOfMemory o;
  o.who = "remat::Planned";
  o.where = "in the forward pass";
  o.plan = "Fc0 Fa1 L B1 Fa0 B0";
  o.budget_bytes = 200 * kMiB;
  o.predicted_peak_bytes = 110 * kMiB;
  o.held_bytes = 100 * kMiB;
  o.request_bytes = 20 * kMiB;
  // A device that does not say what it had free: not known.
  EXPECT_EQ(remat::budget_that_would_fit(o), -1);
  std::string words = remat::describe_out_of_memory(o);
  EXPECT_NE(words.find("the budget that would have fit is not known"), std::string::npos) << words;
  // 100 held, 20 free and 10 cached beyond the allocator's tensors: 130 to give; needing 120 against a
  // prediction of 110, the plan must leave 10 more: 120.
  o.free_bytes = 20 * kMiB;
  o.reserved_bytes = 40 * kMiB;
  o.allocated_bytes = 30 * kMiB;
  EXPECT_EQ(remat::budget_that_would_fit(o), 120 * kMiB);
  words = remat::describe_out_of_memory(o, "what was done");
  EXPECT_EQ(
      words,
      "remat::Planned: out of memory in the forward pass, in a step that ran the plan Fc0 Fa1 L B1 Fa0 B0\n"
      "  its predicted peak: 110.0 MiB (115343360 bytes) above the step's base, for a budget of 200.0 MiB "
      "(209715200 bytes)\n"
      "  the step held 100.0 MiB above its base when 20.0 MiB more could not be had\n"
      "  the caching allocator reserved 10.0 MiB beyond the 30.0 MiB its tensors occupied; the device had "
      "20.0 MiB free\n"
      "  a budget that would have fit: 120.0 MiB (125829120 bytes): what the device could give the step, "
      "less what the step needed beyond its prediction\n"
      "  what was done");
  // Never above the budget; nothing when the step needed more than the device could give beyond it.
  o.budget_bytes = 90 * kMiB;
  EXPECT_EQ(remat::budget_that_would_fit(o), 90 * kMiB);
  o.free_bytes = 0, o.reserved_bytes = o.allocated_bytes = 0, o.predicted_peak_bytes = 0;
  EXPECT_LE(remat::budget_that_would_fit(o), 0);
  EXPECT_NE(remat::describe_out_of_memory(o).find("no budget would have fit"), std::string::npos);
}

}  // namespace
