// Seed 001's BERT-large on CUDA, in C++: remat's BertModel (24 layers, hidden 1024, 16 heads, intermediate
// 4096), sequence 512, batch 64, fp32, trained plain, per layer in both modes, per layer with
// policy::matmuls(), and planned in place (remat::Planned) at two budgets between per-layer checkpointing's
// peak and the plain step's. Peak CUDA memory is the caching allocator's max_memory_allocated above
// memory_allocated before the forward pass (the measurement a user makes; remat's own measuring leaves it
// alone), step time synchronized; every way's steps are paired with plain steps in the same round, and the
// rounds' ratios' medians are reported. One JSON object per way on stdout (and in --json), then a table.
//
//   build-cuda/remat/bench/remat_bert_cuda --rounds 3 --json out/bert-cuda-cpp.json
//
// The budgets default to per-layer's peak plus 1/3 and 2/3 of the distance to the plain peak (--budgets A,B
// in bytes, or the word per-layer for per-layer checkpointing's measured peak). Planned's predicted peak is
// printed beside the peak its window measured (its last_peak_bytes).
// --offload: Planned plans with PlannerOptions::offload (stages kept with what they save on the host, or
// streamed, Fa@stream), and the budgets start at per-layer's peak itself (issue 42's point of comparison);
// --groups: it also profiles each stage's saved groups and may assign them (Fk{khr}). With --offload a way
// at Planned's least feasible budget is added ("least"). A budget below it is planned at it instead (its
// JSON has "asked_budget"). --device cpu runs the same on the CPU (remat's CPU meter; to try the program).
// The --json file is written once the ways are profiled and planned, and again after each round (each way's
// "stage" says how far the run got), so that a run stopped by its time keeps what it measured; each Planned
// way has its predicted step time (remat::step_time_ms on its own profile, "predicted_ms"). --chain PATH also
// writes the first Planned way's profile there ({"chain": the chain's JSON, "rest_ms", "least_budget"}), to
// plan again elsewhere.

#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <remat/memory.h>
#include <remat/models.h>
#include <remat/planned.h>
#include <remat/planner/chain.h>
#include <remat/planner/step.h>
#include <remat/policy.h>

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct Args {
  int64_t layers = 24, hidden = 1024, heads = 16, intermediate = 4096, seq = 512, batch = 64;
  int rounds = 3, steps = 1;
  bool offload = false, groups = false, cpu = false;
  std::vector<int64_t> budgets;
  std::string json, chain;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("remat_bert_cuda: " + k + " needs a value");
      return argv[++i];
    };
    if (k == "--layers")
      a.layers = std::stoll(next());
    else if (k == "--hidden")
      a.hidden = std::stoll(next());
    else if (k == "--heads")
      a.heads = std::stoll(next());
    else if (k == "--intermediate")
      a.intermediate = std::stoll(next());
    else if (k == "--seq")
      a.seq = std::stoll(next());
    else if (k == "--batch")
      a.batch = std::stoll(next());
    else if (k == "--rounds")
      a.rounds = std::stoi(next());
    else if (k == "--steps")
      a.steps = std::stoi(next());
    else if (k == "--json")
      a.json = next();
    else if (k == "--chain")
      a.chain = next();
    else if (k == "--offload")
      a.offload = true;
    else if (k == "--groups")
      a.groups = true;
    else if (k == "--device") {
      const std::string d = next();
      if (d != "cpu" && d != "cuda")
        throw std::invalid_argument("remat_bert_cuda: --device " + d + ": cpu or cuda");
      a.cpu = d == "cpu";
    } else if (k == "--budgets") {
      std::stringstream ss(next());
      std::string part;
      while (std::getline(ss, part, ',')) {
        if (part == "per-layer") {
          a.budgets.push_back(-1);
          continue;
        }
        size_t used = 0;
        int64_t b = -1;
        try {
          b = std::stoll(part, &used);
        } catch (const std::exception&) {
        }
        if (b <= 0 || used != part.size())
          throw std::invalid_argument("remat_bert_cuda: --budgets: '" + part +
                                      "' is neither a positive number of bytes nor per-layer");
        a.budgets.push_back(b);
      }
    } else {
      throw std::invalid_argument("remat_bert_cuda: unknown argument '" + k + "'");
    }
  }
  return a;
}

struct Way {
  Way(std::string n, std::function<void(remat::models::BertModel&)> s, int64_t b = 0)
      : name(std::move(n)), set(std::move(s)), budget(b) {}
  std::string name;
  std::function<void(remat::models::BertModel&)> set;
  int64_t budget = 0;                     // Planned's, or 0
  int64_t asked = 0;                      // the budget asked for, where it was below the least feasible one
  remat::models::BertModel own{nullptr};  // Planned's own model (a Planned keeps its plan across steps)
  std::vector<double> ratios, ms, plain_ms;
  int64_t peak = 0;
  int64_t predicted = -1, window_peak = -1;
  double predicted_ms = -1;  // remat::step_time_ms of its plan on its own profile, or -1
  std::string plan;
};

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (!a.cpu && !torch::cuda::is_available()) {
    std::cerr << "remat_bert_cuda: no CUDA device\n";
    return 2;
  }
  const torch::Device dev = a.cpu ? torch::Device(torch::kCPU) : torch::Device(torch::kCUDA, 0);
  if (a.cpu) remat::memory::track_cpu();
  const auto sync = [&] {
    if (!a.cpu) torch::cuda::synchronize();
  };
  torch::manual_seed(0);
  auto config = remat::models::BertConfig::large()
                    .num_hidden_layers(a.layers)
                    .hidden_size(a.hidden)
                    .num_attention_heads(a.heads)
                    .intermediate_size(a.intermediate)
                    .max_position_embeddings(std::max<int64_t>(512, a.seq));
  auto make = [&] {
    torch::manual_seed(0);
    remat::models::BertModel m(config);
    m->to(dev);
    m->train();
    for (auto& p : m->parameters())
      p.mutable_grad() = torch::zeros_like(p);
    return m;
  };
  remat::models::BertModel model = make();
  const auto ids =
      torch::randint(0, config.vocab_size(), {a.batch, a.seq}, torch::TensorOptions().dtype(torch::kLong))
          .to(dev);
  const auto mask = torch::ones({a.batch, a.seq}, torch::TensorOptions().dtype(torch::kLong)).to(dev);

  // One step of `m`; returns its time (ms, synchronized) and its peak above the bytes alive before the
  // forward.
  auto step_of = [&](remat::models::BertModel& m, int64_t* peak) {
    for (auto& p : m->parameters())
      p.mutable_grad().zero_();
    sync();
    const int64_t base = remat::memory::active_bytes(dev);
    remat::memory::reset_peak(dev);
    const auto t0 = Clock::now();
    m->forward(ids, mask).square().mean().backward();
    sync();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (peak) *peak = std::max(*peak, remat::memory::peak_bytes(dev) - base);
    return ms;
  };
  auto step = [&](int64_t* peak) { return step_of(model, peak); };

  std::vector<Way> ways;
  ways.emplace_back("plain", [](remat::models::BertModel& m) { m->gradient_checkpointing_disable(); });
  ways.emplace_back("per-layer kNonReentrant", [](remat::models::BertModel& m) {
    m->gradient_checkpointing_enable(remat::CheckpointOptions());
  });
  ways.emplace_back("per-layer kReentrant", [](remat::models::BertModel& m) {
    m->gradient_checkpointing_enable(remat::CheckpointOptions().mode(remat::CheckpointMode::kReentrant));
  });
  ways.emplace_back("per-layer policy::matmuls", [](remat::models::BertModel& m) {
    m->gradient_checkpointing_enable(remat::CheckpointOptions().policy(remat::policy::matmuls()));
  });

  // Peaks of the plain step and of per-layer checkpointing first: the Planned budgets lie between them.
  for (size_t w = 0; w < 2; ++w) {
    ways[w].set(model);
    step(nullptr);
    step(&ways[w].peak);
  }
  std::vector<int64_t> budgets = a.budgets;
  for (int64_t& b : budgets)
    if (b == -1) b = ways[1].peak;  // "per-layer": per-layer checkpointing's peak, as measured
  if (budgets.empty()) {
    const int64_t lo = ways[1].peak, hi = ways[0].peak;
    budgets = {lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3};
    if (a.offload) budgets.insert(budgets.begin(), lo);
  }
  remat::PlannerOptions planner;
  planner.offload = a.offload;
  const auto planned_at = [planner, groups = a.groups](int64_t b) {
    return [b, planner, groups](remat::models::BertModel& m) {
      m->gradient_checkpointing_enable(remat::PlannedOptions()
                                           .budget(b)
                                           .policies({remat::policy::matmuls()})
                                           .planner(planner)
                                           .groups(groups));
    };
  };
  const auto planned_name = [&](int64_t b) {
    return std::string(a.offload ? "Planned+offload " : "Planned ") + std::to_string(b >> 20) + " MiB";
  };
  for (int64_t b : budgets)
    ways.emplace_back(planned_name(b), planned_at(b), b);
  // Planned profiles at its first step and plans at its second: run those before timing. The least feasible
  // budget from the first profile (the same chain at every budget): a way below it is planned at it (before
  // 2026-12-03, without --offload, such a budget stopped the program at its planning step); with --offload a
  // way at it is added where none is at or below it.
  int64_t least = -1;
  const auto profile = [&](Way& way) {  // its own model, set, and its profiling step run
    way.own = make();
    way.set(way.own);
    step_of(way.own, nullptr);
  };
  for (size_t w = 4; w < ways.size(); ++w) {
    profile(ways[w]);
    if (least < 0) {
      const auto* planned = ways[w].own->planned();
      TORCH_CHECK(planned != nullptr && planned->chain() != nullptr && planned->step_readings() != nullptr,
                  "remat_bert_cuda: Planned has no profile after its profiling step");
      least = remat::min_step_budget(*planned->chain(), remat::step_context(*planned->step_readings()),
                                     "per-layer", planner);
      std::fprintf(stderr, "remat_bert_cuda: Planned's least feasible budget %lld bytes (%.1f MiB)\n",
                   static_cast<long long>(least), least / 1048576.0);
      const bool listed =
          std::any_of(ways.begin() + 4, ways.end(), [&](const Way& x) { return x.budget <= least; });
      if (a.offload && !listed) ways.emplace_back(planned_name(least) + " (least)", planned_at(least), least);
    }
    if (least >= 0 && ways[w].budget < least) {  // planned at the least instead
      ways[w].asked = ways[w].budget;
      ways[w].budget = least;
      ways[w].name += " -> least";
      ways[w].set = planned_at(least);
      profile(ways[w]);
    }
    step_of(ways[w].own, nullptr);
    const auto* planned = ways[w].own->planned();
    if (planned != nullptr && planned->plan() != nullptr && planned->step_readings() != nullptr) {
      ways[w].predicted = planned->predicted_peak_bytes();
      ways[w].plan = planned->plan()->to_string();
      const remat::StepContext context = remat::step_context(*planned->step_readings());
      ways[w].predicted_ms = remat::step_time_ms(*planned->chain(), context, *planned->plan());
      if (!a.chain.empty() && w == 4)
        std::ofstream(a.chain) << "{\"chain\":" << remat::to_json(*planned->chain())
                               << ",\"rest_ms\":" << context.rest_ms << ",\"least_budget\":" << least
                               << "}\n";
    }
  }

  // Every way so far, as JSON (the --json file is written after the profiles and after each round).
  const auto json_of = [&](const std::string& stage) {
    std::ostringstream json;
    json << "[";
    for (size_t w = 0; w < ways.size(); ++w) {
      const Way& way = ways[w];
      const double ratio = w == 0 ? 1.0 : median(way.ratios);
      json << (w ? "," : "") << "{\"way\":\"" << way.name << "\",\"stage\":\"" << stage
           << "\",\"peak_bytes\":" << way.peak << ",\"median_ms\":" << median(way.ms)
           << ",\"median_ratio\":" << ratio << ",\"budget\":" << way.budget
           << ",\"asked_budget\":" << (way.asked ? way.asked : way.budget)
           << ",\"least\":" << (way.budget > 0 && way.budget == least ? "true" : "false")
           << ",\"predicted_bytes\":" << way.predicted << ",\"window_peak_bytes\":" << way.window_peak
           << ",\"predicted_ms\":" << way.predicted_ms << ",\"plan\":\"" << way.plan << "\",\"ratios\":[";
      for (size_t i = 0; i < way.ratios.size(); ++i)
        json << (i ? "," : "") << way.ratios[i];
      json << "]}";
    }
    json << "]";
    return json.str();
  };
  const auto write = [&](const std::string& stage) {
    if (!a.json.empty()) std::ofstream(a.json) << json_of(stage) << "\n";
  };
  write("planned");

  for (int r = 0; r < a.rounds; ++r) {
    for (size_t w = 1; w < ways.size(); ++w) {
      Way& way = ways[w];
      for (int s = 0; s < a.steps; ++s) {
        ways[0].set(model);
        const double p = step(r == 0 ? &ways[0].peak : nullptr);
        if (way.budget == 0) way.set(model);
        remat::models::BertModel& m_of = way.budget > 0 ? way.own : model;
        const double m = step_of(m_of, &way.peak);
        way.ms.push_back(m), way.plain_ms.push_back(p), way.ratios.push_back(m / p);
        ways[0].ms.push_back(p);
        if (way.budget > 0 && m_of->planned() != nullptr) {
          way.window_peak = m_of->planned()->last_peak_bytes();
          way.predicted = m_of->planned()->predicted_peak_bytes();
        }
      }
    }
    write("round " + std::to_string(r + 1) + " of " + std::to_string(a.rounds));
  }

  std::printf("\n%-34s %12s %10s %8s %12s %12s %12s\n", "way", "peak MiB", "step ms", "ratio", "predicted",
              "measured", "pred. ms");
  for (size_t w = 0; w < ways.size(); ++w) {
    const Way& way = ways[w];
    std::printf("%-34s %12.1f %10.1f %8.3f %12.1f %12.1f %12.1f\n", way.name.c_str(), way.peak / 1048576.0,
                median(way.ms), w == 0 ? 1.0 : median(way.ratios), way.predicted / 1048576.0,
                way.window_peak / 1048576.0, way.predicted_ms);
  }
  const std::string json = json_of("measured");
  std::cout << json << "\n";
  if (!a.json.empty()) std::ofstream(a.json) << json << "\n";
  return 0;
}
