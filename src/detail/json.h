#pragma once
// JSON parsing shared by chain.cpp and plan.cpp (nlohmann/json stays private to the library).

#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

namespace remat::detail {

/// Parses `text`, or throws std::invalid_argument "<who>: malformed JSON: ...".
inline nlohmann::json parse_json(const std::string& text, const char* who) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(std::string(who) + ": malformed JSON: " + e.what());
  }
}

}  // namespace remat::detail
