#include "remat/planner/step.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <stdexcept>

#include "detail/per_layer.h"
#include "detail/plan.h"
#include "detail/planner.h"
#include "detail/step.h"
#include "remat/planner/units.h"

namespace remat {
namespace {

constexpr const char* kWho = "remat::plan_step";

bool is_per_layer(const std::string& planner) {
  if (planner == "optimal") return false;
  if (planner == "per-layer") return true;
  throw std::invalid_argument(std::string(kWho) + ": unknown planner '" + planner +
                              "' (optimal or per-layer)");
}

[[noreturn]] void refuse(int64_t budget_bytes, int64_t least, const std::string& planner,
                         const StepContext& context) {
  throw InfeasibleBudget(
      std::string(kWho) + ": the budget of " + format_bytes(budget_bytes) + " (" +
          std::to_string(budget_bytes) + " bytes) is below the least feasible one, " + format_bytes(least) +
          " (" + std::to_string(least) + " bytes): the step's peak above its base under the least-memory " +
          planner + " plan, with the rest of the step measured at " + format_bytes(context.rest_peak_bytes),
      budget_bytes, least);
}

}  // namespace

StepContext step_context(const StepReadings& r) {
  if (r.input_bytes < 0 || r.output_grad_bytes < 0 || r.output_grad_storage_bytes < -1 ||
      r.output_freed_bytes < 0 || r.checkpoint_state_bytes < 0 || r.side_bytes < 0 || !(r.rest_ms >= 0)) {
    throw std::invalid_argument("remat::step_context: input_bytes (" + std::to_string(r.input_bytes) +
                                "), output_grad_bytes (" + std::to_string(r.output_grad_bytes) +
                                "), output_freed_bytes (" + std::to_string(r.output_freed_bytes) +
                                "), checkpoint_state_bytes (" + std::to_string(r.checkpoint_state_bytes) +
                                "), side_bytes (" + std::to_string(r.side_bytes) + ") and rest_ms (" +
                                std::to_string(r.rest_ms) + ") must be >= 0, output_grad_storage_bytes (" +
                                std::to_string(r.output_grad_storage_bytes) + ") >= -1");
  }
  const size_t between = r.between_backward_peak_bytes.size();
  if (r.between_held_bytes.size() != between || r.between_forward_held_bytes.size() != between ||
      (between != 0 && !r.stage_grads_bytes.empty() && r.stage_grads_bytes.size() != between)) {
    throw std::invalid_argument("remat::step_context: between_forward_held_bytes (" +
                                std::to_string(r.between_forward_held_bytes.size()) +
                                " entries), between_backward_peak_bytes (" + std::to_string(between) +
                                "), between_held_bytes (" + std::to_string(r.between_held_bytes.size()) +
                                ") and stage_grads_bytes (" + std::to_string(r.stage_grads_bytes.size()) +
                                ") must be of one size, one entry per stage (or empty)");
  }
  auto above = [](int64_t v, int64_t from) { return std::max<int64_t>(0, v - from); };
  StepContext c;
  c.input_in_base = r.input_in_base;
  c.before_saved_bytes = r.input_in_base ? 0 : above(r.at_chain - r.input_bytes, r.base);
  c.before_peak_bytes = above(r.peak_before_chain, r.base);
  c.before_backward_peak_bytes =
      r.peak_after_chain_backward < 0 ? 0 : above(r.peak_after_chain_backward, r.base);
  c.rest_peak_bytes = above(r.rest_peak, r.at_return);
  c.rest_ms = r.rest_ms;
  // The chain's output, where the rest's backward let go of it, is the model's to let go of (once). An
  // expanded output gradient's storage is held to the end by the backward pass: the rest's.
  const bool expanded_grad =
      r.output_grad_storage_bytes >= 0 && r.output_grad_storage_bytes < r.output_grad_bytes;
  // Signed: the rest may have let go of what the part before the chain made and the model's code held until
  // its forward returned (GPT-2's token and position embeddings, locals of its forward), which the model
  // charges to the part before until its backward: read so from the rest's backward on, at most what that
  // part holds (before_saved_bytes). Before (found 2026-12-03) it was read as 0: GPT-2's steps were 0.5-1.1%
  // below their predictions, on every plan.
  c.rest_grads_bytes =
      std::max(-c.before_saved_bytes, r.at_output_grad - (expanded_grad ? 0 : r.output_grad_bytes) +
                                          r.output_freed_bytes - r.at_return);
  c.output_held_in_backward = r.output_freed_bytes == 0;
  c.checkpoint_state_bytes = r.checkpoint_state_bytes;
  c.outputs_held_to_end = r.outputs_held_to_end;
  c.stage_grads_bytes = r.stage_grads_bytes;
  c.checkpoint_all_peak_bytes = r.step_peak < 0 ? -1 : above(r.step_peak, r.base);
  c.side_bytes = r.side_bytes;
  c.side_grads_bytes = r.side_grads_bytes;
  c.side_grads_late_bytes = r.side_grads_late_bytes;
  c.side_freed_bytes = r.side_freed_bytes;
  // An input the rest's readings let go of already (input_freed_in_rest) is the model's to hold: charged as
  // let go of from the loss on as well, it would be let go of twice.
  c.input_held_in_backward = r.input_held_in_backward || r.input_freed_in_rest;
  c.outputs_held_in_backward = r.outputs_held_in_backward;
  c.inputs_held_in_forward = r.inputs_held_in_forward;
  c.between_forward_held_bytes = r.between_forward_held_bytes;  // signed, as between_held_bytes
  for (int64_t v : r.between_backward_peak_bytes)
    c.between_backward_peak_bytes.push_back(std::max<int64_t>(0, v));
  c.between_held_bytes = r.between_held_bytes;  // signed: what runs between may free more than it makes
  c.between_frees_output = r.between_frees_output;
  c.rest_frees_output = r.rest_frees_output;
  c.rest_takes_last_input = r.rest_takes_last_input;
  c.last_input_let_go_in_rest = r.last_input_let_go_in_rest;
  c.residual_grad_shared = r.residual_grad_shared;
  if (!expanded_grad) c.output_grad_held_in_backward = r.output_grad_held_in_backward;
  return c;
}

StepContext context_for_grads(const StepContext& context, const std::vector<int64_t>& stage_grads_bytes,
                              const GradsOutside& outside) {
  const std::vector<int64_t>& was = context.stage_grads_bytes;
  if (!was.empty() && was.size() != stage_grads_bytes.size())
    throw std::invalid_argument("remat::context_for_grads: " + std::to_string(stage_grads_bytes.size()) +
                                " entries for a context of " + std::to_string(was.size()) + " stages");
  int64_t stages = 0;  // the stages' gradients made beyond the measured state's (negative: fewer)
  for (size_t j = 0; j < stage_grads_bytes.size(); ++j) {
    if (stage_grads_bytes[j] < 0)
      throw std::invalid_argument("remat::context_for_grads: entry " + std::to_string(j) + " is " +
                                  std::to_string(stage_grads_bytes[j]) + " bytes");
    stages += stage_grads_bytes[j] - (was.empty() ? 0 : was[j]);
  }
  const int64_t more_between = std::max<int64_t>(outside.between_bytes, 0),
                more_before = std::max<int64_t>(outside.before_bytes, 0);
  StepContext c = context;
  c.stage_grads_bytes = stage_grads_bytes;
  // Every stage's gradients, the rest's and those made between stages are held by the time the part before
  // the chain runs its backward: its measured peak moves by their difference exactly. Those that part makes
  // itself may come after its peak: raised by more, not lowered by fewer.
  if (c.before_backward_peak_bytes > 0)
    c.before_backward_peak_bytes = std::max<int64_t>(
        0, c.before_backward_peak_bytes + stages + outside.rest_bytes + outside.between_bytes + more_before);
  // The rest's own, held from its backward on; more made between the stages charged from there too (the model
  // has no per-part figure for them; fewer leave between_held_bytes as measured).
  c.rest_grads_bytes =
      std::max(-c.before_saved_bytes, c.rest_grads_bytes + outside.rest_bytes + more_between);
  const int64_t added =
      std::max<int64_t>(stages, 0) + std::max<int64_t>(outside.rest_bytes, 0) + more_between + more_before;
  if (c.checkpoint_all_peak_bytes >= 0 && added > 0) c.checkpoint_all_peak_bytes += added;
  return c;
}

void validate(const StepContext& c, const Chain& chain) {
  auto check = [](int64_t v, const char* field) {
    if (v < 0)
      throw std::invalid_argument(std::string("remat::StepContext: ") + field + " is negative (" +
                                  std::to_string(v) + ")");
  };
  check(c.before_saved_bytes, "before_saved_bytes");
  check(c.before_peak_bytes, "before_peak_bytes");
  check(c.before_backward_peak_bytes, "before_backward_peak_bytes");
  check(c.rest_peak_bytes, "rest_peak_bytes");
  if (c.rest_grads_bytes < -c.before_saved_bytes) {
    throw std::invalid_argument(
        "remat::StepContext: rest_grads_bytes (" + std::to_string(c.rest_grads_bytes) +
        ") lets go of more than the part before the chain holds (before_saved_bytes " +
        std::to_string(c.before_saved_bytes) + ")");
  }
  check(c.side_bytes, "side_bytes");
  check(c.checkpoint_state_bytes, "checkpoint_state_bytes");
  if (!(c.rest_ms >= 0))
    throw std::invalid_argument("remat::StepContext: rest_ms must be >= 0, got " + std::to_string(c.rest_ms));
  // A per-stage figure: empty, or one entry per stage.
  auto sized = [&](size_t size, const char* field) {
    if (size != 0 && static_cast<int64_t>(size) != chain.size()) {
      throw std::invalid_argument(std::string("remat::StepContext: ") + field + " has " +
                                  std::to_string(size) + " entries for a chain of " +
                                  std::to_string(chain.size()) + " stages");
    }
  };
  sized(c.stage_grads_bytes.size(), "stage_grads_bytes");
  for (int64_t g : c.stage_grads_bytes)
    check(g, "an entry of stage_grads_bytes");
  // Parts of side_bytes, one per stage: none negative, together at most side_bytes.
  auto side_part = [&](const std::vector<int64_t>& v, const char* field) {
    sized(v.size(), field);
    int64_t sum = 0;
    for (int64_t g : v) {
      check(g, (std::string("an entry of ") + field).c_str());
      sum += g;
    }
    if (sum > c.side_bytes) {
      throw std::invalid_argument(std::string("remat::StepContext: ") + field + " adds up to " +
                                  std::to_string(sum) + " bytes, more than side_bytes (" +
                                  std::to_string(c.side_bytes) + "), of which they are a part");
    }
  };
  side_part(c.side_grads_bytes, "side_grads_bytes");
  side_part(c.side_freed_bytes, "side_freed_bytes");
  sized(c.side_grads_late_bytes.size(), "side_grads_late_bytes");
  for (size_t j = 0; j < c.side_grads_late_bytes.size(); ++j) {
    const int64_t late = c.side_grads_late_bytes[j];
    check(late, "an entry of side_grads_late_bytes");
    if (late > detail::stage_figure(c.side_grads_bytes, j)) {
      throw std::invalid_argument("remat::StepContext: side_grads_late_bytes[" + std::to_string(j) + "] is " +
                                  std::to_string(late) + " bytes, more than side_grads_bytes' entry (" +
                                  std::to_string(detail::stage_figure(c.side_grads_bytes, j)) +
                                  "), of which it is a part");
    }
  }
  sized(c.outputs_held_in_backward.size(), "outputs_held_in_backward");
  sized(c.inputs_held_in_forward.size(), "inputs_held_in_forward");
  sized(c.output_grad_held_in_backward.size(), "output_grad_held_in_backward");
  sized(c.outputs_held_to_end.size(), "outputs_held_to_end");
  sized(c.residual_grad_shared.size(), "residual_grad_shared");
  // The tensors only the stages hold past the forward: parts of before_saved_bytes, each with its stages.
  if (c.taken_bytes.size() > kMaxTakenTensors) {
    throw std::invalid_argument(
        "remat::StepContext: taken_bytes lists " + std::to_string(c.taken_bytes.size()) +
        " tensors, more than kMaxTakenTensors (" + std::to_string(kMaxTakenTensors) + ")");
  }
  int64_t taken = 0;
  for (int64_t b : c.taken_bytes) {
    check(b, "an entry of taken_bytes");
    taken += b;
  }
  if (taken > c.before_saved_bytes) {
    throw std::invalid_argument("remat::StepContext: taken_bytes adds up to " + std::to_string(taken) +
                                " bytes, more than before_saved_bytes (" +
                                std::to_string(c.before_saved_bytes) + "), of which they are a part");
  }
  auto per_taken = [&](const std::vector<std::vector<bool>>& v, const char* field) {
    if (v.size() != c.taken_bytes.size()) {
      throw std::invalid_argument(std::string("remat::StepContext: ") + field + " has " +
                                  std::to_string(v.size()) + " entries for " +
                                  std::to_string(c.taken_bytes.size()) + " tensors of taken_bytes");
    }
    for (const auto& flags : v)
      sized(flags.size(), field);
  };
  per_taken(c.taken_by, "taken_by");
  per_taken(c.taken_saved_by, "taken_saved_by");
  // What runs between two stages: nothing before the first (the part before the chain's backward is
  // before_backward_peak_bytes).
  auto between = [&](const std::vector<int64_t>& v, const char* field, bool signed_figure) {
    sized(v.size(), field);
    if (v.empty()) return;
    if (!signed_figure) {
      for (int64_t b : v)
        check(b, field);
    }
    if (v[0] != 0) {
      throw std::invalid_argument(std::string("remat::StepContext: ") + field + "'s entry 0 is " +
                                  std::to_string(v[0]) +
                                  ", not 0 (nothing runs between the part before the chain and its first "
                                  "stage: that part's backward is before_backward_peak_bytes)");
    }
  };
  between(c.between_forward_held_bytes, "between_forward_held_bytes", true);
  between(c.between_backward_peak_bytes, "between_backward_peak_bytes", false);
  between(c.between_held_bytes, "between_held_bytes", true);
  sized(c.between_frees_output.size(), "between_frees_output");
  if (!c.between_frees_output.empty() && c.between_frees_output[0]) {
    throw std::invalid_argument(
        "remat::StepContext: between_frees_output's entry 0 is true (nothing runs between the part before "
        "the chain and its first stage)");
  }
}

Chain step_chain(const Chain& chain, const StepContext& context) {
  validate(chain);
  validate(context, chain);
  Chain step;
  step.input_bytes = 0;
  step.keep = chain.keep;
  step.policies = chain.policies;
  step.to_host_gb_per_s = chain.to_host_gb_per_s;
  step.to_device_gb_per_s = chain.to_device_gb_per_s;
  step.holds_outputs = chain.holds_outputs;
  step.copies_at_once = chain.copies_at_once;
  // Step stage s (chain stage s - 1) takes a_{s-1}, chain stage s - 2's output: held to the step's end where
  // the context says so (outputs_held_to_end), or where the chain says its input is.
  step.inputs_held.assign(static_cast<size_t>(chain.size()) + 2, false);
  for (int64_t s = 1; s <= chain.size(); ++s)
    step.inputs_held[static_cast<size_t>(s)] =
        chain.input_held(s - 1) || (s >= 2 && detail::held_to_end_bytes(chain, context, s - 2) > 0);
  if (std::find(step.inputs_held.begin(), step.inputs_held.end(), true) == step.inputs_held.end())
    step.inputs_held.clear();
  Stage before;
  before.name = "before";
  before.output_bytes = chain.input_bytes;
  // What the stages take or hand on beside their input and output is held through the whole chain: charged
  // with what the part before it holds.
  // (Of those, the gradients that arrive at a stage's backward are charged from there: step_op_peaks().)
  int64_t side_grads = 0;
  for (int64_t g : context.side_grads_bytes)
    side_grads += g;
  before.saved_bytes = chain.input_bytes + context.before_saved_bytes + context.side_bytes - side_grads;
  step.stages.push_back(before);
  step.stages.insert(step.stages.end(), chain.stages.begin(), chain.stages.end());
  Stage after;
  after.name = "rest of the step";
  after.output_bytes = 0;
  // The rest's backward hands the chain's output its gradient, which simulate() adds at that backward: the
  // measured peak has it already, so the rest holds the peak less that gradient (the peak, at least that).
  after.saved_bytes = std::max<int64_t>(0, context.rest_peak_bytes - chain.activation_bytes(chain.size()));
  after.fwd_ms = context.rest_ms;
  step.stages.push_back(after);
  return step;
}

namespace detail {

int64_t stage_figure(const std::vector<int64_t>& figures, size_t stage) {
  return figures.empty() ? 0 : figures[stage];
}

bool stage_flag(const std::vector<bool>& flags, int64_t stage, bool unread) {
  if (flags.empty()) return unread;
  return stage >= 0 && static_cast<size_t>(stage) < flags.size() && flags[static_cast<size_t>(stage)];
}

bool recomputes(OpKind kind, bool groups) {
  return kind == OpKind::kForwardCheckpoint || (kind == OpKind::kForwardKeep && groups);
}

uint32_t taken_held_by(const StepContext& context, int64_t j, OpKind kind) {
  uint32_t held = 0;
  for (size_t m = 0; m < context.taken_bytes.size(); ++m) {
    const bool takes = m < context.taken_by.size() && stage_flag(context.taken_by[m], j, false);
    const bool saves = m < context.taken_saved_by.size() && stage_flag(context.taken_saved_by[m], j, false);
    if (saves || (takes && kind != OpKind::kForwardAll)) held |= uint32_t{1} << m;
  }
  return held;
}

int64_t taken_unheld_bytes(const StepContext& context, uint32_t held) {
  int64_t bytes = 0;
  for (size_t m = 0; m < context.taken_bytes.size(); ++m)
    if (!(held >> m & 1u)) bytes += context.taken_bytes[m];
  return bytes;
}

int64_t held_to_end_bytes(const Chain& chain, const StepContext& context, int64_t j) {
  if (j < 0 || j >= chain.size() || !stage_flag(context.outputs_held_to_end, j, false)) return 0;
  return chain.stages[static_cast<size_t>(j)].output_bytes;
}

int64_t recompute_unmade_bytes(const Chain& chain, int64_t j) {
  if (chain.holds_outputs || j < 0 || j >= chain.size()) return 0;
  const Stage& s = chain.stages[static_cast<size_t>(j)];
  return s.saves_output ? 0 : s.output_bytes;
}

// Whether a_j (1 <= j <= n) is held whatever the stages do: by the runtime (Chain::holds_outputs) or by
// something to the step's end (outputs_held_to_end). output_unheld()'s and output_freed_between()'s rule.
static bool held_regardless(const Chain& chain, const StepContext& context, int64_t j) {
  return chain.holds_outputs || held_to_end_bytes(chain, context, j - 1) > 0;
}

bool output_unheld(const Chain& chain, const StepContext& context, int64_t j) {
  if (j < 1 || j > chain.size() || held_regardless(chain, context, j)) return false;
  if (j == chain.size()) return !context.output_held_in_backward;
  return !stage_flag(context.outputs_held_in_backward, j, true);
}

bool grad_held_through(const Chain& chain, const StepContext& context, int64_t j) {
  if (j < 0 || j >= chain.size() || !output_freed_between(chain, context, j)) return false;
  if (j + 1 == chain.size() && !context.rest_takes_last_input) return false;
  return stage_flag(context.residual_grad_shared, j, true);  // else a copy, let go of once used
}

int64_t grad_held_bytes(const Chain& chain, const StepContext& context, int64_t j, int64_t way) {
  return grad_held_through(chain, context, j) ? chain.stages[static_cast<size_t>(j)].bwd_grad_held(way) : 0;
}

bool output_grad_held(const StepContext& context, int64_t j) {
  return stage_flag(context.output_grad_held_in_backward, j, false);
}

// input_let_go_in_forward() but the reading: whether chain stage j's input may go where nothing held it.
static bool input_may_go(const Chain& chain, const StepContext& context, int64_t j) {
  if (j < 1 || j >= chain.size() || chain.stages[static_cast<size_t>(j)].saves_input) return false;
  const size_t at = static_cast<size_t>(j);
  const bool between = stage_figure(context.between_forward_held_bytes, at) != 0 ||
                       stage_figure(context.between_backward_peak_bytes, at) != 0 ||
                       stage_figure(context.between_held_bytes, at) != 0 ||
                       output_freed_between(chain, context, j - 1);
  // What runs between made the input: let go of where it made it from a_j and let go of a_j there.
  if (between && (!output_freed_between(chain, context, j - 1) ||
                  stage_figure(context.between_forward_held_bytes, at) < 0))
    return false;
  return output_unheld(chain, context, j);
}

bool input_let_go_in_forward(const Chain& chain, const StepContext& context, int64_t j) {
  return !stage_flag(context.inputs_held_in_forward, j, true) && input_may_go(chain, context, j);
}

bool last_input_let_go_in_rest(const Chain& chain, const StepContext& context) {
  const int64_t j = chain.size() - 1;
  return context.last_input_let_go_in_rest && stage_flag(context.inputs_held_in_forward, j, true) &&
         input_may_go(chain, context, j);
}

int64_t input_let_go_extra_bytes(const Chain& chain, const StepContext& context, int64_t j) {
  if (j < 1 || j >= chain.size() || !output_freed_between(chain, context, j - 1)) return 0;
  return std::max<int64_t>(0, stage_figure(context.between_forward_held_bytes, static_cast<size_t>(j)));
}

bool way_leaves_output(const Stage& s, OpKind kind, const OffloadCost* cost, bool groups,
                       const PolicyCost* policy) {
  if (kind == OpKind::kForwardAll) return s.offload ? !s.offload->output : !s.saves_output;
  if (kind != OpKind::kForwardKeep) return false;  // Fc, Fn: a plain output, let go of already
  if (cost) return !cost->output;
  if (groups) return !s.saves_output;
  return policy && !policy->saves_output;
}

int64_t output_freed_in_backward_bytes(const Stage& s, OpKind kind, bool groups, bool streamed) {
  return kind == OpKind::kForwardAll && !groups && !streamed && s.saves_output ? s.bwd_output_freed_bytes : 0;
}

bool output_held_past_runtime(const Chain& chain, const StepContext& context, int64_t j) {
  if (!chain.holds_outputs || j < 0 || j >= chain.size()) return false;
  return stage_flag(context.outputs_held_to_end, j, false) ||
         (j + 1 == chain.size() && context.output_held_in_backward);
}

int64_t output_held_back_bytes(const Stage& s, OpKind kind, bool groups, bool offloaded) {
  if (kind == OpKind::kForwardAll && !groups && !offloaded) return s.bwd_output_freed_bytes;
  // Not measured (a policy, the keep tags, a group assignment, offloaded or streamed): at most the output.
  return kind == OpKind::kForwardAll || kind == OpKind::kForwardKeep ? s.output_bytes : 0;
}

int64_t recomputed_output_held_bytes(const Chain& chain, const StepContext& context, int64_t j) {
  // (One held to the step's end is charged through the recompute already: held_to_end_bytes().)
  if (!output_held_past_runtime(chain, context, j) || held_to_end_bytes(chain, context, j) > 0) return 0;
  return chain.stages[static_cast<size_t>(j)].output_bytes;
}

bool output_freed_early(const Chain& chain, const StepContext& context, int64_t j) {
  if (chain.holds_outputs || j < 0 || j >= chain.size() || !output_unheld(chain, context, j + 1))
    return false;
  return j + 1 < chain.size() || !output_grad_held(context, j);
}

bool output_freed_between(const Chain& chain, const StepContext& context, int64_t j) {
  // The chain's output, which the rest of the step let go of in its forward (StepContext::rest_frees_output):
  // as a next stage's input made from a stage's output, unless the runtime or something else holds it.
  if (j >= 0 && j == chain.size() - 1)
    return context.rest_frees_output && !held_regardless(chain, context, j + 1);
  return j >= 0 && j + 1 < chain.size() && stage_flag(context.between_frees_output, j + 1, false);
}

int64_t held_past_between_bytes(const Stage& s, OpKind kind, const OffloadCost* cost, bool groups,
                                bool offloaded, bool streamed, const PolicyCost* policy) {
  if ((kind != OpKind::kForwardAll && kind != OpKind::kForwardKeep) || groups || streamed) return 0;
  if (offloaded) return cost && cost->output ? s.output_bytes : 0;
  return way_leaves_output(s, kind, cost, false, policy) ? 0 : s.output_bytes;
}

bool leaves_output(const Chain& chain, const Plan& ops, const Op& op) {
  if (op.stage < 0 || op.stage >= chain.size()) return false;
  const std::optional<OffloadCost> c = way_offload(chain, ops, op);
  return way_leaves_output(chain.stages[static_cast<size_t>(op.stage)], op.kind, c ? &*c : nullptr,
                           !op.groups.empty(), way_policy(chain, ops, op));
}

int64_t input_unheld_bytes(const Chain& chain, const StepContext& context) {
  return context.input_held_in_backward ? 0 : chain.input_bytes;
}

bool first_input_let_go(const Chain& chain, const StepContext& context) {
  return chain.size() > 0 && !chain.stages[0].saves_input && input_unheld_bytes(chain, context) > 0 &&
         !stage_flag(context.inputs_held_in_forward, 0, true);
}

int64_t input_gone_from(bool streamed, bool sends_input, bool let_go) {
  if (let_go) return 1;
  // A stage that does not send its input (below the offload's least size, or not among what it saves)
  // leaves it on the device, streamed or not.
  if (!sends_input) return 0;
  return streamed ? 1 : 3;
}

// Whether step stage op.stage's way, offloaded or streamed, sends its input (its offload cost's `input`).
static bool sends_input(const Chain& chain, const Plan& ops, const Op& op) {
  if (!op.offloads()) return false;
  Op in_chain = op;
  in_chain.stage = op.stage - 1;
  const std::optional<OffloadCost> c = way_offload(chain, ops, in_chain);
  return c && c->input;
}

int64_t input_gone_from(const Chain& chain, const StepContext& context, const Plan& ops) {
  if (input_unheld_bytes(chain, context) == 0) return 0;
  int64_t forwards = 0;  // step stage 1's
  for (const Op& op : ops.ops)
    forwards += op.stage == 1 && op.kind != OpKind::kBackward && op.kind != OpKind::kLoss;
  for (const Op& op : ops.ops) {
    if (op.kind == OpKind::kLoss) break;
    if (op.stage != 1 || op.kind == OpKind::kBackward) continue;
    const bool sends = sends_input(chain, ops, op);
    // Run as Fa (kept, or offloaded or streamed not sending it), its only forward, saving none of it, where
    // nothing held it into the backward pass: let go of.
    if (!sends && op.kind == OpKind::kForwardAll && forwards == 1 && first_input_let_go(chain, context))
      return input_gone_from(false, false, true);
    if (op.offloads()) return input_gone_from(op.stream, sends);
  }
  return 0;
}

std::vector<int64_t> step_op_peaks(const Chain& chain, const StepContext& context, const Plan& ops,
                                   const Simulation& sim) {
  const int64_t n = chain.size();
  std::vector<int64_t> peaks(ops.ops.size());
  // How each step stage's backward is charged the gradients it makes: as its last forward ran it
  // (Stage::grads_way; a policy by its index in the chain).
  std::vector<int64_t> way(static_cast<size_t>(n) + 2, -1);
  for (const Op& op : ops.ops) {
    if (op.kind == OpKind::kBackward || op.kind == OpKind::kLoss || op.stage < 0 || op.stage > n + 1)
      continue;
    int64_t policy = -1;
    if (op.policy >= 0 && static_cast<size_t>(op.policy) < ops.policies.size()) {
      const auto it = std::find(chain.policies.begin(), chain.policies.end(),
                                ops.policies[static_cast<size_t>(op.policy)]);
      if (it != chain.policies.end()) policy = it - chain.policies.begin();
    }
    way[static_cast<size_t>(op.stage)] =
        Stage::grads_way(op.kind == OpKind::kForwardKeep, op.stream, !op.groups.empty(), policy);
  }
  // The tensors only the stages hold past the forward (StepContext::taken_bytes), as bits: per step stage s,
  // those its forwards before the loss hold (taken_held_by()), and those held by a stage up to s.
  std::vector<uint32_t> taken_upto(static_cast<size_t>(n) + 2, 0);
  if (!context.taken_bytes.empty()) {
    for (const Op& op : ops.ops) {
      if (op.kind == OpKind::kLoss) break;
      if (op.kind != OpKind::kBackward && op.stage >= 1 && op.stage <= n)
        taken_upto[static_cast<size_t>(op.stage)] |= taken_held_by(context, op.stage - 1, op.kind);
    }
    for (int64_t s = 1; s <= n + 1; ++s)
      taken_upto[static_cast<size_t>(s)] |= taken_upto[static_cast<size_t>(s) - 1];
  }
  // A first stage streamed before the loss, sending its input (OffloadCost::input), takes the chain's input
  // to the host when nothing else holds it (StepContext::input_held_in_backward): from the loss on, the
  // rest's backward and the chain stages' backward passes and recomputes run without it (the first one's
  // measured peak holds it back). Offloaded whole with its input, it takes it until its bytes come back, at
  // the first operation after the loss of it or of the stage after it (simulate()'s schedule).
  const int64_t gone_from = input_gone_from(chain, context, ops);
  const int64_t freed = gone_from > 0 ? input_unheld_bytes(chain, context) : 0;
  // That first stage, streamed, brings the chain's input back within its own backward: what the copy adds to
  // its measured peak, which found its input on the device (OffloadCost::input_back_bytes()).
  int64_t first_back = 0;
  if (gone_from == 1 && freed > 0) {
    for (const Op& op : ops.ops) {
      if (op.kind == OpKind::kLoss) break;
      if (op.stage != 1 || op.kind == OpKind::kBackward || !op.offloads()) continue;
      if (op.stream && sends_input(chain, ops, op)) {
        Op in_chain = op;
        in_chain.stage = 0;
        first_back = way_offload(chain, ops, in_chain)->input_back_bytes(freed);
      }
      break;
    }
  }
  bool input_back = false;
  const int64_t base = context.input_in_base ? chain.input_bytes : int64_t{0};
  bool after_loss = false;
  int64_t arrived = 0;
  std::vector<char> forwarded(static_cast<size_t>(n) + 2, 0);
  // Per step stage: whether its way, as its last forward so far ran it, is known not to save its output; per
  // chain boundary, the bytes of a_j let go of once stage j's backward was done (outputs_held_in_backward).
  std::vector<char> leaves(static_cast<size_t>(n) + 2, 0);
  std::vector<int64_t> let_go(static_cast<size_t>(n) + 1, 0);
  // Per step stage: whether the generators' state its checkpoint saved is held (checkpoint_state_bytes); and
  // whether its last forward so far made a plain output (Fc, Fn), which the simulation lets go of at the next
  // stage's backward rather than at its own.
  std::vector<char> state_held(static_cast<size_t>(n) + 2, 0);
  // Per step stage: whether that state is a checkpoint region's (a group assignment's), held to its
  // backward's end under any runtime.
  std::vector<char> region_state(static_cast<size_t>(n) + 2, 0);
  std::vector<char> plain(static_cast<size_t>(n) + 2, 0);
  // Per step stage: its forward operations run so far (a stage whose forward runs again, sim.forward_calls
  // above 1, replays its draws from the states of its first run).
  std::vector<int64_t> forwarded_so_far(static_cast<size_t>(n) + 2, 0);
  // Per step stage: whether it ran Fc before the loss and has been recomputed since (a per-call checkpoint's
  // recompute, which stops early where the runtime does not hold outputs: recompute_unmade_bytes()).
  std::vector<char> checkpointed(static_cast<size_t>(n) + 2, 0), recomputed(static_cast<size_t>(n) + 2, 0);
  // Per step stage: whether its output, held to the step's end, is charged again already (once: a
  // checkpointed stage's recompute makes it again, and the simulation lets go of that copy at its backward).
  std::vector<char> kept_to_end(static_cast<size_t>(n) + 2, 0);
  auto held_to_end = [&](int64_t s) {  // step stage s's output, let go of by the simulation now
    if (s < 1 || s > n || kept_to_end[static_cast<size_t>(s)]) return int64_t{0};
    kept_to_end[static_cast<size_t>(s)] = 1;
    return held_to_end_bytes(chain, context, s - 1);
  };
  // Per step stage: what its way holds beside the next stage's input (the rest's peak, for the last) where
  // what runs between them let go of its output (held_past_between_bytes()), from the end of its forward
  // before the loss until the next stage's backward (and what runs between, which lets go of that input) is
  // done.
  std::vector<int64_t> past_between(static_cast<size_t>(n) + 2, 0);
  // Per step stage: whether its input a_j was let go of once its forward before the loss was done
  // (input_let_go_in_forward(): run as Fa, not offloaded, the stage before's way not holding it, its only
  // forward, and its backward before any later forward of the stage before, as in a per-layer plan): charged
  // back where the simulation lets go of a_j (the stage before's backward for its abar, below; this stage's
  // backward for a plain one).
  std::vector<char> dropped(static_cast<size_t>(n) + 2, 0);
  // The last stage's input where it goes once the rest's forward is done (last_input_let_go_in_rest()):
  // minus its bytes, from the last stage's forward until then.
  int64_t in_rest = 0;
  // Per step stage: what its backward holds less than with its output held through it, as its last forward
  // so far ran it, where output_freed_early() (output_freed_in_backward_bytes()): charged where it ran once
  // (kept) or is a per-call checkpoint's recompute.
  std::vector<int64_t> freed_in_backward(static_cast<size_t>(n) + 2, 0);
  // Per step stage: what its backward holds beyond its measured peak where something besides the runtime
  // holds its output through it (output_held_back_bytes()), as its last forward so far ran it: charged where
  // it ran once.
  std::vector<int64_t> held_back(static_cast<size_t>(n) + 2, 0);
  // Whether the chain's output gradient is charged past the last stage's backward
  // (output_grad_held_in_backward): from the end of the first backward whose entry is true to the end of the
  // next one whose entry is false.
  bool grad_held = false;
  auto backward_first = [&](size_t k, int64_t s) {
    for (size_t m = k + 1; m < ops.ops.size(); ++m) {
      const Op& o = ops.ops[m];
      if (o.kind == OpKind::kBackward && o.stage == s) return true;
      if (o.kind != OpKind::kBackward && o.kind != OpKind::kLoss && (o.stage == s - 1 || o.stage == s))
        return false;
    }
    return false;
  };
  // Under autocast, what the chain stages' forwards left in autocast's cache (Stage::autocast_cache_bytes),
  // charged whatever their way from each stage's first forward (before the loss: not a replay) through the
  // rest's backward (whose measured peak may be in the rest's forward, inside the caller's autocast region).
  int64_t cached = 0;
  bool rest_done = false;
  for (size_t k = 0; k < ops.ops.size(); ++k) {
    const Op& op = ops.ops[k];
    int64_t past_after = 0;  // past_between's change, from the end of this forward
    if (op.kind == OpKind::kLoss) after_loss = true;
    if (op.kind != OpKind::kBackward && op.kind != OpKind::kLoss && op.stage >= 1 && op.stage <= n) {
      Op in_chain = op;
      in_chain.stage = op.stage - 1;
      leaves[static_cast<size_t>(op.stage)] = leaves_output(chain, ops, in_chain);
      plain[static_cast<size_t>(op.stage)] =
          op.kind == OpKind::kForwardCheckpoint || op.kind == OpKind::kForwardNoSave;
      if (!after_loss) checkpointed[static_cast<size_t>(op.stage)] = op.kind == OpKind::kForwardCheckpoint;
      recomputed[static_cast<size_t>(op.stage)] = after_loss && op.kind == OpKind::kForwardAll;
      freed_in_backward[static_cast<size_t>(op.stage)] =
          output_freed_early(chain, context, in_chain.stage)
              ? output_freed_in_backward_bytes(chain.stages[static_cast<size_t>(in_chain.stage)], op.kind,
                                               !op.groups.empty(), op.stream)
              : 0;
      held_back[static_cast<size_t>(op.stage)] =
          output_held_past_runtime(chain, context, in_chain.stage)
              ? output_held_back_bytes(chain.stages[static_cast<size_t>(in_chain.stage)], op.kind,
                                       !op.groups.empty(), op.offloads())
              : 0;
      // Before the loss: what its way holds beside the next stage's input, where what runs between lets go of
      // its output, once this forward is done (its last forward so far decides).
      if (!after_loss) {
        int64_t past = 0;
        if (output_freed_between(chain, context, in_chain.stage)) {
          const std::optional<OffloadCost> c = way_offload(chain, ops, in_chain);
          past = held_past_between_bytes(chain.stages[static_cast<size_t>(in_chain.stage)], op.kind,
                                         c ? &*c : nullptr, !op.groups.empty(), op.offload && !op.stream,
                                         op.stream, way_policy(chain, ops, in_chain));
        }
        past_after = past - past_between[static_cast<size_t>(op.stage)];
        past_between[static_cast<size_t>(op.stage)] = past;
      }
    }
    // Step stage s is chain stage s - 1; stage n + 1 is the rest, whose measured peak has its own gradients.
    if (rest_done) {
      arrived += context.rest_grads_bytes;
      rest_done = false;
    }
    if (op.kind == OpKind::kBackward && op.stage == n + 1) rest_done = true;
    // What runs between chain stage s - 2 and s - 1 in the forward is held from the later one's first forward
    // on (between_forward_held_bytes).
    if (!after_loss && op.kind != OpKind::kBackward && op.kind != OpKind::kLoss && op.stage >= 2 &&
        op.stage <= n && !forwarded[static_cast<size_t>(op.stage)]) {
      forwarded[static_cast<size_t>(op.stage)] = 1;
      arrived += stage_figure(context.between_forward_held_bytes, static_cast<size_t>(op.stage - 1));
    }
    // A stage's backward adds its own gradients: at its peak, as measured with them made there for the way
    // it ran (Stage::grads_charge_bytes), and all of them once it is done.
    int64_t made = 0, at_peak = 0;
    if (op.kind == OpKind::kBackward && op.stage >= 1 && op.stage <= n &&
        !context.stage_grads_bytes.empty()) {
      made = context.stage_grads_bytes[static_cast<size_t>(op.stage - 1)];
      at_peak = chain.stages[static_cast<size_t>(op.stage - 1)].grads_charge_bytes(
          made, way[static_cast<size_t>(op.stage)]);
    }
    // The gradients of what the stages take beside their input that arrive at this backward: at its peak,
    // but what arrives after it (side_grads_late_bytes), held once it is done.
    if (op.kind == OpKind::kBackward && op.stage >= 1 && op.stage <= n) {
      const size_t j = static_cast<size_t>(op.stage - 1);
      const int64_t side = stage_figure(context.side_grads_bytes, j);
      made += side, at_peak += side - stage_figure(context.side_grads_late_bytes, j);
    }
    // A way that recomputes, or a stage whose forward runs again (Fn, Fc), holds the generators' state of
    // its first run from its forward on, through its replays, to its backward's end.
    const bool forward_op =
        op.kind != OpKind::kBackward && op.kind != OpKind::kLoss && op.stage >= 1 && op.stage <= n;
    const bool replay = forward_op && forwarded_so_far[static_cast<size_t>(op.stage)]++ > 0;
    if (context.checkpoint_state_bytes > 0 && op.stage >= 1 && op.stage <= n &&
        !state_held[static_cast<size_t>(op.stage)] &&
        (recomputes(op.kind, !op.groups.empty()) ||
         (forward_op && sim.forward_calls[static_cast<size_t>(op.stage)] > 1))) {
      state_held[static_cast<size_t>(op.stage)] = 1;
      region_state[static_cast<size_t>(op.stage)] = op.kind == OpKind::kForwardKeep && !op.groups.empty();
      arrived += context.checkpoint_state_bytes;
    }
    if (forward_op && !after_loss && !replay) {
      const int64_t c = chain.stages[static_cast<size_t>(op.stage - 1)].autocast_cache_bytes;
      cached += c, arrived += c;
    }
    if (after_loss && op.kind != OpKind::kLoss && !(op.kind == OpKind::kBackward && op.stage == n + 1))
      arrived -= cached, cached = 0;
    if (after_loss && gone_from > 1 && op.kind != OpKind::kLoss && (op.stage == 1 || op.stage == 2))
      input_back = true;
    const bool without_input = after_loss && !input_back && op.stage >= 1 && op.kind != OpKind::kLoss;
    // Of before_saved_bytes, the tensors only the stages hold past the forward where none holds them now: the
    // rest's forward and backward and the loss, without those no stage holds; a chain stage's backward and
    // recompute, without those no stage up to it holds; the backward of the part before the chain, without
    // any (StepContext::taken_bytes).
    int64_t taken_less = 0;
    if (!context.taken_bytes.empty()) {
      if (op.kind == OpKind::kLoss || op.stage == n + 1)
        taken_less = taken_unheld_bytes(context, taken_upto[static_cast<size_t>(n)]);
      else if (after_loss && op.stage >= 0 && op.stage <= n)
        taken_less = taken_unheld_bytes(context, taken_upto[static_cast<size_t>(op.stage)]);
    }
    const int64_t less = base + (without_input ? freed : 0) + taken_less;
    peaks[k] = sim.op_peak_bytes[k] + arrived + at_peak - less;
    if (op.kind == OpKind::kBackward && op.stage == 1) peaks[k] += first_back;
    // The gradient a residual sum's path holds through a chain stage's backward (grad_held_bytes()).
    if (op.kind == OpKind::kBackward && op.stage >= 1 && op.stage <= n)
      peaks[k] += grad_held_bytes(chain, context, op.stage - 1, way[static_cast<size_t>(op.stage)]);
    // A stage kept whose output the runtime lets go of as its backward begins, which something else holds;
    // one checkpointed, whose recompute makes its output anew beside the one something else holds.
    if (op.kind == OpKind::kBackward && op.stage >= 1 && op.stage <= n &&
        sim.forward_calls[static_cast<size_t>(op.stage)] == 1)
      peaks[k] += held_back[static_cast<size_t>(op.stage)];
    if ((op.kind == OpKind::kBackward || (after_loss && op.kind == OpKind::kForwardAll)) && op.stage >= 1 &&
        op.stage <= n && checkpointed[static_cast<size_t>(op.stage)] &&
        recomputed[static_cast<size_t>(op.stage)])
      peaks[k] += recomputed_output_held_bytes(chain, context, op.stage - 1);
    // That recompute runs inside the stage's backward, once the backward of its last operations, which reads
    // nothing saved, made their gradients (Stage::grads_before_recompute_bytes).
    if (after_loss && op.kind == OpKind::kForwardAll && op.stage >= 1 && op.stage <= n &&
        checkpointed[static_cast<size_t>(op.stage)] && recomputed[static_cast<size_t>(op.stage)])
      peaks[k] += chain.stages[static_cast<size_t>(op.stage - 1)].grads_before_recompute_bytes;
    // A kept stage whose graph alone holds its output lets go of it early in its backward, as does a stage
    // checkpointed per call the output its recompute made again (its last forward, as Fa).
    if (op.kind == OpKind::kBackward && op.stage >= 1 && op.stage <= n &&
        ((!leaves[static_cast<size_t>(op.stage)] && sim.forward_calls[static_cast<size_t>(op.stage)] == 1) ||
         (checkpointed[static_cast<size_t>(op.stage)] && recomputed[static_cast<size_t>(op.stage)])))
      peaks[k] -= freed_in_backward[static_cast<size_t>(op.stage)];
    // The backward of a stage checkpointed per call holds, after its recompute stopped early, no output its
    // graph does not save (the simulation's abar holds it).
    if (op.kind == OpKind::kBackward && op.stage >= 1 && op.stage <= n &&
        checkpointed[static_cast<size_t>(op.stage)] && recomputed[static_cast<size_t>(op.stage)])
      peaks[k] -= recompute_unmade_bytes(chain, op.stage - 1);
    // A replay holds a second generators' state: the one it saves while it replays the first.
    if (replay && state_held[static_cast<size_t>(op.stage)]) peaks[k] += context.checkpoint_state_bytes;
    // So does the recompute that a group assignment's backward runs first (keep tags hold no state): the
    // state it saves while it replays the first, at that recompute's peak, not at the backward's after it.
    // Before (found 2026-12-05 by random group assignments on the CPU), not charged: steps up to that state
    // above their predictions where the recompute was a step's peak.
    // That recompute makes what Fa saves, its output among it, as Fc's does: where the step let go of the
    // first output (let_go, in `arrived` already), the one made anew is held as the recompute ends. Before
    // (found 2026-12-05 by random plans on RoBERTa, bench/architectures.py --random), not charged: a layer's
    // group assignment after a layer on the host held one hidden state more than predicted there, where its
    // recompute was the step's peak (39,104 bytes, 0.95%). Its gradients are those made before it, as Fc's
    // recompute (Stage::grads_before_recompute_bytes), not those at the backward's peak (at_peak, which the
    // backward after it is charged): charged these before, 512 bytes above what it held there. (The
    // simulation's op_peak_bytes, in peaks[k] with at_peak, is the larger of the two: charged apart here.)
    if (op.kind == OpKind::kBackward && op.stage >= 1 && op.stage <= n &&
        sim.op_recompute_peak_bytes[k] > 0) {
      const int64_t state = state_held[static_cast<size_t>(op.stage)] ? context.checkpoint_state_bytes : 0;
      const int64_t recompute =
          std::max(sim.op_recompute_peak_bytes[k],
                   sim.op_recompute_end_bytes[k] + let_go[static_cast<size_t>(op.stage)]);
      const int64_t before = chain.stages[static_cast<size_t>(op.stage - 1)].grads_before_recompute_bytes;
      peaks[k] += std::max(sim.op_backward_peak_bytes[k] + at_peak, recompute + state + before) -
                  (sim.op_peak_bytes[k] + at_peak);
    }
    // The C++ executor (Chain::holds_outputs) lets go of the state it kept for a stage that runs again once
    // the stage's last forward (its recompute) has run: the backward after it holds none. A checkpoint
    // region's (a group assignment's) is held to its backward's end. Before (found 2026-12-05 by plans drawn
    // at random through C++'s Planned), charged through that backward: one state high, safe, where it was
    // the step's peak.
    if (chain.holds_outputs && replay && state_held[static_cast<size_t>(op.stage)] &&
        !region_state[static_cast<size_t>(op.stage)] &&
        forwarded_so_far[static_cast<size_t>(op.stage)] == sim.forward_calls[static_cast<size_t>(op.stage)]) {
      state_held[static_cast<size_t>(op.stage)] = 0;
      arrived -= context.checkpoint_state_bytes;
    }
    // Its input, which it does not save (kept, or offloaded or streamed not sending it) and nothing else
    // holds, goes once this forward is done.
    // Where what runs between made it (a residual sum) and the stage before's way holds its output beside it
    // (past_between), the input is the sum's result alone: it goes as well, and the simulation's a_j stands
    // for that output from this stage's backward on.
    const bool beside = op.stage >= 2 && op.stage <= n && past_between[static_cast<size_t>(op.stage - 1)] > 0;
    if (!after_loss && op.kind == OpKind::kForwardAll && !sends_input(chain, ops, op) && op.stage >= 2 &&
        op.stage <= n &&
        (leaves[static_cast<size_t>(op.stage - 1)] || plain[static_cast<size_t>(op.stage - 1)] || beside) &&
        sim.forward_calls[static_cast<size_t>(op.stage)] == 1 && backward_first(k, op.stage)) {
      // Now, or for the last stage's input let go of in the rest's forward, once that is done.
      const bool now = input_let_go_in_forward(chain, context, op.stage - 1);
      if (now || (op.stage == n && last_input_let_go_in_rest(chain, context))) {
        const int64_t a = chain.activation_bytes(op.stage - 1);
        const bool own =
            !leaves[static_cast<size_t>(op.stage - 1)] && !plain[static_cast<size_t>(op.stage - 1)];
        dropped[static_cast<size_t>(op.stage)] = own ? 2 : 1;
        (now ? arrived : in_rest) -= a + input_let_go_extra_bytes(chain, context, op.stage - 1);
        if (!plain[static_cast<size_t>(op.stage - 1)] && !own) let_go[static_cast<size_t>(op.stage - 1)] = a;
      }
    }
    if (!after_loss && op.stage == n + 1 && op.kind != OpKind::kBackward && op.kind != OpKind::kLoss)
      arrived += in_rest, in_rest = 0;
    arrived += made + past_after;
    // What the stages take beside their input, and gradients of it, let go of once this backward is done.
    if (op.kind == OpKind::kBackward && op.stage >= 1 && op.stage <= n)
      arrived -= stage_figure(context.side_freed_bytes, static_cast<size_t>(op.stage - 1));
    // The stage before's output held beside this stage's input (the rest's, for the last stage's), let go of
    // once this backward (and what runs between, below) is done.
    auto let_go_past = [&]() {
      if (op.kind != OpKind::kBackward || op.stage < 2 || op.stage > n + 1) return;
      arrived -= past_between[static_cast<size_t>(op.stage - 1)];
      past_between[static_cast<size_t>(op.stage - 1)] = 0;
    };
    if (op.kind == OpKind::kBackward && op.stage >= 1 && op.stage <= n &&
        state_held[static_cast<size_t>(op.stage)]) {
      state_held[static_cast<size_t>(op.stage)] = 0;
      arrived -= context.checkpoint_state_bytes;
    }
    // The chain's output a_n, which nothing else holds and the last stage does not save, goes once the rest's
    // backward is done (output_held_in_backward).
    if (op.kind == OpKind::kBackward && op.stage == n + 1 && leaves[static_cast<size_t>(n)] &&
        output_unheld(chain, context, n)) {
      let_go[static_cast<size_t>(n)] = chain.activation_bytes(n);
      arrived -= let_go[static_cast<size_t>(n)];
    }
    // An output held to the step's end (outputs_held_to_end), from where the simulation lets go of it on:
    // a plain one when the stage that takes it is done (the rest's backward for the chain's output, below for
    // a chain stage's, once what runs between has run), another with its stage's abar.
    if (op.kind == OpKind::kBackward && op.stage == n + 1 && plain[static_cast<size_t>(n)])
      arrived += held_to_end(n);
    if (op.kind == OpKind::kBackward && op.stage == n + 1) let_go_past();
    if (op.kind != OpKind::kBackward || op.stage < 1 || op.stage > n) continue;
    const size_t j = static_cast<size_t>(op.stage - 1);  // the chain stage whose backward this is
    arrived += held_to_end(op.stage);                    // with its abar (a plain one is charged already)
    // Its output, let go of once the next stage's backward (or the rest's) was done, the simulation lets go
    // of now.
    arrived += let_go[j + 1];
    let_go[j + 1] = 0;
    // What runs between chain stage s - 2 and s - 1 (between_backward_peak_bytes) runs once the later one's
    // backward is done, above what it left held and every gradient arrived by then; what it leaves held
    // (between_held_bytes, its gradients less what it frees) from then on.
    if (op.stage >= 2) {
      const int64_t between = stage_figure(context.between_backward_peak_bytes, j),
                    held = stage_figure(context.between_held_bytes, j);
      // (Once this backward is done, the tensors only this stage held are let go of too.)
      const int64_t between_less =
          less - taken_less + (context.taken_bytes.empty() ? 0 : taken_unheld_bytes(context, taken_upto[j]));
      if (between > 0 || held != 0)
        peaks[k] = std::max(peaks[k], sim.op_done_bytes[k] + arrived + between - between_less);
      arrived += held;
      // What of its input, gone since its forward, runs between made beyond a_j, which held lets go of; and
      // a_j, where the stage before's way holds its output (the simulation's a_j from now on).
      if (dropped[static_cast<size_t>(op.stage)])
        arrived += input_let_go_extra_bytes(chain, context, static_cast<int64_t>(j));
      if (dropped[static_cast<size_t>(op.stage)] == 2)
        arrived += chain.activation_bytes(static_cast<int64_t>(j));
      // Its input a_j, which nothing else holds and the stage before it does not save, goes now (unless gone
      // since its forward).
      if (leaves[static_cast<size_t>(op.stage - 1)] && !dropped[static_cast<size_t>(op.stage)] &&
          output_unheld(chain, context, static_cast<int64_t>(j))) {
        let_go[j] = chain.activation_bytes(static_cast<int64_t>(j));
        arrived -= let_go[j];
      }
      // Its input a_j, a plain output held to the step's end, which the simulation lets go of now.
      if (plain[static_cast<size_t>(op.stage - 1)]) arrived += held_to_end(op.stage - 1);
      // Its input a_j, a plain output gone since its forward, which the simulation lets go of now.
      if (plain[static_cast<size_t>(op.stage - 1)] && dropped[static_cast<size_t>(op.stage)])
        arrived += chain.activation_bytes(static_cast<int64_t>(j));
    }
    let_go_past();
    // The chain's output gradient, held past the last stage's backward or let go of now.
    const bool held_now = output_grad_held(context, static_cast<int64_t>(j));
    if (held_now != grad_held) arrived += held_now ? chain.activation_bytes(n) : -chain.activation_bytes(n);
    grad_held = held_now;
  }
  return peaks;
}

int64_t step_peak_of(const StepContext& context, const std::vector<int64_t>& op_peaks) {
  int64_t peak = std::max(context.before_peak_bytes, context.before_backward_peak_bytes);
  for (int64_t p : op_peaks)
    peak = std::max(peak, p);
  return peak;
}

}  // namespace detail

int64_t step_peak_bytes(const Chain& chain, const StepContext& context, const Plan& plan) {
  const Chain step = step_chain(chain, context);
  const Plan ops = step_plan(plan);
  return detail::step_peak_of(context, detail::step_op_peaks(chain, context, ops, simulate(step, ops)));
}

double step_time_ms(const Chain& chain, const StepContext& context, const Plan& plan) {
  constexpr const char* kWho = "remat::step_time_ms";
  validate(chain);
  validate(context, chain);
  check_plan(plan);
  const int64_t n = chain.size();
  if (plan.num_stages != n) {
    throw std::invalid_argument(std::string(kWho) + ": the plan is for " + std::to_string(plan.num_stages) +
                                " stages, the chain has " + std::to_string(n));
  }
  return detail::per_layer_step_time(chain, context, plan) + context.rest_ms;
}

namespace {
StepPlan plan_step_by_model(const Chain& chain, const StepContext& context, int64_t budget_bytes,
                            const std::string& planner, const PlannerOptions& options);
}  // namespace

StepPlan plan_step(const Chain& chain, const StepContext& context, int64_t budget_bytes,
                   const std::string& planner, const PlannerOptions& options) {
  try {
    return plan_step_by_model(chain, context, budget_bytes, planner, options);
  } catch (const InfeasibleBudget& e) {
    // The model charges a recompute as a whole stage run beside its output, which a per-call checkpoint's
    // recompute (stopping early) never holds, so it can refuse a budget that every stage checkpointed fits:
    // the profiling step ran exactly that schedule and measured its peak.
    if (context.checkpoint_all_peak_bytes < 0 || context.checkpoint_all_peak_bytes > budget_bytes) {
      if (context.checkpoint_all_peak_bytes >= 0 && context.checkpoint_all_peak_bytes < e.min_bytes())
        refuse(budget_bytes, context.checkpoint_all_peak_bytes, planner, context);
      throw;
    }
    StepPlan out;
    // Every stage checkpointed, as the profiling step ran it. A stage without a backward ran so as kept
    // (Stage::has_backward): the per-layer planner's plan says kept, as its program would.
    std::vector<int64_t> every;
    for (int64_t i = 0; i < chain.size(); ++i)
      if (planner != "per-layer" || chain.stages[static_cast<size_t>(i)].has_backward) every.push_back(i);
    out.plan = static_cast<int64_t>(every.size()) == chain.size()
                   ? checkpoint_all(chain)
                   : detail::finish(chain, checkpoint_stages(chain.size(), every), "all", 0);
    out.step_peak_bytes = context.checkpoint_all_peak_bytes;
    // Its time as the per-layer program charges a checkpointed stage (run per call, its recompute stopping
    // early), as the profiling step ran it; not simulate()'s Fn, Fa and B.
    out.plan.predicted.time_ms = per_call_time_ms(chain, every);
    out.step_time_ms = out.plan.predicted.time_ms + context.rest_ms;
    return out;
  }
}

namespace {
StepPlan plan_step_by_model(const Chain& chain, const StepContext& context, int64_t budget_bytes,
                            const std::string& planner, const PlannerOptions& options) {
  const bool layers = is_per_layer(planner);
  validate(chain);
  validate(context, chain);
  if (budget_bytes <= 0)
    throw std::invalid_argument(std::string(kWho) + ": the budget must be positive, got " +
                                std::to_string(budget_bytes) + " bytes");
  StepPlan out;
  auto fits = [&](Plan plan, StepPlan* to) {
    const int64_t peak = step_peak_bytes(chain, context, plan);
    if (peak > budget_bytes) return peak;
    to->step_time_ms = plan.predicted.time_ms + context.rest_ms;
    to->plan = std::move(plan);
    to->step_peak_bytes = peak;
    return peak;
  };
  if (layers) {
    // Exact: the per-layer program on the whole step.
    int64_t least = 0;
    std::optional<Plan> plan = detail::per_layer_in_step(chain, context, budget_bytes, options, &least);
    if (!plan) refuse(budget_bytes, least, planner, context);
    const int64_t peak = fits(std::move(*plan), &out);
    if (peak > budget_bytes)
      throw std::logic_error(std::string(kWho) + ": internal error: the per-layer plan's step peak (" +
                             std::to_string(peak) + " bytes) exceeds the budget it was planned for (" +
                             std::to_string(budget_bytes) + ")");
    return out;
  }
  // The step's peak is at least the chain's (less the input when it is in the base), so no plan above the
  // first chain budget fits. Walking down the optimal planner's frontier one plan at a time (each next chain
  // budget one byte under the last plan's peak), the first plan that fits the step is the fastest of that
  // frontier that does; after kWalk plans (long chains) the chain's budget is lowered by the step's excess
  // instead, which skips plans that might have fitted. A plan off the chain's frontier (slower for the chain
  // alone, yet lower for the step) is not considered.
  constexpr int kWalk = 256;
  const int64_t floor = min_feasible_budget(chain, options);
  int64_t chain_budget = budget_bytes + (context.input_in_base ? chain.input_bytes : int64_t{0});
  for (int attempt = 0; attempt < kWalk + 64 && chain_budget >= floor; ++attempt) {
    Plan plan = optimal(chain, chain_budget, options);
    const int64_t chain_peak = plan.predicted.peak_bytes;
    const int64_t peak = fits(std::move(plan), &out);
    if (peak <= budget_bytes) return out;
    chain_budget = attempt < kWalk ? std::min(chain_budget, chain_peak) - 1
                                   : chain_budget - std::max<int64_t>(peak - budget_bytes, 1);
  }
  const int64_t least = fits(optimal(chain, floor, options), &out);
  if (least <= budget_bytes) return out;
  refuse(budget_bytes, least, planner, context);
}
}  // namespace

int64_t min_step_budget(const Chain& chain, const StepContext& context, const std::string& planner,
                        const PlannerOptions& options) {
  const bool layers = is_per_layer(planner);
  validate(chain);
  validate(context, chain);
  const int64_t model =
      layers ? detail::per_layer_step_min(chain, context, options)
             : step_peak_bytes(chain, context, optimal(chain, min_feasible_budget(chain, options), options));
  // plan_step() accepts the measured every-stage-checkpointed peak too.
  return context.checkpoint_all_peak_bytes >= 0 ? std::min(model, context.checkpoint_all_peak_bytes) : model;
}

PredictionCheck check_prediction(int64_t predicted_bytes, int64_t measured_bytes, int64_t budget_bytes,
                                 double tolerance) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("remat::check_prediction: " + what); };
  if (predicted_bytes <= 0) bad("the prediction must be > 0 bytes, got " + std::to_string(predicted_bytes));
  if (measured_bytes < 0) bad("the measured peak must be >= 0 bytes, got " + std::to_string(measured_bytes));
  if (budget_bytes <= 0) bad("the budget must be > 0 bytes, got " + std::to_string(budget_bytes));
  if (!(tolerance >= 0) || !std::isfinite(tolerance))
    bad("the tolerance must be a finite share >= 0, got " + std::to_string(tolerance));
  PredictionCheck c;
  c.error = double(measured_bytes - predicted_bytes) / double(predicted_bytes);
  c.beyond = std::abs(c.error) > tolerance;
  if (c.beyond && measured_bytes > predicted_bytes)
    c.replan_budget_bytes = std::max<int64_t>(0, budget_bytes - (measured_bytes - predicted_bytes));
  return c;
}

int64_t covering_shape(const std::vector<InputShape>& planned, const InputShape& shape) {
  auto elements = [](const InputShape& s) {
    int64_t n = 0;
    for (const auto& sizes : s) {
      int64_t m = 1;
      for (const int64_t d : sizes) {
        if (d < 0)
          throw std::invalid_argument("remat::covering_shape: a size is negative (" + std::to_string(d) +
                                      ")");
        m *= d;
      }
      n += m;
    }
    return n;
  };
  elements(shape);  // its sizes checked
  int64_t best = -1, best_elements = 0;
  for (size_t j = 0; j < planned.size(); ++j) {
    const InputShape& p = planned[j];
    bool covers = p.size() == shape.size();
    for (size_t t = 0; covers && t < p.size(); ++t) {
      covers = p[t].size() == shape[t].size();
      for (size_t d = 0; covers && d < p[t].size(); ++d)
        covers = p[t][d] >= shape[t][d];
    }
    if (!covers) continue;
    const int64_t n = elements(p);
    if (best < 0 || n < best_elements) {
      best = static_cast<int64_t>(j);
      best_elements = n;
    }
  }
  return best;
}

}  // namespace remat
