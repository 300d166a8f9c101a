#pragma once
// JSON helpers shared by the planner library's sources (header-only; nlohmann/json stays private to the
// library).

#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>
#include <vector>

namespace remat::detail {

/// Parses `text`, or throws std::invalid_argument "<who>: malformed JSON: ...".
inline nlohmann::json parse_json(const std::string& text, const char* who) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(std::string(who) + ": malformed JSON: " + e.what());
  }
}

/// The optional array of strings j[key] (empty when absent), or throws std::invalid_argument
/// "<who>: \"key\" must be an array of strings, got ...".
inline std::vector<std::string> string_array(const nlohmann::json& j, const char* key, const char* who) {
  if (!j.contains(key)) return {};
  const auto& k = j.at(key);
  bool strings = k.is_array();
  for (const auto& v : k)
    strings = strings && v.is_string();
  if (!strings)
    throw std::invalid_argument(std::string(who) + ": \"" + key + "\" must be an array of strings, got " +
                                k.dump());
  return k.get<std::vector<std::string>>();
}

}  // namespace remat::detail
