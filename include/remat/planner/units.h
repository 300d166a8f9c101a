#pragma once
/// \file
/// Sizes and durations as people write them. Plain C++ (no torch headers).
///
///   int64_t b = remat::parse_size("1.5GiB");   // 1610612736
///   remat::format_bytes(b);                    // "1.50 GiB"

#include <cstdint>
#include <string>

namespace remat {

/// Parses a byte size: a non-negative number with an optional unit B, KB, MB, GB, TB (powers of 1000),
/// KiB, MiB, GiB, TiB (powers of 1024), case-insensitive; K, M, G alone mean KiB, MiB, GiB. A bare number
/// means bytes. Throws std::invalid_argument naming the text when it is not such a size, is negative, or
/// overflows.
int64_t parse_size(const std::string& text);

/// Formats bytes for people: "812 B", "3.20 KiB", "147.0 MiB", "1.50 GiB" (negative values keep their sign).
std::string format_bytes(int64_t bytes);

/// Bytes as MiB with one decimal, no unit ("147.0").
std::string format_mib(int64_t bytes);

}  // namespace remat
