// remat profile: measure a model as a chain of stages (remat::profile_workload), show it, and say what
// checkpointing can save of the step's memory (remat::memory_breakdown and its verdict).

#include <iostream>

#include "common.h"

namespace remat::cli {
namespace {

struct ProfileArgs {
  ModelArgs model;
  std::string optimizer = "none", json;
  int64_t repeats = 5;
};

int run(const ProfileArgs& a) {
  auto w = a.model.make();
  progress("profiling " + w->description());
  const auto options = a.model.profile_options(a.repeats);
  const Chain chain = profile_workload(*w, &options);
  std::cout << w->description() << "\n\n";
  std::vector<std::string> columns{"stage",     "fwd ms",      "bwd ms",     "output MiB",
                                   "saved MiB", "fwd tmp MiB", "bwd tmp MiB"};
  const bool keep = !chain.keep.empty();
  if (keep) columns.insert(columns.end(), {"Fk kept MiB", "Fk bwd ms"});
  for (const auto& name : chain.policies)
    columns.insert(columns.end(), {"Fk[" + name + "] kept MiB", "bwd ms"});
  Table t(columns);
  const size_t shown = 40;
  for (size_t i = 0; i < chain.stages.size(); ++i) {
    if (chain.stages.size() > shown && i == shown / 2) {
      t.add({"... (" + std::to_string(chain.stages.size() - shown) + " more)"});
      i = chain.stages.size() - shown / 2;
    }
    const auto& s = chain.stages[i];
    std::vector<std::string> row{s.name,
                                 fixed(s.fwd_ms, 3),
                                 fixed(s.bwd_ms, 3),
                                 mib(s.output_bytes),
                                 mib(s.saved_bytes),
                                 mib(s.fwd_tmp_bytes),
                                 mib(s.bwd_tmp_bytes)};
    if (keep) {
      row.insert(row.end(), {s.has_keep() ? mib(*s.keep_saved_bytes) : "-",
                             s.has_keep() ? fixed(*s.keep_bwd_ms, 3) : "-"});
    }
    for (size_t k = 0; k < chain.policies.size(); ++k) {
      const bool has = k < s.policies.size();
      row.insert(row.end(),
                 {has ? mib(s.policies[k].saved_bytes) : "-", has ? fixed(s.policies[k].bwd_ms, 3) : "-"});
    }
    t.add(row);
  }
  t.print(std::cout);

  int64_t params = 0, trainable = 0;
  for (const auto& p : w->module().parameters()) {
    params += p.nbytes();
    if (p.requires_grad()) trainable += p.nbytes();
  }
  const MemoryBreakdown m = memory_breakdown(chain, params, trainable, parse_optimizer(a.optimizer));
  auto pct = [&](int64_t b) { return fixed(m.percent(b), 1) + "%"; };
  std::cout << "\nmemory of one training step (predicted from the profile)\n";
  Table parts({"part", "MiB", "share"});
  parts.add({"parameters", mib(m.parameters), pct(m.parameters)});
  parts.add({"gradients", mib(m.gradients), pct(m.gradients)});
  parts.add({"optimizer state (" + m.optimizer_name + ")", mib(m.optimizer), pct(m.optimizer)});
  parts.add({"inputs", mib(m.inputs), pct(m.inputs)});
  parts.add({"activations and transients, peak", mib(m.activations), pct(m.activations)});
  parts.print(std::cout);
  std::cout << "\nverdict: " << m.verdict();
  if (!a.json.empty()) {
    save_chain(chain, a.json);
    std::cout << "chain written to " << a.json << "\n";
  }
  return 0;
}

}  // namespace

Subcommand add_profile(CLI::App& app) {
  auto a = std::make_shared<ProfileArgs>();
  auto* cmd =
      app.add_subcommand("profile", "Measure a model as a chain of stages; say what checkpointing can save");
  a->model.add(cmd);
  cmd->add_option("--optimizer", a->optimizer, "count optimizer state: none, sgd-momentum or adam")
      ->check(CLI::IsMember({"none", "sgd-momentum", "adam"}))
      ->capture_default_str();
  cmd->add_option("--repeats", a->repeats, "timed runs per stage")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_option("--json", a->json, "write the chain (docs/chain-format.md) to this file");
  return {cmd, [a] { return run(*a); }};
}

}  // namespace remat::cli
