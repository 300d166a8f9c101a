#include "remat/planner/per_layer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#ifdef __linux__
#include <sched.h>
#endif

#include "detail/per_layer.h"
#include "detail/plan.h"
#include "detail/planner.h"
#include "detail/step.h"
#include "remat/planner/step.h"

// The per-layer planner: for each stage on its own, keep it (Fa), keep it under an Fk variant, or checkpoint
// it (Fc, recomputed right before its backward): the choices per-layer torch.utils.checkpoint (with or
// without a selective policy) and remat::checkpoint per layer offer, chosen for the least time within a
// budget by an exact dynamic program over Pareto frontiers.
//
// The peak of such a plan, in the model of remat/planner/plan.h, with R_j = a_0 + the bytes held by stages
// 0..j-1 (abar, what an Fk variant keeps, or a plain a_{j+1} for a checkpointed stage), is the largest of
//   R_j + held_j + fwd_tmp_j (nosave_tmp_j if checkpointed, keep_tmp_j under Fk)  stage j's forward
//   R_j + a_{j+1} + abar_{j+1} + max(a_j + bwd_tmp_j, fwd_tmp_j if j is checkpointed, else 0)
//                                                                    its recompute and backward (d_{j+1}
//                                                                    held)
//   R_n + a_n                                                        the loss (d_n created)
// so a stage's choice matters to the stages after it only through R: the frontier of (R, time) pairs, each
// with the largest peak so far within the budget, is all the program carries from one stage to the next.
// per_layer_min_budget() runs the same program on (R, peak) pairs.

namespace remat {
namespace {

using detail::push;

// One choice for a stage: keep everything, checkpoint it, or an Fk variant (0: the keep tags; v >= 1: the
// chain's policy v - 1), each possibly offloaded.
struct Choice {
  OpKind kind = OpKind::kForwardAll;
  int64_t variant = -1;
  int64_t held = 0;      // bytes held after its forward (before any of it leaves for the host)
  double ms = 0;         // its forward and backward, as run per call
  double fwd_ms = 0;     // its forward (what hides the previous stage's copy to the host)
  double bwd_ms = 0;     // its recompute and backward (what hides the previous stage's copy back)
  bool offload = false;  // what it saves goes to the host
  bool stream = false;   // with offload: streamed (Fa@stream), each tensor back just ahead of its use
  int64_t window = -1;   // streamed: the bytes in flight each way (0: each copy waited for as it is made,
                         // each tensor brought back at its use, the copies' whole time charged)
  const OffloadCost* cost = nullptr;  // the way's offload cost, offloaded or not (null: unknown)
  std::string groups{};               // a group assignment (Fk{...}), or empty
  std::optional<OffloadCost> own{};   // a group assignment's offload cost (cost points here once placed)
  int64_t unsaved = 0;                // a group assignment's group_unsaved_bytes()
  int64_t mid = -1;                   // a group assignment's group_recompute_peak_bytes()
  int64_t fpeak = -1;                 // a group assignment's group_forward_peak_bytes()
};

// The policy cost of choice `c` of stage `s`: Fk under a policy (variant >= 1), else null.
const PolicyCost* policy_of(const Stage& s, const Choice& c) {
  if (c.kind != OpKind::kForwardKeep || !c.groups.empty() || c.variant < 1 ||
      static_cast<size_t>(c.variant - 1) >= s.policies.size())
    return nullptr;
  return &s.policies[static_cast<size_t>(c.variant - 1)];
}

// The most group assignments of one stage the program plans with (kMaxGroupChoices).
constexpr size_t kMaxGroupChoices = 48;

// Past kMaxGroupChoices assignments no other beats, keeps kMaxGroupChoices of them spread evenly over what
// they hold on the device (kept and sent bytes, then unsaved bytes), the least and the most included (the
// most holds every group, and is the fastest: keeping a group never costs time), so that every budget still
// finds assignments near its own. The program is then the best over those: on BERT-large's H200 profile a
// stage has about 550 (ten groups, offloading) and planning took several times as long with them all
// (2026-12-04).
std::vector<Choice> thin_group_choices(std::vector<Choice> all) {
  if (all.size() <= kMaxGroupChoices) return all;
  std::stable_sort(all.begin(), all.end(), [](const Choice& a, const Choice& b) {
    return std::tie(a.held, a.unsaved, a.ms) < std::tie(b.held, b.unsaved, b.ms);
  });
  std::vector<char> take(all.size(), 0);
  for (size_t k = 0; k < kMaxGroupChoices; ++k)
    take[k * (all.size() - 1) / (kMaxGroupChoices - 1)] = 1;
  std::vector<Choice> out;
  for (size_t k = 0; k < all.size(); ++k)
    if (take[k]) out.push_back(std::move(all[k]));
  return out;
}

// (key, value) pairs added so far, as stairs: only those no other beats in both (each with a larger key has a
// smaller value), so that whether one of them has a key at most k and a value at most l is one look-up
// (group_choices(): sent bytes and time; pareto(): time and owed()).
template <typename K>
struct Stairs {
  std::map<K, double> steps;
  // Whether a pair so far has a key at most k (less than k where `strict`) and a value at most l.
  bool covers(K k, double l, bool strict) const {
    auto it = strict ? steps.lower_bound(k) : steps.upper_bound(k);
    return it != steps.begin() && std::prev(it)->second <= l;
  }
  void add(K k, double l) {
    if (covers(k, l, false)) return;
    for (auto it = steps.lower_bound(k); it != steps.end() && it->second >= l;)
      it = steps.erase(it);
    steps[k] = l;
  }
};

// The choice of stage `s` run as the group assignment `text`, which keeps `unsaved` bytes Fa does not save
// (group_unsaved_bytes()), holds `mid` part way through its recompute (group_recompute_peak_bytes()) and
// peaks at `fpeak` in its forward (group_forward_peak_bytes()). Its cost is placed (cost = &*own) once the
// vector holding it no longer moves.
Choice group_choice(const Stage& s, std::string text, int64_t unsaved, int64_t mid, int64_t fpeak) {
  const PolicyCost cost = group_cost(s, text);
  Choice ch{OpKind::kForwardKeep, -1, cost.saved_bytes, 0, cost.fwd_ms, cost.bwd_ms};
  ch.ms = ch.fwd_ms + ch.bwd_ms;
  ch.unsaved = unsaved;
  ch.mid = mid;
  ch.fpeak = fpeak;
  ch.groups = std::move(text);
  ch.own = cost.offload;
  ch.offload = cost.offload.has_value();
  return ch;
}

// The group assignments of a stage worth planning with: each of k, h (when offloading) and r per group, but
// all r (that is Fc), and of those the ones no other beats in kept bytes, sent bytes and time together (a
// plan's peak and time only grow with each); their figures are group_cost()'s, as simulate() charges them.
// The 3^groups assignments are enumerated by their sums alone (the same sums, in the same order, as
// group_cost() makes: the same doubles), and group_cost() is called for the ones kept; past kMaxGroupChoices,
// thin_group_choices() keeps that many.
std::vector<Choice> group_choices(const Stage& s, bool offload) {
  const size_t g = s.groups.size();
  std::vector<Choice> all;
  if (g == 0) return all;
  const std::string letters = offload ? "rkh" : "rk";
  const size_t base = letters.size();
  size_t count = 1;
  for (size_t k = 0; k < g; ++k)
    count *= base;
  const double fwd_ms = s.group_fwd_ms();
  struct Candidate {
    int64_t unsaved, mid, fpeak, kept, sent;
    double ms;
    size_t code;
  };
  std::vector<Candidate> cands;
  cands.reserve(count - 1);
  std::vector<size_t> letter(g, 0);              // code's digits in base `base`, the lowest first
  for (size_t code = 1; code < count; ++code) {  // code 0 is all r
    for (size_t k = 0; k < g && ++letter[k] == base; ++k)
      letter[k] = 0;
    int64_t kept = 0, sent = 0, unsaved = 0;
    double skipped_ms = 0, redone_ms = 0;
    for (size_t k = 0; k < g; ++k) {
      if (letter[k] == 1) kept += s.groups[k].bytes, skipped_ms += s.groups[k].recompute_ms;
      if (letter[k] == 2)
        kept += s.groups[k].stays_bytes, sent += s.groups[k].bytes - s.groups[k].stays_bytes,
            skipped_ms += s.groups[k].recompute_ms;
      if (letter[k] == 0) redone_ms += s.groups[k].recompute_ms;
      if (letter[k] != 0) unsaved += s.groups[k].unsaved_bytes;
    }
    // What its recompute holds part way (group_recompute_peak_bytes()'s sum).
    const int64_t mid = detail::recompute_part_way_bytes(s, [&](size_t k) { return letter[k] != 0; });
    // And its forward's peak (group_forward_peak_bytes()'s sum).
    const int64_t fpeak = detail::forward_part_way_bytes(s, [&](size_t k) { return letter[k] != 0; });
    cands.push_back({unsaved, mid, fpeak, kept, sent, fwd_ms + s.group_bwd_ms(skipped_ms, redone_ms), code});
  }
  // The unsaved bytes (group_unsaved_bytes()) raise the peak of a forward and of a recompute too, what the
  // recompute holds part way (mid) that of a recompute, and the forward's measured peak (fpeak, -1 for every
  // candidate where not measured) that of a forward: a candidate is beaten only by one with no more of each.
  // Sorted by them first, each triple of amounts is filtered apart. Across amounts of unsaved bytes, also by
  // one whose backward holds no more of the stage's saved tensors (detail::kept_saved_at_backward(),
  // stage_need()'s rule), which fewer unsaved bytes may raise.
  std::stable_sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) {
    return std::tie(a.unsaved, a.mid, a.fpeak, a.kept, a.sent, a.ms) <
           std::tie(b.unsaved, b.mid, b.fpeak, b.kept, b.sent, b.ms);
  });
  // In that order, a candidate is beaten when one before it (kept no more) has sent no more and time no more:
  // `stairs` holds the (sent, time) pairs of the candidates taken so far.
  // Then a survivor is beaten by one of a smaller amount of unsaved bytes with kept, sent and time no more
  // (`lower`: the survivors of the amounts before the current one).
  Stairs<int64_t> stairs;
  std::vector<Candidate> lower, current;
  // An unmeasured forward peak (-1) is charged the bound, which no measured one exceeds.
  auto unbounded = [](int64_t fpeak) { return fpeak < 0 ? std::numeric_limits<int64_t>::max() : fpeak; };
  auto at_backward = [&](const Candidate& a) {
    return detail::kept_saved_at_backward(s, s.output_bytes + a.kept + a.sent, a.unsaved);
  };
  for (size_t k = 0; k < cands.size(); ++k) {
    const Candidate& c = cands[k];
    if (k > 0 &&
        (cands[k - 1].unsaved != c.unsaved || cands[k - 1].mid != c.mid || cands[k - 1].fpeak != c.fpeak)) {
      stairs = {};
      lower.insert(lower.end(), current.begin(), current.end());
      current.clear();
    }
    if (stairs.covers(c.sent, c.ms, false)) continue;  // beaten
    stairs.add(c.sent, c.ms);
    current.push_back(c);
    if (std::any_of(lower.begin(), lower.end(), [&](const Candidate& a) {
          return a.mid <= c.mid && unbounded(a.fpeak) <= unbounded(c.fpeak) && a.kept <= c.kept &&
                 a.sent <= c.sent && a.ms <= c.ms && at_backward(a) <= at_backward(c);
        }))
      continue;  // beaten by one that holds fewer unsaved bytes, or less part way through its recompute
    std::string text(g, 'r');
    for (size_t k = 0, code = c.code; k < g; ++k, code /= base)
      text[k] = letters[code % base];
    all.push_back(group_choice(s, std::move(text), c.unsaved, c.mid, c.fpeak));
  }
  return thin_group_choices(std::move(all));
}

std::vector<Choice> choices_of(const Chain& chain, int64_t j, const std::vector<char>& allowed, bool all_only,
                               bool offload, bool groups) {
  const Stage& s = chain.stages[static_cast<size_t>(j)];
  std::vector<Choice> out;
  auto add = [&](Choice c, const std::optional<OffloadCost>& cost) {
    c.ms = c.fwd_ms + c.bwd_ms;
    c.cost = cost ? &*cost : nullptr;
    out.push_back(c);
    if (offload && c.cost) {
      c.offload = true;
      out.push_back(c);
    }
  };
  add({OpKind::kForwardAll, -1, s.saved_bytes, 0, s.fwd_ms, s.bwd_ms}, s.offload);
  if (all_only) return out;
  if (!s.has_backward) {  // no graph: every way runs it as Fa, kept (Stage::has_backward)
    out.resize(1);
    return out;
  }
  if (offload && s.offload && s.offload->can_stream()) {
    Choice c = out.back();  // Fa@host: the same forward, backward and copies, streamed
    c.stream = true;
    c.window = s.offload->window_bytes;
    out.push_back(c);
    if (c.window > 0) {  // and with no window: less memory, the copies' time exposed
      c.window = 0;
      out.push_back(c);
    }
  }
  add({OpKind::kForwardCheckpoint, -1, s.output_bytes, 0, s.per_call_fwd_ms(), s.per_call_bwd_ms()},
      s.checkpoint_offload);
  if (s.has_keep() && allowed[0])
    add({OpKind::kForwardKeep, 0, *s.keep_saved_bytes, 0, *s.keep_fwd_ms, *s.keep_bwd_ms}, s.keep_offload);
  for (size_t p = 0; p < s.policies.size(); ++p) {
    if (!allowed[p + 1]) continue;
    const PolicyCost& c = s.policies[p];
    add({OpKind::kForwardKeep, static_cast<int64_t>(p) + 1, c.saved_bytes, 0, c.fwd_ms, c.bwd_ms}, c.offload);
  }
  if (groups) {
    for (Choice& c : group_choices(s, offload))
      out.push_back(std::move(c));
  }
  for (Choice& c : out)
    if (c.own) c.cost = &*c.own;  // placed: the vector moves whole from here on, its elements stay
  return out;
}

// What a whole training step adds to a chain's stages (plan_step's per-layer case, on step_chain()): stages
// that can only be kept (what comes before the chain and the rest of the step), and per stage the bytes that
// have arrived by its backward (the gradients of its parameters and of those after it) and by its recompute
// (those after it only).
struct StepTerms {
  std::vector<char> all_only;
  // The step's context where it lists tensors only the stages hold past the forward
  // (StepContext::taken_bytes), else null.
  const StepContext* taken = nullptr;
  std::vector<int64_t> at_recompute;
  std::vector<int64_t> own;  // per stage, the gradients its own backward makes
  // Per stage: the gradients of what the stages take beside their input that arrive at its backward, of
  // those what arrives after its peak (side_grads_late_bytes), and what of those tensors and their gradients
  // is let go of once it is done (side_freed_bytes).
  std::vector<int64_t> side;
  std::vector<int64_t> side_late;
  std::vector<int64_t> side_freed;
  // Per stage: the backward peak of what runs between the stage before it and it (once its backward is done,
  // above what that leaves held with every gradient arrived by then), -1 where nothing is charged there.
  std::vector<int64_t> between;
  // Per stage: what runs between the stage before it and it leaves held in the forward, from its forward on
  // (added to R before it).
  std::vector<int64_t> forward_held;
  // Per stage: whether nothing besides the stages holds its output once the next stage's backward is done
  // (StepContext::outputs_held_in_backward): a way that does not save it lets go of it then.
  std::vector<char> output_unheld;
  // Per stage: whether a residual sum's path holds the gradient it is handed through its backward, which is
  // then charged its way's figure (detail::grad_held_through(), Stage::bwd_grad_held(way)).
  std::vector<char> grad_held;
  // Per stage: whether what runs between it and the next let go of its output in the profiling step
  // (detail::output_freed_between()): a way that holds its output is charged it beside the next stage's
  // input (the rest's peak, for the last), from the end of its forward until the next stage's backward is
  // done (detail::held_past_between_bytes()).
  std::vector<char> frees_output;
  // Per stage: whether its input may be let go of once its forward as Fa is done, where the stage before's
  // way does not hold it (detail::input_let_go_in_forward()), and what it holds beyond a_j then
  // (detail::input_let_go_extra_bytes(): let go of with it, R_j holds it as forward_held).
  std::vector<char> input_let_go;
  std::vector<int64_t> input_extra;
  // Whether the last chain stage's input, where it may go, goes once the rest's forward is done rather than
  // its own (detail::last_input_let_go_in_rest()), and its bytes then (a_j and input_extra): gone from the
  // rest's backward on.
  bool last_in_rest = false;
  int64_t rest_gone = 0;
  // Per stage: whether its backward may be charged its output let go of early (detail::output_freed_early()).
  std::vector<char> freed_early;
  // Per stage: whether something besides a runtime that holds outputs holds its output through its backward
  // (detail::output_held_past_runtime()), and what it holds beyond the simulation from its recompute as Fc on
  // (detail::recomputed_output_held_bytes()).
  std::vector<char> held_past_runtime;
  std::vector<int64_t> recomputed_held;
  // What a way that recomputes holds beside its input until its backward is done (checkpoint_state_bytes).
  int64_t checkpoint_state = 0;
  // Per stage: what the chain stages' forwards up to its own left in autocast's cache
  // (Stage::autocast_cache_bytes), charged in its forward; the rest's, all of them, in its forward and its
  // backward (whose measured peak may be in its forward); in no chain stage's backward (step_op_peaks()'s
  // rule).
  std::vector<int64_t> cached_through;
  // Per stage: its output where something holds it to the step's end (outputs_held_to_end; 0 otherwise),
  // charged again from where the simulation lets go of it: its own backward, or for a checkpointed stage's
  // plain output, the next stage's (so its own recompute and backward are charged it too).
  std::vector<int64_t> held_to_end;
  // The chain's input where nothing but the stages holds it in the backward pass (bytes; 0 otherwise): gone
  // from the rest's and every chain stage's backward once the first is streamed (step_op_peaks()'s
  // input_gone_from()).
  int64_t input_freed = 0;
  // Whether the first stage, run as Fa (kept, or offloaded or streamed not sending its input), lets go of the
  // chain's input by the backward pass (detail::first_input_let_go()): gone from step stage 1 on, as where it
  // is streamed.
  bool first_input_let_go = false;
};

// What step stage j run as `c` holds beside the next stage's input from the end of its forward until the next
// stage's backward is done (detail::held_past_between_bytes(), where step says what runs between lets go of
// its output): in R of the stages after it.
int64_t past_between_bytes(const Stage& s, const Choice& c, const StepTerms* step, int64_t j) {
  if (!step || !step->frees_output[static_cast<size_t>(j)]) return 0;
  return detail::held_past_between_bytes(s, c.kind, c.cost, !c.groups.empty(), c.offload && !c.stream,
                                         c.stream, policy_of(s, c));
}

// The peak of stage j run as `c` above R_j (the bytes held before it), with what `step` adds (none if null).
// `bwd_less`: bytes of R_j not on the device in its backward and recompute (a streamed stage's input that
// left with what it saves, less what its copy brought back adds to its measured backward peak; the chain's
// input once the first stage took it to the host); `bwd_less_input`: whether the chain's input is among them.
// `twice`: bytes its backward and its recompute hold twice (its input, which left with it, beside the stage
// before's own copy, brought back ahead: simulate()'s rule).
// `dropped`: its input's bytes where they were let go of once its forward was done (Point::output_let_go),
// else 0: neither its backward nor what runs between holds them.
// `taken_less`: of R_j, the tensors only the stages hold past the forward that no stage holds at its
// forward (the rest's), its backward and recompute, and what runs between once its backward is done, in that
// order (StepContext::taken_bytes; step_op_peaks()'s rule).
struct TakenLess {
  int64_t fwd = 0, bwd = 0, between = 0;
};

int64_t stage_need(const Chain& chain, int64_t j, const Choice& c, const StepTerms* step, int64_t bwd_less,
                   bool bwd_less_input, int64_t twice, int64_t dropped, const TakenLess& taken_less = {}) {
  const Stage& s = chain.stages[static_cast<size_t>(j)];
  const int64_t a_in = chain.activation_bytes(j), a_out = s.output_bytes;
  const int64_t at_rec = step ? step->at_recompute[static_cast<size_t>(j)] : 0;
  // The generators' state a checkpoint saved, held from its forward to its backward's end.
  const int64_t state = step && detail::recomputes(c.kind, !c.groups.empty()) ? step->checkpoint_state : 0;
  const int64_t kept_to_end = step ? step->held_to_end[static_cast<size_t>(j)] : 0;
  // What the forwards so far left in autocast's cache: in its forward; the rest's backward too.
  const int64_t cached = step ? step->cached_through[static_cast<size_t>(j)] : 0;
  const int64_t cached_bwd = step && j + 1 == chain.size() ? cached : 0;
  // Its own gradients at its backward's peak, as measured with them made there for its way
  // (Stage::grads_way, the rule step_op_peaks() follows).
  const int64_t own = step ? step->own[static_cast<size_t>(j)] : 0;
  const int64_t side = step ? step->side[static_cast<size_t>(j)] : 0;
  const int64_t side_late = step ? step->side_late[static_cast<size_t>(j)] : 0;  // (held once it is done)
  // What a residual sum's path holding the gradient it is handed adds to its backward.
  const int64_t way =
      Stage::grads_way(c.kind == OpKind::kForwardKeep, c.stream, !c.groups.empty(), c.variant - 1);
  const int64_t held_grad = step && step->grad_held[static_cast<size_t>(j)] ? s.bwd_grad_held(way) : 0;
  const int64_t at_bwd = at_rec + side - side_late + held_grad + s.grads_charge_bytes(own, way);
  // What runs between the stage before it and it, once its backward is done: above R_j and its input's
  // gradient, every gradient arrived by then (its input back on the device; the chain's input still gone).
  const int64_t freed = step ? step->side_freed[static_cast<size_t>(j)] : 0;
  const int64_t between = step && step->between[static_cast<size_t>(j)] >= 0
                              ? a_in + at_rec + own + side - freed + kept_to_end +
                                    step->between[static_cast<size_t>(j)] -
                                    (bwd_less_input ? step->input_freed : 0) - dropped - taken_less.between
                              : -taken_less.fwd;  // (R_j, the floor, less what the rest does not hold of it)
  // Its output, where neither its way saves it (detail::way_leaves_output()) nor anything else holds it, is
  // gone by its backward; one its graph alone holds, let go of early in it where output_freed_early() (a
  // checkpointed stage's: the one its recompute made again, as Fa).
  const bool unsaved = detail::way_leaves_output(s, c.kind, c.cost, !c.groups.empty(), policy_of(s, c));
  const bool checkpointed = c.kind == OpKind::kForwardCheckpoint;
  const int64_t early = step && step->freed_early[static_cast<size_t>(j)]
                            ? detail::output_freed_in_backward_bytes(
                                  s, checkpointed ? OpKind::kForwardAll : c.kind,
                                  !c.groups.empty() && !checkpointed, c.stream && !checkpointed)
                            : 0;
  const int64_t gone =
      step && step->output_unheld[static_cast<size_t>(j)] && !checkpointed ? (unsaved ? a_out : early) : 0;
  // Its output, which the runtime lets go of as its backward begins, held through it by something else
  // (step_op_peaks()'s rule).
  const int64_t held_back =
      step && step->held_past_runtime[static_cast<size_t>(j)]
          ? detail::output_held_back_bytes(s, c.kind, !c.groups.empty(), c.offload || c.stream)
          : 0;
  if (c.stream) {
    // Streamed (see simulate()): its measured peaks, each with its window beside it (the forward's, only what
    // leaves the device: detail::stream_forward_window_bytes()); the backward's above what the stage keeps on
    // the device (its output included) and the gradient it is handed.
    const OffloadCost& o = *c.cost;
    return std::max(
        {o.stream_fwd_bytes + detail::stream_forward_window_bytes(o, c.window) + cached - taken_less.fwd,
         a_out + s.saved_bytes - o.bytes + c.window + o.stream_bwd_bytes + at_bwd - bwd_less - gone + twice -
             dropped + held_back - taken_less.bwd,
         between});
  }
  // (Its output beside the next stage's input, where what runs between them let go of it in the profiling
  // step and its way holds it, is held from the end of its forward until the next stage's backward is done:
  // in R of the stages after it, not here; step_op_peaks()'s rule.)
  const int64_t fwd =
      c.held + detail::forward_tmp_bytes(s, c.kind, c.held, c.unsaved, c.fpeak) + state + cached;
  // Under a policy (variant >= 1): what it keeps plus its backward's own peak, recompute included.
  const bool policy = c.kind == OpKind::kForwardKeep && c.groups.empty() && c.variant >= 1;
  // With keep tags or a group assignment: the larger of its backward and the recompute before it, which makes
  // what it did not keep as its forward did (simulate()'s rule).
  const bool keeps = c.kind == OpKind::kForwardKeep && !policy;
  // What its backward holds of the stage's saved tensors: what Fa saves; with keep tags or a group
  // assignment, what it kept (less what Fa does not save) where that is more, as its recompute makes nothing
  // again then (detail::kept_saved_at_backward(), simulate()'s rule). Before (found 2026-12-06 by a random
  // chain whose groups, less their unsaved bytes, held 51 bytes more than Fa saves), the program charged what
  // Fa saves, below simulate().
  const int64_t saved = keeps ? detail::kept_saved_at_backward(s, c.held, c.unsaved) : s.saved_bytes;
  int64_t bwd = policy
                    ? a_out + c.held + a_in + s.policy_bwd_bytes(static_cast<size_t>(c.variant - 1)) + at_bwd
                    : a_out + saved + a_in + s.bwd_tmp_bytes + at_bwd;
  bwd += twice;  // and the recompute's below
  // (A group assignment's recompute begins with all it kept, c.held, those Fa does not save included, and
  // ends with what Fa saves: simulate()'s rule; with a second generators' state while it runs, the one it
  // saves while it replays the first, and its output made anew where it was gone (`gone`, taken off below);
  // its gradients those made before it, as Fc's recompute: step_op_peaks()'s rule.)
  // Part way through, where measured: the groups not reached yet beside what it has made again, above its
  // input and the output it has not made again (group_recompute_peak_bytes(); simulate()'s rule).
  if (keeps) {
    const int64_t at_rec_grads = at_rec + held_grad + (step ? s.grads_before_recompute_bytes : 0);
    const int64_t mid = c.mid >= 0 ? a_out + a_out + c.mid : 0;
    bwd = std::max(bwd, std::max({a_out + saved + s.fwd_tmp_bytes + gone, a_out + c.held, mid}) +
                            at_rec_grads + twice + state);
  }
  bwd += held_back;
  if (c.kind == OpKind::kForwardCheckpoint) {
    // In a step, its backward after a recompute that stopped early holds no output its graph does not save,
    // and one it saves only until its graph lets go of it (step_op_peaks()'s rule); the recompute itself is
    // charged whole, with a second generators' state (the one the recompute saves while it replays the
    // first) and its input twice where it came back so (`twice`).
    // Where something besides the runtime holds its first output, the runtime's recompute makes it anew
    // beside it (step_op_peaks()'s rule). The recompute runs inside its backward, once the backward of its
    // last operations made their gradients (Stage::grads_before_recompute_bytes, step_op_peaks()'s rule).
    // The C++ executor (Chain::holds_outputs) lets go of the state once the recompute has run: the backward
    // after it holds none (step_op_peaks()'s rule).
    const int64_t anew = step ? step->recomputed_held[static_cast<size_t>(j)] : 0;
    const int64_t before_rec = step ? s.grads_before_recompute_bytes : 0;
    const int64_t let_go = chain.holds_outputs ? state : 0;
    if (step) bwd -= detail::recompute_unmade_bytes(chain, j) + early;
    bwd = std::max(bwd + anew - let_go,
                   a_out + s.saved_bytes + s.fwd_tmp_bytes + at_rec + state + anew + twice + before_rec);
  }
  // A checkpointed stage's plain output held to the step's end: let go of by the simulation at the next
  // stage's backward, held through its recompute and backward.
  if (c.kind == OpKind::kForwardCheckpoint) bwd += kept_to_end;
  return std::max(
      {fwd - taken_less.fwd, bwd + state + cached_bwd - bwd_less - gone - dropped - taken_less.bwd, between});
}

// A point of a frontier: R (bytes held on the device), what of R the previous stage sent to the host and
// leaves once the next forward has run (pending; it comes back for the backward while this stage's runs),
// the bytes its copies move each way, the time its copies to the host still need once its forward is done
// (link: they began with that forward, after what the link still had to copy), whether the previous stage
// holds its output (this stage's input) on the device, whether the chain's input left the device for the
// backward pass (StepTerms::input_freed), the host bytes so far, the peak so far, the time so far, and how it
// was reached.
struct Point {
  int64_t held = 0;
  int64_t pending = 0;
  int64_t copied = 0;
  double link = 0;
  bool keeps_output = true;
  // Whether the previous stage brings its output (this stage's input) back ahead from the host, its own copy
  // (simulate()'s Away::output_ahead).
  bool output_ahead = false;
  // Whether the previous stage's way does not hold its output (this stage's input: it saves none of it, or it
  // is plain), set only where this stage may let go of it (StepTerms::input_let_go): run as Fa, not
  // offloaded, it does once its forward is done. At the rest (the step's last stage), whether the last chain
  // stage's input goes once the rest's forward is done (StepTerms::last_in_rest): its backward runs without
  // it.
  bool output_let_go = false;
  int64_t input_gone_from = 0;  // from which stage on the chain's input is gone (detail::input_gone_from())
  // The tensors only the stages hold past the forward that a stage so far holds (detail::taken_held_by()'s
  // bits).
  uint32_t taken_held = 0;
  int64_t host = 0;
  int64_t peak = 0;
  double ms = 0;
  double transfer_ms = 0;  // of ms, the copies' time no computation hides
  int64_t parent = -1;     // index in the previous stage's frontier
  int64_t choice = -1;     // index in choices_of()
};

// Frontiers larger than this are thinned (see thin()).
constexpr size_t kMaxFrontier = size_t{1} << 15;
// The rough program's (see solve()): two bands of R a group.
constexpr size_t kRoughFrontier = 4;
static_assert(kRoughFrontier >= 2, "thin() makes cap / 2 bands");
// The second rough program's (see solve()), run where the first's frontiers grew past
// detail::second_rough_after points.
constexpr size_t kMidFrontier = 64;
// The most anchors a candidate is checked against (solve()).
constexpr size_t kMaxWalk = 32;

// How long the chain's input is gone in the backward pass (StepTerms::input_freed), as an order: from stage
// 1 on, then from stage 3 on, then never. Every later stage needs no more (stage_need()'s bwd_less_input) the
// longer it is gone.
int64_t gone_rank(int64_t input_gone_from) {
  return input_gone_from == 0 ? std::numeric_limits<int64_t>::min() : -input_gone_from;
}
int64_t gone_rank(const Point& p) {
  return gone_rank(p.input_gone_from);
}

// The time so far with the link's time still owed (ms + link): where two points of one group are otherwise
// alike, the one with less time and no more of this ends no later, whatever follows. A stage after a point
// adds to its time max(0, link - its forward) (the wait) and leaves owed max(0, its copies' time - max(0, its
// forward - link)), or none; both grow with link, and their sum by no more than link does. So if a.ms <=
// b.ms and owed(a) <= owed(b), the same holds one stage on, and at the end, where the last link is waited for
// (solve()). This beats more points than comparing link itself, with the same best plan.
double owed(const Point& p) {
  return p.ms + p.link;
}

// Whether a and b are alike in all the future depends on beside R and the masks held (Point::taken_held).
bool same_kind(const Point& a, const Point& b) {
  return a.pending == b.pending && a.copied == b.copied && a.keeps_output == b.keeps_output &&
         a.output_ahead == b.output_ahead && a.output_let_go == b.output_let_go;
}

// A frontier's groups: points of one kind that hold the same masks.
bool same_group(const Point& a, const Point& b) {
  return same_kind(a, b) && a.taken_held == b.taken_held;
}

// pareto()'s order: by group (pending, copied, keeps_output, output_ahead, output_let_go, the masks held),
// then R, the key, the input gone longest first, host bytes, and where all are equal as the points were made
// (parent, then choice).
template <typename Key>
inline bool in_order(const Point& a, const Point& b, const Key& key) {
  if (a.pending != b.pending) return a.pending < b.pending;
  if (a.copied != b.copied) return a.copied < b.copied;
  if (a.keeps_output != b.keeps_output) return a.keeps_output < b.keeps_output;
  if (a.output_ahead != b.output_ahead) return a.output_ahead < b.output_ahead;
  if (a.output_let_go != b.output_let_go) return a.output_let_go < b.output_let_go;
  if (a.taken_held != b.taken_held) return a.taken_held < b.taken_held;
  if (a.held != b.held) return a.held < b.held;
  if (key(a) != key(b)) return key(a) < key(b);
  if (a.input_gone_from != b.input_gone_from) return gone_rank(a) > gone_rank(b);
  if (a.host != b.host) return a.host < b.host;
  if (a.parent != b.parent) return a.parent < b.parent;
  return a.choice < b.choice;
}

// The points so far that may beat a later one, for pareto()'s test (`host`, `link` and the key as there):
// every point added has R at most the next one tested's.
template <typename K>
struct Beaters {
  bool host = false, link = false;
  // Without `host` and `link`: per gone_rank(), the least key. At most three ranks.
  std::vector<std::pair<int64_t, K>> least{};
  // With `link` alone: per input_gone_from value, the (key, owed()) stairs and, per key, the (owed(), host)
  // pairs (a point whose input is gone longer beats another of an equal key only with host bytes no more).
  struct Gone {
    int64_t from = 0;
    Stairs<K> stairs{};
    std::map<K, std::vector<std::pair<double, int64_t>>> at{};
    bool tied(K k, double l, int64_t h) const {
      const auto it = at.find(k);
      return it != at.end() && std::any_of(it->second.begin(), it->second.end(),
                                           [&](const auto& e) { return e.first <= l && e.second <= h; });
    }
  };
  std::vector<Gone> gones{};
  std::vector<std::pair<Point, K>> all{};  // otherwise: the points themselves and their keys

  // Whether a point added beats p (of key k).
  bool beat(const Point& p, K k) const {
    const int64_t rank = gone_rank(p);
    if (!host && !link) {
      const auto it =
          std::find_if(least.begin(), least.end(), [&](const auto& e) { return e.first == rank; });
      return it != least.end() && !(k < it->second);
    }
    if (link && !host) {  // the same test, by stairs per input-gone value: a group may hold 10^4 points
      for (const Gone& g : gones) {
        if (g.from == p.input_gone_from) {
          if (g.stairs.covers(k, owed(p), false)) return true;
        } else if (gone_rank(g.from) > rank &&
                   (g.stairs.covers(k, owed(p), true) || g.tied(k, owed(p), p.host))) {
          return true;
        }
      }
      return false;
    }
    return std::any_of(all.begin(), all.end(), [&](const auto& e) {
      const Point& o = e.first;
      const K ok = e.second;
      return !(k < ok) && (!host || o.host <= p.host) && (!link || owed(o) <= owed(p)) &&
             (o.input_gone_from == p.input_gone_from ||
              (gone_rank(o) > rank && (ok < k || o.host <= p.host)));
    });
  }
  void add(const Point& p, K k) {
    if (!host && !link) {
      const int64_t rank = gone_rank(p);
      auto it = std::find_if(least.begin(), least.end(), [&](const auto& e) { return e.first == rank; });
      if (it == least.end())
        least.emplace_back(rank, k);
      else if (k < it->second)
        it->second = k;
    } else if (link && !host) {
      auto it = std::find_if(gones.begin(), gones.end(),
                             [&](const Gone& g) { return g.from == p.input_gone_from; });
      if (it == gones.end()) it = gones.insert(gones.end(), Gone{p.input_gone_from});
      it->stairs.add(k, owed(p));
      it->at[k].emplace_back(owed(p), p.host);
    } else {
      all.emplace_back(p, k);
    }
  }
};

// Keeps the points no other point beats: within each group of equal (pending, copied, keeps_output,
// output_ahead, output_let_go, the masks held), which
// the future depends on beside R, no point with R, `key` (time when planning for a budget, peak when looking
// for the least memory), when `host` bounds it host bytes, and when `link` (planning for time with
// offloading) the link's time still owed, all at most its, and the chain's input gone as long (gone_rank()).
// With `host` or `link`, a point whose input is gone longer beats it too where its host bytes are at most
// its (so that the last stage's choice between equal times, the fewer host bytes, is still there to make);
// without them, such points are kept apart as they were, and those frontiers stay linear. Ties keep the first
// point in in_order()'s order. (Between groups that hold different masks: across_masks().) `points` are in
// in_order()'s order (solve()'s candidates, sorted in parts and merged: see there).
template <typename Key>
std::vector<Point> pareto_sorted(const Point* first, const Point* last, Key key, bool host,
                                 bool link = false) {
  using K = decltype(key(*first));
  std::vector<Point> out;
  Beaters<K> group{host, link};
  for (const Point* it = first; it != last; ++it) {
    const Point& p = *it;
    if (!out.empty() && !same_group(out.back(), p)) group = Beaters<K>{host, link};
    if (group.beat(p, key(p))) continue;
    group.add(p, key(p));
    out.push_back(p);
  }
  return out;
}

template <typename Key>
std::vector<Point> pareto_sorted(const std::vector<Point>& points, Key key, bool host, bool link = false) {
  return pareto_sorted(points.data(), points.data() + points.size(), key, host, link);
}

// pareto_sorted() of points of its own, sorted first.
template <typename Key>
std::vector<Point> pareto(std::vector<Point> points, Key key, bool host, bool link = false) {
  std::sort(points.begin(), points.end(),
            [&](const Point& a, const Point& b) { return in_order(a, b, key); });
  return pareto_sorted(points, key, host, link);
}

// The bytes of the masks that `a` holds and `b` does not (StepContext::taken_bytes).
int64_t masks_beyond(const std::vector<int64_t>& taken, uint32_t a, uint32_t b) {
  int64_t bytes = 0;
  for (size_t m = 0; m < taken.size(); ++m)
    if ((a & ~b) >> m & 1u) bytes += taken[m];
  return bytes;
}

// pareto()'s points (in its order) without those that a point of the same kind (pending, copied,
// keeps_output, output_ahead, output_let_go) holding other masks beats. A mask held is charged where it would
// otherwise be let go of (stage_need()'s taken_less, the loss's), a point's masks stay held
// (Point::taken_held only gains bits), and each need is a maximum of terms, each of which a mask held raises
// by at most its bytes. So where a point o holds masks that a point p does not, of `beyond` bytes
// (masks_beyond()), o needs no more than p at any moment from here on if o.held + beyond <= p.held (and
// o.held < p.held where beyond is 0 and o holds a mask p does not: masks of no bytes, which would otherwise
// let two points leave out each other); where o's key, host bytes and link's time owed beat p's too, as
// pareto() compares them, p is left out. Each point left out has one kept that beats it (each step to the one
// that beats it lowers R, or holds fewer masks at the same R), so the program's best plan is the same, from
// fewer points (BERT-large's H200 profile with four masks, each taken by every fourth layer: 2.8 s, where it
// took 5.4; docs/BENCHMARKS.md, "Planner speed").
template <typename Key>
std::vector<Point> across_masks(std::vector<Point> points, Key key, bool host, bool link,
                                const std::vector<int64_t>& taken) {
  if (taken.empty()) return points;
  using K = decltype(key(points.front()));
  std::vector<char> out_of(points.size(), 0);
  bool any = false;
  for (size_t first = 0; first < points.size();) {
    size_t last = first;
    while (last < points.size() && same_kind(points[first], points[last]))
      ++last;
    std::vector<std::pair<size_t, size_t>> groups;  // the kind's groups, each in R's order
    for (size_t g = first; g < last;) {
      size_t e = g;
      while (e < last && points[e].taken_held == points[g].taken_held)
        ++e;
      groups.emplace_back(g, e);
      g = e;
    }
    for (const auto& [b0, b1] : groups) {
      for (const auto& [a0, a1] : groups) {
        if (a0 == b0) continue;
        const uint32_t ha = points[a0].taken_held, hb = points[b0].taken_held;
        const int64_t beyond = masks_beyond(taken, ha, hb);
        const bool strict = beyond == 0 && (ha & ~hb) != 0;
        Beaters<K> by{host, link};
        size_t o = a0;
        for (size_t x = b0; x < b1; ++x) {
          if (out_of[x]) continue;
          const Point& p = points[x];
          while (o < a1 &&
                 (points[o].held + beyond < p.held || (!strict && points[o].held + beyond == p.held))) {
            by.add(points[o], key(points[o]));
            ++o;
          }
          if (by.beat(p, key(p))) out_of[x] = 1, any = true;
        }
      }
    }
    first = last;
  }
  if (!any) return points;
  std::vector<Point> out;
  for (size_t x = 0; x < points.size(); ++x)
    if (!out_of[x]) out.push_back(points[x]);
  return out;
}

// Whether pareto() never keeps x where a is among its points (both candidates of one stage): a beats x as
// pareto() does (same group, R, key, link and bounded host no worse, earlier in in_order()), and whatever
// kept point beats a beats x too. With the chain's input gone as long, that needs, where a point whose input
// is gone longer could beat a, a key strictly less or host bytes no more; with x's input gone less long
// (allowed where pareto() compares ranks: with `host` or `link`), a key strictly less. Then leaving x out
// changes nothing pareto() keeps.
template <typename Key>
inline bool filtered_by(const Point& a, const Point& x, const Key& key, bool host, bool link) {
  if (!same_group(a, x) || a.held > x.held || key(x) < key(a) || (host && a.host > x.host) ||
      (link && owed(a) > owed(x)))
    return false;
  if (a.input_gone_from == x.input_gone_from)
    return (!(host || link) || key(a) < key(x) || a.host <= x.host) && in_order(a, x, key);
  return (host || link) && gone_rank(a) > gone_rank(x) && key(a) < key(x);
}

// A group past `cap` points with the chain's input gone as long keeps one point per band of R (the
// best key in it), its R raised to the band's top: the program stays exact about feasibility (R only grows)
// and loses at most a band's worth of memory. Never reached by chains of equal layers, whose R takes few
// values.
template <typename Key>
std::vector<Point> thin(std::vector<Point> points, Key key, bool host, bool link, size_t cap) {
  // The groups before the first past the cap stay as they are (all of them, the usual case but in the rough
  // programs: the points themselves, not a copy).
  size_t first = 0;
  for (size_t last = 0; first < points.size(); first = last) {
    while (last < points.size() && same_group(points[first], points[last]))
      ++last;
    if (last - first > cap) break;
  }
  if (first == points.size()) return points;
  std::vector<Point> out(points.begin(), points.begin() + static_cast<std::ptrdiff_t>(first));
  while (first < points.size()) {
    size_t last = first;
    while (last < points.size() && same_group(points[first], points[last]))
      ++last;
    if (last - first <= cap) {
      out.insert(out.end(), points.begin() + static_cast<std::ptrdiff_t>(first),
                 points.begin() + static_cast<std::ptrdiff_t>(last));
      first = last;
      continue;
    }
    std::vector<int64_t> gone;  // the group's input_gone_from values, banded apart
    for (size_t k = first; k < last; ++k)
      if (std::find(gone.begin(), gone.end(), points[k].input_gone_from) == gone.end())
        gone.push_back(points[k].input_gone_from);
    std::vector<Point> kept;
    for (const int64_t from : gone) {
      std::vector<Point> part;  // in R's order
      for (size_t k = first; k < last; ++k)
        if (points[k].input_gone_from == from) part.push_back(points[k]);
      if (part.size() <= cap) {
        kept.insert(kept.end(), part.begin(), part.end());
        continue;
      }
      const int64_t lo = part.front().held, hi = part.back().held;
      const int64_t band = std::max<int64_t>(1, (hi - lo) / static_cast<int64_t>(cap / 2) + 1);
      std::vector<Point> banded;
      for (const Point& p : part) {
        const int64_t top = lo + ((p.held - lo) / band + 1) * band - 1;
        if (!banded.empty() && banded.back().held == top) {
          if (key(p) < key(banded.back())) {
            banded.back() = p;
            banded.back().held = top;
          }
        } else {
          banded.push_back(p);
          banded.back().held = top;
        }
      }
      kept.insert(kept.end(), banded.begin(), banded.end());
    }
    kept = pareto(std::move(kept), key, host, link);
    out.insert(out.end(), kept.begin(), kept.end());
    first = last;
  }
  return out;
}

// PlannerOptions::threads' default at most, and the most it may ask for.
constexpr int kMostThreads = 8;
constexpr int kMostThreadsAsked = 1024;

// The threads the per-layer program runs on: PlannerOptions::threads, or where 0 the cores this process may
// run on (its CPU affinity, where the system tells it), at most kMostThreads. Throws std::invalid_argument
// naming `who` for a count below 0 or above kMostThreadsAsked.
int threads_for(const PlannerOptions& options, const char* who) {
  if (options.threads < 0 || options.threads > kMostThreadsAsked) {
    throw std::invalid_argument(std::string(who) +
                                ": threads must be from 0 (the cores this process may run on, " + "at most " +
                                std::to_string(kMostThreads) + ") to " + std::to_string(kMostThreadsAsked) +
                                ", got " + std::to_string(options.threads));
  }
  if (options.threads > 0) return options.threads;
  int cores = 0;
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
#endif
  if (cores <= 0) cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores, 1, kMostThreads);
}

// fn(0), ..., fn(n - 1): fn(0) on the caller's thread, each other on a thread of its own (on the caller's
// too where a thread cannot be started: the same results, later). Rethrows the first exception, by index,
// once all have ended.
template <typename Fn>
void in_parallel(size_t n, const Fn& fn) {
  std::vector<std::exception_ptr> errors(n);
  auto one = [&](size_t w) {
    try {
      fn(w);
    } catch (...) {
      errors[w] = std::current_exception();
    }
  };
  std::vector<std::thread> started;
  std::vector<size_t> here{0};
  for (size_t w = 1; w < n; ++w) {
    try {
      started.emplace_back(one, w);
    } catch (...) {  // std::system_error (no thread to be had), std::bad_alloc
      here.push_back(w);
    }
  }
  for (size_t w : here)
    one(w);
  for (std::thread& t : started)
    t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

// Whether a's kind (same_kind()) comes before b's in in_order()'s order.
inline bool kind_before(const Point& a, const Point& b) {
  return std::tie(a.pending, a.copied, a.keeps_output, a.output_ahead, a.output_let_go) <
         std::tie(b.pending, b.copied, b.keeps_output, b.output_ahead, b.output_let_go);
}

// A stage's frontier from candidates [first, last) in in_order()'s order: pareto_sorted(), across_masks() and
// thin(), `before_thin` set to the points kept before thin(). A whole stage's on one thread, or one kind's
// (frontier_by_kind()).
template <typename Key>
std::vector<Point> filtered(const Point* first, const Point* last, Key key, bool host, bool link,
                            const std::vector<int64_t>& masks, size_t cap, size_t* before_thin) {
  std::vector<Point> kept = across_masks(pareto_sorted(first, last, key, host, link), key, host, link, masks);
  *before_thin = kept.size();
  return thin(std::move(kept), key, host, link, cap);
}

// A stage's frontier from its candidates sorted in parts (parts[0, n), each in in_order()'s order) on n
// threads, a kind (same_kind()) at a time: each kind's candidates merged from the parts, then
// pareto_sorted(), across_masks() and thin(). Each of these works within a kind (pareto_sorted() and thin()
// within a group, a kind's points holding the same masks; across_masks() between a kind's groups), so the
// kinds' frontiers, one after another in in_order()'s order, are what they make of all the candidates merged:
// the same frontier as on one thread, without the merge, the filter and the masks' pass over millions of
// points on the caller's thread alone (about 40% of BERT-large's H200 profile's planning time with four masks
// on two threads, before; a stage's candidates fall in about 35 kinds, the largest about a tenth of them).
// `scratch` (two buffers a worker) serves the merges; `widest` is raised to the points the frontier held
// before thin().
template <typename Key>
std::vector<Point> frontier_by_kind(const std::vector<std::vector<Point>>& parts, size_t n,
                                    std::vector<std::vector<Point>>& scratch, Key key, bool host, bool link,
                                    const std::vector<int64_t>& masks, size_t cap, size_t* widest) {
  // Each part's runs of one kind, sorted by kind (a stable sort: a kind's runs in the parts' order).
  struct Run {
    const Point* first;
    const Point* last;
  };
  std::vector<Run> runs;
  for (size_t w = 0; w < n; ++w) {
    const Point* p = parts[w].data();
    const size_t size = parts[w].size();
    for (size_t b = 0; b < size;) {
      size_t e = b + 1;
      while (e < size && same_kind(p[b], p[e]))
        ++e;
      runs.push_back({p + b, p + e});
      b = e;
    }
  }
  std::stable_sort(runs.begin(), runs.end(),
                   [](const Run& a, const Run& b) { return kind_before(*a.first, *b.first); });
  std::vector<std::pair<size_t, size_t>> kinds;  // runs[first, last) of each kind, in order
  for (size_t r = 0; r < runs.size(); ++r) {
    if (r == 0 || !same_kind(*runs[r - 1].first, *runs[r].first))
      kinds.emplace_back(r, r + 1);
    else
      kinds.back().second = r + 1;
  }
  // The largest kinds first, so that the threads end together.
  std::vector<size_t> order(kinds.size());
  std::vector<size_t> size(kinds.size(), 0);
  for (size_t k = 0; k < kinds.size(); ++k) {
    order[k] = k;
    for (size_t r = kinds[k].first; r < kinds[k].second; ++r)
      size[k] += static_cast<size_t>(runs[r].last - runs[r].first);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return size[a] > size[b]; });
  std::vector<std::vector<Point>> done(kinds.size());
  std::vector<size_t> before_thin(kinds.size(), 0);
  const auto less = [&](const Point& a, const Point& b) { return in_order(a, b, key); };
  std::atomic<size_t> next{0};
  in_parallel(n, [&](size_t w) {
    std::vector<Point>& merged = scratch[2 * w];
    std::vector<Point>& spare = scratch[2 * w + 1];
    for (size_t i = next++; i < order.size(); i = next++) {
      const size_t k = order[i];
      const Run* r = runs.data() + kinds[k].first;
      const size_t count = kinds[k].second - kinds[k].first;
      const Point* first = r[0].first;
      const Point* last = r[0].last;
      if (count > 1) {  // the runs merged one by one (in_order() is a total order: one result)
        merged.clear();
        merged.reserve(size[k]);
        std::merge(r[0].first, r[0].last, r[1].first, r[1].last, std::back_inserter(merged), less);
        for (size_t m = 2; m < count; ++m) {
          spare.clear();
          spare.reserve(size[k]);
          std::merge(merged.begin(), merged.end(), r[m].first, r[m].last, std::back_inserter(spare), less);
          std::swap(merged, spare);
        }
        first = merged.data();
        last = merged.data() + merged.size();
      }
      done[k] = filtered(first, last, key, host, link, masks, cap, &before_thin[k]);
    }
  });
  size_t total = 0, held = 0;
  for (size_t k = 0; k < kinds.size(); ++k)
    total += done[k].size(), held += before_thin[k];
  *widest = std::max(*widest, held);
  std::vector<Point> out;
  out.reserve(total);
  for (std::vector<Point>& d : done)
    out.insert(out.end(), d.begin(), d.end());
  return out;
}

struct Solution {
  std::vector<std::vector<Point>> frontiers;  // per stage boundary 0..n
  std::vector<std::vector<Choice>> choices;   // per stage
  int64_t best = -1;                          // index in frontiers[n], or -1
  int64_t best_peak = 0;
  double best_ms = 0;           // its time, the last stage's copies included
  double best_transfer_ms = 0;  // of which the copies no computation hides
};

// A plan given, to be charged rather than chosen (step_time_ms()): stage i of the plan is stage first + i of
// the chain solve() runs on (1 on step_chain()), whose only choice is then the plan's forward of it.
struct Given {
  const Plan* plan = nullptr;
  int64_t first = 0;
};

// The forward of stage j run as choice `c` (a policy by the chain's index of it; its stream window apart).
Op op_of(const Choice& c, int64_t j) {
  Op op{c.kind, j};
  if (c.kind == OpKind::kForwardKeep && c.groups.empty()) op.policy = static_cast<int32_t>(c.variant - 1);
  op.offload = c.offload && c.groups.empty() && !c.stream;  // a group assignment says itself what goes
  op.stream = c.stream;
  op.groups = c.groups;
  return op;
}

// Whether choice `c` runs as the forward `op` with stream window `window`.
bool runs_as(const Choice& c, const Op& op, int64_t window) {
  return op_of(c, op.stage) == op && (!c.stream || c.window == window);
}

// Stage j's choices cut to the given plan's forward of it (Given): the one that runs as it, or, for a group
// assignment thin_group_choices() left out, that assignment made again. Throws std::invalid_argument naming
// the stage where none does (a way the chain has no figures for, or one its options leave out).
void keep_given(const Chain& chain, int64_t j, const Given& given, std::vector<Choice>& cs) {
  const int64_t i = j - given.first;
  if (!given.plan || i < 0 || i >= given.plan->num_stages) return;
  const Stage& s = chain.stages[static_cast<size_t>(j)];
  Op op = given.plan->ops[static_cast<size_t>(i)];
  // A policy the plan names (Plan::policies) by the chain's index of it (Chain::policies; -2: none such).
  const auto& names = given.plan->policies;
  if (op.kind == OpKind::kForwardKeep && op.groups.empty() && op.policy >= 0 &&
      static_cast<size_t>(op.policy) < names.size()) {
    const auto at =
        std::find(chain.policies.begin(), chain.policies.end(), names[static_cast<size_t>(op.policy)]);
    op.policy = at == chain.policies.end() ? -2 : static_cast<int32_t>(at - chain.policies.begin());
  }
  const auto& windows = given.plan->stream_windows;
  const int64_t window = !windows.empty() && windows[static_cast<size_t>(i)] >= 0
                             ? windows[static_cast<size_t>(i)]
                         : s.offload ? s.offload->window_bytes
                                     : -1;
  std::vector<Choice> only;
  for (Choice& c : cs) {
    if (runs_as(c, op, window)) {
      only.push_back(std::move(c));
      break;
    }
  }
  if (only.empty() && op.kind == OpKind::kForwardKeep && !op.groups.empty() &&
      op.groups.size() == s.groups.size())
    only.push_back(group_choice(s, op.groups, group_unsaved_bytes(s, op.groups),
                                group_recompute_peak_bytes(s, op.groups),
                                group_forward_peak_bytes(s, op.groups)));
  if (only.empty()) {
    throw std::invalid_argument("remat::step_time_ms: the plan runs stage " + std::to_string(i) + " ('" +
                                s.name + "') as " +
                                op_text(*given.plan, given.plan->ops[static_cast<size_t>(i)]) +
                                ", a way the chain has no figures for (profile it with that way: offloading, "
                                "groups, the policy)");
  }
  cs = std::move(only);
  for (Choice& c : cs)
    if (c.own) c.cost = &*c.own;
}

// by_time: the fastest within `budget`; otherwise the least peak (budget ignored). offload: the choices may
// offload (what options allow), the host bytes at most max_host (-1: no bound). filter: leave out the
// candidates an anchor beats (filtered_by()) and, after a rough program, those its plan's time (or peak)
// rules out; without, every candidate is made and sorted (the tests' check that neither changes a plan).
Solution solve(const Chain& chain, const std::vector<char>& allowed, bool by_time, int64_t budget,
               const StepTerms* step, bool offload, int64_t max_host, bool groups, int threads,
               bool filter = true, const Given& given = {}) {
  const int64_t n = chain.size();
  const bool bounded = offload && max_host >= 0;
  Solution sol;
  sol.choices.resize(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    sol.choices[static_cast<size_t>(j)] =
        choices_of(chain, j, allowed, step && step->all_only[static_cast<size_t>(j)], offload, groups);
    keep_given(chain, j, given, sol.choices[static_cast<size_t>(j)]);
  }
  // Per stage boundary j, the least time stages j.. can take: each stage's fastest choice, no copy waited
  // for.
  std::vector<double> rest(static_cast<size_t>(n) + 1, 0.0);
  for (int64_t j = n; j-- > 0;) {
    double least = std::numeric_limits<double>::infinity();
    for (const Choice& c : sol.choices[static_cast<size_t>(j)])
      least = std::min(least, c.ms);
    rest[static_cast<size_t>(j)] = rest[static_cast<size_t>(j) + 1] + least;
  }
  auto time_key = [](const Point& p) { return p.ms; };
  auto peak_key = [](const Point& p) { return p.peak; };
  // The time model of the copies (see simulate()): a stage's copies to the host start with its forward (or
  // once it has run: OffloadCost::after_forward), once the link has finished the previous stage's, and are
  // waited for when the next stage's forward is done; its
  // copies back start with the next stage's backward and are waited for when its own begins.
  auto back_wait = [&](int64_t copied, double bwd) {
    return copied == 0 ? 0.0 : std::max(0.0, chain.transfer_ms(copied, false) - bwd);
  };
  const bool link = by_time && offload;
  // The masks' bytes (StepContext::taken_bytes), for across_masks().
  const std::vector<int64_t> masks = step && step->taken ? step->taken->taken_bytes : std::vector<int64_t>{};
  // The most points a stage's frontier held before thinning, in the last run.
  size_t widest = 0;
  // A stage's candidates: up to millions of points (BERT-large's H200 profile between hf's peak and the plain
  // step's: 2.6 million, 270 MB), made and sorted in parts, one per thread (each part the candidates of the
  // choices it took), then merged and filtered a kind at a time on the threads too (frontier_by_kind(); on
  // one thread, `made` alone). Every buffer serves every stage of every run: fresh pages, taken and given
  // back at each stage, cost about a fifth of the program's time (docs/BENCHMARKS.md, "Planner speed").
  std::vector<Point> made;
  std::vector<std::vector<Point>> parts(static_cast<size_t>(threads)),
      spare(2 * static_cast<size_t>(threads));
  // The program, its frontiers thinned past `cap` points a group, leaving out the candidates whose peak
  // exceeds `most` (bytes) and those whose time and the least the stages after them take exceed `bound` (ms).
  auto run = [&](size_t cap, double bound, int64_t most) {
    widest = 0;
    sol.frontiers.assign(static_cast<size_t>(n) + 1, {});
    Point start;
    start.held = start.peak = chain.input_bytes;
    sol.frontiers[0].push_back(start);
    sol.best = -1;
    for (int64_t j = 0; j < n; ++j) {
      const auto& cs = sol.choices[static_cast<size_t>(j)];
      const int64_t a_in = chain.activation_bytes(j),
                    a_out = chain.stages[static_cast<size_t>(j)].output_bytes;
      const auto& cur = sol.frontiers[static_cast<size_t>(j)];
      // Per choice, what does not depend on the point it follows: the bytes its copies move each way, their
      // times, and its need (stage_need()) for each way its input and the chain's input may be gone, made
      // when first asked for. Per point, its copies' time back.
      struct Fixed {
        int64_t copied = 0;
        double to_host_ms = 0, to_device_ms = 0;
        int64_t past = 0;    // past_between_bytes()
        uint32_t holds = 0;  // the masks this choice's way holds (detail::taken_held_by()'s bits)
        // (Indexed first by the tensors only the stages hold that the stages before hold: Point::taken_held.)
        int64_t need[1u << kMaxTakenTensors][2][2][2][2] = {};
        bool made[1u << kMaxTakenTensors][2][2][2][2] = {};
      };
      std::vector<Fixed> fixed(cs.size());
      for (size_t c = 0; c < cs.size(); ++c) {
        const Choice& ch = cs[c];
        Fixed& f = fixed[c];
        f.copied =
            ch.offload ? ch.cost->bytes + (ch.cost->input ? a_in : 0) + (ch.cost->output ? a_out : 0) : 0;
        f.to_host_ms = chain.transfer_ms(f.copied, true);
        f.to_device_ms = chain.transfer_ms(f.copied, false);
        f.past = past_between_bytes(chain.stages[static_cast<size_t>(j)], ch, step, j);
        if (step && step->taken && j >= 1 && j <= n - 2)
          f.holds = detail::taken_held_by(*step->taken, j - 1, ch.kind);
      }
      std::vector<double> back_ms(cur.size());
      for (size_t k = 0; k < cur.size(); ++k)
        back_ms[k] = chain.transfer_ms(cur[k].copied, false);
      // Candidate (k, c): stage j run as cs[c] after cur[k]; false where it does not fit (the budget, the
      // host).
      auto make = [&](size_t k, size_t c, Point& q) {
        const Point& p = cur[k];
        // What runs between the stage before this one and it, in the forward: held from here on.
        const int64_t p_held = step ? p.held + step->forward_held[static_cast<size_t>(j)] : p.held;
        const Choice& ch = cs[c];
        Fixed& f = fixed[c];
        const bool sends_input = ch.offload && ch.cost && ch.cost->input;
        const bool input_leaves = sends_input && j > 0 && !p.keeps_output && !chain.input_held(j);
        // Step stage 1 is the chain's first: where it sends its input (step stage 0's output), streamed it
        // takes it for the whole backward pass; offloaded whole, until its bytes come back (step stage 2's
        // backward).
        q.input_gone_from = p.input_gone_from;
        if (step && step->input_freed > 0 && j == 1)
          q.input_gone_from = detail::input_gone_from(
              ch.stream, sends_input,
              step->first_input_let_go && ch.kind == OpKind::kForwardAll && !sends_input);
        // Without it: the backward of every stage from there on (the rest's included).
        const bool gone = q.input_gone_from > 0 && j >= q.input_gone_from;
        const bool twice = input_leaves && p.output_ahead;
        // Its input, which it does not save (kept, or offloaded or streamed not sending it) and nothing else
        // holds, let go of once its forward is done.
        // At the rest: the last chain stage's input, gone once its forward is done (Point::output_let_go).
        const bool rest_less = p.output_let_go && j + 1 == n;
        const bool dropped = p.output_let_go && !rest_less && ch.kind == OpKind::kForwardAll && !sends_input;
        // The last chain stage's input, let go of once the rest's forward is done rather than its own.
        const bool in_rest = dropped && j + 2 == n && step->last_in_rest;
        const int64_t dropped_bytes = dropped ? a_in + step->input_extra[static_cast<size_t>(j)] : 0;
        const bool less = dropped || rest_less;
        // The tensors only the stages hold past the forward (StepContext::taken_bytes): held from here on
        // by those before and this one's way; charged to its backward where any of them holds them, to what
        // runs between once it is done where a stage before does, to the rest where any stage does, and never
        // to the backward of the part before the chain.
        q.taken_held = p.taken_held | f.holds;
        const uint32_t th = p.taken_held;
        if (!f.made[th][input_leaves][gone][twice][less]) {
          TakenLess taken_less;
          if (step && step->taken) {
            const StepContext& x = *step->taken;
            if (j == 0) {
              taken_less.bwd = detail::taken_unheld_bytes(x, 0);
            } else if (j == n - 1) {
              taken_less.fwd = taken_less.bwd = detail::taken_unheld_bytes(x, th);
            } else {
              taken_less.bwd = detail::taken_unheld_bytes(x, q.taken_held);
              taken_less.between = detail::taken_unheld_bytes(x, th);
            }
          }
          // (A streamed stage's input that left with it: gone from R_j, but its copy brought back adds what
          // it adds to the measured backward: OffloadCost::input_back_bytes(), simulate()'s rule.)
          // Likewise the chain's input, taken to the host by the first stage streamed: back in its backward.
          const int64_t first_back =
              j == 1 && gone && ch.stream && sends_input ? ch.cost->input_back_bytes(step->input_freed) : 0;
          const int64_t bwd_less = (ch.stream && input_leaves ? a_in - ch.cost->input_back_bytes(a_in) : 0) +
                                   (gone ? step->input_freed - first_back : 0) +
                                   (rest_less ? step->rest_gone : 0);
          f.need[th][input_leaves][gone][twice][less] =
              stage_need(chain, j, ch, step, bwd_less, gone, twice ? a_in : 0, dropped_bytes, taken_less);
          f.made[th][input_leaves][gone][twice][less] = true;
        }
        q.peak = std::max(p.peak, p_held + f.need[th][input_leaves][gone][twice][less]);
        if (q.peak > most) return false;
        const int64_t copied = f.copied;
        double wait =
            std::max(0.0, p.link - ch.fwd_ms) + (p.copied == 0 ? 0.0 : std::max(0.0, back_ms[k] - ch.bwd_ms));
        // Streamed with no window: its copies each way are waited for as they are made or asked for, so
        // nothing hides them (simulate()'s charge); nor copies made at once (Chain::copies_at_once).
        const bool exposed = ch.stream && ch.window == 0;
        const bool unhidden = exposed || (ch.offload && chain.copies_at_once);
        if (unhidden) wait += f.to_host_ms + f.to_device_ms;
        q.ms = p.ms + ch.ms + wait;
        if (q.ms + rest[static_cast<size_t>(j) + 1] > bound) return false;
        q.transfer_ms = p.transfer_ms + wait;
        q.held = p_held - p.pending + ch.held + f.past - (in_rest ? 0 : dropped_bytes);
        // Whether the next stage may let go of this one's output once its forward is done: this way does not
        // hold it, or holds it beside the next stage's input made from it (f.past: a residual sum's result,
        // which goes alone).
        q.output_let_go = (step && j + 1 < n && step->input_let_go[static_cast<size_t>(j) + 1] &&
                           (ch.kind == OpKind::kForwardCheckpoint || f.past > 0 ||
                            detail::way_leaves_output(
                                chain.stages[static_cast<size_t>(j)], ch.kind, ch.cost, !ch.groups.empty(),
                                policy_of(chain.stages[static_cast<size_t>(j)], ch)))) ||
                          in_rest;
        if (step && detail::recomputes(ch.kind, !ch.groups.empty())) q.held += step->checkpoint_state;
        q.host = p.host;
        if (ch.offload) {
          q.pending = ch.cost->bytes + (input_leaves ? a_in : 0);
          q.copied = copied;
          if (ch.stream) {
            // Only its tail stays in flight past its forward (and comes back ahead of its backward).
            const int64_t tail = ch.cost->tail_bytes(ch.window, q.pending);
            q.held -= q.pending - tail;
            q.pending = tail;
          }
          // Copies that start once its forward has run (OffloadCost::after_forward): none hidden by it.
          q.link = ch.cost->after_forward ? f.to_host_ms
                                          : std::max(0.0, f.to_host_ms - std::max(0.0, ch.fwd_ms - p.link));
          q.host += q.copied;
          if (unhidden) q.link = 0, q.copied = 0;  // its copies are done, and come back within its backward
          // The runtime may hold a kept stage's output whatever the stage saves (the C++ executor).
          q.keeps_output = chain.holds_outputs && ch.kind != OpKind::kForwardCheckpoint;
          q.output_ahead = ch.cost->output && !exposed;
          if (bounded && q.host > max_host) return false;
        } else if (!offload) {
          q.keeps_output = true;  // read by offloaded choices only: one group without them
        } else if (ch.kind == OpKind::kForwardCheckpoint) {
          q.keeps_output = false;  // a checkpoint holds its input, not its output
        } else {
          // Unknown: held, as before offloading.
          q.keeps_output = chain.holds_outputs || !ch.cost || ch.cost->output;
        }
        q.parent = static_cast<int64_t>(k);
        q.choice = static_cast<int64_t>(c);
        return true;
      };
      // Anchors: each point of cur followed by the choice of the same index as its own (in a chain of equal
      // layers, often where the frontier goes on), kept where no other beats them. A candidate an anchor
      // beats by filtered_by() is never kept by pareto(), so it is not made at all: the same frontier from
      // far fewer points to sort.
      // Where cur is long, made and sorted in parts (runs of cur) on the threads, then merged and filtered a
      // kind at a time there too (frontier_by_kind(), with no masks' pass and no thinning: pareto()'s
      // points).
      std::vector<Point> anchors;
      // A part's points sorted in in_order()'s order (the anchors' parts and make_part()'s).
      auto sort_part = [&](std::vector<Point>& v) {
        if (by_time)
          std::sort(v.begin(), v.end(),
                    [&](const Point& a, const Point& b) { return in_order(a, b, time_key); });
        else
          std::sort(v.begin(), v.end(),
                    [&](const Point& a, const Point& b) { return in_order(a, b, peak_key); });
      };
      auto make_anchors = [&](size_t from, size_t to, std::vector<Point>& out) {
        out.clear();
        for (size_t k = from; k < to; ++k) {
          Point q;
          if (cur[k].choice >= 0 && static_cast<size_t>(cur[k].choice) < cs.size() &&
              make(k, static_cast<size_t>(cur[k].choice), q))
            out.push_back(q);
        }
      };
      const size_t anchor_parts = !filter ? 0 : cur.size() < detail::parts_from ? 1 : parts.size();
      if (anchor_parts == 1) {
        make_anchors(0, cur.size(), anchors);
        anchors = by_time ? pareto(std::move(anchors), time_key, bounded, link)
                          : pareto(std::move(anchors), peak_key, bounded);
      } else if (anchor_parts > 1) {
        in_parallel(anchor_parts, [&](size_t w) {
          make_anchors(cur.size() * w / anchor_parts, cur.size() * (w + 1) / anchor_parts, parts[w]);
          sort_part(parts[w]);
        });
        size_t unused = 0;
        const size_t all = std::numeric_limits<size_t>::max();
        anchors =
            by_time
                ? frontier_by_kind(parts, anchor_parts, spare, time_key, bounded, link, {}, all, &unused)
                : frontier_by_kind(parts, anchor_parts, spare, peak_key, bounded, false, {}, all, &unused);
      }
      // Per anchor, the least key of its group's anchors up to it (in R's order): below a candidate's key,
      // none of them beats it.
      std::vector<double> least_key(anchors.size());
      std::vector<int64_t> anchor_held(anchors.size());
      for (size_t a = 0; a < anchors.size(); ++a) {
        const double k = static_cast<double>(by_time ? time_key(anchors[a]) : peak_key(anchors[a]));
        least_key[a] = a > 0 && same_group(anchors[a - 1], anchors[a]) ? std::min(least_key[a - 1], k) : k;
        anchor_held[a] = anchors[a].held;
      }
      // A part: the candidates of the choices it takes, each the next no part has taken (so that parts made
      // on threads end together), sorted in in_order()'s order, into `out`.
      std::atomic<size_t> next_choice{0};
      auto make_part = [&](std::vector<Point>& out) {
        out.clear();
        for (size_t c = next_choice++; c < cs.size(); c = next_choice++) {
          // anchors[first, last): the group of the last candidate; anchors[first, up): those of R up to its.
          size_t first = 0, last = 0, up = 0;
          int64_t up_held = 0;
          for (size_t k = 0; k < cur.size(); ++k) {
            Point q;
            if (!make(k, c, q)) continue;
            if (first == last || !same_group(anchors[first], q)) {
              const auto range =
                  std::equal_range(anchors.begin(), anchors.end(), q, [](const Point& a, const Point& b) {
                    return std::tie(a.pending, a.copied, a.keeps_output, a.output_ahead, a.output_let_go,
                                    a.taken_held) < std::tie(b.pending, b.copied, b.keeps_output,
                                                             b.output_ahead, b.output_let_go, b.taken_held);
                  });
              first = static_cast<size_t>(range.first - anchors.begin());
              last = static_cast<size_t>(range.second - anchors.begin());
              up = first;
            } else if (q.held < up_held) {
              up = first;  // the next group of cur's points, into the same group of anchors
            }
            // The points of cur follow one another in R's order within a group, and so do their candidates
            // under one choice: `up` moves on.
            up_held = q.held;
            while (up < last && anchor_held[up] <= q.held)
              ++up;
            // From the anchor of largest R up to q's down: along a frontier, the one of least key.
            size_t a = up;
            bool beaten = false;
            const double q_key = static_cast<double>(by_time ? time_key(q) : peak_key(q));
            // (At most kMaxWalk of them: a candidate let through is left out by pareto() all the same, and on
            // frontiers of 10^5 points the walk cost more than the rest of the program.)
            size_t walked = 0;
            while (a > first && !beaten && !(least_key[a - 1] > q_key) && walked++ < kMaxWalk) {
              --a;
              beaten = by_time ? filtered_by(anchors[a], q, time_key, bounded, link)
                               : filtered_by(anchors[a], q, peak_key, bounded, false);
            }
            if (!beaten) out.push_back(q);
          }
        }
        sort_part(out);
      };
      // in_order() is a total order (each candidate its own parent and choice), so each kind's candidates
      // merged from the parts are what one sort of them all would order them: the same frontier, whatever the
      // threads and whichever part made which choice's candidates. (`spare`: two merge buffers a thread.)
      const size_t workers =
          std::min(parts.size(), cur.size() * cs.size() < detail::parts_from ? size_t{1} : cs.size());
      std::vector<Point> next;
      if (workers <= 1) {
        make_part(made);
        const Point* first = made.data();
        const Point* last = first + made.size();
        size_t held = 0;
        next = by_time ? filtered(first, last, time_key, bounded, link, masks, cap, &held)
                       : filtered(first, last, peak_key, bounded, false, masks, cap, &held);
        widest = std::max(widest, held);
      } else {
        in_parallel(workers, [&](size_t w) { make_part(parts[w]); });
        next = by_time
                   ? frontier_by_kind(parts, workers, spare, time_key, bounded, link, masks, cap, &widest)
                   : frontier_by_kind(parts, workers, spare, peak_key, bounded, false, masks, cap, &widest);
      }
      sol.frontiers[static_cast<size_t>(j) + 1] = std::move(next);
    }
    const auto& last = sol.frontiers[static_cast<size_t>(n)];
    const int64_t a_n = chain.activation_bytes(n);
    for (size_t k = 0; k < last.size(); ++k) {
      // (The loss, without the tensors only the stages hold that none holds: step_op_peaks()'s rule.)
      const int64_t taken_less =
          step && step->taken ? detail::taken_unheld_bytes(*step->taken, last[k].taken_held) : 0;
      const int64_t peak = std::max(last[k].peak, last[k].held + a_n - taken_less);
      if (by_time && peak > budget) continue;
      // A last stage's copies to the host are waited for at the loss, and come straight back.
      const double wait = last[k].link + back_wait(last[k].copied, 0.0);
      const double ms = last[k].ms + wait;
      // Between plans of the same time (an offloaded stage whose copies hide completely costs nothing more),
      // the one holding less in host memory: copies that cost no time still take the link and the host's
      // memory.
      const int64_t host = last[k].host;
      const bool better =
          sol.best < 0 ||
          (by_time
               ? ms < sol.best_ms || (ms == sol.best_ms && host < last[static_cast<size_t>(sol.best)].host)
               : peak < sol.best_peak ||
                     (peak == sol.best_peak && host < last[static_cast<size_t>(sol.best)].host));
      if (better) {
        sol.best = static_cast<int64_t>(k);
        sol.best_peak = peak;
        sol.best_ms = ms;
        sol.best_transfer_ms = last[k].transfer_ms + wait;
      }
    }
  };
  constexpr double kNone = std::numeric_limits<double>::infinity();
  const int64_t fits = by_time ? budget : std::numeric_limits<int64_t>::max();
  if (!filter) {
    run(kMaxFrontier, kNone, fits);
    return sol;
  }
  // First a rough program, its frontiers thinned to kRoughFrontier points a group: its plan fits (thinning
  // only raises R), with its time and peak. No candidate slower than that on its way to the end (the bound a
  // billionth above, for the sums' rounding) can be the fastest plan or tie with it; when looking for the
  // least peak, none whose peak so far is above that plan's.
  run(kRoughFrontier, kNone, fits);
  if (sol.best < 0) {
    run(kMaxFrontier, kNone, fits);
    return sol;
  }
  // A rough plan's time as a bound: a billionth above, for the sums' rounding.
  auto above = [](double ms) { return ms + std::abs(ms) * 1e-9; };
  double bound = by_time ? above(sol.best_ms) : kNone;
  const int64_t most = by_time ? budget : sol.best_peak;
  // Planning for time, where the first's frontiers grew past detail::second_rough_after points (a program
  // whose exact run will be long), a second rough program, thinned to kMidFrontier points a group and cut by
  // the first's plan: its plan fits too and is usually much nearer the best, and the tighter bound leaves out
  // most of the exact program's candidates. BERT-large's H200 profile, offloading and groups: at 12 GB 1600
  // ms against the first's 1759 (the best 1585), planned in 14.2 s where it took 23-26; at 28 GB, 7 s where
  // it took 42-44 (docs/BENCHMARKS.md, "Planner speed"). Where the first's frontiers stay small (a 48-layer
  // BERT of width 64: 400-560 points), the second would cost more than it saves.
  if (by_time && widest > detail::second_rough_after) {
    run(kMidFrontier, bound, most);
    if (sol.best >= 0) bound = std::min(bound, above(sol.best_ms));
  }
  run(kMaxFrontier, bound, most);
  // Past kMaxFrontier points a group the program itself is thinned, and may miss the rough plan.
  if (sol.best < 0) run(kMaxFrontier, kNone, fits);
  return sol;
}

// The choices of a solution, per stage.
std::vector<const Choice*> picks(const Solution& sol) {
  const size_t n = sol.choices.size();
  std::vector<const Choice*> picked(n);
  int64_t k = sol.best;
  for (size_t j = n; j-- > 0;) {
    const Point& p = sol.frontiers[j + 1][static_cast<size_t>(k)];
    picked[j] = &sol.choices[j][static_cast<size_t>(p.choice)];
    k = p.parent;
  }
  return picked;
}

// The plan of per-layer choices: forwards in order, the loss, then each stage's backward (a checkpointed
// stage's recompute first). *ms is their time, checkpointed stages as run per call.
Plan plan_of(const std::vector<const Choice*>& picked, double* ms) {
  const int64_t n = static_cast<int64_t>(picked.size());
  Plan plan;
  plan.num_stages = n;
  *ms = 0;
  if (std::any_of(picked.begin(), picked.end(), [](const Choice* c) { return c->stream; })) {
    for (const Choice* c : picked)
      plan.stream_windows.push_back(c->stream ? c->window : -1);
  }
  for (int64_t j = 0; j < n; ++j) {
    const Choice& c = *picked[static_cast<size_t>(j)];
    plan.ops.push_back(op_of(c, j));
    *ms += c.ms;
  }
  push(plan, OpKind::kLoss, -1);
  for (int64_t j = n; j-- > 0;) {
    if (picked[static_cast<size_t>(j)]->kind == OpKind::kForwardCheckpoint)
      push(plan, OpKind::kForwardAll, j);
    push(plan, OpKind::kBackward, j);
  }
  return plan;
}

// The terms step_peak_bytes() adds to step_chain(chain, context)'s stages: the first (before the chain) and
// the last (the rest of the step) only kept; the rest's gradients arrive after its backward, each chain
// stage's at its own backward.
StepTerms step_terms(const Chain& chain, const StepContext& context) {
  const size_t n = static_cast<size_t>(chain.size());
  StepTerms t;
  if (!context.taken_bytes.empty()) t.taken = &context;
  t.all_only.assign(n + 2, 0);
  t.all_only.front() = t.all_only.back() = 1;
  t.at_recompute.assign(n + 2, 0);
  t.own.assign(n + 2, 0);
  t.side.assign(n + 2, 0);
  t.side_late.assign(n + 2, 0);
  t.side_freed.assign(n + 2, 0);
  t.between.assign(n + 2, -1);
  t.forward_held.assign(n + 2, 0);
  t.grad_held.assign(n + 2, 0);
  t.output_unheld.assign(n + 2, 0);
  t.frees_output.assign(n + 2, 0);
  t.input_let_go.assign(n + 2, 0);
  t.input_extra.assign(n + 2, 0);
  t.freed_early.assign(n + 2, 0);
  t.held_past_runtime.assign(n + 2, 0);
  t.recomputed_held.assign(n + 2, 0);
  for (size_t s = 1; s <= n; ++s) {  // step stage s is chain stage s - 1, whose output is stage s's input
    t.grad_held[s] = detail::grad_held_through(chain, context, static_cast<int64_t>(s) - 1);
    t.output_unheld[s] = detail::output_unheld(chain, context, static_cast<int64_t>(s));
    t.frees_output[s] = detail::output_freed_between(chain, context, static_cast<int64_t>(s) - 1);
    t.input_let_go[s] = detail::input_let_go_in_forward(chain, context, static_cast<int64_t>(s) - 1);
    t.input_extra[s] = detail::input_let_go_extra_bytes(chain, context, static_cast<int64_t>(s) - 1);
    t.freed_early[s] = detail::output_freed_early(chain, context, static_cast<int64_t>(s) - 1);
    t.held_past_runtime[s] = detail::output_held_past_runtime(chain, context, static_cast<int64_t>(s) - 1);
    t.recomputed_held[s] = detail::recomputed_output_held_bytes(chain, context, static_cast<int64_t>(s) - 1);
  }
  t.last_in_rest = n >= 1 && detail::last_input_let_go_in_rest(chain, context);
  if (t.last_in_rest) {
    t.input_let_go[n] = 1;
    t.rest_gone = chain.activation_bytes(static_cast<int64_t>(n) - 1) + t.input_extra[n];
  }
  t.input_freed = detail::input_unheld_bytes(chain, context);
  t.first_input_let_go = detail::first_input_let_go(chain, context);
  t.checkpoint_state = context.checkpoint_state_bytes;
  t.cached_through.assign(n + 2, 0);
  for (size_t s = 1; s <= n + 1; ++s)
    t.cached_through[s] = t.cached_through[s - 1] + (s <= n ? chain.stages[s - 1].autocast_cache_bytes : 0);
  t.held_to_end.assign(n + 2, 0);
  for (size_t s = 1; s <= n; ++s)
    t.held_to_end[s] = detail::held_to_end_bytes(chain, context, static_cast<int64_t>(s) - 1);
  int64_t after = context.rest_grads_bytes;  // arrived once the backward pass is below stage s
  for (size_t s = n + 1; s-- > 0;) {
    t.at_recompute[s] = after;
    if (s >= 1 && s <= n) {
      t.own[s] = detail::stage_figure(context.stage_grads_bytes, s - 1);
      t.side[s] = detail::stage_figure(context.side_grads_bytes, s - 1);
      t.side_late[s] = detail::stage_figure(context.side_grads_late_bytes, s - 1);
      t.side_freed[s] = detail::stage_figure(context.side_freed_bytes, s - 1);
    }
    after += t.own[s] + t.side[s] + t.held_to_end[s] - t.side_freed[s];
    // What runs between chain stages s - 2 and s - 1 (step_op_peaks()'s rule).
    if (s >= 2 && s <= n) {
      const int64_t between = detail::stage_figure(context.between_backward_peak_bytes, s - 1),
                    held = detail::stage_figure(context.between_held_bytes, s - 1);
      if (between > 0 || held != 0) t.between[s] = between;
      t.forward_held[s] = detail::stage_figure(context.between_forward_held_bytes, s - 1);
      after += held + t.forward_held[s];  // the stages before it: held through their backward passes
    }
  }
  // The chain's output gradient, held once chain stage s's backward is done: through step stage s's recompute
  // and backward (chain stage s - 1's; the part before the chain's for s = 0; step_op_peaks()'s rule).
  for (size_t s = 0; s < n; ++s)
    if (detail::output_grad_held(context, static_cast<int64_t>(s)))
      t.at_recompute[s] += chain.activation_bytes(chain.size());
  return t;
}

// The allowed Fk variants, after checking that offloading, when asked for, has what it needs.
std::vector<char> allowed_for(const Chain& chain, const PlannerOptions& options, const char* who) {
  if (options.offload && !chain.can_offload()) {
    throw std::invalid_argument(std::string(who) +
                                ": offloading needs the chain's measured bandwidths (to_host_gb_per_s, "
                                "to_device_gb_per_s are 0): profile the chain for offloading");
  }
  if (options.max_host_bytes < -1) {
    throw std::invalid_argument(std::string(who) + ": max_host_bytes must be >= 0, or -1 for no bound, got " +
                                std::to_string(options.max_host_bytes));
  }
  return detail::allowed_variants(chain, options, who);
}

}  // namespace

int64_t per_layer_min_budget(const Chain& chain, const PlannerOptions& options) {
  validate(chain);
  const std::vector<char> allowed = allowed_for(chain, options, "remat::per_layer");
  return solve(chain, allowed, false, 0, nullptr, options.offload, options.max_host_bytes, options.groups,
               threads_for(options, "remat::per_layer"))
      .best_peak;
}

Plan per_layer(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options) {
  return detail::per_layer_with(chain, budget_bytes, options, true);
}

namespace detail {

size_t second_rough_after = 1024;
size_t parts_from = size_t{1} << 14;

Plan per_layer_with(const Chain& chain, int64_t budget_bytes, const PlannerOptions& options, bool filter) {
  validate(chain);
  if (budget_bytes < 0) {
    throw std::invalid_argument("remat::per_layer: negative budget (" + std::to_string(budget_bytes) +
                                " bytes)");
  }
  const std::vector<char> allowed = allowed_for(chain, options, "remat::per_layer");
  const int threads = threads_for(options, "remat::per_layer");
  const Solution sol = solve(chain, allowed, true, budget_bytes, nullptr, options.offload,
                             options.max_host_bytes, options.groups, threads, filter);
  if (sol.best < 0) {
    infeasible("remat::per_layer", budget_bytes,
               solve(chain, allowed, false, 0, nullptr, options.offload, options.max_host_bytes,
                     options.groups, threads)
                   .best_peak);
  }
  double ms = 0;
  Plan plan = finish(chain, plan_of(picks(sol), &ms), "per-layer", budget_bytes);
  // The program's peak is simulate()'s, or above it where a frontier was thinned.
  if (plan.predicted.peak_bytes > sol.best_peak) {
    throw std::logic_error("remat::per_layer: internal error: simulate()'s peak (" +
                           std::to_string(plan.predicted.peak_bytes) + ") exceeds the program's (" +
                           std::to_string(sol.best_peak) + ") for plan '" + plan.to_string() + "'");
  }
  // Checkpointed stages as run per call (recompute with early stopping), the copies no neighbour hides.
  plan.predicted.time_ms = sol.best_ms;
  plan.predicted.transfer_ms = sol.best_transfer_ms;
  return plan;
}

double per_layer_step_time(const Chain& chain, const StepContext& context, const Plan& plan) {
  // A per-layer plan: each stage's forward once, in order (read here, stage by stage, as its one choice),
  // then the loss and each stage's backward from the last, a checkpointed one recomputed (Fa) right before it
  // (as plan_of() makes them, compared below).
  const int64_t n = chain.size();
  auto not_per_layer = [&]() {
    return std::invalid_argument(
        "remat::step_time_ms: '" + plan.to_string() +
        "' is not a per-layer plan (each stage's forward once, in order, the loss, then "
        "each stage's backward from the last, a checkpointed stage's recompute Fa right "
        "before it): the per-layer program charges those only (simulate() charges any)");
  };
  if (static_cast<int64_t>(plan.ops.size()) < n) throw not_per_layer();
  for (int64_t j = 0; j < n; ++j) {
    const Op& op = plan.ops[static_cast<size_t>(j)];
    if (op.stage != j || (op.kind != OpKind::kForwardAll && op.kind != OpKind::kForwardCheckpoint &&
                          op.kind != OpKind::kForwardKeep))
      throw not_per_layer();
  }
  PlannerOptions options;
  options.offload = std::any_of(plan.ops.begin(), plan.ops.end(), [](const Op& op) { return op.offloads(); });
  options.groups =
      std::any_of(plan.ops.begin(), plan.ops.end(), [](const Op& op) { return !op.groups.empty(); });
  const Chain step = step_chain(chain, context);
  const std::vector<char> allowed = allowed_for(step, options, "remat::step_time_ms");
  const StepTerms terms = step_terms(chain, context);
  // No budget: the plan's one choice per stage is charged whatever it holds.
  const Solution sol = solve(step, allowed, true, std::numeric_limits<int64_t>::max() / 4, &terms,
                             options.offload, -1, options.groups, 1, true, Given{&plan, 1});
  if (sol.best < 0)
    throw std::logic_error("remat::step_time_ms: internal error: the plan given was not charged");
  std::vector<const Choice*> picked = picks(sol);
  picked = std::vector<const Choice*>(picked.begin() + 1, picked.end() - 1);  // the chain's stages
  double ms = 0;
  const Plan made = plan_of(picked, &ms);
  if (!std::equal(plan.ops.begin() + n, plan.ops.end(), made.ops.begin() + n, made.ops.end()))
    throw not_per_layer();
  return ms + sol.best_transfer_ms;
}

std::optional<Plan> per_layer_in_step(const Chain& chain, const StepContext& context, int64_t budget_bytes,
                                      const PlannerOptions& options, int64_t* least_bytes, bool filter) {
  const Chain step = step_chain(chain, context);
  const std::vector<char> allowed = allowed_for(step, options, "remat::plan_step");
  const StepTerms terms = step_terms(chain, context);
  const int64_t base = context.input_in_base ? chain.input_bytes : 0;
  Solution sol;
  if (std::max(context.before_peak_bytes, context.before_backward_peak_bytes) <= budget_bytes)
    sol = solve(step, allowed, true, budget_bytes + base, &terms, options.offload, options.max_host_bytes,
                options.groups, threads_for(options, "remat::plan_step"), filter);
  if (sol.best < 0) {
    *least_bytes = per_layer_step_min(chain, context, options, filter);
    return std::nullopt;
  }
  std::vector<const Choice*> picked = picks(sol);
  picked = std::vector<const Choice*>(picked.begin() + 1, picked.end() - 1);  // the chain's stages
  double ms = 0;
  Plan plan = finish(chain, plan_of(picked, &ms), "per-layer", budget_bytes);
  plan.predicted.time_ms = ms + sol.best_transfer_ms;
  plan.predicted.transfer_ms = sol.best_transfer_ms;
  return plan;
}

int64_t per_layer_step_min(const Chain& chain, const StepContext& context, const PlannerOptions& options,
                           bool filter) {
  const Chain step = step_chain(chain, context);
  const StepTerms terms = step_terms(chain, context);
  const Solution sol =
      solve(step, allowed_for(step, options, "remat::plan_step"), false, 0, &terms, options.offload,
            options.max_host_bytes, options.groups, threads_for(options, "remat::plan_step"), filter);
  return std::max(std::max(context.before_peak_bytes, context.before_backward_peak_bytes),
                  sol.best_peak - (context.input_in_base ? chain.input_bytes : int64_t{0}));
}

}  // namespace detail
}  // namespace remat
