#include "remat/bench.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "remat/memory.h"
#include "remat/models.h"
#include "remat/planner.h"
#include "remat/profile.h"
#include "remat/units.h"

namespace remat {
namespace {

constexpr const char* kWho = "remat::bench";

int64_t batch_or(const WorkloadConfig& c, int64_t fallback) {
  return c.batch() > 0 ? c.batch() : fallback;
}

// --------------------------------------------------------------------------------------------------------------
// Workloads

// What every workload shares: a model holder with the Checkpointable methods, its input, and its config.
template <typename Holder>
class ModelWorkload : public Workload {
 public:
  ModelWorkload(const WorkloadConfig& c, int64_t default_batch) : c_(c), batch_(batch_or(c, default_batch)) {}
  torch::nn::Module& module() override { return *model_; }
  torch::Tensor input() const override { return x_; }
  void set_per_layer(std::optional<CheckpointOptions> o) override {
    o ? model_->gradient_checkpointing_enable(*o) : model_->gradient_checkpointing_disable();
  }
  torch::Tensor forward() override { return model_->forward(x_); }

 protected:
  void place(Holder model, torch::Tensor input) {
    model_ = std::move(model);
    model_->to(c_.device());
    x_ = std::move(input);
  }
  torch::TensorOptions on_device() const { return torch::TensorOptions().device(c_.device()); }

  WorkloadConfig c_;
  int64_t batch_;
  Holder model_{nullptr};
  torch::Tensor x_;  // the input of the model's chain
};

class BertWorkload final : public ModelWorkload<models::BertModel> {
 public:
  explicit BertWorkload(const WorkloadConfig& c) : ModelWorkload(c, 8) {
    place(models::BertModel(models::BertConfig()
                                .vocab_size(c.vocab())
                                .hidden_size(c.hidden())
                                .num_hidden_layers(c.layers())
                                .num_attention_heads(c.heads())
                                .intermediate_size(c.intermediate())
                                .max_position_embeddings(std::max<int64_t>(512, c.seq()))
                                .hidden_dropout_prob(c.dropout())
                                .attention_probs_dropout_prob(c.dropout())),
          torch::randint(0, c.vocab(), {batch_, c.seq()}, on_device().dtype(torch::kLong)));
    mask_ = torch::ones({batch_, c.seq()}, on_device());
    types_ = torch::zeros({batch_, c.seq()}, on_device().dtype(torch::kLong));
  }
  std::string description() const override {
    std::ostringstream os;
    os << "bert " << c_.layers() << " layers x " << c_.hidden() << " (" << c_.heads() << " heads, ffn "
       << c_.intermediate() << "), seq " << c_.seq() << ", batch " << batch_ << ", dropout " << c_.dropout();
    return os.str();
  }
  std::vector<StageFn> stages() override {
    return model_->stages(x_, mask_, types_, false, c_.granularity());
  }
  std::vector<int64_t> per_layer_stages() const override {
    if (c_.granularity() != Granularity::kLayer) return {};
    std::vector<int64_t> layers;
    for (int64_t i = 1; i <= c_.layers(); ++i)
      layers.push_back(i);  // stage 0 is the embeddings
    return layers;
  }
  torch::Tensor forward() override { return model_->forward(x_, mask_, types_); }

 private:
  torch::Tensor mask_, types_;
};

class MlpWorkload final : public ModelWorkload<models::ResidualMlp> {
 public:
  explicit MlpWorkload(const WorkloadConfig& c) : ModelWorkload(c, 64) {
    // The input requires grad, as in bench/pytorch_reference.py (whose reentrant baseline needs it).
    place(models::ResidualMlp(models::ResidualMlpOptions().depth(c.depth()).width(c.width())),
          torch::randn({batch_, c.width()}, on_device().requires_grad(true)));
  }
  std::string description() const override {
    std::ostringstream os;
    os << "mlp " << c_.depth() << " residual blocks x " << c_.width() << " (hidden " << 4 * c_.width()
       << "), batch " << batch_;
    return os.str();
  }
  std::vector<StageFn> stages() override { return stages_of(model_->blocks()); }
  std::vector<int64_t> per_layer_stages() const override {
    std::vector<int64_t> blocks;
    for (int64_t i = 0; i < c_.depth(); ++i)
      blocks.push_back(i);
    return blocks;
  }
};

// A CIFAR-style ResNet: the chain is the stem, the nine (3 x blocks) BasicBlocks of layer1..layer3 (unequal:
// layer1's keep four times layer3's activations) and the head; per-layer checkpointing is one
// remat::checkpoint per block.
class ResNetWorkload final : public ModelWorkload<models::ResNet> {
 public:
  explicit ResNetWorkload(const WorkloadConfig& c) : ModelWorkload(c, 64) {
    TORCH_CHECK(c.blocks() >= 1, "remat::make_workload: blocks must be >= 1, got ", c.blocks());
    place(models::ResNet(c.blocks()), torch::randn({batch_, 3, 32, 32}, on_device()));
  }
  std::string description() const override {
    return "resnet (CIFAR, " + std::to_string(3 * c_.blocks()) + " BasicBlocks), batch " +
           std::to_string(batch_);
  }
  std::vector<StageFn> stages() override {
    auto m = model_;
    std::vector<StageFn> out{
        {"stem", [m](const torch::Tensor& x) mutable { return m->stem(x); }, stem_holder()}};
    for (auto& s : stages_at(*model_, {"layer1", "layer2", "layer3"}))
      out.push_back(std::move(s));
    out.push_back({"head", [m](const torch::Tensor& h) mutable { return m->head(h); }, m->fc.ptr()});
    return out;
  }
  std::vector<int64_t> per_layer_stages() const override {
    std::vector<int64_t> blocks;
    for (int64_t i = 1; i <= 3 * c_.blocks(); ++i)
      blocks.push_back(i);
    return blocks;
  }

 private:
  // The stem's convolution and BatchNorm as one module, so that the executor restores the BatchNorm's
  // statistics when it recomputes the stem.
  std::shared_ptr<torch::nn::Module> stem_holder() {
    if (!stem_) {
      stem_ = std::make_shared<torch::nn::Module>("stem");
      stem_->register_module("conv1", model_->conv1);
      stem_->register_module("bn1", model_->bn1);
    }
    return stem_;
  }
  std::shared_ptr<torch::nn::Module> stem_;
};

class CifarWorkload final : public ModelWorkload<models::CifarNet> {
 public:
  explicit CifarWorkload(const WorkloadConfig& c) : ModelWorkload(c, 64) {
    place(models::CifarNet(), torch::randn({batch_, 3, 32, 32}, on_device()));
  }
  std::string description() const override { return "cifar (CifarNet), batch " + std::to_string(batch_); }
  std::vector<StageFn> stages() override {
    auto m = model_;
    return {
        {"cnn_block_1",
         [m](const torch::Tensor& x) mutable { return m->dropout_1(m->cnn_block_1->forward(x)); },
         m->cnn_block_1.ptr()},
        {"cnn_block_2", [m](const torch::Tensor& x) mutable { return m->cnn_block_2->forward(x); },
         m->cnn_block_2.ptr()},
        {"linearize",
         [m](const torch::Tensor& x) mutable {
           return m->dropout_3(m->linearize->forward(torch::flatten(m->dropout_2(x), 1)));
         },
         m->linearize.ptr()},
        {"out", [m](const torch::Tensor& x) mutable { return m->out(x); }, m->out.ptr()},
    };
  }
};

class HeavyWorkload final : public ModelWorkload<models::HeavyChain> {
 public:
  explicit HeavyWorkload(const WorkloadConfig& c) : ModelWorkload(c, 1) {
    place(models::HeavyChain(models::HeavyChainOptions().calls(c.calls()).adds(c.adds())),
          torch::zeros({}, on_device().requires_grad(true)));
  }
  std::string description() const override {
    return "heavy: " + std::to_string(c_.calls()) + " calls of " + std::to_string(c_.adds()) + " additions";
  }
  std::vector<StageFn> stages() override {
    std::vector<StageFn> out;
    const torch::Tensor a = model_->a;
    const int64_t adds = c_.adds();
    for (int64_t i = 0; i < c_.calls(); ++i) {
      out.push_back({"call" + std::to_string(i),
                     [a, adds](const torch::Tensor& x) { return models::heavy_function(x, a, adds); },
                     model_.ptr()});  // every call uses the parameter
    }
    return out;
  }
  torch::Tensor loss_of(const torch::Tensor& output) const override { return output.sum(); }
};

class ForumWorkload final : public ModelWorkload<models::ForumCnn> {
 public:
  explicit ForumWorkload(const WorkloadConfig& c) : ModelWorkload(c, 100) {
    models::ForumCnn model(models::ForumCnnOptions().variant(c.variant()).placement(c.placement()));
    auto shape = model->sample_shape();
    shape.insert(shape.begin(), batch_);
    place(model, torch::randn(shape, on_device()));
  }
  std::string description() const override {
    return "forum-cnn " + c_.variant() + " (placement " + c_.placement() + "), batch " +
           std::to_string(batch_);
  }
  std::vector<StageFn> stages() override {
    auto m = model_;
    const bool full = c_.variant() == "full";
    return {
        {"conv1+relu", [m](const torch::Tensor& x) mutable { return torch::relu(m->conv1(x)); },
         m->conv1.ptr()},
        {"conv2+relu", [m](const torch::Tensor& x) mutable { return torch::relu(m->conv2(x)); },
         m->conv2.ptr()},
        {"conv3+relu", [m](const torch::Tensor& x) mutable { return torch::relu(m->conv3(x)); },
         m->conv3.ptr()},
        {full ? "heads" : "fc1",
         [m, full](const torch::Tensor& x) mutable {
           auto f = torch::flatten(x, 1);
           if (!full) return m->heads[0](f);
           return torch::cat({torch::sigmoid(m->heads[0](f)), m->heads[1](f), m->heads[2](f)}, 1);
         },
         m.ptr()},  // the heads' parameters (and the convolutions', unused here)
    };
  }
};

// The loss of a step under a strategy.
struct Runner {
  Workload& w;
  std::optional<Plan> plan;
  std::vector<StageFn> stages;
  torch::Tensor step_loss() { return w.loss_of(plan ? run_plan(stages, *plan, w.input()) : w.forward()); }
};

}  // namespace

std::optional<CheckpointOptions> per_layer_options(const std::string& strategy) {
  if (strategy == "all") return CheckpointOptions();
  if (strategy == "all-reentrant") return CheckpointOptions().mode(CheckpointMode::kReentrant);
  if (strategy == "all-no-early-stop") return CheckpointOptions().early_stop(false);
  if (strategy == "all-keep-matmul") return CheckpointOptions().keep({kMatmul});
  if (strategy == "all-keep-conv") return CheckpointOptions().keep({kConv});
  return std::nullopt;
}

namespace {

void configure(Workload& w, const std::string& strategy, const std::optional<Plan>& plan) {
  w.set_per_layer(plan ? std::nullopt : per_layer_options(strategy));
}

// Strategies that run through the model's own per-layer checkpointing (or none) need no chain.
bool needs_chain(const std::string& s) {
  return !(s == "none" || per_layer_options(s));
}

// Gradients exist after a first step; allocate them up front so that no measured step counts them.
void allocate_grads(Workload& w) {
  torch::NoGradGuard no_grad;
  for (auto& p : w.module().parameters()) {
    if (p.requires_grad() && !p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
  }
}

std::vector<torch::Tensor> grads_after_step(Workload& w, Runner& r, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for (auto& p : w.module().parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  torch::manual_seed(seed);
  {
    at::AutoGradMode grad(true);
    r.step_loss().backward();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : w.module().parameters())
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

}  // namespace

torch::Tensor Workload::loss_of(const torch::Tensor& output) const {
  return output.to(torch::kFloat).pow(2).mean();
}

std::unique_ptr<Workload> make_workload(const WorkloadConfig& c) {
  const std::string& m = c.model();
  TORCH_CHECK(c.batch() >= 0, "remat::make_workload: batch must be >= 0, got ", c.batch());
  TORCH_CHECK(c.granularity() == Granularity::kLayer || m == "bert", "remat::make_workload: model '", m,
              "' has no sub-layer stages (Granularity::kSublayer is for bert)");
  torch::manual_seed(c.seed());  // the weights and inputs drawn below
  if (m == "bert") return std::make_unique<BertWorkload>(c);
  if (m == "mlp") return std::make_unique<MlpWorkload>(c);
  if (m == "cifar") return std::make_unique<CifarWorkload>(c);
  if (m == "resnet") return std::make_unique<ResNetWorkload>(c);
  if (m == "heavy") return std::make_unique<HeavyWorkload>(c);
  if (m == "forum-cnn") return std::make_unique<ForumWorkload>(c);
  TORCH_CHECK(false, "remat::make_workload: unknown model '", m,
              "' (bert, cifar, heavy, forum-cnn, mlp, resnet)");
}

std::optional<Plan> plan_for(const std::string& s, const Chain& chain) {
  if (!needs_chain(s)) return std::nullopt;
  try {
    if (s == "plan-all") return checkpoint_all(chain);
    if (s == "selective") {
      std::vector<int64_t> cores;
      for (size_t i = 0; i < chain.stages.size(); ++i) {
        const std::string& name = chain.stages[i].name;
        const std::string suffix = ".attention_core";
        if (name.size() >= suffix.size() &&
            name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
          cores.push_back(static_cast<int64_t>(i));
      }
      TORCH_CHECK(!cores.empty(), kWho,
                  ": 'selective' recomputes attention cores, and this chain has none (use ",
                  "--model bert --granularity sublayer)");
      Plan p = checkpoint_stages(chain.size(), cores);
      p.planner = "selective";
      p.predicted = simulate(chain, p);
      return p;
    }
    if (s == "sqrt" || s.rfind("uniform:", 0) == 0 || s.rfind("revolve:", 0) == 0 ||
        s.rfind("balanced:", 0) == 0 || s.rfind("balanced-time:", 0) == 0)
      return make_plan(chain, s, 0);
    if (s.rfind("optimal:", 0) == 0) {
      const std::string arg = s.substr(8);
      if (arg.rfind("as=", 0) == 0) {
        const auto base = plan_for(arg.substr(3), chain);
        TORCH_CHECK(base, kWho, ": '", s,
                    "' needs a plan strategy after as= (uniform:K, sqrt, plan-all, ...)");
        Plan p = optimal(chain, base->predicted.peak_bytes);
        p.planner = s;
        return p;
      }
      const bool overhead = arg.rfind("overhead=", 0) == 0, time = arg.rfind("time=", 0) == 0;
      if (overhead || time) {
        const std::string number = arg.substr(overhead ? 9 : 5);
        double f = 0;
        try {
          f = std::stod(number);
        } catch (const std::logic_error&) {
          f = -1;
        }
        TORCH_CHECK(f >= 0, kWho, ": '", s, "' needs a non-negative number after ",
                    overhead ? "overhead=" : "time=");
        const Plan none = no_checkpoint(chain), all = checkpoint_all(chain);
        const double target =
            overhead ? none.predicted.time_ms + f * (all.predicted.time_ms - none.predicted.time_ms)
                     : f * none.predicted.time_ms;
        int64_t lo = min_feasible_budget(chain), hi = none.predicted.peak_bytes;
        if (optimal(chain, lo).predicted.time_ms > target) {
          while (hi - lo > std::max<int64_t>(1, hi / 2000)) {
            const int64_t mid = lo + (hi - lo) / 2;
            (optimal(chain, mid).predicted.time_ms <= target ? hi : lo) = mid;
          }
        } else {
          hi = lo;
        }
        Plan p = optimal(chain, hi);
        p.planner = s;
        return p;
      }
      Plan p = optimal(chain, parse_size(arg));
      p.planner = s;
      return p;
    }
  } catch (const InfeasibleBudget&) {
    throw;
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, kWho, ": strategy '", s, "': ", e.what());
  }
  TORCH_CHECK(false, kWho, ": unknown strategy '", s,
              "' (none, all, all-reentrant, all-no-early-stop, all-keep-matmul, all-keep-conv, plan-all, "
              "sqrt, uniform:K, balanced:K, "
              "balanced-time:K, revolve:S, "
              "optimal:SIZE, optimal:as=P, optimal:overhead=F)");
}

Chain profile_workload(Workload& w, const ProfileOptions* profile) {
  w.set_per_layer(std::nullopt);
  return profile_chain(w.stages(), w.input(), profile ? *profile : ProfileOptions());
}

namespace {
// Each strategy's plan (nullopt for those without one), on `given` or on the chain profiled once if a plan
// needs it.
std::vector<std::optional<Plan>> plans_for(Workload& w, const std::vector<std::string>& strategies,
                                           const ProfileOptions* profile, const Progress& progress,
                                           const Chain* given, std::optional<Chain>* chain_used = nullptr) {
  std::optional<Chain> chain;
  if (given) chain = *given;
  std::vector<std::optional<Plan>> plans;
  for (const auto& s : strategies) {
    if (needs_chain(s) && !chain) {
      if (progress) progress("profiling " + w.description());
      chain = profile_workload(w, profile);
    }
    plans.push_back(needs_chain(s) ? plan_for(s, *chain) : std::nullopt);
  }
  if (chain_used) *chain_used = std::move(chain);
  return plans;
}
}  // namespace

std::vector<BenchRow> bench(Workload& w, const std::vector<std::string>& strategies,
                            const MeasureOptions& measure, const ProfileOptions* profile,
                            const Progress& progress, const Chain* given) {
  TORCH_CHECK(!strategies.empty(), kWho, ": no strategies");
  std::vector<std::string> order = strategies;
  if (std::find(order.begin(), order.end(), "none") == order.end()) order.insert(order.begin(), "none");
  std::stable_partition(order.begin(), order.end(), [](const std::string& s) { return s == "none"; });

  std::optional<Chain> chain;
  const std::vector<std::optional<Plan>> plans = plans_for(w, order, profile, progress, given, &chain);

  // Steps of the strategies are interleaved (one step of each in turn), so that a shared machine's drift
  // affects every strategy alike and the ratios to "none" hold.
  std::vector<BenchRow> rows(order.size());
  std::vector<Runner> runners;
  const std::vector<int64_t> per_layer = w.per_layer_stages();
  for (size_t k = 0; k < order.size(); ++k) {
    rows[k].strategy = order[k];
    rows[k].plan = plans[k];
    runners.push_back(Runner{w, plans[k], plans[k] ? w.stages() : std::vector<StageFn>{}});
    if (!chain) continue;
    if (plans[k]) {
      rows[k].predicted_time_ms = simulate(*chain, *plans[k]).time_ms;
    } else if (order[k] == "none") {
      rows[k].predicted_time_ms = simulate(*chain, no_checkpoint(*chain)).time_ms;
    } else if (order[k] == "all" && !per_layer.empty()) {
      rows[k].predicted_time_ms = per_call_time_ms(*chain, per_layer);
    }
  }
  auto one_step = [&](size_t k, const MeasureOptions& m) {
    configure(w, order[k], plans[k]);
    return measure_step(
        w.module(), [&] { return runners[k].step_loss(); }, m);
  };
  allocate_grads(w);
  if (progress) progress("warming up " + std::to_string(order.size()) + " strategies");
  for (size_t k = 0; k < order.size(); ++k) {
    if (measure.warmup() > 0) one_step(k, MeasureOptions(measure).steps(measure.warmup()).warmup(0));
  }
  for (int64_t i = 0; i < measure.steps(); ++i) {
    if (progress)
      progress("step " + std::to_string(i + 1) + "/" + std::to_string(measure.steps()) +
               " of every strategy");
    for (size_t k = 0; k < order.size(); ++k) {
      const StepStats s = one_step(k, MeasureOptions(measure).steps(1).warmup(0));
      StepStats& acc = rows[k].stats;
      acc.base_bytes = s.base_bytes;
      acc.peak_bytes = std::max(acc.peak_bytes, s.peak_bytes);
      acc.after_forward_bytes = std::max(acc.after_forward_bytes, s.after_forward_bytes);
      acc.after_backward_bytes = s.after_backward_bytes;
      acc.step_ms.push_back(s.median_ms);
      acc.forward_ms.push_back(s.median_forward_ms);
    }
  }
  for (auto& r : rows) {
    r.stats.median_ms = median(r.stats.step_ms);
    r.stats.median_forward_ms = median(r.stats.forward_ms);
  }

  if (progress) progress("comparing gradients with 'none'");
  std::vector<torch::Tensor> reference;
  const uint64_t seed = 1234;
  for (size_t k = 0; k < order.size(); ++k) {
    configure(w, order[k], plans[k]);
    auto grads = grads_after_step(w, runners[k], seed);
    BenchRow& row = rows[k];
    if (k == 0) {
      reference = grads;
      continue;
    }
    double scale = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!reference[i].defined() || !grads[i].defined()) {
        if (reference[i].defined() != grads[i].defined()) row.max_grad_diff = INFINITY;
        continue;
      }
      scale = std::max(scale, reference[i].abs().max().item<double>());
      row.max_grad_diff = std::max(
          row.max_grad_diff,
          (grads[i].to(torch::kDouble) - reference[i].to(torch::kDouble)).abs().max().item<double>());
    }
    // Relative 1e-4: recomputation changes the order in which float gradient contributions are summed
    // (HeavyChain sums 100,000 of them into one parameter); a missing or wrong contribution is O(1).
    row.max_grad_diff_relative = row.max_grad_diff / std::max(scale, 1e-30);
    row.grads_equal = row.max_grad_diff <= 1e-4 * (1 + scale);
  }
  w.set_per_layer(std::nullopt);
  return rows;
}

std::vector<SweepPoint> sweep(const Chain& chain, int64_t budgets) {
  TORCH_CHECK(budgets >= 2, "remat::sweep: budgets must be >= 2, got ", budgets);
  const Plan none = no_checkpoint(chain);
  const double base_ms = none.predicted.time_ms;
  auto point = [&](const std::string& kind, const Plan& p, int64_t budget) {
    return SweepPoint{kind,
                      p.planner,
                      budget,
                      p.predicted.peak_bytes,
                      p.predicted.time_ms,
                      base_ms > 0 ? p.predicted.time_ms / base_ms - 1 : 0,
                      chain.input_bytes};
  };
  std::vector<SweepPoint> out;
  const int64_t lo = min_feasible_budget(chain), hi = none.predicted.peak_bytes;
  for (int64_t i = 0; i < budgets; ++i) {
    const int64_t budget =
        lo + static_cast<int64_t>(std::llround(double(hi - lo) * double(i) / double(budgets - 1)));
    out.push_back(point("optimal", optimal(chain, budget), budget));
  }
  out.push_back(point("baseline", none, 0));
  out.push_back(point("baseline", checkpoint_all(chain), 0));
  out.push_back(point("baseline", sqrt_n(chain), 0));
  for (int64_t k = 2; k <= std::min<int64_t>(8, chain.size()); ++k)
    out.push_back(point("baseline", uniform(chain, k), 0));
  return out;
}

// --------------------------------------------------------------------------------------------------------------

namespace {

Chain scale_chain(const Chain& a, int64_t batch_a, const Chain& b, int64_t batch_b, int64_t batch) {
  auto lerp = [&](double va, double vb) {
    return va + (vb - va) * double(batch - batch_a) / double(batch_b - batch_a);
  };
  auto bytes = [&](int64_t va, int64_t vb) {
    return std::max<int64_t>(0, std::llround(lerp(double(va), double(vb))));
  };
  Chain c = a;
  c.input_bytes = bytes(a.input_bytes, b.input_bytes);
  for (size_t i = 0; i < c.stages.size(); ++i) {
    Stage& s = c.stages[i];
    const Stage& sa = a.stages[i];
    const Stage& sb = b.stages[i];
    s.fwd_ms = std::max(0.0, lerp(sa.fwd_ms, sb.fwd_ms));
    s.bwd_ms = std::max(0.0, lerp(sa.bwd_ms, sb.bwd_ms));
    auto opt_ms = [&](const std::optional<double>& va,
                      const std::optional<double>& vb) -> std::optional<double> {
      if (!va || !vb) return std::nullopt;
      return std::max(0.0, lerp(*va, *vb));
    };
    s.fwd_nosave_ms = opt_ms(sa.fwd_nosave_ms, sb.fwd_nosave_ms);
    s.checkpoint_fwd_ms = opt_ms(sa.checkpoint_fwd_ms, sb.checkpoint_fwd_ms);
    s.checkpoint_bwd_ms = opt_ms(sa.checkpoint_bwd_ms, sb.checkpoint_bwd_ms);
    s.output_bytes = bytes(sa.output_bytes, sb.output_bytes);
    s.saved_bytes = std::max(s.output_bytes, bytes(sa.saved_bytes, sb.saved_bytes));
    s.fwd_tmp_bytes = bytes(sa.fwd_tmp_bytes, sb.fwd_tmp_bytes);
    s.bwd_tmp_bytes = bytes(sa.bwd_tmp_bytes, sb.bwd_tmp_bytes);
    if (sa.has_keep() && sb.has_keep()) {
      s.keep_fwd_ms = opt_ms(sa.keep_fwd_ms, sb.keep_fwd_ms);
      s.keep_bwd_ms = opt_ms(sa.keep_bwd_ms, sb.keep_bwd_ms);
      s.keep_saved_bytes =
          std::clamp(bytes(*sa.keep_saved_bytes, *sb.keep_saved_bytes), s.output_bytes, s.saved_bytes);
    } else {
      s.keep_saved_bytes.reset(), s.keep_fwd_ms.reset(), s.keep_bwd_ms.reset();
    }
  }
  return c;
}

// The peak a strategy predicts on a chain; "optimal" is the least memory of any schedule.
// The plan a max-batch strategy runs; "optimal" plans for `budget`.
Plan plan_at(const std::string& s, const Chain& chain, int64_t budget) {
  if (s == "optimal") return optimal(chain, budget);
  if (s == "none") return no_checkpoint(chain);
  if (s == "all") return checkpoint_all(chain);
  auto p = plan_for(s, chain);
  TORCH_CHECK(p, "remat::max_batch: unknown strategy '", s, "' (none, all, sqrt, uniform:K, optimal)");
  return *p;
}

// The peak a strategy predicts on a chain; for "optimal", the least memory of any schedule.
int64_t predicted_peak(const std::string& s, const Chain& chain) {
  return s == "optimal" ? min_feasible_budget(chain) : plan_at(s, chain, 0).predicted.peak_bytes;
}

}  // namespace

std::vector<MaxBatch> max_batch(const std::function<std::unique_ptr<Workload>(int64_t)>& make, int64_t budget,
                                const std::vector<std::string>& strategies, const Progress& progress,
                                const ProfileOptions* profile) {
  TORCH_CHECK(budget > 0, "remat::max_batch: the budget must be > 0 bytes, got ", budget);
  constexpr int64_t b1 = 2, b2 = 4;
  if (progress) progress("profiling at batch " + std::to_string(b1) + " and " + std::to_string(b2));
  Chain c1, c2;
  {
    auto w = make(b1);
    c1 = profile_workload(*w, profile);
  }
  {
    auto w = make(b2);
    c2 = profile_workload(*w, profile);
  }
  TORCH_CHECK(c2.input_bytes > c1.input_bytes,
              "remat::max_batch: the model's input does not grow with the batch");
  std::vector<MaxBatch> out;
  for (const auto& s : strategies) {
    MaxBatch r;
    r.strategy = s;
    auto fits = [&](int64_t b) { return predicted_peak(s, scale_chain(c1, b1, c2, b2, b)) <= budget; };
    if (fits(1)) {
      int64_t lo = 1, hi = 2;
      while (fits(hi) && hi < (int64_t{1} << 24))
        lo = hi, hi *= 2;
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        (fits(mid) ? lo : hi) = mid;
      }
      r.batch = lo;
    }
    // Confirm with a real step, stepping down while it does not fit.
    for (int attempt = 0; attempt < 6 && r.batch > 0; ++attempt) {
      const Chain chain = scale_chain(c1, b1, c2, b2, r.batch);
      r.predicted_peak_bytes = predicted_peak(s, chain);
      if (progress) progress("'" + s + "': confirming batch " + std::to_string(r.batch));
      auto w = make(r.batch);
      // "none" and "all" run as users run them (the plain model, the model's per-layer checkpointing), not
      // through the plan executor, which may hold less.
      std::optional<Plan> plan;
      if (s != "none" && s != "all") plan = plan_at(s, chain, budget);
      configure(*w, s, plan);
      Runner runner{*w, plan, plan ? w->stages() : std::vector<StageFn>{}};
      const StepStats st = measure_step(
          w->module(), [&] { return runner.step_loss(); }, MeasureOptions().warmup(1).steps(1));
      r.measured_peak_bytes = st.peak_bytes + static_cast<int64_t>(w->input().nbytes());
      r.confirmed = r.measured_peak_bytes <= budget;
      if (r.confirmed) break;
      r.batch = std::max<int64_t>(0, std::min(r.batch - 1, int64_t(double(r.batch) * double(budget) /
                                                                   double(r.measured_peak_bytes))));
    }
    out.push_back(r);
  }
  return out;
}

#if REMAT_HAS_DISTRIBUTED
DataParallelBench bench_data_parallel(Workload& w, const std::vector<std::string>& strategies,
                                      distributed::ProcessGroup& group, const MeasureOptions& measure,
                                      const distributed::DataParallelOptions& options,
                                      const ProfileOptions* profile, const Progress& progress,
                                      const Chain* given) {
  constexpr const char* who = "remat::bench_data_parallel";
  TORCH_CHECK(!strategies.empty(), who, ": no strategies");
  const std::vector<std::optional<Plan>> plans = plans_for(w, strategies, profile, progress, given);
  allocate_grads(w);
  distributed::DataParallel dp(
      w.module().shared_from_this(),
      std::shared_ptr<distributed::ProcessGroup>(&group, [](distributed::ProcessGroup*) {}), options);
  DataParallelBench out;
  out.world_size = group.size();
  const auto st = dp.stats();
  out.gradient_bytes = st.bytes_per_step;
  out.buckets = st.buckets;
  out.all_reduce_ms = dp.time_all_reduce(5);
  std::vector<at::Tensor> max_of(1), sum_of(1);
  for (size_t k = 0; k < strategies.size(); ++k) {
    if (progress) progress("data parallel over " + std::to_string(group.size()) + ": " + strategies[k]);
    Runner runner{w, plans[k], plans[k] ? w.stages() : std::vector<StageFn>{}};
    configure(w, strategies[k], plans[k]);
    auto loss = [&] { return runner.step_loss(); };
    if (measure.warmup() > 0)
      measure_step(w.module(), loss, MeasureOptions(measure).steps(measure.warmup()).warmup(0));
    group.barrier();
    dp.reset_stats();
    const StepStats s = measure_step(w.module(), loss, MeasureOptions(measure).warmup(0));
    const auto d = dp.stats();
    DataParallelBenchRow row;
    row.strategy = strategies[k];
    row.plan = plans[k];
    // Per rank peaks (each rank fills its slot of a sum), and the slowest rank's times.
    sum_of[0] = torch::zeros({group.size()}, torch::kLong);
    sum_of[0][group.rank()] = s.peak_bytes;
    group.all_reduce(sum_of);
    for (int r = 0; r < group.size(); ++r)
      row.peak_bytes.push_back(sum_of[0][r].item<int64_t>());
    const double exposed = d.steps > 0 ? d.wait_seconds * 1e3 / double(d.steps) : 0.0;
    row.buckets_early = d.steps > 0 ? double(d.buckets_early) / double(d.steps) : 0.0;
    max_of[0] = torch::tensor({s.median_ms, exposed}, torch::kDouble);
    group.all_reduce(max_of, distributed::ReduceOp::kMax);
    row.median_ms = max_of[0][0].item<double>();
    row.exposed_all_reduce_ms = max_of[0][1].item<double>();
    row.hidden_fraction = out.all_reduce_ms > 0
                              ? std::clamp(1.0 - row.exposed_all_reduce_ms / out.all_reduce_ms, 0.0, 1.0)
                              : 1.0;
    // The gradients after the last step agree across ranks (one parameter at a time: a copy of all of them
    // would add the model's size twice over).
    for (const auto& p : w.module().parameters()) {
      if (!p.grad().defined()) continue;
      std::vector<at::Tensor> hi{p.grad().clone()}, lo{p.grad().clone()};
      group.all_reduce(hi, distributed::ReduceOp::kMax);
      group.all_reduce(lo, distributed::ReduceOp::kMin);
      if (!at::equal(hi[0], lo[0])) row.grads_equal_across_ranks = false;
    }
    out.rows.push_back(std::move(row));
  }
  w.set_per_layer(std::nullopt);
  return out;
}
#endif

}  // namespace remat
