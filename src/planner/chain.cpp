#include "remat/planner/chain.h"

#include <nlohmann/json.hpp>

#include "detail/json.h"
#include "detail/plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

namespace remat {
namespace {

std::string stage_label(const Chain& chain, size_t i) {
  return "stage " + std::to_string(i) + " ('" + chain.stages[i].name + "')";
}

void check_bytes(const Chain& chain, size_t i, const char* field, int64_t value) {
  if (value < 0) {
    throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " has negative " + field +
                                " (" + std::to_string(value) + ")");
  }
}

// A figure of stage i that is part of its output (at most output_bytes).
void check_within_output(const Chain& chain, size_t i, const char* field, int64_t value) {
  const int64_t most = chain.stages[i].output_bytes;
  if (value > most) {
    throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " has " + field + " (" +
                                std::to_string(value) + ") above its output_bytes (" + std::to_string(most) +
                                ")");
  }
}

void check_ms(const Chain& chain, size_t i, const char* field, double value) {
  if (!std::isfinite(value) || value < 0 || value > kMaxStageMs) {
    std::ostringstream os;
    os << "remat::validate: " << stage_label(chain, i) << " has "
       << (!std::isfinite(value) ? "non-finite "
           : value < 0           ? "negative "
                                 : "too large a ")
       << field << " (" << value << (value > kMaxStageMs ? " ms; the limit is 1e12 ms" : "") << ")";
    throw std::invalid_argument(os.str());
  }
}

// Adds `value` to the chain's byte total, refusing totals above kMaxChainBytes (so that no sum the
// simulator or the planners form can overflow int64).
void add_bytes(int64_t& total, int64_t value, const std::string& what) {
  if (value > kMaxChainBytes - total) {
    throw std::invalid_argument("remat::validate: the chain's bytes add up to more than 2^60 (" + what +
                                " brings them over); no real chain is that large");
  }
  total += value;
}

}  // namespace

int64_t Stage::bwd_grad_held(int64_t way) const {
  if (way == kGradsStreamed) return output_bytes;
  if (way >= 0 && static_cast<size_t>(way) < policies.size() &&
      policies[static_cast<size_t>(way)].bwd_grad_held_bytes)
    return std::clamp<int64_t>(*policies[static_cast<size_t>(way)].bwd_grad_held_bytes, 0, output_bytes);
  return bwd_grad_held();
}

double Chain::transfer_ms(int64_t bytes, bool to_host) const {
  const double gbps = to_host ? to_host_gb_per_s : to_device_gb_per_s;
  if (bytes <= 0) return 0.0;
  if (!(gbps > 0)) return std::numeric_limits<double>::infinity();
  return static_cast<double>(bytes) / (gbps * 1e6);
}

namespace {

// An OffloadCost of stage i for the way that keeps `kept` bytes (its output included).
void check_offload(const Chain& chain, size_t i, const char* field, const std::optional<OffloadCost>& o,
                   int64_t kept) {
  if (!o) return;
  check_bytes(chain, i, field, o->bytes);
  if (o->stream_fwd_bytes != -1 || o->stream_bwd_bytes != -1 || o->window_bytes != 0) {
    if (std::string(field) != "offload")
      throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " has stream figures in " +
                                  field + " (only the stage's offload, run as Fa, streams)");
    if (!o->can_stream())
      throw std::invalid_argument("remat::validate: " + stage_label(chain, i) +
                                  " has one of stream_fwd_bytes and stream_bwd_bytes but not the other (" +
                                  std::to_string(o->stream_fwd_bytes) + ", " +
                                  std::to_string(o->stream_bwd_bytes) + ")");
    check_bytes(chain, i, "offload stream_fwd_bytes", o->stream_fwd_bytes);
    check_bytes(chain, i, "offload stream_bwd_bytes", o->stream_bwd_bytes);
    check_bytes(chain, i, "offload window_bytes", o->window_bytes);
    if (o->ahead_bytes != -1) {
      check_bytes(chain, i, "offload ahead_bytes", o->ahead_bytes);
      if (o->ahead_bytes > o->window_bytes)
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) +
                                    " has offload ahead_bytes (" + std::to_string(o->ahead_bytes) +
                                    ") above its window_bytes (" + std::to_string(o->window_bytes) + ")");
    }
  }
  if (o->after_forward && o->can_stream())
    throw std::invalid_argument(
        "remat::validate: " + stage_label(chain, i) + " has stream figures in " + field +
        " and after_forward (copies that start once its forward has run do not stream)");
  // Read with the stream figures only (without them nothing streams, and it is not written; ahead_bytes too).
  if (o->stream_bwd_grads_bytes != -1)
    check_bytes(chain, i, "offload stream_bwd_grads_bytes", o->stream_bwd_grads_bytes);
  if (o->stream_bwd_input_bytes != -1)
    check_bytes(chain, i, "offload stream_bwd_input_bytes", o->stream_bwd_input_bytes);
  const int64_t most = kept - chain.stages[i].output_bytes;
  if (o->bytes > most) {
    throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " has " + field + " bytes (" +
                                std::to_string(o->bytes) + ") above what that way keeps beyond its output (" +
                                std::to_string(most) + ")");
  }
}

}  // namespace

bool valid_policy_name(const std::string& name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

void validate(const Chain& chain) {
  if (chain.stages.empty()) throw std::invalid_argument("remat::validate: the chain has no stages");
  if (chain.input_bytes < 0) {
    throw std::invalid_argument("remat::validate: negative input_bytes (" +
                                std::to_string(chain.input_bytes) + ")");
  }
  for (auto [name, gbps] : {std::pair<const char*, double>{"to_host_gb_per_s", chain.to_host_gb_per_s},
                            {"to_device_gb_per_s", chain.to_device_gb_per_s}}) {
    if (!std::isfinite(gbps) || gbps < 0) {
      std::ostringstream os;
      os << "remat::validate: " << name << " must be a finite bandwidth >= 0 (GB/s), got " << gbps;
      throw std::invalid_argument(os.str());
    }
  }
  if (!chain.inputs_held.empty() && chain.inputs_held.size() != chain.stages.size()) {
    throw std::invalid_argument("remat::validate: inputs_held has " +
                                std::to_string(chain.inputs_held.size()) + " entries but the chain has " +
                                std::to_string(chain.stages.size()) + " stages (one per stage, or none)");
  }
  int64_t total = 0;
  add_bytes(total, chain.input_bytes, "input_bytes");
  for (size_t i = 0; i < chain.stages.size(); ++i) {
    const Stage& s = chain.stages[i];
    check_ms(chain, i, "fwd_ms", s.fwd_ms);
    check_ms(chain, i, "bwd_ms", s.bwd_ms);
    if (s.fwd_nosave_ms) check_ms(chain, i, "fwd_nosave_ms", *s.fwd_nosave_ms);
    if (s.checkpoint_fwd_ms) check_ms(chain, i, "checkpoint_fwd_ms", *s.checkpoint_fwd_ms);
    if (s.checkpoint_bwd_ms) check_ms(chain, i, "checkpoint_bwd_ms", *s.checkpoint_bwd_ms);
    if (s.groups_fwd_ms) check_ms(chain, i, "groups_fwd_ms", *s.groups_fwd_ms);
    if (s.groups_bwd_ms) check_ms(chain, i, "groups_bwd_ms", *s.groups_bwd_ms);
    check_bytes(chain, i, "output_bytes", s.output_bytes);
    check_bytes(chain, i, "saved_bytes", s.saved_bytes);
    check_bytes(chain, i, "fwd_tmp_bytes", s.fwd_tmp_bytes);
    check_bytes(chain, i, "bwd_tmp_bytes", s.bwd_tmp_bytes);
    check_bytes(chain, i, "bwd_output_freed_bytes", s.bwd_output_freed_bytes);
    check_bytes(chain, i, "autocast_cache_bytes", s.autocast_cache_bytes);
    check_bytes(chain, i, "grads_before_recompute_bytes", s.grads_before_recompute_bytes);
    check_within_output(chain, i, "bwd_output_freed_bytes", s.bwd_output_freed_bytes);
    if (s.bwd_grad_held_bytes) {
      check_bytes(chain, i, "bwd_grad_held_bytes", *s.bwd_grad_held_bytes);
      check_within_output(chain, i, "bwd_grad_held_bytes", *s.bwd_grad_held_bytes);
    }
    if (s.fwd_nosave_tmp_bytes) {
      check_bytes(chain, i, "fwd_nosave_tmp_bytes", *s.fwd_nosave_tmp_bytes);
      add_bytes(total, *s.fwd_nosave_tmp_bytes, stage_label(chain, i));
    }
    if (s.bwd_grads_tmp_bytes) {
      check_bytes(chain, i, "bwd_grads_tmp_bytes", *s.bwd_grads_tmp_bytes);
      add_bytes(total, *s.bwd_grads_tmp_bytes, stage_label(chain, i));
    }
    const int keep_fields =
        s.keep_saved_bytes.has_value() + s.keep_fwd_ms.has_value() + s.keep_bwd_ms.has_value();
    if (keep_fields != 0 && keep_fields != 3) {
      throw std::invalid_argument("remat::validate: " + stage_label(chain, i) +
                                  " has some of keep_saved_bytes, keep_fwd_ms and keep_bwd_ms but not all");
    }
    if (s.has_keep()) {
      check_ms(chain, i, "keep_fwd_ms", *s.keep_fwd_ms);
      check_ms(chain, i, "keep_bwd_ms", *s.keep_bwd_ms);
      check_bytes(chain, i, "keep_saved_bytes", *s.keep_saved_bytes);
      if (*s.keep_saved_bytes < s.output_bytes) {
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " has keep_saved_bytes (" +
                                    std::to_string(*s.keep_saved_bytes) + ") < output_bytes (" +
                                    std::to_string(s.output_bytes) + ")");
      }
      add_bytes(total, *s.keep_saved_bytes, stage_label(chain, i));
      if (chain.keep.empty()) {
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) +
                                    " has keep_ fields but the chain names no keep tags");
      }
    }
    if (s.saved_bytes < s.output_bytes) {
      throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " has saved_bytes (" +
                                  std::to_string(s.saved_bytes) + ") < output_bytes (" +
                                  std::to_string(s.output_bytes) +
                                  "); what a stage keeps includes its output");
    }
    for (int64_t v : {s.output_bytes, s.saved_bytes, s.fwd_tmp_bytes, s.bwd_tmp_bytes})
      add_bytes(total, v, stage_label(chain, i));
    check_offload(chain, i, "offload", s.offload, s.saved_bytes);
    check_offload(chain, i, "checkpoint_offload", s.checkpoint_offload, s.output_bytes);
    if (s.keep_offload && !s.has_keep()) {
      throw std::invalid_argument("remat::validate: " + stage_label(chain, i) +
                                  " has keep_offload but no keep_ fields");
    }
    if (s.has_keep()) check_offload(chain, i, "keep_offload", s.keep_offload, *s.keep_saved_bytes);
    if (s.groups.size() > kMaxGroups) {
      throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " has " +
                                  std::to_string(s.groups.size()) + " saved groups; at most " +
                                  std::to_string(kMaxGroups) + " (each assignment is one of 3^groups)");
    }
    int64_t grouped = 0;
    for (size_t g = 0; g < s.groups.size(); ++g) {
      const SavedGroup& sg = s.groups[g];
      if (sg.name.empty()) {
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + "'s saved group " +
                                    std::to_string(g) + " has no name");
      }
      for (size_t h = 0; h < g; ++h) {
        if (s.groups[h].name == sg.name)
          throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " names saved group '" +
                                      sg.name + "' twice");
      }
      check_bytes(chain, i, "group bytes", sg.bytes);
      check_ms(chain, i, "group recompute_ms", sg.recompute_ms);
      if (sg.unsaved_bytes < 0 || sg.unsaved_bytes > sg.bytes) {
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + "'s saved group '" +
                                    sg.name + "' has unsaved_bytes " + std::to_string(sg.unsaved_bytes) +
                                    "; it must be within [0, bytes] = [0, " + std::to_string(sg.bytes) + "]");
      }
      if (sg.stays_bytes < 0 || sg.stays_bytes > sg.bytes) {
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + "'s saved group '" +
                                    sg.name + "' has stays_bytes " + std::to_string(sg.stays_bytes) +
                                    "; it must be within [0, bytes] = [0, " + std::to_string(sg.bytes) + "]");
      }
      if (sg.fwd_peak_before_bytes < -1) {
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + "'s saved group '" +
                                    sg.name + "' has fwd_peak_before_bytes " +
                                    std::to_string(sg.fwd_peak_before_bytes) +
                                    "; it must be a number of bytes >= 0, or -1 (not measured)");
      }
      if (sg.fwd_peak_after_bytes < -1) {
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + "'s saved group '" +
                                    sg.name + "' has fwd_peak_after_bytes " +
                                    std::to_string(sg.fwd_peak_after_bytes) +
                                    "; it must be a number of bytes >= 0, or -1 (not measured)");
      }
      add_bytes(grouped, sg.bytes, stage_label(chain, i));
    }
    if (s.policies.empty()) continue;
    if (s.policies.size() != chain.policies.size()) {
      throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " has " +
                                  std::to_string(s.policies.size()) + " policy costs but the chain names " +
                                  std::to_string(chain.policies.size()) + " policies");
    }
    for (size_t p = 0; p < s.policies.size(); ++p) {
      const PolicyCost& c = s.policies[p];
      if (c.policy != chain.policies[p]) {
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + "'s policy cost " +
                                    std::to_string(p) + " is for '" + c.policy + "' but the chain's policy " +
                                    std::to_string(p) + " is '" + chain.policies[p] + "'");
      }
      check_ms(chain, i, "policy fwd_ms", c.fwd_ms);
      check_ms(chain, i, "policy bwd_ms", c.bwd_ms);
      check_bytes(chain, i, "policy saved_bytes", c.saved_bytes);
      if (c.saved_bytes < s.output_bytes) {
        throw std::invalid_argument("remat::validate: " + stage_label(chain, i) + " under policy '" +
                                    c.policy + "' has saved_bytes (" + std::to_string(c.saved_bytes) +
                                    ") < output_bytes (" + std::to_string(s.output_bytes) + ")");
      }
      add_bytes(total, c.saved_bytes, stage_label(chain, i));
      for (const auto& [what, v] :
           {std::pair<const char*, const std::optional<int64_t>*>{"policy bwd_tmp_bytes", &c.bwd_tmp_bytes},
            {"policy bwd_grads_tmp_bytes", &c.bwd_grads_tmp_bytes}}) {
        if (!*v) continue;
        check_bytes(chain, i, what, **v);
        add_bytes(total, **v, stage_label(chain, i));
      }
      if (c.bwd_grad_held_bytes) {
        check_bytes(chain, i, "policy bwd_grad_held_bytes", *c.bwd_grad_held_bytes);
        check_within_output(chain, i, "policy bwd_grad_held_bytes", *c.bwd_grad_held_bytes);
      }
      check_offload(chain, i, "policy offload", c.offload, c.saved_bytes);
    }
  }
  for (size_t p = 0; p < chain.policies.size(); ++p) {
    if (!valid_policy_name(chain.policies[p])) {
      throw std::invalid_argument("remat::validate: policy name '" + chain.policies[p] +
                                  "' must be non-empty and made of letters, digits, '_', '-' and '.'");
    }
    for (size_t q = 0; q < p; ++q) {
      if (chain.policies[q] == chain.policies[p])
        throw std::invalid_argument("remat::validate: policy '" + chain.policies[p] + "' is named twice");
    }
  }
}

namespace {

nlohmann::ordered_json offload_json(const OffloadCost& o) {
  nlohmann::ordered_json j;
  j["bytes"] = o.bytes;
  j["input"] = o.input;
  j["output"] = o.output;
  if (o.after_forward) j["after_forward"] = true;
  if (o.can_stream()) {
    j["stream_fwd_bytes"] = o.stream_fwd_bytes;
    j["stream_bwd_bytes"] = o.stream_bwd_bytes;
    j["window_bytes"] = o.window_bytes;
    if (o.stream_bwd_grads_bytes >= 0) j["stream_bwd_grads_bytes"] = o.stream_bwd_grads_bytes;
    if (o.ahead_bytes >= 0) j["ahead_bytes"] = o.ahead_bytes;
    if (o.stream_bwd_input_bytes >= 0) j["stream_bwd_input_bytes"] = o.stream_bwd_input_bytes;
  }
  return j;
}

}  // namespace

std::string to_json(const Chain& chain) {
  nlohmann::ordered_json j;
  j["input_bytes"] = chain.input_bytes;
  j["stages"] = nlohmann::ordered_json::array();
  for (const Stage& s : chain.stages) {
    nlohmann::ordered_json js;
    js["name"] = s.name;
    js["fwd_ms"] = s.fwd_ms;
    js["bwd_ms"] = s.bwd_ms;
    js["output_bytes"] = s.output_bytes;
    js["saved_bytes"] = s.saved_bytes;
    if (!s.saves_output) js["saves_output"] = false;
    if (!s.saves_input) js["saves_input"] = false;
    if (s.bwd_output_freed_bytes != 0) js["bwd_output_freed_bytes"] = s.bwd_output_freed_bytes;
    if (s.bwd_grad_held_bytes) js["bwd_grad_held_bytes"] = *s.bwd_grad_held_bytes;
    if (!s.has_backward) js["has_backward"] = false;
    if (s.autocast_cache_bytes != 0) js["autocast_cache_bytes"] = s.autocast_cache_bytes;
    if (s.grads_before_recompute_bytes != 0)
      js["grads_before_recompute_bytes"] = s.grads_before_recompute_bytes;
    js["fwd_tmp_bytes"] = s.fwd_tmp_bytes;
    if (s.fwd_nosave_tmp_bytes) js["fwd_nosave_tmp_bytes"] = *s.fwd_nosave_tmp_bytes;
    js["bwd_tmp_bytes"] = s.bwd_tmp_bytes;
    if (s.bwd_grads_tmp_bytes) js["bwd_grads_tmp_bytes"] = *s.bwd_grads_tmp_bytes;
    if (s.fwd_nosave_ms) js["fwd_nosave_ms"] = *s.fwd_nosave_ms;
    if (s.checkpoint_fwd_ms) js["checkpoint_fwd_ms"] = *s.checkpoint_fwd_ms;
    if (s.checkpoint_bwd_ms) js["checkpoint_bwd_ms"] = *s.checkpoint_bwd_ms;
    if (s.has_keep()) {
      js["keep_saved_bytes"] = *s.keep_saved_bytes;
      js["keep_fwd_ms"] = *s.keep_fwd_ms;
      js["keep_bwd_ms"] = *s.keep_bwd_ms;
    }
    if (s.offload) js["offload"] = offload_json(*s.offload);
    if (s.keep_offload) js["keep_offload"] = offload_json(*s.keep_offload);
    if (s.checkpoint_offload) js["checkpoint_offload"] = offload_json(*s.checkpoint_offload);
    if (!s.policies.empty()) {
      js["policies"] = nlohmann::ordered_json::array();
      for (const PolicyCost& c : s.policies) {
        nlohmann::ordered_json jc;
        jc["policy"] = c.policy;
        jc["saved_bytes"] = c.saved_bytes;
        jc["fwd_ms"] = c.fwd_ms;
        jc["bwd_ms"] = c.bwd_ms;
        if (c.bwd_tmp_bytes) jc["bwd_tmp_bytes"] = *c.bwd_tmp_bytes;
        if (c.bwd_grads_tmp_bytes) jc["bwd_grads_tmp_bytes"] = *c.bwd_grads_tmp_bytes;
        if (c.offload) jc["offload"] = offload_json(*c.offload);
        if (!c.saves_output) jc["saves_output"] = false;
        if (c.bwd_grad_held_bytes) jc["bwd_grad_held_bytes"] = *c.bwd_grad_held_bytes;
        js["policies"].push_back(jc);
      }
    }
    if (!s.groups.empty()) {
      js["groups"] = nlohmann::ordered_json::array();
      for (const SavedGroup& g : s.groups) {
        nlohmann::ordered_json jg = {{"name", g.name}, {"bytes", g.bytes}, {"recompute_ms", g.recompute_ms}};
        if (g.unsaved_bytes != 0) jg["unsaved_bytes"] = g.unsaved_bytes;
        if (g.stays_bytes != 0) jg["stays_bytes"] = g.stays_bytes;
        if (g.fwd_peak_before_bytes >= 0) jg["fwd_peak_before_bytes"] = g.fwd_peak_before_bytes;
        if (g.fwd_peak_after_bytes >= 0) jg["fwd_peak_after_bytes"] = g.fwd_peak_after_bytes;
        js["groups"].push_back(jg);
      }
    }
    if (s.groups_fwd_ms) js["groups_fwd_ms"] = *s.groups_fwd_ms;
    if (s.groups_bwd_ms) js["groups_bwd_ms"] = *s.groups_bwd_ms;
    j["stages"].push_back(js);
  }
  if (!chain.keep.empty()) j["keep"] = chain.keep;
  if (!chain.policies.empty()) j["policies"] = chain.policies;
  if (chain.to_host_gb_per_s > 0 || chain.to_device_gb_per_s > 0) {
    j["to_host_gb_per_s"] = chain.to_host_gb_per_s;
    j["to_device_gb_per_s"] = chain.to_device_gb_per_s;
  }
  if (chain.holds_outputs) j["holds_outputs"] = true;
  if (chain.copies_at_once) j["copies_at_once"] = true;
  if (!chain.inputs_held.empty()) j["inputs_held"] = chain.inputs_held;
  return j.dump(2);
}

namespace {

template <typename T>
T required(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key))
    throw std::invalid_argument("remat::chain_from_json: " + where + " has no \"" + key + "\"");
  const auto& v = j.at(key);
  if (!v.is_number()) {
    throw std::invalid_argument("remat::chain_from_json: " + where + ": \"" + key +
                                "\" must be a number, got " + v.dump());
  }
  if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) {
      throw std::invalid_argument("remat::chain_from_json: " + where + ": \"" + key +
                                  "\" must be a whole number of bytes, got " + v.dump());
    }
    if (v.is_number_unsigned() &&
        v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw std::invalid_argument("remat::chain_from_json: " + where + ": \"" + key + "\" is too large (" +
                                  v.dump() + ")");
    }
  }
  return v.get<T>();
}

template <typename T>
T optional(const nlohmann::json& j, const char* key, const std::string& where, T fallback) {
  return j.contains(key) ? required<T>(j, key, where) : fallback;
}

// A true/false under `key`, `fallback` when absent.
bool boolean(const nlohmann::json& j, const char* key, const std::string& where, bool fallback) {
  if (!j.contains(key)) return fallback;
  if (!j.at(key).is_boolean())
    throw std::invalid_argument("remat::chain_from_json: " + where + ": \"" + key +
                                "\" must be true or false, got " + j.at(key).dump());
  return j.at(key).get<bool>();
}

// {"bytes": N, "input": bool, "output": bool} under `key`, when present.
std::optional<OffloadCost> offload_from(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key)) return std::nullopt;
  const auto& o = j.at(key);
  const std::string at = where + " \"" + key + "\"";
  if (!o.is_object())
    throw std::invalid_argument("remat::chain_from_json: " + at + " must be an object {\"bytes\": N, ...}");
  OffloadCost c;
  c.bytes = required<int64_t>(o, "bytes", at);
  for (auto [name, field] : {std::pair<const char*, bool*>{"input", &c.input},
                             {"output", &c.output},
                             {"after_forward", &c.after_forward}}) {
    if (!o.contains(name)) continue;
    if (!o.at(name).is_boolean())
      throw std::invalid_argument("remat::chain_from_json: " + at + ": \"" + name +
                                  "\" must be true or false");
    *field = o.at(name).get<bool>();
  }
  const bool fwd = o.contains("stream_fwd_bytes"), bwd = o.contains("stream_bwd_bytes");
  if (fwd != bwd || ((o.contains("window_bytes") || o.contains("stream_bwd_grads_bytes") ||
                      o.contains("ahead_bytes") || o.contains("stream_bwd_input_bytes")) &&
                     !fwd))
    throw std::invalid_argument("remat::chain_from_json: " + at +
                                ": \"stream_fwd_bytes\" and \"stream_bwd_bytes\" come together (with "
                                "\"window_bytes\", \"stream_bwd_grads_bytes\", \"ahead_bytes\" and "
                                "\"stream_bwd_input_bytes\"), or not at all");
  if (fwd) {
    c.stream_fwd_bytes = required<int64_t>(o, "stream_fwd_bytes", at);
    c.stream_bwd_bytes = required<int64_t>(o, "stream_bwd_bytes", at);
    c.window_bytes = optional<int64_t>(o, "window_bytes", at, 0);
    c.stream_bwd_grads_bytes = optional<int64_t>(o, "stream_bwd_grads_bytes", at, -1);
    c.ahead_bytes = optional<int64_t>(o, "ahead_bytes", at, -1);
    c.stream_bwd_input_bytes = optional<int64_t>(o, "stream_bwd_input_bytes", at, -1);
  }
  return c;
}

}  // namespace

Chain chain_from_json(const std::string& text) {
  const nlohmann::json j = detail::parse_json(text, "remat::chain_from_json");
  if (!j.is_object())
    throw std::invalid_argument("remat::chain_from_json: expected an object with \"stages\"");
  Chain chain;
  chain.input_bytes = required<int64_t>(j, "input_bytes", "the chain");
  if (!j.contains("stages") || !j.at("stages").is_array()) {
    throw std::invalid_argument("remat::chain_from_json: \"stages\" must be an array");
  }
  const auto& stages = j.at("stages");
  for (size_t i = 0; i < stages.size(); ++i) {
    const auto& js = stages[i];
    const std::string where = "stage " + std::to_string(i);
    if (!js.is_object())
      throw std::invalid_argument("remat::chain_from_json: " + where + " is not an object");
    Stage s;
    if (js.contains("name")) {
      if (!js.at("name").is_string()) {
        throw std::invalid_argument("remat::chain_from_json: " + where + ": \"name\" must be a string");
      }
      s.name = js.at("name").get<std::string>();
    } else {
      s.name = "stage" + std::to_string(i);
    }
    s.fwd_ms = required<double>(js, "fwd_ms", where);
    s.bwd_ms = required<double>(js, "bwd_ms", where);
    s.output_bytes = required<int64_t>(js, "output_bytes", where);
    s.saved_bytes = required<int64_t>(js, "saved_bytes", where);
    s.saves_output = boolean(js, "saves_output", where, true);
    s.saves_input = boolean(js, "saves_input", where, true);
    s.has_backward = boolean(js, "has_backward", where, true);
    if (js.contains("autocast_cache_bytes"))
      s.autocast_cache_bytes = required<int64_t>(js, "autocast_cache_bytes", where);
    if (js.contains("grads_before_recompute_bytes"))
      s.grads_before_recompute_bytes = required<int64_t>(js, "grads_before_recompute_bytes", where);
    if (js.contains("bwd_output_freed_bytes"))
      s.bwd_output_freed_bytes = required<int64_t>(js, "bwd_output_freed_bytes", where);
    if (js.contains("bwd_grad_held_bytes"))
      s.bwd_grad_held_bytes = required<int64_t>(js, "bwd_grad_held_bytes", where);
    s.fwd_tmp_bytes = optional<int64_t>(js, "fwd_tmp_bytes", where, 0);
    s.bwd_tmp_bytes = optional<int64_t>(js, "bwd_tmp_bytes", where, 0);
    if (js.contains("fwd_nosave_tmp_bytes"))
      s.fwd_nosave_tmp_bytes = required<int64_t>(js, "fwd_nosave_tmp_bytes", where);
    if (js.contains("bwd_grads_tmp_bytes"))
      s.bwd_grads_tmp_bytes = required<int64_t>(js, "bwd_grads_tmp_bytes", where);
    for (auto [key, field] :
         {std::pair<const char*, std::optional<double>*>{"fwd_nosave_ms", &s.fwd_nosave_ms},
          {"checkpoint_fwd_ms", &s.checkpoint_fwd_ms},
          {"checkpoint_bwd_ms", &s.checkpoint_bwd_ms},
          {"keep_fwd_ms", &s.keep_fwd_ms},
          {"keep_bwd_ms", &s.keep_bwd_ms},
          {"groups_fwd_ms", &s.groups_fwd_ms},
          {"groups_bwd_ms", &s.groups_bwd_ms}}) {
      if (js.contains(key)) *field = required<double>(js, key, where);
    }
    if (js.contains("keep_saved_bytes"))
      s.keep_saved_bytes = required<int64_t>(js, "keep_saved_bytes", where);
    s.offload = offload_from(js, "offload", where);
    s.keep_offload = offload_from(js, "keep_offload", where);
    s.checkpoint_offload = offload_from(js, "checkpoint_offload", where);
    if (js.contains("policies")) {
      const auto& jp = js.at("policies");
      if (!jp.is_array())
        throw std::invalid_argument("remat::chain_from_json: " + where + ": \"policies\" must be an array");
      for (size_t p = 0; p < jp.size(); ++p) {
        const std::string at = where + " policy " + std::to_string(p);
        if (!jp[p].is_object() || !jp[p].contains("policy") || !jp[p].at("policy").is_string()) {
          throw std::invalid_argument("remat::chain_from_json: " + at +
                                      " must be an object with a \"policy\" name");
        }
        PolicyCost c;
        c.policy = jp[p].at("policy").get<std::string>();
        c.saved_bytes = required<int64_t>(jp[p], "saved_bytes", at);
        c.fwd_ms = required<double>(jp[p], "fwd_ms", at);
        c.bwd_ms = required<double>(jp[p], "bwd_ms", at);
        if (jp[p].contains("bwd_tmp_bytes")) c.bwd_tmp_bytes = required<int64_t>(jp[p], "bwd_tmp_bytes", at);
        if (jp[p].contains("bwd_grads_tmp_bytes"))
          c.bwd_grads_tmp_bytes = required<int64_t>(jp[p], "bwd_grads_tmp_bytes", at);
        c.offload = offload_from(jp[p], "offload", at);
        c.saves_output = boolean(jp[p], "saves_output", at, true);
        if (jp[p].contains("bwd_grad_held_bytes"))
          c.bwd_grad_held_bytes = required<int64_t>(jp[p], "bwd_grad_held_bytes", at);
        s.policies.push_back(std::move(c));
      }
    }
    if (js.contains("groups")) {
      const auto& jg = js.at("groups");
      if (!jg.is_array())
        throw std::invalid_argument("remat::chain_from_json: " + where + ": \"groups\" must be an array");
      for (size_t g = 0; g < jg.size(); ++g) {
        const std::string at = where + " group " + std::to_string(g);
        if (!jg[g].is_object() || !jg[g].contains("name") || !jg[g].at("name").is_string()) {
          throw std::invalid_argument("remat::chain_from_json: " + at + " must be an object with a \"name\"");
        }
        SavedGroup sg;
        sg.name = jg[g].at("name").get<std::string>();
        sg.bytes = required<int64_t>(jg[g], "bytes", at);
        sg.recompute_ms = required<double>(jg[g], "recompute_ms", at);
        sg.unsaved_bytes = optional<int64_t>(jg[g], "unsaved_bytes", at, 0);
        sg.stays_bytes = optional<int64_t>(jg[g], "stays_bytes", at, 0);
        sg.fwd_peak_before_bytes = optional<int64_t>(jg[g], "fwd_peak_before_bytes", at, -1);
        sg.fwd_peak_after_bytes = optional<int64_t>(jg[g], "fwd_peak_after_bytes", at, -1);
        s.groups.push_back(std::move(sg));
      }
    }
    chain.stages.push_back(std::move(s));
  }
  chain.keep = detail::string_array(j, "keep", "remat::chain_from_json");
  chain.policies = detail::string_array(j, "policies", "remat::chain_from_json");
  chain.to_host_gb_per_s = optional<double>(j, "to_host_gb_per_s", "the chain", 0.0);
  chain.to_device_gb_per_s = optional<double>(j, "to_device_gb_per_s", "the chain", 0.0);
  chain.holds_outputs = boolean(j, "holds_outputs", "the chain", false);
  chain.copies_at_once = boolean(j, "copies_at_once", "the chain", false);
  if (j.contains("inputs_held")) {
    const auto& held = j.at("inputs_held");
    if (!held.is_array())
      throw std::invalid_argument(
          "remat::chain_from_json: \"inputs_held\" must be an array of true or false");
    for (const auto& b : held) {
      if (!b.is_boolean())
        throw std::invalid_argument(
            "remat::chain_from_json: every entry of \"inputs_held\" must be true or "
            "false, got " +
            b.dump());
      chain.inputs_held.push_back(b.get<bool>());
    }
  }
  validate(chain);
  return chain;
}

Chain load_chain(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("remat::load_chain: cannot read '" + path + "'");
  std::ostringstream os;
  os << in.rdbuf();
  return chain_from_json(os.str());
}

void save_chain(const Chain& chain, const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::invalid_argument("remat::save_chain: cannot write '" + path + "'");
  out << to_json(chain) << "\n";
  if (!out) throw std::invalid_argument("remat::save_chain: failed writing '" + path + "'");
}

Chain uniform_chain(int64_t n, double fwd_ms, double bwd_ms, int64_t output_bytes, int64_t saved_bytes) {
  if (n < 1) throw std::invalid_argument("remat::uniform_chain: n must be >= 1, got " + std::to_string(n));
  Chain chain;
  chain.input_bytes = output_bytes;
  chain.stages.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    Stage s;
    s.name = "stage" + std::to_string(i);
    s.fwd_ms = fwd_ms;
    s.bwd_ms = bwd_ms;
    s.output_bytes = output_bytes;
    s.saved_bytes = saved_bytes;
    chain.stages.push_back(std::move(s));
  }
  validate(chain);
  return chain;
}

bool costly_to_recompute(const std::string& call) {
  static const std::set<std::string> kCostly{
      // matrix products
      "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::addmv", "aten::mv",
      "aten::dot", "aten::vdot", "aten::matmul", "aten::linear", "aten::_grouped_mm", "aten::_scaled_mm",
      // convolutions
      "aten::convolution", "aten::_convolution", "aten::cudnn_convolution", "aten::mkldnn_convolution",
      // attention
      "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math",
      "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
      "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_cudnn_attention",
      "aten::_scaled_dot_product_fused_attention_overrideable", "aten::_efficient_attention_forward",
      "aten::_flash_attention_forward"};
  return kCostly.count(call.substr(0, call.find('#'))) > 0;
}

namespace {

// The indices of `found` in order, each group's bytes checked (fit_groups()'s error).
std::vector<size_t> checked_indices(const std::vector<SavedGroup>& found) {
  std::vector<size_t> order(found.size());
  for (size_t g = 0; g < found.size(); ++g) {
    if (found[g].bytes < 0)
      throw std::invalid_argument("remat::fit_groups: group '" + found[g].name + "' has " +
                                  std::to_string(found[g].bytes) + " bytes");
    order[g] = g;
  }
  return order;
}

}  // namespace

std::vector<SavedGroup> fit_groups(const std::vector<SavedGroup>& found) {
  std::vector<size_t> order = checked_indices(found);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const bool ca = costly_to_recompute(found[a].name), cb = costly_to_recompute(found[b].name);
    if (ca != cb) return ca;
    return found[a].bytes > found[b].bytes;
  });
  if (order.size() > kMaxGroups) order.resize(kMaxGroups);
  std::sort(order.begin(), order.end());
  std::vector<SavedGroup> out;
  for (size_t g : order)
    out.push_back(found[g]);
  return out;
}

std::vector<SavedGroup> fit_groups(const std::vector<SavedGroup>& found, int64_t room_bytes) {
  if (room_bytes < 0)
    throw std::invalid_argument("remat::fit_groups: room_bytes must be >= 0, got " +
                                std::to_string(room_bytes));
  std::vector<size_t> order = checked_indices(found);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return found[a].bytes > found[b].bytes; });
  if (order.size() > kMaxGroups) order.resize(kMaxGroups);
  std::vector<char> chosen(found.size(), 0);
  int64_t total = 0;
  for (size_t g : order) {
    if (total + found[g].bytes > room_bytes) continue;
    chosen[g] = 1;
    total += found[g].bytes;
  }
  std::vector<SavedGroup> out;
  for (size_t g = 0; g < found.size(); ++g)
    if (chosen[g]) out.push_back(found[g]);
  return out;
}

namespace {

// group_cost()'s checks of an assignment (group_unsaved_bytes() makes them too, in its words).
void check_assignment(const Stage& stage, const std::string& assignment) {
  if (assignment.size() != stage.groups.size()) {
    throw std::invalid_argument("remat::group_cost: the assignment '" + assignment + "' has " +
                                std::to_string(assignment.size()) + " characters, but stage '" + stage.name +
                                "' has " + std::to_string(stage.groups.size()) + " saved groups");
  }
  const size_t bad = assignment.find_first_not_of("khr");
  if (bad != std::string::npos) {
    throw std::invalid_argument("remat::group_cost: the assignment '" + assignment + "' has '" +
                                std::string(1, assignment[bad]) +
                                "'; each group is 'k' (kept), 'h' (sent to the host) or 'r' (recomputed)");
  }
}

}  // namespace

int64_t group_unsaved_bytes(const Stage& stage, const std::string& assignment) {
  check_assignment(stage, assignment);
  int64_t unsaved = 0;
  for (size_t g = 0; g < assignment.size(); ++g)
    if (assignment[g] != 'r') unsaved += stage.groups[g].unsaved_bytes;
  return unsaved;
}

int64_t group_forward_peak_bytes(const Stage& stage, const std::string& assignment) {
  check_assignment(stage, assignment);
  return detail::forward_part_way_bytes(stage, [&](size_t g) { return assignment[g] != 'r'; });
}

int64_t group_recompute_peak_bytes(const Stage& stage, const std::string& assignment) {
  check_assignment(stage, assignment);
  return detail::recompute_part_way_bytes(stage, [&](size_t g) { return assignment[g] != 'r'; });
}

PolicyCost group_cost(const Stage& stage, const std::string& assignment) {
  check_assignment(stage, assignment);
  PolicyCost c;
  c.policy = "{" + assignment + "}";
  int64_t kept = 0, sent = 0;
  double skipped_ms = 0, redone_ms = 0;
  for (size_t g = 0; g < assignment.size(); ++g) {
    const SavedGroup& sg = stage.groups[g];
    switch (assignment[g]) {
      case 'k':
        kept += sg.bytes, skipped_ms += sg.recompute_ms;
        break;
      case 'h':  // what an Offload keeps on the device stays, as kept
        kept += sg.stays_bytes, sent += sg.bytes - sg.stays_bytes, skipped_ms += sg.recompute_ms;
        break;
      default:  // 'r' (check_assignment)
        redone_ms += sg.recompute_ms;
        break;
    }
  }
  c.saved_bytes = stage.output_bytes + kept + sent;
  c.saves_output = stage.saves_output;  // the output is no group: its recompute makes it where Fa saves it
  c.fwd_ms = stage.group_fwd_ms();
  c.bwd_ms = stage.group_bwd_ms(skipped_ms, redone_ms);
  if (assignment.find('h') != std::string::npos) c.offload = OffloadCost{sent, false, false};
  return c;
}

}  // namespace remat
