#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "remat/planner/figures.h"

// The figures a plan depends on, for agreeing across processes (remat/planner/step.h, PlanFigures): one walk
// over a chain and its step context, used both to collect the figures and to write them back, so that the two
// directions cannot fall out of step.

namespace remat {
namespace {

constexpr const char* kSetFiguresWho = "remat::set_plan_figures";

// Collects the figures.
struct Collect {
  PlanFigures out;
  void bytes(const int64_t& v) { out.ints.push_back(v); }
  void flag(const bool& v) { out.ints.push_back(v ? 1 : 0); }
  // A flag that lets go of something: set where every process's is (agreed on as the largest of their
  // negations).
  void let_go(const bool& v) { out.ints.push_back(v ? 0 : 1); }
  void ms(const double& v) { out.reals.push_back(v); }
  void bandwidth(const double& v) { out.reals.push_back(-v); }
  // Bytes let go of: the least any process read (agreed on as the largest of their negatives).
  void freed(const int64_t& v) { out.ints.push_back(-v); }
  void opt_ms(const std::optional<double>& v) {
    out.ints.push_back(v ? 0 : 1);
    out.reals.push_back(v ? *v : 0.0);
  }
  void opt_bytes(const std::optional<int64_t>& v) {
    out.ints.push_back(v ? 0 : 1);
    out.ints.push_back(v ? *v : 0);
  }
  // Bytes measured on some processes, standing for `unset` where not: measured where any process measured
  // them (a presence flag's maximum is presence), the largest of what each reads.
  void measured_bytes(const std::optional<int64_t>& v, int64_t unset) {
    out.ints.push_back(v ? 1 : 0);
    out.ints.push_back(v.value_or(unset));
  }
  void offload(const std::optional<OffloadCost>& v) {
    out.ints.push_back(v ? 0 : 1);
    out.ints.push_back(v ? v->bytes : 0);
    out.ints.push_back(v && v->input ? 1 : 0);
    out.ints.push_back(v && v->output ? 1 : 0);
    // Copies that start once its forward has run: where any process's do (hidden the less).
    out.ints.push_back(v && v->after_forward ? 1 : 0);
    // Streaming: measured on every process, or on none (an absence flag's maximum is absence).
    const bool stream = v && v->can_stream();
    out.ints.push_back(stream ? 0 : 1);
    out.ints.push_back(stream ? v->stream_fwd_bytes : 0);
    out.ints.push_back(stream ? v->stream_bwd_bytes : 0);
    out.ints.push_back(stream ? v->window_bytes : 0);
    // The streamed backward's peak with its gradients made: likewise measured everywhere, or unmeasured.
    opt_bytes(stream && v->stream_bwd_grads_bytes >= 0 ? std::optional<int64_t>(v->stream_bwd_grads_bytes)
                                                       : std::nullopt);
    // What comes back ahead of its backward: likewise (the largest is at most the largest window).
    opt_bytes(stream && v->ahead_bytes >= 0 ? std::optional<int64_t>(v->ahead_bytes) : std::nullopt);
    // What its input brought back adds to its backward: likewise (absent, the input's bytes are charged).
    opt_bytes(stream && v->stream_bwd_input_bytes >= 0 ? std::optional<int64_t>(v->stream_bwd_input_bytes)
                                                       : std::nullopt);
  }
};

// Writes them back, in the same order.
struct Write {
  const PlanFigures& in;
  size_t i = 0, r = 0;
  int64_t next_int() { return in.ints.at(i++); }
  double next_real() { return in.reals.at(r++); }
  bool next_flag() {
    const int64_t v = next_int();
    if (v != 0 && v != 1)
      throw std::invalid_argument(std::string(kSetFiguresWho) + ": figure " + std::to_string(i - 1) +
                                  " is a flag, 0 or 1, got " + std::to_string(v));
    return v == 1;
  }
  void bytes(int64_t& v) { v = next_int(); }
  void flag(bool& v) { v = next_flag(); }
  void let_go(bool& v) { v = !next_flag(); }
  void ms(double& v) { v = next_real(); }
  void bandwidth(double& v) { v = -next_real(); }
  void freed(int64_t& v) { v = -next_int(); }
  void opt_ms(std::optional<double>& v) {
    const bool absent = next_flag();
    const double x = next_real();
    v = absent ? std::nullopt : std::optional<double>(x);
  }
  void opt_bytes(std::optional<int64_t>& v) {
    const bool absent = next_flag();
    const int64_t x = next_int();
    v = absent ? std::nullopt : std::optional<int64_t>(x);
  }
  void measured_bytes(std::optional<int64_t>& v, int64_t) {
    const bool present = next_flag();
    const int64_t x = next_int();
    v = present ? std::optional<int64_t>(x) : std::nullopt;
  }
  void offload(std::optional<OffloadCost>& v) {
    const bool absent = next_flag();
    OffloadCost c;
    c.bytes = next_int();
    c.input = next_flag();
    c.output = next_flag();
    c.after_forward = next_flag();
    const bool no_stream = next_flag();
    const int64_t fwd = next_int(), bwd = next_int(), window = next_int();
    std::optional<int64_t> grads, ahead, input_back;
    opt_bytes(grads);
    opt_bytes(ahead);
    opt_bytes(input_back);
    if (!no_stream) c.stream_fwd_bytes = fwd, c.stream_bwd_bytes = bwd, c.window_bytes = window;
    if (!no_stream && grads) c.stream_bwd_grads_bytes = *grads;
    if (!no_stream && ahead) c.ahead_bytes = *ahead;
    if (!no_stream && input_back) c.stream_bwd_input_bytes = *input_back;
    v = absent ? std::nullopt : std::optional<OffloadCost>(c);
  }
};

// Each flag of a vector<bool> (a const one when reading), through a bool: vector<bool> hands out proxies, so
// each is written back where the vector is not const.
template <typename B, typename V>
void flags(B& bits, V& v) {
  for (size_t j = 0; j < bits.size(); ++j) {
    bool bit = bits[j];
    v.flag(bit);
    if constexpr (!std::is_const_v<B>) bits[j] = bit;
  }
}

// The tensors only the stages hold past the forward (StepContext::taken_bytes): kMaxTakenTensors of them
// whatever a process lists (its own padded with none), so that every process has the same figures. Each one's
// bytes the least any process read (less let go of: none where a process lists fewer), and per stage taken
// and saved where any process's is (held the longer). Written back, those of no bytes are left out.
template <typename X, typename V>
void taken(X& context, size_t stages, V& v) {
  constexpr bool write = !std::is_const_v<X>;
  if constexpr (write) {
    context.taken_bytes.resize(kMaxTakenTensors, 0);
    context.taken_by.resize(kMaxTakenTensors);
    context.taken_saved_by.resize(kMaxTakenTensors);
  }
  for (size_t m = 0; m < kMaxTakenTensors; ++m) {
    int64_t bytes = m < context.taken_bytes.size() ? context.taken_bytes[m] : 0;
    v.freed(bytes);
    if constexpr (write) context.taken_bytes[m] = bytes;
    for (auto field : {&StepContext::taken_by, &StepContext::taken_saved_by}) {
      for (size_t j = 0; j < stages; ++j) {
        const auto& flags = context.*field;
        bool bit = m < flags.size() && j < flags[m].size() && flags[m][j];
        v.flag(bit);
        if constexpr (write) {
          std::vector<bool>& out = (context.*field)[m];
          out.resize(stages, false);
          out[j] = bit;
        }
      }
    }
  }
  if constexpr (write) {
    StepContext kept;
    for (size_t m = 0; m < kMaxTakenTensors; ++m) {
      if (context.taken_bytes[m] <= 0) continue;
      kept.taken_bytes.push_back(context.taken_bytes[m]);
      kept.taken_by.push_back(context.taken_by[m]);
      kept.taken_saved_by.push_back(context.taken_saved_by[m]);
    }
    context.taken_bytes = std::move(kept.taken_bytes);
    context.taken_by = std::move(kept.taken_by);
    context.taken_saved_by = std::move(kept.taken_saved_by);
  }
}

// Visits every figure of `chain` and `context` in one order (the chain's input bytes first). C and X may be
// const for collecting.
template <typename C, typename X, typename V>
void visit(C& chain, X& context, V& v) {
  v.bytes(chain.input_bytes);
  v.flag(chain.holds_outputs);
  v.flag(chain.copies_at_once);  // the copies hidden the less, where any process makes them at once
  v.bandwidth(chain.to_host_gb_per_s);
  v.bandwidth(chain.to_device_gb_per_s);
  for (auto& s : chain.stages) {
    v.ms(s.fwd_ms);
    v.ms(s.bwd_ms);
    v.bytes(s.output_bytes);
    v.bytes(s.saved_bytes);
    v.flag(s.saves_output);  // saved where any process saves it
    v.flag(s.saves_input);   // likewise
    v.flag(s.has_backward);  // likewise
    v.bytes(s.autocast_cache_bytes);
    v.bytes(s.grads_before_recompute_bytes);
    // A credit where the runtime does not hold outputs (agreed as the least), a charge where it does (the
    // C++ executor's: the most; detail::output_held_back_bytes()).
    if (chain.holds_outputs)
      v.bytes(s.bwd_output_freed_bytes);
    else
      v.freed(s.bwd_output_freed_bytes);
    v.measured_bytes(s.bwd_grad_held_bytes, s.output_bytes);
    v.bytes(s.fwd_tmp_bytes);
    v.measured_bytes(s.fwd_nosave_tmp_bytes, s.fwd_tmp_bytes);
    v.bytes(s.bwd_tmp_bytes);
    v.opt_bytes(s.bwd_grads_tmp_bytes);
    v.opt_ms(s.fwd_nosave_ms);
    v.opt_ms(s.checkpoint_fwd_ms);
    v.opt_ms(s.checkpoint_bwd_ms);
    v.opt_bytes(s.keep_saved_bytes);
    v.opt_ms(s.keep_fwd_ms);
    v.opt_ms(s.keep_bwd_ms);
    v.offload(s.offload);
    v.offload(s.keep_offload);
    v.offload(s.checkpoint_offload);
    for (auto& c : s.policies) {
      v.bytes(c.saved_bytes);
      v.ms(c.fwd_ms);
      v.ms(c.bwd_ms);
      v.opt_bytes(c.bwd_tmp_bytes);
      v.opt_bytes(c.bwd_grads_tmp_bytes);
      v.offload(c.offload);
      v.flag(c.saves_output);  // held where any process's policy holds it
      v.measured_bytes(c.bwd_grad_held_bytes, s.bwd_grad_held());
    }
    v.opt_ms(s.groups_fwd_ms);
    v.opt_ms(s.groups_bwd_ms);
    for (auto& g : s.groups) {
      v.bytes(g.bytes);
      v.ms(g.recompute_ms);
      v.bytes(g.unsaved_bytes);          // the largest: held longest where any rank holds it
      v.bytes(g.stays_bytes);            // the largest: on the device where any rank's Offload keeps it there
      v.bytes(g.fwd_peak_before_bytes);  // the largest (-1, not measured, where no rank measured it)
      // The largest, as the one before: group_forward_peak_bytes() grows with each group's figure.
      v.bytes(g.fwd_peak_after_bytes);
    }
  }
  v.flag(context.input_in_base);
  v.bytes(context.before_saved_bytes);
  v.bytes(context.before_peak_bytes);
  v.bytes(context.before_backward_peak_bytes);
  v.bytes(context.rest_peak_bytes);
  v.ms(context.rest_ms);
  v.bytes(context.rest_grads_bytes);
  for (auto& g : context.stage_grads_bytes)
    v.bytes(g);
  v.bytes(context.checkpoint_all_peak_bytes);
  v.bytes(context.side_bytes);
  for (auto& g : context.side_grads_bytes)
    v.bytes(g);
  for (auto& f : context.side_freed_bytes)
    v.freed(f);
  // The smallest: charged at the peak where any rank's arrived before it.
  for (auto& f : context.side_grads_late_bytes)
    v.freed(f);
  flags(context.outputs_held_in_backward, v);
  flags(context.inputs_held_in_forward, v);  // held where any rank held it
  v.flag(context.input_held_in_backward);
  v.flag(context.output_held_in_backward);
  v.bytes(context.checkpoint_state_bytes);
  flags(context.outputs_held_to_end, v);
  for (auto& f : context.between_forward_held_bytes)
    v.bytes(f);
  for (auto& b : context.between_backward_peak_bytes)
    v.bytes(b);
  for (auto& g : context.between_held_bytes)
    v.bytes(g);
  flags(context.between_frees_output, v);          // charged where any rank let go of it
  v.flag(context.rest_frees_output);               // likewise
  v.flag(context.rest_takes_last_input);           // taken where any rank's takes it
  flags(context.output_grad_held_in_backward, v);  // held where any rank held it
  v.let_go(context.last_input_let_go_in_rest);     // let go of where every rank let go of it
  flags(context.residual_grad_shared, v);          // shared (charged) where any rank's is
  taken(context, chain.stages.size(), v);
}

// An offload cost's bytes at most what its way keeps beyond the output (validate()'s rule), which maxima
// taken from different processes may exceed.
void lower_to_kept(std::optional<OffloadCost>& o, int64_t kept, int64_t output) {
  if (o) o->bytes = std::max<int64_t>(0, std::min(o->bytes, kept - output));
}

}  // namespace

PlanFigures plan_figures(const Chain& chain, const StepContext& context) {
  Collect c;
  visit(chain, context, c);
  return std::move(c.out);
}

void set_plan_figures(Chain& chain, StepContext& context, const PlanFigures& figures) {
  const PlanFigures mine = plan_figures(chain, context);
  if (figures.ints.size() != mine.ints.size() || figures.reals.size() != mine.reals.size()) {
    throw std::invalid_argument(
        std::string(kSetFiguresWho) + ": " + std::to_string(figures.ints.size()) + " integer and " +
        std::to_string(figures.reals.size()) + " real figures for a chain and context that have " +
        std::to_string(mine.ints.size()) + " and " + std::to_string(mine.reals.size()) +
        " (the processes' chains differ in stages, policies, saved groups, stage_grads_bytes or the between "
        "figures)");
  }
  Chain c = chain;
  StepContext x = context;
  Write w{figures};
  visit(c, x, w);
  for (Stage& s : c.stages) {
    lower_to_kept(s.offload, s.saved_bytes, s.output_bytes);
    lower_to_kept(s.checkpoint_offload, s.output_bytes, s.output_bytes);
    if (s.keep_saved_bytes)
      lower_to_kept(s.keep_offload, *s.keep_saved_bytes, s.output_bytes);
    else
      s.keep_offload.reset();  // no Fk on some process: no Fk@host either
    for (PolicyCost& p : s.policies)
      lower_to_kept(p.offload, p.saved_bytes, s.output_bytes);
  }
  validate(c);
  validate(x, c);
  chain = std::move(c);
  context = std::move(x);
}

}  // namespace remat
