#include "remat/planner/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

namespace remat {

int64_t parse_size(const std::string& text) {
  auto fail = [&](const char* why) {
    throw std::invalid_argument("remat::parse_size: '" + text + "' is not a size (" + why +
                                "); write e.g. 1048576, 512MiB, 1.5GiB, 300MB");
  };
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i])))
    ++i;
  const size_t start = i;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  if (i == start) fail(text.find('-') != std::string::npos ? "negative" : "no number");
  double value = 0;
  try {
    size_t used = 0;
    value = std::stod(text.substr(start, i - start), &used);
    if (used != i - start) fail("bad number");
  } catch (const std::logic_error&) {
    fail("bad number");
  }
  std::string unit;
  for (; i < text.size(); ++i) {
    if (!std::isspace(static_cast<unsigned char>(text[i]))) unit += static_cast<char>(std::tolower(text[i]));
  }
  double scale = 1;
  if (unit.empty() || unit == "b") {
    scale = 1;
  } else if (unit == "kb") {
    scale = 1e3;
  } else if (unit == "mb") {
    scale = 1e6;
  } else if (unit == "gb") {
    scale = 1e9;
  } else if (unit == "tb") {
    scale = 1e12;
  } else if (unit == "k" || unit == "kib") {
    scale = 1024.0;
  } else if (unit == "m" || unit == "mib") {
    scale = 1024.0 * 1024;
  } else if (unit == "g" || unit == "gib") {
    scale = 1024.0 * 1024 * 1024;
  } else if (unit == "t" || unit == "tib") {
    scale = 1024.0 * 1024 * 1024 * 1024;
  } else {
    fail("unknown unit");
  }
  const double bytes = std::round(value * scale);
  if (!std::isfinite(bytes) || bytes > static_cast<double>(std::numeric_limits<int64_t>::max()))
    fail("too large");
  return static_cast<int64_t>(bytes);
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const double a = std::fabs(b);
  char buf[64];
  if (a < 1024) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  } else if (a < 1024.0 * 1024) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", b / 1024);
  } else if (a < 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  }
  return buf;
}

std::string format_mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(bytes) / (1024.0 * 1024));
  return buf;
}

}  // namespace remat
