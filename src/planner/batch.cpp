// The largest batch (remat/planner/batch.h): profiles carried to another batch size, and the search.

#include "remat/planner/batch.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

namespace remat {
namespace {

// The line through (batch_a, va) and (batch_b, vb), read at batch.
struct Line {
  int64_t batch_a, batch_b, batch;
  double at(double va, double vb) const {
    return va + (vb - va) * double(batch - batch_a) / double(batch_b - batch_a);
  }
  // Bytes that may be negative (what may free more than it makes): not floored at 0.
  int64_t signed_bytes(int64_t va, int64_t vb) const { return std::llround(at(double(va), double(vb))); }
  int64_t bytes(int64_t va, int64_t vb) const { return std::max<int64_t>(0, signed_bytes(va, vb)); }
  std::optional<int64_t> bytes(const std::optional<int64_t>& va, const std::optional<int64_t>& vb) const {
    if (!va || !vb) return std::nullopt;
    return bytes(*va, *vb);
  }
  double ms(double va, double vb) const { return std::max(0.0, at(va, vb)); }
  std::optional<double> ms(const std::optional<double>& va, const std::optional<double>& vb) const {
    if (!va || !vb) return std::nullopt;
    return ms(*va, *vb);
  }
};

void check_batches(const char* who, int64_t batch_a, int64_t batch_b, int64_t batch) {
  if (batch_a < 1 || batch_b < 1 || batch < 1)
    throw std::invalid_argument(std::string(who) + ": batches must be >= 1, got " + std::to_string(batch_a) +
                                ", " + std::to_string(batch_b) + " and " + std::to_string(batch));
  if (batch_a == batch_b)
    throw std::invalid_argument(std::string(who) +
                                ": the two profiles must be at different batches, both are " +
                                std::to_string(batch_a));
}

[[noreturn]] void differ(const std::string& what) {
  throw std::invalid_argument("remat::chain_at_batch: the profiles are not of one chain: " + what);
}

std::optional<OffloadCost> offload_at(const std::optional<OffloadCost>& a,
                                      const std::optional<OffloadCost>& b, const Line& line,
                                      const std::string& where) {
  if (!a || !b) return std::nullopt;
  if (a->input != b->input || a->output != b->output)
    differ(where + " offloads its input or output in one profile only");
  OffloadCost c = *a;
  c.bytes = line.bytes(a->bytes, b->bytes);
  c.after_forward = a->after_forward || b->after_forward;  // the copies hidden the less, where either is
  if (a->can_stream() && b->can_stream()) {
    c.stream_fwd_bytes = line.bytes(a->stream_fwd_bytes, b->stream_fwd_bytes);
    c.stream_bwd_bytes = line.bytes(a->stream_bwd_bytes, b->stream_bwd_bytes);
    c.stream_bwd_grads_bytes = a->stream_bwd_grads_bytes >= 0 && b->stream_bwd_grads_bytes >= 0
                                   ? line.bytes(a->stream_bwd_grads_bytes, b->stream_bwd_grads_bytes)
                                   : -1;
    c.stream_bwd_input_bytes = a->stream_bwd_input_bytes >= 0 && b->stream_bwd_input_bytes >= 0
                                   ? line.bytes(a->stream_bwd_input_bytes, b->stream_bwd_input_bytes)
                                   : -1;
  } else {
    c.stream_fwd_bytes = c.stream_bwd_bytes = c.stream_bwd_grads_bytes = c.stream_bwd_input_bytes = -1;
  }
  c.window_bytes = line.bytes(a->window_bytes, b->window_bytes);
  // What comes back ahead: on the line too, within the window there.
  c.ahead_bytes = c.can_stream() && a->ahead_bytes >= 0 && b->ahead_bytes >= 0
                      ? std::min(line.bytes(a->ahead_bytes, b->ahead_bytes), c.window_bytes)
                      : -1;
  return c;
}

// Per stage, held where either context holds it (two flag vectors of one size).
std::vector<bool> held_where_either(const std::vector<bool>& a, const std::vector<bool>& b) {
  std::vector<bool> held = a;
  for (size_t j = 0; j < held.size(); ++j)
    held[j] = a[j] || b[j];
  return held;
}

// A context's per-stage figures' lengths, for an error: the between figures', side_grads_bytes',
// side_freed_bytes', outputs_held_in_backward's, inputs_held_in_forward's, output_grad_held_in_backward's,
// outputs_held_to_end's, between_frees_output's and residual_grad_shared's.
std::string per_stage_sizes(const StepContext& c) {
  return std::to_string(c.between_backward_peak_bytes.size()) + "/" +
         std::to_string(c.side_grads_bytes.size()) + "/" + std::to_string(c.side_freed_bytes.size()) + "/" +
         std::to_string(c.outputs_held_in_backward.size()) + "/" +
         std::to_string(c.inputs_held_in_forward.size()) + "/" +
         std::to_string(c.output_grad_held_in_backward.size()) + "/" +
         std::to_string(c.outputs_held_to_end.size()) + "/" + std::to_string(c.between_frees_output.size()) +
         "/" + std::to_string(c.residual_grad_shared.size());
}

}  // namespace

Chain chain_at_batch(const Chain& a, int64_t batch_a, const Chain& b, int64_t batch_b, int64_t batch) {
  check_batches("remat::chain_at_batch", batch_a, batch_b, batch);
  if (a.stages.size() != b.stages.size())
    differ(std::to_string(a.stages.size()) + " stages against " + std::to_string(b.stages.size()));
  if (a.policies != b.policies) differ("their policies differ");
  if (a.keep != b.keep) differ("their keep tags differ");
  const Line line{batch_a, batch_b, batch};
  Chain c = a;
  c.input_bytes = line.bytes(a.input_bytes, b.input_bytes);
  const bool offload = a.can_offload() && b.can_offload();
  c.to_host_gb_per_s = offload ? (a.to_host_gb_per_s + b.to_host_gb_per_s) / 2 : 0;
  c.to_device_gb_per_s = offload ? (a.to_device_gb_per_s + b.to_device_gb_per_s) / 2 : 0;
  c.copies_at_once = a.copies_at_once || b.copies_at_once;  // the copies hidden the less, where either is
  for (size_t i = 0; i < c.stages.size(); ++i) {
    Stage& s = c.stages[i];
    const Stage& sa = a.stages[i];
    const Stage& sb = b.stages[i];
    const std::string where = "stage " + std::to_string(i) + " ('" + sa.name + "')";
    if (sa.name != sb.name) differ(where + " is '" + sb.name + "' in the other");
    s.fwd_ms = line.ms(sa.fwd_ms, sb.fwd_ms);
    s.bwd_ms = line.ms(sa.bwd_ms, sb.bwd_ms);
    s.fwd_nosave_ms = line.ms(sa.fwd_nosave_ms, sb.fwd_nosave_ms);
    s.checkpoint_fwd_ms = line.ms(sa.checkpoint_fwd_ms, sb.checkpoint_fwd_ms);
    s.checkpoint_bwd_ms = line.ms(sa.checkpoint_bwd_ms, sb.checkpoint_bwd_ms);
    s.groups_fwd_ms = line.ms(sa.groups_fwd_ms, sb.groups_fwd_ms);
    s.groups_bwd_ms = line.ms(sa.groups_bwd_ms, sb.groups_bwd_ms);
    s.output_bytes = line.bytes(sa.output_bytes, sb.output_bytes);
    s.saved_bytes = std::max(s.output_bytes, line.bytes(sa.saved_bytes, sb.saved_bytes));
    s.saves_output = sa.saves_output || sb.saves_output;  // saved where either profile saw it saved
    s.saves_input = sa.saves_input || sb.saves_input;     // likewise
    s.has_backward = sa.has_backward || sb.has_backward;  // likewise
    s.autocast_cache_bytes =
        std::max<int64_t>(0, line.bytes(sa.autocast_cache_bytes, sb.autocast_cache_bytes));
    s.grads_before_recompute_bytes =
        std::max<int64_t>(0, line.bytes(sa.grads_before_recompute_bytes, sb.grads_before_recompute_bytes));
    s.bwd_output_freed_bytes = std::clamp<int64_t>(
        line.bytes(sa.bwd_output_freed_bytes, sb.bwd_output_freed_bytes), 0, s.output_bytes);
    s.fwd_tmp_bytes = line.bytes(sa.fwd_tmp_bytes, sb.fwd_tmp_bytes);
    // Where either profile measured it, the other's stand-in (its output's bytes) beside it, within the
    // output.
    s.bwd_grad_held_bytes = std::nullopt;
    if (sa.bwd_grad_held_bytes || sb.bwd_grad_held_bytes)
      s.bwd_grad_held_bytes =
          std::clamp<int64_t>(line.bytes(sa.bwd_grad_held(), sb.bwd_grad_held()), 0, s.output_bytes);
    // Where one profile measured it and the other did not, the other's stands in for it (as the planners read
    // it).
    s.fwd_nosave_tmp_bytes = std::nullopt;
    if (sa.fwd_nosave_tmp_bytes || sb.fwd_nosave_tmp_bytes)
      s.fwd_nosave_tmp_bytes = line.bytes(sa.nosave_tmp_bytes(), sb.nosave_tmp_bytes());
    s.bwd_tmp_bytes = line.bytes(sa.bwd_tmp_bytes, sb.bwd_tmp_bytes);
    s.bwd_grads_tmp_bytes = line.bytes(sa.bwd_grads_tmp_bytes, sb.bwd_grads_tmp_bytes);
    if (sa.has_keep() && sb.has_keep()) {
      s.keep_fwd_ms = line.ms(sa.keep_fwd_ms, sb.keep_fwd_ms);
      s.keep_bwd_ms = line.ms(sa.keep_bwd_ms, sb.keep_bwd_ms);
      s.keep_saved_bytes = std::max(line.bytes(*sa.keep_saved_bytes, *sb.keep_saved_bytes), s.output_bytes);
    } else {
      s.keep_saved_bytes.reset(), s.keep_fwd_ms.reset(), s.keep_bwd_ms.reset();
    }
    s.offload = offload_at(sa.offload, sb.offload, line, where);
    s.keep_offload = offload_at(sa.keep_offload, sb.keep_offload, line, where);
    s.checkpoint_offload = offload_at(sa.checkpoint_offload, sb.checkpoint_offload, line, where);
    if (sa.policies.size() != sb.policies.size()) differ(where + " has policy costs in one profile only");
    for (size_t p = 0; p < s.policies.size(); ++p) {
      const PolicyCost& pa = sa.policies[p];
      const PolicyCost& pb = sb.policies[p];
      if (pa.policy != pb.policy)
        differ(where + "'s policy '" + pa.policy + "' is '" + pb.policy + "' in the other");
      PolicyCost& pc = s.policies[p];
      // At least the output; it may exceed what Fa keeps (a policy that keeps a product Fa frees).
      pc.saved_bytes = std::max(line.bytes(pa.saved_bytes, pb.saved_bytes), s.output_bytes);
      pc.fwd_ms = line.ms(pa.fwd_ms, pb.fwd_ms);
      pc.bwd_ms = line.ms(pa.bwd_ms, pb.bwd_ms);
      pc.bwd_tmp_bytes = line.bytes(pa.bwd_tmp_bytes, pb.bwd_tmp_bytes);
      pc.bwd_grads_tmp_bytes = line.bytes(pa.bwd_grads_tmp_bytes, pb.bwd_grads_tmp_bytes);
      pc.offload = offload_at(pa.offload, pb.offload, line, where + " under '" + pa.policy + "'");
      pc.saves_output = pa.saves_output || pb.saves_output;  // held where either profile saw it held
      // Where either profile measured it, the other's stand-in (the stage's figure) beside it.
      pc.bwd_grad_held_bytes = std::nullopt;
      if (pa.bwd_grad_held_bytes || pb.bwd_grad_held_bytes)
        pc.bwd_grad_held_bytes = std::clamp<int64_t>(
            line.bytes(sa.bwd_grad_held(static_cast<int64_t>(p)), sb.bwd_grad_held(static_cast<int64_t>(p))),
            0, s.output_bytes);
    }
    if (sa.groups.size() != sb.groups.size()) differ(where + " has another number of saved groups");
    for (size_t g = 0; g < s.groups.size(); ++g) {
      if (sa.groups[g].name != sb.groups[g].name)
        differ(where + "'s group " + std::to_string(g) + " is '" + sa.groups[g].name +
               "' in one profile and '" + sb.groups[g].name + "' in the other");
      s.groups[g].bytes = line.bytes(sa.groups[g].bytes, sb.groups[g].bytes);
      s.groups[g].recompute_ms = line.ms(sa.groups[g].recompute_ms, sb.groups[g].recompute_ms);
      s.groups[g].unsaved_bytes =
          std::min(s.groups[g].bytes, line.bytes(sa.groups[g].unsaved_bytes, sb.groups[g].unsaved_bytes));
      s.groups[g].stays_bytes =
          std::min(s.groups[g].bytes, line.bytes(sa.groups[g].stays_bytes, sb.groups[g].stays_bytes));
      // Measured in both or neither (-1).
      const int64_t pa = sa.groups[g].fwd_peak_before_bytes, pb = sb.groups[g].fwd_peak_before_bytes;
      s.groups[g].fwd_peak_before_bytes = pa >= 0 && pb >= 0 ? line.bytes(pa, pb) : -1;
      const int64_t qa = sa.groups[g].fwd_peak_after_bytes, qb = sb.groups[g].fwd_peak_after_bytes;
      s.groups[g].fwd_peak_after_bytes = qa >= 0 && qb >= 0 ? line.bytes(qa, qb) : -1;
    }
  }
  return c;
}

StepContext context_at_batch(const StepContext& a, int64_t batch_a, const StepContext& b, int64_t batch_b,
                             int64_t batch) {
  check_batches("remat::context_at_batch", batch_a, batch_b, batch);
  if (a.input_in_base != b.input_in_base)
    throw std::invalid_argument(
        "remat::context_at_batch: one context holds the chain's input in its base, the "
        "other does not");
  if (a.stage_grads_bytes.size() != b.stage_grads_bytes.size())
    throw std::invalid_argument("remat::context_at_batch: the contexts are of " +
                                std::to_string(a.stage_grads_bytes.size()) + " and " +
                                std::to_string(b.stage_grads_bytes.size()) + " stages");
  if (a.between_backward_peak_bytes.size() != b.between_backward_peak_bytes.size() ||
      a.between_forward_held_bytes.size() != b.between_forward_held_bytes.size() ||
      a.between_held_bytes.size() != b.between_held_bytes.size() ||
      a.side_grads_bytes.size() != b.side_grads_bytes.size() ||
      a.side_freed_bytes.size() != b.side_freed_bytes.size() ||
      a.outputs_held_in_backward.size() != b.outputs_held_in_backward.size() ||
      a.inputs_held_in_forward.size() != b.inputs_held_in_forward.size() ||
      a.output_grad_held_in_backward.size() != b.output_grad_held_in_backward.size() ||
      a.outputs_held_to_end.size() != b.outputs_held_to_end.size() ||
      a.between_frees_output.size() != b.between_frees_output.size() ||
      a.residual_grad_shared.size() != b.residual_grad_shared.size())
    throw std::invalid_argument(
        "remat::context_at_batch: the contexts' per-stage figures (between_backward_peak_bytes and the other "
        "between figures, side_grads_bytes, side_freed_bytes, outputs_held_in_backward, "
        "inputs_held_in_forward, output_grad_held_in_backward, outputs_held_to_end, between_frees_output, "
        "residual_grad_shared) "
        "differ in length: one has them for " +
        per_stage_sizes(a) + " stages, the other for " + per_stage_sizes(b));
  const Line line{batch_a, batch_b, batch};
  StepContext c = a;
  // A per-stage figure on the line, entry by entry (floored at 0 unless `signed_figure`), and its sum.
  auto per_stage = [&](std::vector<int64_t> StepContext::*field, bool signed_figure = false) {
    int64_t sum = 0;
    std::vector<int64_t>& out = c.*field;
    for (size_t i = 0; i < out.size(); ++i) {
      const int64_t va = (a.*field)[i], vb = (b.*field)[i];
      sum += out[i] = signed_figure ? line.signed_bytes(va, vb) : line.bytes(va, vb);
    }
    return sum;
  };
  c.before_saved_bytes = line.bytes(a.before_saved_bytes, b.before_saved_bytes);
  c.before_peak_bytes = line.bytes(a.before_peak_bytes, b.before_peak_bytes);
  c.before_backward_peak_bytes = line.bytes(a.before_backward_peak_bytes, b.before_backward_peak_bytes);
  c.rest_peak_bytes = line.bytes(a.rest_peak_bytes, b.rest_peak_bytes);
  c.rest_ms = line.ms(a.rest_ms, b.rest_ms);
  c.rest_grads_bytes =  // signed: at most what the part before holds let go of
      std::max(-c.before_saved_bytes, line.signed_bytes(a.rest_grads_bytes, b.rest_grads_bytes));
  // A measured peak is the largest of the step's moments, and which moment is largest changes with the batch:
  // on a BERT of width 256 the embedding's dense gradient (the same at every batch) tops the step at batches
  // 2 and 4, the layers' recomputes from batch 16 on, so a line through two peaks is no peak at a third batch
  // (it predicted 43 MB at batch 44 where the step holds 190). Only the batches measured keep theirs.
  c.checkpoint_all_peak_bytes = batch == batch_a   ? a.checkpoint_all_peak_bytes
                                : batch == batch_b ? b.checkpoint_all_peak_bytes
                                                   : -1;
  per_stage(&StepContext::stage_grads_bytes);
  c.side_bytes = line.bytes(a.side_bytes, b.side_bytes);
  // Of it, the gradients arriving and what is let go of per stage: each a part of it (each line stops at 0 on
  // its own).
  const int64_t side_grads = per_stage(&StepContext::side_grads_bytes),
                side_freed = per_stage(&StepContext::side_freed_bytes);
  c.side_bytes = std::max({c.side_bytes, side_grads, side_freed});
  // Of each stage's arriving gradients, what arrives after its backward's peak: all of it where it does at
  // both batches, else none (charged at the peak); none where either context did not read it.
  c.side_grads_late_bytes.clear();
  if (a.side_grads_late_bytes.size() == a.side_grads_bytes.size() &&
      b.side_grads_late_bytes.size() == b.side_grads_bytes.size() && !c.side_grads_bytes.empty()) {
    c.side_grads_late_bytes.assign(c.side_grads_bytes.size(), 0);
    for (size_t j = 0; j < c.side_grads_bytes.size(); ++j) {
      const bool late = a.side_grads_late_bytes[j] == a.side_grads_bytes[j] &&
                        b.side_grads_late_bytes[j] == b.side_grads_bytes[j];
      if (late) c.side_grads_late_bytes[j] = c.side_grads_bytes[j];
    }
  }
  // What runs between two stages: a line through its two readings, as the rest's peak; what its forward and
  // its backward leave held signed (they may free more than they make).
  per_stage(&StepContext::between_backward_peak_bytes);
  per_stage(&StepContext::between_forward_held_bytes, true);
  per_stage(&StepContext::between_held_bytes, true);
  c.input_held_in_backward = a.input_held_in_backward || b.input_held_in_backward;  // held where either is
  c.outputs_held_in_backward = held_where_either(a.outputs_held_in_backward, b.outputs_held_in_backward);
  c.inputs_held_in_forward = held_where_either(a.inputs_held_in_forward, b.inputs_held_in_forward);
  c.output_held_in_backward = a.output_held_in_backward || b.output_held_in_backward;
  c.outputs_held_to_end = held_where_either(a.outputs_held_to_end, b.outputs_held_to_end);
  // Charged where either let go of it (the charge is held_past_between_bytes()'s).
  c.between_frees_output = held_where_either(a.between_frees_output, b.between_frees_output);
  c.rest_frees_output = a.rest_frees_output || b.rest_frees_output;
  c.rest_takes_last_input = a.rest_takes_last_input || b.rest_takes_last_input;
  c.last_input_let_go_in_rest = a.last_input_let_go_in_rest && b.last_input_let_go_in_rest;    // where both
  c.residual_grad_shared = held_where_either(a.residual_grad_shared, b.residual_grad_shared);  // charged so
  c.output_grad_held_in_backward =
      held_where_either(a.output_grad_held_in_backward, b.output_grad_held_in_backward);
  // The generators' state a checkpoint saves: the same at every batch.
  c.checkpoint_state_bytes = std::max(a.checkpoint_state_bytes, b.checkpoint_state_bytes);
  // The tensors only the stages hold past the forward (masks: a line through their bytes, as the batch makes
  // them), where both contexts list the same ones taken and saved by the same stages and they stay within
  // before_saved_bytes; else none (each charged to the step's end, as before_saved_bytes charges it).
  c.taken_bytes.clear(), c.taken_by.clear(), c.taken_saved_by.clear();
  if (a.taken_bytes.size() == b.taken_bytes.size() && a.taken_by == b.taken_by &&
      a.taken_saved_by == b.taken_saved_by) {
    int64_t sum = 0;
    std::vector<int64_t> bytes;
    for (size_t m = 0; m < a.taken_bytes.size(); ++m)
      sum += bytes.emplace_back(line.bytes(a.taken_bytes[m], b.taken_bytes[m]));
    if (sum <= c.before_saved_bytes) {
      c.taken_bytes = std::move(bytes);
      c.taken_by = a.taken_by;
      c.taken_saved_by = a.taken_saved_by;
    }
  }
  return c;
}

int64_t largest_batch(const std::function<bool(int64_t)>& fits, int64_t limit) {
  if (limit < 1)
    throw std::invalid_argument("remat::largest_batch: the limit must be >= 1, got " + std::to_string(limit));
  if (!fits(1)) return 0;
  int64_t lo = 1, hi;  // fits(lo); hi: the least batch known not to fit, or limit + 1
  for (int64_t next = 2;; next *= 2) {
    if (next > limit) {
      hi = limit + 1;
      break;
    }
    if (!fits(next)) {
      hi = next;
      break;
    }
    lo = next;
    if (next > limit / 2) {  // the next doubling passes the limit (and would overflow near INT64_MAX)
      hi = limit + 1;
      break;
    }
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace remat
