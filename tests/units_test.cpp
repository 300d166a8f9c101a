#include <gtest/gtest.h>

#include <remat/planner/units.h>

namespace {

TEST(Units, ParseSize) {
  EXPECT_EQ(remat::parse_size("1048576"), 1048576);
  EXPECT_EQ(remat::parse_size("512MiB"), 512LL << 20);
  EXPECT_EQ(remat::parse_size("1.5GiB"), 3LL << 29);
  EXPECT_EQ(remat::parse_size("300MB"), 300000000);
  EXPECT_EQ(remat::parse_size("2 kib"), 2048);
  EXPECT_EQ(remat::parse_size("64K"), 65536);
  EXPECT_EQ(remat::parse_size("1g"), 1LL << 30);
  EXPECT_EQ(remat::parse_size("12B"), 12);
  for (const char* bad : {"", "MiB", "-5", "1.2.3", "5 parsecs", "1e999GiB"}) {
    EXPECT_THROW(remat::parse_size(bad), std::invalid_argument) << bad;
  }
  try {
    remat::parse_size("5 parsecs");
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'5 parsecs'"), std::string::npos);
  }
}

TEST(Units, FormatBytes) {
  EXPECT_EQ(remat::format_bytes(812), "812 B");
  EXPECT_EQ(remat::format_bytes(3277), "3.20 KiB");
  EXPECT_EQ(remat::format_bytes(147LL << 20), "147.0 MiB");
  EXPECT_EQ(remat::format_bytes(3LL << 29), "1.50 GiB");
  EXPECT_EQ(remat::format_bytes(-2048), "-2.00 KiB");
  EXPECT_EQ(remat::format_mib(147LL << 20), "147.0");
}

}  // namespace
