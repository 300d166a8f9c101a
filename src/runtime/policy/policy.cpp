// remat::Policy and its presets (remat/policy.h). Where the calls are asked and how kept calls are kept is
// non_reentrant.cpp's business; this file only decides.

#include "remat/policy.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <remat/planner/chain.h>  // valid_policy_name: the one rule for policy names, in chains, plans and here

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "detail/compat.h"

namespace remat {

namespace {

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

// A [batch, heads, query, key]-shaped score: four or more dimensions, the last two equal and above one; for a
// batched matrix product (where aten::matmul takes four-dimensional scores, reshaped to [batch * heads,
// query, key]), three.
bool score_shaped(const at::Tensor& t, int64_t least_dims) {
  return t.defined() && t.dim() >= least_dims && t.size(-1) == t.size(-2) && t.size(-1) > 1;
}

// The operators LibTorch 2.x tags `pointwise` and 1.13 has (generated from 2.15's tags; in-place variants,
// which are never kept, left out).
const std::unordered_set<std::string>& pointwise_names() {
  static const std::unordered_set<std::string> names = {"aten::abs",
                                                        "aten::acos",
                                                        "aten::acosh",
                                                        "aten::add",
                                                        "aten::addcdiv",
                                                        "aten::addcmul",
                                                        "aten::angle",
                                                        "aten::asin",
                                                        "aten::asinh",
                                                        "aten::atan",
                                                        "aten::atan2",
                                                        "aten::atanh",
                                                        "aten::bitwise_and",
                                                        "aten::bitwise_left_shift",
                                                        "aten::bitwise_not",
                                                        "aten::bitwise_or",
                                                        "aten::bitwise_right_shift",
                                                        "aten::bitwise_xor",
                                                        "aten::ceil",
                                                        "aten::celu",
                                                        "aten::clamp",
                                                        "aten::clamp_max",
                                                        "aten::clamp_min",
                                                        "aten::clip",
                                                        "aten::clone",
                                                        "aten::conj_physical",
                                                        "aten::copysign",
                                                        "aten::cos",
                                                        "aten::cosh",
                                                        "aten::deg2rad",
                                                        "aten::digamma",
                                                        "aten::div",
                                                        "aten::elu",
                                                        "aten::eq",
                                                        "aten::erf",
                                                        "aten::erfc",
                                                        "aten::erfinv",
                                                        "aten::exp",
                                                        "aten::exp2",
                                                        "aten::expm1",
                                                        "aten::floor",
                                                        "aten::fmax",
                                                        "aten::fmin",
                                                        "aten::fmod",
                                                        "aten::frac",
                                                        "aten::frexp",
                                                        "aten::gcd",
                                                        "aten::ge",
                                                        "aten::gelu",
                                                        "aten::gelu_backward",
                                                        "aten::gt",
                                                        "aten::hardshrink",
                                                        "aten::hardsigmoid",
                                                        "aten::hardtanh",
                                                        "aten::heaviside",
                                                        "aten::hypot",
                                                        "aten::i0",
                                                        "aten::igamma",
                                                        "aten::igammac",
                                                        "aten::isfinite",
                                                        "aten::isinf",
                                                        "aten::isnan",
                                                        "aten::isneginf",
                                                        "aten::isposinf",
                                                        "aten::lcm",
                                                        "aten::ldexp",
                                                        "aten::le",
                                                        "aten::leaky_relu",
                                                        "aten::lerp",
                                                        "aten::lgamma",
                                                        "aten::log",
                                                        "aten::log10",
                                                        "aten::log1p",
                                                        "aten::log2",
                                                        "aten::logaddexp",
                                                        "aten::logaddexp2",
                                                        "aten::logical_and",
                                                        "aten::logical_not",
                                                        "aten::logical_or",
                                                        "aten::logical_xor",
                                                        "aten::logit",
                                                        "aten::logit_backward",
                                                        "aten::lt",
                                                        "aten::masked_fill",
                                                        "aten::max",
                                                        "aten::maximum",
                                                        "aten::min",
                                                        "aten::minimum",
                                                        "aten::mish",
                                                        "aten::mul",
                                                        "aten::mvlgamma",
                                                        "aten::nan_to_num",
                                                        "aten::native_dropout_backward",
                                                        "aten::ne",
                                                        "aten::neg",
                                                        "aten::nextafter",
                                                        "aten::polygamma",
                                                        "aten::positive",
                                                        "aten::pow",
                                                        "aten::rad2deg",
                                                        "aten::reciprocal",
                                                        "aten::relu",
                                                        "aten::relu6",
                                                        "aten::remainder",
                                                        "aten::round",
                                                        "aten::rsqrt",
                                                        "aten::rsub",
                                                        "aten::selu",
                                                        "aten::sgn",
                                                        "aten::sigmoid",
                                                        "aten::sigmoid_backward",
                                                        "aten::sign",
                                                        "aten::signbit",
                                                        "aten::silu",
                                                        "aten::silu_backward",
                                                        "aten::sin",
                                                        "aten::sinc",
                                                        "aten::sinh",
                                                        "aten::softplus",
                                                        "aten::softshrink",
                                                        "aten::special_entr",
                                                        "aten::special_erfcx",
                                                        "aten::special_i0e",
                                                        "aten::special_i1",
                                                        "aten::special_i1e",
                                                        "aten::special_log_ndtr",
                                                        "aten::special_ndtri",
                                                        "aten::special_xlog1py",
                                                        "aten::special_zeta",
                                                        "aten::sqrt",
                                                        "aten::square",
                                                        "aten::sub",
                                                        "aten::tan",
                                                        "aten::tanh",
                                                        "aten::tanh_backward",
                                                        "aten::threshold",
                                                        "aten::threshold_backward",
                                                        "aten::true_divide",
                                                        "aten::trunc",
                                                        "aten::where",
                                                        "aten::xlogy"};
  return names;
}

// Dropout and dtype casts: cheap, and torch.compile's traces decompose them into pointwise operations.
const std::unordered_set<std::string>& also_recomputed() {
  static const std::unordered_set<std::string> names = {"aten::dropout",         "aten::native_dropout",
                                                        "aten::feature_dropout", "aten::alpha_dropout",
                                                        "aten::_to_copy",        "aten::type_as"};
  return names;
}

bool pointwise(const OpCall& call) {
  if (pointwise_names().count(call.name) || also_recomputed().count(call.name)) return true;
  // LibTorch 2.x tags more (operators 1.13 does not have); 1.13 has no tags.
  const auto op = c10::Dispatcher::singleton().findOp(c10::OperatorName(call.name, call.overload));
  return op && detail::compat::has_pointwise_tag(*op);
}

}  // namespace

Policy::Policy(std::string name, std::function<bool(const OpCall&)> decide) : name_(std::move(name)) {
  TORCH_CHECK(valid_policy_name(name_), "remat::Policy: the name '", name_,
              "' must be non-empty and made of letters, digits, '_', '-' and '.'");
  TORCH_CHECK(static_cast<bool>(decide), "remat::Policy '", name_,
              "': the decision function is empty (a default-constructed std::function)");
  decide_ = std::make_shared<std::function<CheckpointPolicy(const OpCall&)>>(
      [decide = std::move(decide)](const OpCall& call) {
        return decide(call) ? CheckpointPolicy::kPreferSave : CheckpointPolicy::kPreferRecompute;
      });
}

Policy::Policy(std::string name, std::function<CheckpointPolicy(const OpCall&)> decide)
    : name_(std::move(name)) {
  TORCH_CHECK(valid_policy_name(name_), "remat::Policy: the name '", name_,
              "' must be non-empty and made of letters, digits, '_', '-' and '.'");
  TORCH_CHECK(static_cast<bool>(decide), "remat::Policy '", name_,
              "': the decision function is empty (a default-constructed std::function)");
  decide_ = std::make_shared<std::function<CheckpointPolicy(const OpCall&)>>(std::move(decide));
}

const char* to_string(CheckpointPolicy p) {
  switch (p) {
    case CheckpointPolicy::kMustSave:
      return "MUST_SAVE";
    case CheckpointPolicy::kPreferSave:
      return "PREFER_SAVE";
    case CheckpointPolicy::kMustRecompute:
      return "MUST_RECOMPUTE";
    case CheckpointPolicy::kPreferRecompute:
      return "PREFER_RECOMPUTE";
    case CheckpointPolicy::kMustCpuOffload:
      return "MUST_CPU_OFFLOAD";
    case CheckpointPolicy::kPreferCpuOffload:
      return "PREFER_CPU_OFFLOAD";
  }
  return "?";
}

Policy Policy::named(std::string name) const {
  TORCH_CHECK(!empty(), "remat::Policy::named('", name, "'): there is no policy to name");
  TORCH_CHECK(valid_policy_name(name), "remat::Policy: the name '", name,
              "' must be non-empty and made of letters, digits, '_', '-' and '.'");
  Policy p = *this;
  p.name_ = std::move(name);
  return p;
}

CheckpointPolicy Policy::decide(const OpCall& call) const {
  TORCH_CHECK(!empty(), "remat::Policy: asked about ", call.name, " but there is no policy");
  const CheckpointPolicy answer = (*decide_)(call);
  TORCH_CHECK(static_cast<int>(answer) >= 0 && static_cast<int>(answer) <= 5, "remat::Policy '", name_,
              "': answered ", static_cast<int>(answer), " for ", call.name, ", which is no CheckpointPolicy");
  return answer;
}

bool Policy::keeps(const OpCall& call) const {
  return remat::keeps(decide(call));
}

Policy group_policy(const std::vector<std::string>& names, const std::string& assignment) {
  TORCH_CHECK(!assignment.empty() && assignment.size() == names.size() &&
                  assignment.find_first_not_of("khr") == std::string::npos,
              "remat::group_policy: the assignment '", assignment, "' does not fit the ", names.size(),
              " saved groups named (one of 'k', 'h' or 'r' each)");
  auto answers = std::make_shared<std::unordered_map<std::string, CheckpointPolicy>>();
  for (size_t g = 0; g < names.size(); ++g) {
    const char a = assignment[g];
    const CheckpointPolicy answer = a == 'k'   ? CheckpointPolicy::kMustSave
                                    : a == 'h' ? CheckpointPolicy::kMustCpuOffload
                                               : CheckpointPolicy::kPreferRecompute;
    TORCH_CHECK(answers->emplace(names[g], answer).second, "remat::group_policy: the group '", names[g],
                "' is named twice");
  }
  return Policy("groups." + assignment,
                std::function<CheckpointPolicy(const OpCall&)>([answers](const OpCall& c) {
                  const auto it = answers->find(c.call);
                  return it == answers->end() ? CheckpointPolicy::kPreferRecompute : it->second;
                }));
}

namespace policy {

Policy matmuls() {
  return Policy("matmuls", [](const OpCall& call) {
    static const std::unordered_set<std::string> kept = {
        "aten::linear", "aten::mm", "aten::addmm", "aten::bmm",  "aten::baddbmm",    "aten::addbmm",
        "aten::addmv",  "aten::mv", "aten::dot",   "aten::vdot", "aten::convolution"};
    return kept.count(call.name) > 0;
  });
}

Policy attention_core() {
  return Policy("attention_core", [](const OpCall& call) {
    if (starts_with(call.name, "aten::scaled_dot_product") ||
        starts_with(call.name, "aten::_scaled_dot_product") ||
        starts_with(call.name, "aten::_flash_attention") ||
        starts_with(call.name, "aten::_efficient_attention"))
      return false;
    const int64_t dims = call.name == "aten::bmm" || call.name == "aten::baddbmm" ? 3 : 4;
    auto score = [dims](const at::Tensor& t) { return score_shaped(t, dims); };
    const bool core = std::any_of(call.inputs.begin(), call.inputs.end(), score) ||
                      std::any_of(call.outputs.begin(), call.outputs.end(), score);
    return !core;
  });
}

Policy recompute_pointwise() {
  return Policy("recompute_pointwise", [](const OpCall& call) { return !pointwise(call); });
}

bool is_preset(const std::string& name) {
  return name == "matmuls" || name == "attention_core" || name == "recompute_pointwise";
}

Policy preset(const std::string& name) {
  if (name == "matmuls") return matmuls();
  if (name == "attention_core") return attention_core();
  if (name == "recompute_pointwise") return recompute_pointwise();
  TORCH_CHECK(false, "remat::policy::preset: no preset named '", name, "' (", kPresetNames, ")");
}

}  // namespace policy
}  // namespace remat
