// A picture of a planned step, as data (remat/planner/timeline.h).

#include "remat/planner/timeline.h"

#include <algorithm>
#include <cctype>

#include "detail/json.h"
#include "detail/step.h"

namespace remat {
namespace {

// "Fc3" -> "Fc", "Fk2[matmuls]@host" -> "Fk[matmuls]@host": a forward's way, without its stage number.
std::string way_of(const std::string& token) {
  std::string out;
  size_t i = 0;
  while (i < token.size() && std::isalpha(static_cast<unsigned char>(token[i])))
    out += token[i++];
  while (i < token.size() && std::isdigit(static_cast<unsigned char>(token[i])))
    ++i;
  return out + token.substr(i);
}

}  // namespace

StepTimeline step_timeline(const Chain& chain, const StepContext& context, const Plan& plan) {
  const Chain step = step_chain(chain, context);
  const Plan ops = step_plan(plan);
  const Simulation sim = simulate(step, ops);
  const std::vector<int64_t> peaks = detail::step_op_peaks(chain, context, ops, sim);
  const int64_t n = chain.size();
  StepTimeline t;
  t.plan = plan.to_string();
  for (const Stage& s : chain.stages)
    t.names.push_back(s.name);
  t.ways.assign(static_cast<size_t>(n), "");
  for (const Op& op : plan.ops) {
    const bool forward = op.kind != OpKind::kBackward && op.kind != OpKind::kLoss;
    if (forward && t.ways[static_cast<size_t>(op.stage)].empty())
      t.ways[static_cast<size_t>(op.stage)] = way_of(op_text(plan, op));
  }
  // The step's operations against the chain plan's: step_plan() adds the part before the chain first and
  // last, and the rest of the step around the loss.
  double start = 0;
  size_t next = 0;  // the chain plan's next operation
  for (size_t k = 0; k < ops.ops.size(); ++k) {
    const Op& op = ops.ops[k];
    StepPoint p;
    p.backward = op.kind == OpKind::kBackward;
    if (op.stage == 0 && op.kind != OpKind::kLoss) {
      p.stage = -1;
      p.op = p.backward ? "B(before)" : "before";
    } else if (op.stage == n + 1) {
      p.stage = n;
      p.op = p.backward ? "B(after)" : "after";
    } else {
      p.stage = op.kind == OpKind::kLoss ? -2 : op.stage - 1;
      p.op = op_text(plan, plan.ops[next++]);
    }
    p.start_ms = start;
    p.end_ms = std::max(start, sim.op_end_ms[k]);
    p.peak_bytes = peaks[k];
    start = p.end_ms;
    t.points.push_back(std::move(p));
  }
  t.peak_bytes = detail::step_peak_of(context, peaks);
  t.time_ms = t.points.empty() ? 0 : t.points.back().end_ms;
  return t;
}

std::string step_timeline_json(const StepTimeline& t, int64_t budget_bytes) {
  nlohmann::ordered_json j;
  j["plan"] = t.plan;
  j["peak_bytes"] = t.peak_bytes;
  j["time_ms"] = t.time_ms;
  j["budget_bytes"] = budget_bytes;
  j["stages"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < t.names.size(); ++i)
    j["stages"].push_back({{"name", t.names[i]}, {"way", t.ways[i]}});
  j["points"] = nlohmann::ordered_json::array();
  for (const StepPoint& p : t.points)
    j["points"].push_back({{"op", p.op},
                           {"stage", p.stage},
                           {"backward", p.backward},
                           {"start_ms", p.start_ms},
                           {"end_ms", p.end_ms},
                           {"peak_bytes", p.peak_bytes}});
  return j.dump(1);
}

}  // namespace remat
