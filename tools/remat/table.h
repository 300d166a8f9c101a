#pragma once
// A plain-text table for the remat command: columns padded to their widest cell, numbers right-aligned.

#include <algorithm>
#include <cctype>
#include <ostream>
#include <string>
#include <vector>

namespace remat::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }

  void print(std::ostream& os) const {
    std::vector<size_t> width(header_.size(), 0);
    auto measure = [&](const std::vector<std::string>& row) {
      for (size_t i = 0; i < row.size() && i < width.size(); ++i)
        width[i] = std::max(width[i], row[i].size());
    };
    measure(header_);
    for (const auto& r : rows_)
      measure(r);
    auto line = [&](const std::vector<std::string>& row) {
      for (size_t i = 0; i < width.size(); ++i) {
        const std::string cell = i < row.size() ? row[i] : "";
        const bool right =
            i > 0 && !cell.empty() &&
            (std::isdigit(static_cast<unsigned char>(cell[0])) || cell[0] == '-' || cell[0] == '+');
        const std::string pad(width[i] - cell.size(), ' ');
        os << (i ? "  " : "") << (right ? pad + cell : cell + pad);
      }
      os << "\n";
    };
    line(header_);
    size_t total = 0;
    for (size_t w : width)
      total += w;
    os << std::string(total + 2 * (width.size() - 1), '-') << "\n";
    for (const auto& r : rows_)
      line(r);
  }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace remat::cli
