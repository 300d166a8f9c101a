#include "remat/planner/plan.h"

#include <nlohmann/json.hpp>

#include "detail/json.h"
#include "detail/plan.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "remat/planner/chain.h"

namespace remat {
namespace {

// An Fa streamed with no window is written so (Fa3@stream0): its plan's window for the stage is 0.
constexpr const char* kNoWindow = "@stream0";

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() > suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::string op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kForwardNoSave:
      return "Fn";
    case OpKind::kForwardCheckpoint:
      return "Fc";
    case OpKind::kForwardAll:
      return "Fa";
    case OpKind::kLoss:
      return "L";
    case OpKind::kBackward:
      return "B";
    case OpKind::kForwardKeep:
      return "Fk";
  }
  return "?";
}

std::string op_text(const Plan& plan, const Op& op) {
  if (op.kind == OpKind::kLoss) return "L";
  std::string text = op_name(op.kind) + std::to_string(op.stage);
  if (op.kind == OpKind::kForwardKeep && op.policy >= 0) {
    const auto p = static_cast<size_t>(op.policy);
    text += "[" + (p < plan.policies.size() ? plan.policies[p] : "#" + std::to_string(op.policy)) + "]";
  }
  if (!op.groups.empty()) text += "{" + op.groups + "}";
  if (op.offload) text += "@host";
  if (op.stream) {
    // With no window (the plan's stream_windows 0 for the stage): @stream0, a text that runs as it reads.
    const bool none = !plan.stream_windows.empty() && op.stage >= 0 &&
                      static_cast<size_t>(op.stage) < plan.stream_windows.size() &&
                      plan.stream_windows[static_cast<size_t>(op.stage)] == 0;
    text += none ? kNoWindow : "@stream";
  }
  return text;
}

std::string Plan::to_string() const {
  std::string out;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (i) out += ' ';
    out += op_text(*this, ops[i]);
  }
  return out;
}

int64_t Plan::count(OpKind kind) const {
  int64_t c = 0;
  for (const Op& op : ops)
    c += op.kind == kind;
  return c;
}

Op parse_op(const std::string& text) {
  std::vector<std::string> none;
  const Op op = parse_op(text, none);
  if (!none.empty()) {
    throw std::invalid_argument(
        "remat::parse_op: '" + text +
        "' names a policy, which only a plan's list of policies can resolve (parse it "
        "with parse_op(text, policies), or read the plan with plan_from_json)");
  }
  return op;
}

Op parse_op(const std::string& full, std::vector<std::string>& policies) {
  auto fail = [&] {
    throw std::invalid_argument(
        "remat::parse_op: '" + full +
        "' is not an operation (Fn<i>, Fc<i>, Fa<i>, Fk<i>, Fk<i>[policy], Fk<i>{groups}, L or B<i>, Fa, Fk "
        "and Fc with @host after them, Fa with @stream or @stream0, e.g. Fc0, Fa3, Fk2[matmuls], Fk2{khr}, "
        "Fa1@host, Fa1@stream, Fa1@stream0, L, B3)");
  };
  static const std::string kHost = "@host", kStream = "@stream";
  // Fa3@stream0 (streamed with no window) is an Fa3@stream here; plan_from_json gives the plan its window.
  if (ends_with(full, kNoWindow)) return parse_op(full.substr(0, full.size() - 1), policies);
  if (ends_with(full, kStream)) {
    if (full.rfind("Fa", 0) != 0 || full.find_first_of("{[@") < full.size() - kStream.size()) fail();
    Op op = parse_op(full.substr(0, full.size() - kStream.size()), policies);
    op.stream = true;
    return op;
  }
  if (ends_with(full, kHost)) {
    if (!(full.rfind("Fa", 0) == 0 || full.rfind("Fk", 0) == 0 || full.rfind("Fc", 0) == 0)) fail();
    if (full.find('{') != std::string::npos) fail();  // a group assignment says what goes to the host
    if (full.find('@') != full.size() - kHost.size()) fail();  // one suffix (Fa3@stream@host is not one)
    Op op = parse_op(full.substr(0, full.size() - kHost.size()), policies);
    op.offload = true;
    return op;
  }
  const size_t brace = full.find('{');
  if (brace != std::string::npos) {
    // A group assignment: Fk<i>{...}, one of k, h, r per group, at least one; no policy, no @host.
    if (full.back() != '}' || full.rfind("Fk", 0) != 0 || full.find('[') != std::string::npos) fail();
    std::string groups = full.substr(brace + 1, full.size() - brace - 2);
    if (groups.empty() || groups.size() > kMaxGroups || groups.find_first_not_of("khr") != std::string::npos)
      fail();
    Op op = parse_op(full.substr(0, brace), policies);
    op.groups = std::move(groups);
    return op;
  }
  std::string text = full;
  std::optional<std::string> policy;
  const size_t bracket = full.find('[');
  if (bracket != std::string::npos) {
    if (full.back() != ']' || full.rfind("Fk", 0) != 0) fail();
    policy = full.substr(bracket + 1, full.size() - bracket - 2);
    if (!valid_policy_name(*policy)) fail();
    text = full.substr(0, bracket);
  }
  if (text == "L") return Op{OpKind::kLoss, -1};
  size_t digits = 0;
  Op op;
  if (text.rfind("Fn", 0) == 0) {
    op.kind = OpKind::kForwardNoSave, digits = 2;
  } else if (text.rfind("Fc", 0) == 0) {
    op.kind = OpKind::kForwardCheckpoint, digits = 2;
  } else if (text.rfind("Fa", 0) == 0) {
    op.kind = OpKind::kForwardAll, digits = 2;
  } else if (text.rfind("Fk", 0) == 0) {
    op.kind = OpKind::kForwardKeep, digits = 2;
  } else if (text.rfind("B", 0) == 0) {
    op.kind = OpKind::kBackward, digits = 1;
  } else {
    fail();
  }
  if (text.size() == digits || text.size() > digits + 12) fail();
  for (size_t i = digits; i < text.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(text[i]))) fail();
  }
  op.stage = std::stoll(text.substr(digits));
  if (policy) {
    const auto it = std::find(policies.begin(), policies.end(), *policy);
    op.policy = static_cast<int32_t>(it - policies.begin());
    if (it == policies.end()) policies.push_back(*policy);
  }
  return op;
}

namespace {

// kKept: what Fk keeps of stage i - 1 (its output and its kept calls' outputs).
enum Held : uint8_t { kNone = 0, kPlain = 1, kFull = 2, kKept = 3 };

// Runs a plan over the model of plan.h; charges memory and time when a chain is given, checks only otherwise.
Simulation run(const Plan& plan, const Chain* chain, const char* who) {
  const int64_t n = plan.num_stages;
  if (n < 1) throw std::invalid_argument(std::string(who) + ": the plan has num_stages " + std::to_string(n));
  auto act = [&](int64_t i) -> int64_t { return chain ? chain->activation_bytes(i) : 0; };
  auto saved = [&](int64_t i) -> int64_t { return chain ? chain->stages[i - 1].saved_bytes : 0; };

  // The chain's cost of each of the plan's policies (its index in Stage::policies).
  std::vector<size_t> policy_at(plan.policies.size(), 0);
  if (chain) {
    for (size_t p = 0; p < plan.policies.size(); ++p) {
      const auto it = std::find(chain->policies.begin(), chain->policies.end(), plan.policies[p]);
      if (it == chain->policies.end()) {
        throw std::invalid_argument(std::string(who) + ": the plan keeps with policy '" + plan.policies[p] +
                                    "', which the chain was not profiled under (ProfileOptions::policies)");
      }
      policy_at[p] = static_cast<size_t>(it - chain->policies.begin());
    }
  }
  std::vector<Held> held(static_cast<size_t>(n + 1), kNone);
  std::vector<int32_t> kept_with(static_cast<size_t>(n + 1), -1);    // for kKept: the Fk's policy
  std::vector<std::string> kept_groups(static_cast<size_t>(n + 1));  // for kKept: its group assignment
  held[0] = kPlain;                                                  // the chain's input, resident throughout
  int64_t grad = -1;  // index j of the gradient d_j held, -1 before the loss
  bool loss_done = false;
  int64_t current = act(0);
  Simulation sim;
  sim.forward_calls.assign(static_cast<size_t>(n), 0);
  sim.peak_bytes = current;

  // What Fk of stage i - 1 keeps, and its forward and backward, with the policy `p` (-1: the keep tags), or
  // the group assignment `groups` when not empty.
  auto fk = [&](int64_t i, int32_t p, const std::string& groups) -> std::tuple<int64_t, double, double> {
    if (!chain) return {0, 0.0, 0.0};
    const Stage& st = chain->stages[i - 1];
    if (!groups.empty()) {
      const PolicyCost c = group_cost(st, groups);
      return {c.saved_bytes, c.fwd_ms, c.bwd_ms};
    }
    if (p < 0) return {*st.keep_saved_bytes, *st.keep_fwd_ms, *st.keep_bwd_ms};
    const PolicyCost& c = st.policies[policy_at[static_cast<size_t>(p)]];
    return {c.saved_bytes, c.fwd_ms, c.bwd_ms};
  };
  auto kept = [&](int64_t i) -> int64_t { return std::get<0>(fk(i, kept_with[i], kept_groups[i])); };
  // Of what Fk of stage i - 1 keeps, what Fa does not save (group_unsaved_bytes()): 0 but for a group
  // assignment.
  auto unsaved = [&](int64_t i, const std::string& groups) -> int64_t {
    return chain && !groups.empty() ? group_unsaved_bytes(chain->stages[i - 1], groups) : 0;
  };
  auto held_bytes = [&](int64_t i) -> int64_t {
    return held[i] == kPlain ? act(i) : held[i] == kFull ? saved(i) : held[i] == kKept ? kept(i) : 0;
  };
  sim.op_peak_bytes.assign(plan.ops.size(), 0);
  sim.op_end_ms.assign(plan.ops.size(), 0.0);
  sim.op_done_bytes.assign(plan.ops.size(), 0);
  sim.op_recompute_peak_bytes.assign(plan.ops.size(), 0);
  sim.op_recompute_end_bytes.assign(plan.ops.size(), 0);
  sim.op_backward_peak_bytes.assign(plan.ops.size(), 0);

  // Offloading: per stage, what its offloaded forward sent to the host (see plan.h).
  struct Away {
    int64_t device = 0;  // bytes that leave the device (and come back)
    int64_t copied = 0;  // bytes copied each way
    enum { kNo, kInFlight, kGone, kBack } state = kNo;
    double back_at = 0;  // the compute time (time_ms - transfer_ms) when it began coming back
    bool charged = false;
    // Streamed (Fa@stream): of `device`, only `tail` (at most a window: OffloadCost::tail_bytes) is in flight
    // after its forward and comes back ahead of its backward; the rest left as it was copied and comes back
    // tensor by tensor within it.
    bool stream = false;
    int64_t window = 0;    // streamed: the window it runs with (the plan's, else the chain's)
    bool exposed = false;  // streamed with no window: its copies waited for as made and as asked for
    int64_t tail = 0;
    bool input_left = false;  // its input left the device with it (back with it, or for a streamed backward)
    // Its output among what it sent, and brought back ahead of its backward (not streamed with no window):
    // while the next stage's backward runs, beside that stage's own copy where its input left with it too.
    bool output_ahead = false;
    OffloadCost cost;  // streamed: its offload cost
    int64_t moving() const { return stream ? tail : device; }
  };
  std::vector<Away> away(static_cast<size_t>(n));
  // The stages whose copies to the host may still be in flight (a superset: each is checked against its
  // state), so that a forward visits those, not every stage (simulate() stays linear in the plan's length).
  std::vector<int64_t> in_flight;
  // Per boundary i: whether stage i - 1's forward holds a_i on the device through what it saves.
  std::vector<char> keeps_output(static_cast<size_t>(n + 1), 1);
  std::vector<char> forwarded(static_cast<size_t>(n), 0);  // a forward of the stage ran before the loss
  int64_t host = 0;
  // The time the copies to the host in flight still need after the last forward (one link: a stage's copies
  // begin with its forward, once the link has finished those before them).
  double link = 0;
  // Copies made at once where they are started (Chain::copies_at_once): charged in full, each way.
  const bool at_once = chain && chain->copies_at_once;
  std::optional<OffloadCost> way_cost;  // offload_cost()'s, for the operation at hand
  auto offload_cost = [&](const Op& op) -> const OffloadCost* {
    if (!chain) return nullptr;
    way_cost = detail::way_offload(*chain, plan, op);
    return way_cost ? &*way_cost : nullptr;
  };
  auto transfer = [&](int64_t bytes, bool to_host) {
    return chain ? chain->transfer_ms(bytes, to_host) : 0.0;
  };
  // A streamed stage's window: the plan's (Plan::stream_windows), else the chain's.
  auto window_of = [&](int64_t i) {
    if (!plan.stream_windows.empty() && plan.stream_windows[static_cast<size_t>(i)] >= 0)
      return plan.stream_windows[static_cast<size_t>(i)];
    return chain->stages[static_cast<size_t>(i)].offload->window_bytes;
  };

  // Stage i's input a_i, which left with it, back beside the stage before's own copy of it (its output, which
  // it sent too), brought back ahead once stage i's backward began: two copies until stage i's backward is
  // done, its recompute included (after the loss, the first operation of stage i brings both back).
  auto twice = [&](int64_t i) -> int64_t {
    const Away* before = i > 0 ? &away[static_cast<size_t>(i - 1)] : nullptr;
    return away[static_cast<size_t>(i)].input_left && before && before->output_ahead &&
                   before->state == Away::kBack
               ? act(i)
               : 0;
  };

  auto charge = [&](int64_t peak, size_t k) {
    sim.op_peak_bytes[k] = std::max(sim.op_peak_bytes[k], peak);
    if (peak > sim.peak_bytes) {
      sim.peak_bytes = peak;
      sim.peak_op = static_cast<int64_t>(k);
    }
  };

  // Per-stage lists: absent, or one entry per stage.
  auto per_stage = [&](size_t size, const std::string& what, const char* field) {
    if (size != 0 && static_cast<int64_t>(size) != n) {
      throw std::invalid_argument(std::string(who) + ": the plan " + what + " for " + std::to_string(size) +
                                  " stages but has " + std::to_string(n) + " (" + field + ": one per stage)");
    }
  };
  per_stage(plan.stream_windows.size(), "gives stream windows", "Plan::stream_windows");
  per_stage(plan.group_names.size(), "names saved groups", "Plan::group_names");
  for (size_t k = 0; k < plan.ops.size(); ++k) {
    if (k > 0)
      sim.op_end_ms[k - 1] = sim.time_ms;  // what the last operation charged, copies waited for included
    const Op& op = plan.ops[k];
    auto fail = [&](const std::string& why) {
      throw std::invalid_argument(std::string(who) + ": operation " + std::to_string(k) + " (" +
                                  op_text(plan, op) + ") " + why);
    };
    if (op.policy != -1 && (op.kind != OpKind::kForwardKeep || op.policy < 0 ||
                            static_cast<size_t>(op.policy) >= plan.policies.size())) {
      fail("names policy " + std::to_string(op.policy) + ", but the plan has " +
           std::to_string(plan.policies.size()) + " policies (and only Fk keeps with one)");
    }
    const int64_t i = op.stage;
    if (op.kind != OpKind::kLoss && (i < 0 || i >= n)) {
      fail("names stage " + std::to_string(i) + ", but the plan has " + std::to_string(n) + " stages");
    }
    if (!op.groups.empty()) {
      if (op.kind != OpKind::kForwardKeep || op.policy != -1 || op.offload)
        fail("has a group assignment, which only Fk carries, with no policy and no @host");
      if (op.groups.find_first_not_of("khr") != std::string::npos)
        fail("has a group assignment with characters other than k, h and r");
      if (loss_done) fail("has a group assignment after the loss (only forwards before it can)");
      if (!plan.group_names.empty() && op.stage >= 0 && op.stage < n &&
          plan.group_names[static_cast<size_t>(op.stage)].size() != op.groups.size()) {
        fail("assigns " + std::to_string(op.groups.size()) + " groups, but the plan names " +
             std::to_string(plan.group_names[static_cast<size_t>(op.stage)].size()) + " for stage " +
             std::to_string(op.stage) + " (Plan::group_names)");
      }
      if (chain && op.stage >= 0 && op.stage < n &&
          op.groups.size() != chain->stages[static_cast<size_t>(op.stage)].groups.size()) {
        fail("assigns " + std::to_string(op.groups.size()) + " groups, but the chain's stage " +
             std::to_string(op.stage) + " ('" + chain->stages[static_cast<size_t>(op.stage)].name +
             "') has " + std::to_string(chain->stages[static_cast<size_t>(op.stage)].groups.size()) +
             " saved groups (profile it with groups)");
      }
      if (chain && !plan.group_names.empty() && op.stage >= 0 && op.stage < n) {
        const auto& groups = chain->stages[static_cast<size_t>(op.stage)].groups;
        const auto& names = plan.group_names[static_cast<size_t>(op.stage)];
        for (size_t g = 0; g < groups.size() && g < names.size(); ++g) {
          if (groups[g].name != names[g])
            fail("names group " + std::to_string(g) + " '" + names[g] + "', but the chain's stage " +
                 std::to_string(op.stage) + " calls it '" + groups[g].name + "' (a plan of another chain)");
        }
      }
    }
    if (op.stream) {
      if (op.kind != OpKind::kForwardAll || op.offload) fail("streams, but only Fa can (and not with @host)");
      if (!plan.stream_windows.empty() && op.stage >= 0 && op.stage < n &&
          plan.stream_windows[static_cast<size_t>(op.stage)] < 0)
        fail("streams stage " + std::to_string(op.stage) +
             ", but the plan gives it no window (Plan::stream_windows)");
      if (chain && op.stage >= 0 && op.stage < n) {
        const auto& o = chain->stages[static_cast<size_t>(op.stage)].offload;
        if (!o || !o->can_stream())
          fail("streams stage " + std::to_string(i) + " ('" + chain->stages[static_cast<size_t>(i)].name +
               "'), but the chain has no stream figures for it (stream_fwd_bytes, stream_bwd_bytes: profile "
               "with offloading)");
      }
    }
    if (op.offloads()) {
      if (op.kind != OpKind::kForwardAll && op.kind != OpKind::kForwardKeep &&
          op.kind != OpKind::kForwardCheckpoint)
        fail("offloads, but only Fa, Fk and Fc can");
      if (loss_done) fail("offloads after the loss (only forwards before it can)");
    }
    if (!loss_done && op.kind != OpKind::kLoss && op.kind != OpKind::kBackward) {
      if (forwarded[i] && (op.offloads() || away[i].state != Away::kNo))
        fail("runs stage " + std::to_string(i) +
             " a second time before the loss, and one of its forwards "
             "offloads (an offloaded stage's forward must be its only one before the loss)");
      forwarded[i] = 1;
    }
    // After the loss, the first operation of stage i or i + 1 brings stage i's offloaded bytes back; the
    // first of stage i waits for its own.
    if (loss_done && op.kind != OpKind::kLoss) {
      for (int64_t s : {i - 1, i}) {
        if (s < 0) continue;
        Away& a = away[static_cast<size_t>(s)];
        if (a.state == Away::kGone) {
          current += a.moving();
          a.back_at = sim.time_ms - sim.transfer_ms;
          a.state = Away::kBack;
        } else if (a.state == Away::kInFlight) {  // never left: its copy to the host is waited for, then back
          const double wait = link;
          link = 0;
          sim.time_ms += wait, sim.transfer_ms += wait;
          a.back_at = sim.time_ms - sim.transfer_ms;
          a.state = Away::kBack;
        }
      }
      Away& own = away[static_cast<size_t>(i)];
      if (own.state == Away::kBack && !own.charged) {
        // Only computation hides a copy: the waits for other copies share its link. With no window, each
        // tensor comes back when its backward asks for it, and copies made at once (Chain::copies_at_once)
        // as they are made: nothing hides them.
        const double hidden = own.exposed || at_once ? 0.0 : sim.time_ms - sim.transfer_ms - own.back_at;
        const double wait = std::max(0.0, transfer(own.copied, false) - hidden);
        sim.time_ms += wait, sim.transfer_ms += wait;
        own.charged = true;
      }
    }
    switch (op.kind) {
      case OpKind::kForwardNoSave:
      case OpKind::kForwardCheckpoint:
      case OpKind::kForwardAll:
      case OpKind::kForwardKeep: {
        if (held[i] == kNone) fail("needs a_" + std::to_string(i) + ", which is not held");
        if (grad >= 0 && grad <= i) fail("runs after stage " + std::to_string(i) + "'s backward");
        const bool all = op.kind == OpKind::kForwardAll, keep = op.kind == OpKind::kForwardKeep;
        if (held[i + 1] == kFull || held[i + 1] == kKept || (!all && !keep && held[i + 1] == kPlain)) {
          fail("recomputes a_" + std::to_string(i + 1) + ", which is already held");
        }
        if (keep && chain && op.policy < 0 && op.groups.empty() && !chain->stages[i].has_keep()) {
          fail("runs stage " + std::to_string(i) + " ('" + chain->stages[i].name +
               "') with kept calls, but the chain has no keep_ fields for it (profile with keep tags)");
        }
        if (keep && chain && op.policy >= 0 && chain->stages[i].policies.empty()) {
          fail("runs stage " + std::to_string(i) + " ('" + chain->stages[i].name + "') under policy '" +
               plan.policies[static_cast<size_t>(op.policy)] +
               "', but the chain has no costs under it for it");
        }
        if (keep) kept_with[i + 1] = op.policy, kept_groups[i + 1] = op.groups;
        const int64_t out = all    ? (chain ? chain->stages[i].saved_bytes : 0)
                            : keep ? kept(i + 1)
                                   : act(i + 1);
        // A group assignment's forward: its measured peak where each group it keeps or sends has its
        // (group_forward_peak_bytes()), within the bound.
        const int64_t group_peak =
            keep && chain && !op.groups.empty() ? group_forward_peak_bytes(chain->stages[i], op.groups) : -1;
        const int64_t tmp = chain
                                ? detail::forward_tmp_bytes(chain->stages[i], op.kind, out,
                                                            keep ? unsaved(i + 1, op.groups) : 0, group_peak)
                                : 0;
        if (op.stream && chain) {
          // Streamed: its measured peak, each copy waited for at once, and the copies in flight beside it.
          const OffloadCost& o = *chain->stages[i].offload;
          charge(current + o.stream_fwd_bytes + detail::stream_forward_window_bytes(o, window_of(i)), k);
        } else {
          // After the loss, a recompute: with its input twice where it came back so (twice()). Before
          // 2026-12-04 only the backward was charged that: the Linear-ReLU stack's Fa2@host Fc3@host held its
          // recompute's generator state (5,056 bytes) above its prediction, with copies made at once.
          charge(current + out + tmp + (loss_done ? twice(i) : 0), k);
        }
        current += out - held_bytes(i + 1);
        held[i + 1] = all ? kFull : keep ? kKept : kPlain;
        if (op.kind == OpKind::kForwardNoSave && held[i] == kPlain && i > 0) {
          current -= act(i);
          held[i] = kNone;
        }
        sim.forward_calls[i] += 1;
        double ms = 0;
        if (chain) {
          const Stage& st = chain->stages[i];
          ms = all ? st.fwd_ms : keep ? std::get<1>(fk(i + 1, op.policy, op.groups)) : st.nosave_ms();
          sim.time_ms += ms;
        }
        // Copies to the host started before this forward have run beside it (and beside their own forward,
        // from when the link was free): they are waited for now, and what they freed leaves.
        // (`link` is owed only while a copy is in flight.)
        size_t still = 0;
        for (int64_t s : in_flight) {
          Away& a = away[static_cast<size_t>(s)];
          if (a.state != Away::kInFlight) continue;  // waited for after the loss, or its backward ran
          if (s == i) {
            in_flight[still++] = s;
            continue;
          }
          current -= a.moving();
          a.state = Away::kGone;
        }
        in_flight.resize(still);
        const double owed = link, wait = std::max(0.0, owed - ms);
        sim.time_ms += wait, sim.transfer_ms += wait;
        link = 0;
        // A runtime that holds a kept stage's output (Chain::holds_outputs) holds it, offloaded or not.
        const bool runtime_holds = chain && chain->holds_outputs && (all || keep);
        if (op.offloads()) {
          const OffloadCost* c = offload_cost(op);
          if (chain && !c)
            fail("offloads stage " + std::to_string(i) + " ('" + chain->stages[i].name +
                 "'), but the chain has no offload costs for it run so (profile with offloading)");
          if (chain && !chain->can_offload())
            fail("offloads, but the chain has no measured bandwidths (to_host_gb_per_s, to_device_gb_per_s)");
          Away& a = away[static_cast<size_t>(i)];
          a = Away{};
          if (c) {
            // Its input leaves with it unless something holds it on the device (the stage before, through
            // what it saves; the step, to its end: Chain::inputs_held).
            a.input_left = c->input && i > 0 && !keeps_output[i] && held[i] != kNone && !chain->input_held(i);
            a.device = c->bytes + (a.input_left ? act(i) : 0);
            a.copied = c->bytes + (c->input ? act(i) : 0) + (c->output ? act(i + 1) : 0);
          }
          if (op.stream && c) {
            // Only its tail (at most a window) stays in flight past its forward: the rest has left as it was
            // copied.
            a.stream = true;
            a.window = window_of(i);
            a.exposed = a.window == 0;
            a.tail = c->tail_bytes(a.window, a.device);
            a.cost = *c;
            current -= a.device - a.tail;
          }
          // With no window each tensor comes back when its backward asks for it: its output not ahead.
          a.output_ahead = c && c->output && !a.exposed;
          a.state = Away::kInFlight;
          in_flight.push_back(i);
          if (a.exposed || at_once) {
            // No window: each copy was waited for as the forward made it; made at once
            // (Chain::copies_at_once), on the thread that computes: nothing hid them.
            const double copies = transfer(a.copied, true);
            sim.time_ms += copies, sim.transfer_ms += copies;
          } else if (c && c->after_forward) {
            // Its copies start once its forward has run (a compiled layer's graph saves its tensors at its
            // end, once the link was free): hidden by the next forward alone.
            link = transfer(a.copied, true);
          } else {
            link = std::max(0.0, transfer(a.copied, true) - std::max(0.0, ms - owed));
          }
          host += a.copied;
          sim.host_peak_bytes = std::max(sim.host_peak_bytes, host);
          keeps_output[i + 1] = runtime_holds;
        } else {
          // Held through what the stage saves (unknown: held, as before offloading).
          const OffloadCost* c = (all || keep) ? offload_cost(op) : nullptr;
          keeps_output[i + 1] = runtime_holds || ((all || keep) && (!c || c->output));
        }
        break;
      }
      case OpKind::kLoss: {
        if (loss_done) fail("comes a second time");
        if (held[n] == kNone) fail("needs the chain's output a_" + std::to_string(n) + ", which is not held");
        charge(current + act(n), k);
        current += act(n);
        grad = n;
        loss_done = true;
        if (held[n] == kPlain) {
          current -= act(n);
          held[n] = kNone;
        }
        break;
      }
      case OpKind::kBackward: {
        if (!loss_done) fail("comes before the loss");
        if (grad != i + 1) {
          fail("needs d_" + std::to_string(i + 1) + ", but the backward pass is at d_" +
               std::to_string(grad));
        }
        if (held[i + 1] != kFull && held[i + 1] != kKept)
          fail("needs abar_" + std::to_string(i + 1) + " (run Fa" + std::to_string(i) + " or Fk" +
               std::to_string(i) + " first)");
        if (held[i] == kNone) fail("needs a_" + std::to_string(i) + ", which is not held");
        const bool after_keep = held[i + 1] == kKept;
        // Of what the way keeps, what Fa does not save: held through the recompute, gone by the backward.
        const int64_t beyond = after_keep ? unsaved(i + 1, kept_groups[i + 1]) : 0;
        // Recomputed before the backward (none where the way kept more than Fa does): what the backward holds
        // of what the stage saved (detail::kept_saved_at_backward(), the per-layer program's rule too) beyond
        // what the way kept that Fa saves.
        const int64_t rest = after_keep && chain
                                 ? detail::kept_saved_at_backward(chain->stages[i], kept(i + 1), beyond) -
                                       (kept(i + 1) - beyond)
                                 : 0;
        const int64_t tmp = chain ? chain->stages[i].bwd_tmp_bytes : 0;
        Away& own = away[static_cast<size_t>(i)];
        // Its input twice, where it came back so (twice()).
        const int64_t two = twice(i);
        if (own.stream) {
          // Streamed: its window came back ahead; within its backward each tensor comes back just ahead of
          // its use (its measured peak, with its input found on the device; where the input left with it,
          // what its copy brought back adds: OffloadCost::input_back_bytes(); a window ahead beside it). Then
          // all it sent is accounted as back, as autograd drops it.
          const int64_t input_back = own.input_left ? own.cost.input_back_bytes(act(i)) : 0;
          charge(current - own.tail + own.window + own.cost.stream_bwd_bytes + input_back + two, k);
          current += own.device - own.tail;
        } else if (chain && after_keep && kept_groups[i + 1].empty() && kept_with[i + 1] >= 0) {
          // Fk under a policy: its backward's own measured peak, recompute included (or its parts).
          charge(current + act(i) +
                     chain->stages[i].policy_bwd_bytes(policy_at[static_cast<size_t>(kept_with[i + 1])]) +
                     two,
                 k);
        } else {
          // Fk with keep tags or a group assignment first recomputes what it did not keep, as its forward
          // made it (fwd_tmp_bytes above what that forward saves), then runs its backward: the larger.
          // Before (found 2026-12-03), only the backward: a BertModel layer's group assignment, whose
          // attention makes 2.6 MiB of transients in its forward and 0.8 MiB in its backward, held 1.3 MiB
          // (6.5%) above its prediction in C++.
          // A group assignment's groups that Fa does not save (`beyond`, since 2026-12-04) are all back as
          // its recompute begins (`current` holds them: what it keeps), used by it and let go of by its end,
          // where it holds what Fa saves (current + rest - beyond) and its forward's transient; its backward
          // holds what Fa saves.
          const int64_t recompute = after_keep && chain ? chain->stages[i].fwd_tmp_bytes : 0;
          charge(current + two + std::max<int64_t>(0, rest - beyond + std::max(act(i) + tmp, recompute)), k);
          if (after_keep) {
            sim.op_recompute_end_bytes[k] = current + two + rest - beyond + recompute;
            sim.op_recompute_peak_bytes[k] = std::max(current + two, sim.op_recompute_end_bytes[k]);
            sim.op_backward_peak_bytes[k] =
                current + two + std::max<int64_t>(0, rest - beyond + act(i) + tmp);
            // Part way through, where measured: the groups kept or sent that it has not reached yet beside
            // what it has made again (group_recompute_peak_bytes(), above what was alive before the stage's
            // forward: `current` less what the way kept beyond its output).
            const int64_t mid = kept_groups[i + 1].empty() || !chain
                                    ? -1
                                    : group_recompute_peak_bytes(chain->stages[i], kept_groups[i + 1]);
            if (mid >= 0) {
              const int64_t at = current + two - (kept(i + 1) - chain->stages[i].output_bytes) + mid;
              charge(at, k);
              sim.op_recompute_peak_bytes[k] = std::max(sim.op_recompute_peak_bytes[k], at);
            }
          }
        }
        current += act(i) - held_bytes(i + 1) - act(i + 1);
        held[i + 1] = kNone;
        grad = i;
        sim.op_done_bytes[k] = current;  // a_i still held
        if (held[i] == kPlain && i > 0) {
          current -= act(i);
          held[i] = kNone;
        }
        if (chain)
          sim.time_ms += after_keep ? std::get<2>(fk(i + 1, kept_with[i + 1], kept_groups[i + 1]))
                                    : chain->stages[i].bwd_ms;
        if (away[static_cast<size_t>(i)].state != Away::kNo) {  // autograd drops what it saved: host freed
          host -= away[static_cast<size_t>(i)].copied;
          away[static_cast<size_t>(i)] = Away{};
        }
        break;
      }
    }
    if (op.kind != OpKind::kBackward) sim.op_done_bytes[k] = current;
  }
  if (grad != 0) {
    throw std::invalid_argument(
        std::string(who) + ": the plan ends before d_0 (" +
        (loss_done ? "the backward pass stops at d_" + std::to_string(grad) : std::string("no loss")) + ")");
  }
  if (!sim.op_end_ms.empty()) sim.op_end_ms.back() = sim.time_ms;
  return sim;
}

}  // namespace

void check_plan(const Plan& plan) {
  run(plan, nullptr, "remat::check_plan");
}

Simulation simulate(const Chain& chain, const Plan& plan) {
  validate(chain);
  if (chain.size() != plan.num_stages) {
    throw std::invalid_argument("remat::simulate: the chain has " + std::to_string(chain.size()) +
                                " stages but the plan " + std::to_string(plan.num_stages));
  }
  return run(plan, &chain, "remat::simulate");
}

namespace detail {
std::optional<OffloadCost> way_offload(const Chain& chain, const Plan& plan, const Op& op) {
  if (op.stage < 0 || op.stage >= chain.size()) return std::nullopt;
  const Stage& st = chain.stages[static_cast<size_t>(op.stage)];
  if (op.kind == OpKind::kForwardAll) return st.offload;
  if (op.kind == OpKind::kForwardCheckpoint) return st.checkpoint_offload;
  if (op.kind != OpKind::kForwardKeep) return std::nullopt;
  if (!op.groups.empty()) return group_cost(st, op.groups).offload;
  if (op.policy < 0) return st.keep_offload;
  const PolicyCost* c = way_policy(chain, plan, op);
  return c ? c->offload : std::nullopt;
}

const PolicyCost* way_policy(const Chain& chain, const Plan& plan, const Op& op) {
  if (op.stage < 0 || op.stage >= chain.size() || op.kind != OpKind::kForwardKeep || !op.groups.empty() ||
      op.policy < 0 || static_cast<size_t>(op.policy) >= plan.policies.size())
    return nullptr;
  const Stage& st = chain.stages[static_cast<size_t>(op.stage)];
  const auto it =
      std::find(chain.policies.begin(), chain.policies.end(), plan.policies[static_cast<size_t>(op.policy)]);
  if (it == chain.policies.end()) return nullptr;
  const size_t p = static_cast<size_t>(it - chain.policies.begin());
  return p < st.policies.size() ? &st.policies[p] : nullptr;
}

nlohmann::ordered_json plan_json(const Plan& plan) {
  nlohmann::ordered_json j;
  j["num_stages"] = plan.num_stages;
  j["planner"] = plan.planner;
  j["budget_bytes"] = plan.budget_bytes;
  j["ops"] = nlohmann::ordered_json::array();
  for (const Op& op : plan.ops)
    j["ops"].push_back(op_text(plan, op));
  nlohmann::ordered_json p;
  p["peak_bytes"] = plan.predicted.peak_bytes;
  p["time_ms"] = plan.predicted.time_ms;
  p["forward_calls"] = plan.predicted.forward_calls;
  const bool offloads =
      std::any_of(plan.ops.begin(), plan.ops.end(), [](const Op& op) { return op.offloads(); });
  if (offloads) {
    p["host_peak_bytes"] = plan.predicted.host_peak_bytes;
    p["transfer_ms"] = plan.predicted.transfer_ms;
  }
  j["predicted"] = p;
  if (!plan.keep.empty()) j["keep"] = plan.keep;
  if (!plan.policies.empty()) j["policies"] = plan.policies;
  if (!plan.group_names.empty()) j["group_names"] = plan.group_names;
  if (!plan.stream_windows.empty()) j["stream_windows"] = plan.stream_windows;
  return j;
}
}  // namespace detail

std::string to_json(const Plan& plan) {
  return detail::plan_json(plan).dump(2);
}

Plan plan_from_json(const std::string& text) {
  const nlohmann::json j = detail::parse_json(text, "remat::plan_from_json");
  auto fail = [](const std::string& why) { throw std::invalid_argument("remat::plan_from_json: " + why); };
  if (!j.is_object()) fail("expected an object with \"num_stages\" and \"ops\"");
  if (!j.contains("num_stages") || !j.at("num_stages").is_number_integer())
    fail("\"num_stages\" must be an integer");
  if (!j.contains("ops") || !j.at("ops").is_array()) fail("\"ops\" must be an array of strings");
  Plan plan;
  plan.num_stages = j.at("num_stages").get<int64_t>();
  if (j.contains("planner") && j.at("planner").is_string()) plan.planner = j.at("planner").get<std::string>();
  if (j.contains("plan_budget_bytes") && j.at("plan_budget_bytes").is_number_integer()) {
    plan.budget_bytes = j.at("plan_budget_bytes").get<int64_t>();  // remat plan --json: the plan's own
  } else if (j.contains("budget_bytes") && j.at("budget_bytes").is_number_integer()) {
    plan.budget_bytes = j.at("budget_bytes").get<int64_t>();
  }
  plan.policies = detail::string_array(j, "policies", "remat::plan_from_json");
  std::vector<char> no_window;  // per op: written @stream0
  for (const auto& o : j.at("ops")) {
    if (!o.is_string()) fail("every operation must be a string, got " + o.dump());
    const std::string text = o.get<std::string>();
    plan.ops.push_back(parse_op(text, plan.policies));
    no_window.push_back(ends_with(text, kNoWindow));
  }
  if (j.contains("predicted") && j.at("predicted").is_object()) {
    const auto& p = j.at("predicted");
    if (p.contains("peak_bytes")) plan.predicted.peak_bytes = p.at("peak_bytes").get<int64_t>();
    if (p.contains("time_ms")) plan.predicted.time_ms = p.at("time_ms").get<double>();
    if (p.contains("forward_calls"))
      plan.predicted.forward_calls = p.at("forward_calls").get<std::vector<int64_t>>();
    if (p.contains("host_peak_bytes"))
      plan.predicted.host_peak_bytes = p.at("host_peak_bytes").get<int64_t>();
    if (p.contains("transfer_ms")) plan.predicted.transfer_ms = p.at("transfer_ms").get<double>();
  }
  plan.keep = detail::string_array(j, "keep", "remat::plan_from_json");
  if (j.contains("group_names")) {
    const auto& g = j.at("group_names");
    if (!g.is_array()) fail("\"group_names\" must be an array (per stage) of arrays of strings");
    for (const auto& names : g) {
      if (!names.is_array()) fail("\"group_names\" must be an array (per stage) of arrays of strings");
      plan.group_names.emplace_back();
      for (const auto& name : names) {
        if (!name.is_string()) fail("every group name must be a string, got " + name.dump());
        plan.group_names.back().push_back(name.get<std::string>());
      }
    }
  }
  if (j.contains("stream_windows")) {
    const auto& w = j.at("stream_windows");
    if (!w.is_array()) fail("\"stream_windows\" must be an array of integers (bytes per stage)");
    for (const auto& b : w) {
      if (!b.is_number_integer()) fail("every stream window must be an integer (bytes), got " + b.dump());
      plan.stream_windows.push_back(b.get<int64_t>());
    }
  }
  // An operation written @stream0 streams its stage with no window: the plan's window for it is 0.
  for (size_t k = 0; k < plan.ops.size(); ++k) {
    const int64_t s = plan.ops[k].stage;
    if (!no_window[k] || s < 0 || s >= plan.num_stages) continue;
    if (plan.stream_windows.empty()) plan.stream_windows.assign(static_cast<size_t>(plan.num_stages), -1);
    if (plan.stream_windows.size() != static_cast<size_t>(plan.num_stages)) break;  // check_plan names it
    int64_t& w = plan.stream_windows[static_cast<size_t>(s)];
    if (w > 0 || (w < 0 && j.contains("stream_windows"))) {
      fail("operation " + std::to_string(k) + " ('" + j.at("ops").at(k).get<std::string>() +
           "') streams with no window, but \"stream_windows\" gives stage " + std::to_string(s) + " " +
           std::to_string(w));
    }
    w = 0;
  }
  check_plan(plan);
  for (const Op& op : plan.ops) {
    if (op.kind == OpKind::kForwardKeep && op.policy < 0 && op.groups.empty() && plan.keep.empty())
      fail("the plan has Fk operations but no \"keep\" tags to run them with");
  }
  return plan;
}

OffloadSchedule offload_schedule(const Plan& plan) {
  check_plan(plan);
  const int64_t n = plan.num_stages;
  OffloadSchedule out;
  out.before.resize(plan.ops.size());
  out.after.resize(plan.ops.size());
  enum State : char { kNone, kInFlight, kGone, kBack };
  std::vector<char> state(static_cast<size_t>(n), kNone);
  bool loss_done = false;
  using Action = OffloadPoint::Action;
  for (size_t k = 0; k < plan.ops.size(); ++k) {
    const Op& op = plan.ops[k];
    if (op.kind == OpKind::kLoss) {
      loss_done = true;
      continue;
    }
    const int64_t i = op.stage;
    // After the loss, the first operation of stage s or s + 1 brings stage s back (waiting first for its
    // copies to the host when they are still in flight).
    if (loss_done) {
      for (int64_t s : {i - 1, i}) {
        if (s < 0) continue;
        char& st = state[static_cast<size_t>(s)];
        if (st == kInFlight) out.before[k].push_back({Action::kWaitToHost, s});
        if (st == kInFlight || st == kGone) {
          out.before[k].push_back({Action::kStartBack, s});
          st = kBack;
        }
      }
    }
    if (op.kind == OpKind::kBackward) continue;
    // A forward: the copies to the host in flight beside it (of other stages) are waited for once it has run.
    for (int64_t s = 0; s < n; ++s) {
      if (s != i && state[static_cast<size_t>(s)] == kInFlight) {
        out.after[k].push_back({Action::kWaitToHost, s});
        state[static_cast<size_t>(s)] = kGone;
      }
    }
    if (op.offloads()) state[static_cast<size_t>(i)] = kInFlight;
  }
  return out;
}

Plan checkpoint_stages(int64_t n, const std::vector<int64_t>& stages) {
  if (n < 1)
    throw std::invalid_argument("remat::checkpoint_stages: num_stages must be >= 1, got " +
                                std::to_string(n));
  std::vector<char> recompute(static_cast<size_t>(n), 0);
  for (int64_t i : stages) {
    if (i < 0 || i >= n) {
      throw std::invalid_argument("remat::checkpoint_stages: stage " + std::to_string(i) + " is not in [0, " +
                                  std::to_string(n) + ")");
    }
    if (recompute[static_cast<size_t>(i)])
      throw std::invalid_argument("remat::checkpoint_stages: stage " + std::to_string(i) +
                                  " is listed twice");
    recompute[static_cast<size_t>(i)] = 1;
  }
  Plan plan;
  plan.num_stages = n;
  for (int64_t i = 0; i < n; ++i)
    plan.ops.push_back(
        {recompute[static_cast<size_t>(i)] ? OpKind::kForwardCheckpoint : OpKind::kForwardAll, i});
  plan.ops.push_back({OpKind::kLoss, -1});
  for (int64_t i = n; i-- > 0;) {
    if (recompute[static_cast<size_t>(i)]) plan.ops.push_back({OpKind::kForwardAll, i});
    plan.ops.push_back({OpKind::kBackward, i});
  }
  plan.planner = "checkpoint_stages";
  check_plan(plan);
  return plan;
}

double per_call_time_ms(const Chain& chain, const std::vector<int64_t>& stages) {
  validate(chain);
  checkpoint_stages(chain.size(), stages);  // checks the list
  std::vector<char> listed(chain.stages.size(), 0);
  for (int64_t i : stages)
    listed[static_cast<size_t>(i)] = 1;
  double ms = 0;
  for (size_t i = 0; i < chain.stages.size(); ++i) {
    const Stage& s = chain.stages[i];
    ms += listed[i] ? s.per_call_fwd_ms() + s.per_call_bwd_ms() : s.fwd_ms + s.bwd_ms;
  }
  return ms;
}

namespace {
// A per-stage list of a chain's plan as the step's: `pad` for the part before the chain and the rest after it
// (empty stays empty).
template <class T>
std::vector<T> padded(const std::vector<T>& per_stage, const T& pad) {
  if (per_stage.empty()) return {};
  std::vector<T> out{pad};
  out.insert(out.end(), per_stage.begin(), per_stage.end());
  out.push_back(pad);
  return out;
}
}  // namespace

Plan step_plan(const Plan& chain_plan) {
  check_plan(chain_plan);
  const int64_t n = chain_plan.num_stages;
  Plan step;
  step.num_stages = n + 2;
  step.planner = chain_plan.planner.empty() ? "step" : "step(" + chain_plan.planner + ")";
  step.budget_bytes = 0;
  step.keep = chain_plan.keep;
  step.policies = chain_plan.policies;
  step.group_names = padded(chain_plan.group_names, {});
  step.stream_windows = padded(chain_plan.stream_windows, int64_t{-1});
  step.ops.push_back({OpKind::kForwardAll, 0});
  for (const Op& op : chain_plan.ops) {
    if (op.kind == OpKind::kLoss) {
      step.ops.push_back({OpKind::kForwardAll, n + 1});
      step.ops.push_back(op);
      step.ops.push_back({OpKind::kBackward, n + 1});
    } else {
      Op shifted = op;
      ++shifted.stage;
      step.ops.push_back(shifted);
    }
  }
  step.ops.push_back({OpKind::kBackward, 0});
  check_plan(step);
  return step;
}

}  // namespace remat
