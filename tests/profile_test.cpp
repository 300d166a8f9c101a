// The profiler measures chains exactly, and plans made from them run with the predicted peak and calls.
#include <ATen/CPUGeneratorImpl.h>
#include <remat/bench.h>
#include <remat/models.h>
#include <remat/planner/planner.h>
#include <remat/profile.h>

#include "checkpoint/region.h"
#include "detail/compat.h"
#include "support.h"

#include <chrono>
#include <thread>

namespace {

using remat::testing::clear_grads;
using remat::testing::expect_all_close;
using remat::testing::grads_of;
using remat::testing::max_abs_diff;

class ProfileTest : public ::testing::Test {
 protected:
  void SetUp() override { remat::testing::meter_on(); }
};

TEST_F(ProfileTest, MeasuresEveryFieldOfSimpleStages) {
  const int64_t b = 16, w = 32, act = b * w * 4;
  torch::nn::Sequential seq(torch::nn::Linear(w, w), torch::nn::Tanh(), torch::nn::GELU(),
                            torch::nn::Linear(w, 2 * w));
  const auto x = torch::randn({b, w});
  const remat::Chain chain = remat::profile_chain(seq, x, remat::ProfileOptions().warmup(1).repeats(3));
  ASSERT_EQ(chain.size(), 4);
  EXPECT_EQ(chain.input_bytes, act);
  EXPECT_EQ(chain.stages[0].name, "0:Linear");
  EXPECT_EQ(chain.stages[1].name, "1:Tanh");
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(chain.stages[i].output_bytes, act) << i;
  EXPECT_EQ(chain.stages[3].output_bytes, 2 * act);
  // Linear keeps its input and weight (alive anyway), Tanh its output, GELU its input: each adds only its
  // output.
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(chain.stages[i].saved_bytes, chain.stages[i].output_bytes) << i;
  for (const auto& s : chain.stages) {
    EXPECT_GT(s.fwd_ms, 0);
    EXPECT_GT(s.bwd_ms, 0);
  }
  // The backward of a Linear allocates its weight's gradient temporarily ([w, w] or [2w, w] floats); its
  // output, which nothing saved, is freed as the backward starts (the executor hands it over by move).
  EXPECT_GE(chain.stages[3].bwd_tmp_bytes + chain.stages[3].output_bytes, 2 * w * w * 4);
}

// A first stage frozen on a sample that needs no gradient makes no graph: no backward (Stage::has_backward),
// nothing saved but its output, and the per-layer planner keeps it at every budget; a stage with parameters
// to train has a backward. (A later stage's input is taken as needing a gradient, as before.)
TEST_F(ProfileTest, AFirstStageFrozenOnASampleWithoutAGradientHasNoBackward) {
  const int64_t b = 16, w = 32;
  torch::nn::Sequential seq(torch::nn::Linear(w, w), torch::nn::Tanh(), torch::nn::Linear(w, w));
  for (auto& p : seq[0]->parameters())
    p.set_requires_grad(false);
  const remat::Chain chain =
      remat::profile_chain(seq, torch::randn({b, w}), remat::ProfileOptions().warmup(0).repeats(1));
  EXPECT_FALSE(chain.stages[0].has_backward);
  EXPECT_EQ(chain.stages[0].saved_bytes, chain.stages[0].output_bytes);
  EXPECT_TRUE(chain.stages[2].has_backward);
  const int64_t least = remat::per_layer_min_budget(chain);
  for (const int64_t budget : {least, least * 8})
    EXPECT_EQ(remat::per_layer(chain, budget).ops[0].kind, remat::OpKind::kForwardAll) << budget;
}

// A stage whose forward without saving holds two tensors at once that a forward with saving keeps one of: the
// feed-forward product and its ReLU (which saves its output; the product is let go of once the ReLU is done).
TEST_F(ProfileTest, MeasuresWhatTheForwardWithoutSavingHoldsAboveItsOutput) {
  const int64_t b = 16, w = 32, act = b * w * 4, wide = 4 * act;
  torch::nn::Sequential block(torch::nn::Linear(w, 4 * w), torch::nn::ReLU(), torch::nn::Linear(4 * w, w));
  const std::vector<remat::StageFn> stages{
      {"block", [block](const torch::Tensor& x) mutable { return block->forward(x); }, block.ptr()}};
  const remat::Chain chain =
      remat::profile_chain(stages, torch::randn({b, w}), remat::ProfileOptions().repeats(1));
  const remat::Stage& s = chain.stages.at(0);
  EXPECT_EQ(s.saved_bytes, wide + act);    // the ReLU's output and the stage's
  EXPECT_EQ(s.fwd_tmp_bytes, wide - act);  // at the ReLU: the product and its output, above those
  ASSERT_TRUE(s.fwd_nosave_tmp_bytes.has_value());
  EXPECT_EQ(*s.fwd_nosave_tmp_bytes, 2 * wide - act);  // the same peak, above the output alone
  EXPECT_EQ(s.nosave_tmp_bytes(), s.fwd_tmp_bytes + wide);
}

// ProfileOptions::progress gets every run of one stage in order, with its phase, and the phases' times add
// up to the profile's; what it throws propagates with the model put back.
TEST_F(ProfileTest, ReportsEveryRunOfOneStageByPhase) {
  torch::nn::Sequential seq(torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32));
  const auto x = torch::randn({8, 32});
  std::vector<remat::ProfileProgress> got;
  remat::profile_chain(seq, x,
                       remat::ProfileOptions()
                           .warmup(1)
                           .repeats(1)
                           .policies({remat::policy::matmuls()})
                           .offload_min_bytes(0)
                           .progress([&](const remat::ProfileProgress& p) { got.push_back(p); }));
  // Two rounds of: a forward without saving and a forward and backward per stage, then per stage a
  // checkpointed forward and its recompute and backward, the same under the policy; offloading per stage
  // once, and the bandwidth once.
  const int64_t n = 3, total = 2 * n * (2 + 2 * 2) + n + 1;
  ASSERT_EQ(static_cast<int64_t>(got.size()), total);
  std::vector<std::string> phases;
  double sum = 0;
  for (int64_t k = 0; k < total; ++k) {
    EXPECT_EQ(got[k].done, k + 1);
    EXPECT_EQ(got[k].total, total);
    EXPECT_EQ(got[k].stages, n);
    if (phases.empty() || phases.back() != got[k].phase) phases.push_back(got[k].phase);
    sum += got[k].phase_ms;
  }
  // The offloading figures are measured in the measured round, each stage's after its forward and backward.
  EXPECT_EQ(phases, (std::vector<std::string>{"forward without saving", "forward and backward",
                                              "checkpointed", "policy matmuls", "forward without saving",
                                              "forward and backward", "offloading", "forward and backward",
                                              "offloading", "forward and backward", "offloading",
                                              "checkpointed", "policy matmuls", "bandwidth"}));
  EXPECT_NEAR(sum, got.back().elapsed_ms, 1e-6 * got.back().elapsed_ms);
  EXPECT_EQ(got.front().stage, "0:Linear");
  // A callback that throws stops profiling; the gradients are as they were (none).
  EXPECT_THROW_WITH(
      remat::profile_chain(seq, x, remat::ProfileOptions().progress([](const remat::ProfileProgress& p) {
        TORCH_CHECK(p.done != 4, "stop at 4");
      })),
      "stop at 4");
  for (const auto& p : seq->parameters())
    EXPECT_FALSE(p.grad().defined());
}

// Each kind of forward is timed as it runs: Fn/Fc without grad, Fa with it, a per-call checkpoint's forward
// with grad and nothing saved, and its backward with the recompute. A stage that sleeps only when grad is on
// tells them apart.
TEST_F(ProfileTest, TimesEachKindOfForwardAsItRuns) {
  torch::nn::Linear lin(8, 8);
  const remat::StageFn slow_with_grad{"slow-with-grad",
                                      [lin](const torch::Tensor& x) mutable {
                                        if (torch::GradMode::is_enabled())
                                          std::this_thread::sleep_for(std::chrono::milliseconds(40));
                                        return lin(x);
                                      },
                                      lin.ptr()};
  const remat::Chain chain = remat::profile_chain({slow_with_grad}, torch::randn({4, 8}),
                                                  remat::ProfileOptions().warmup(0).repeats(3));
  const remat::Stage& s = chain.stages[0];
  ASSERT_TRUE(s.fwd_nosave_ms && s.checkpoint_fwd_ms && s.checkpoint_bwd_ms);
  EXPECT_GE(s.fwd_ms, 40);
  EXPECT_LT(*s.fwd_nosave_ms, 20);
  EXPECT_GE(*s.checkpoint_fwd_ms, 40);
  EXPECT_LT(s.bwd_ms, 20);
  EXPECT_GE(*s.checkpoint_bwd_ms, 40);  // the recompute runs with grad
  // The per-call prediction uses them: one checkpointed stage costs its two runs with grad.
  EXPECT_DOUBLE_EQ(remat::per_call_time_ms(chain, {0}), *s.checkpoint_fwd_ms + *s.checkpoint_bwd_ms);
}

// A stage's region under a policy keeps the generators' states it starts and ends in (it draws: dropout). Run
// after the stage before's region, its start would share the state that one ended in; the profiler measures
// each with states of its own, as where the stage before runs another way (a plan "Fa0 Fk1[matmuls]"): three
// stages alike measure alike (before, the later two one CPU state, 5,056 bytes, less: such plans held that
// much above their predictions).
TEST_F(ProfileTest, EachStageUnderAPolicyIsMeasuredWithGeneratorStatesOfItsOwn) {
  torch::manual_seed(0);
  std::vector<remat::StageFn> stages;
  std::vector<torch::nn::Sequential> mods;
  for (int i = 0; i < 3; ++i) {
    mods.emplace_back(torch::nn::Linear(16, 64), torch::nn::Dropout(0.1), torch::nn::Linear(64, 16));
    torch::nn::Sequential m = mods.back();
    stages.push_back({"block", [m](const torch::Tensor& t) mutable { return m->forward(t); }, m.ptr()});
  }
  const remat::Chain chain =
      remat::profile_chain(stages, torch::randn({32, 16}),
                           remat::ProfileOptions().warmup(0).repeats(1).policies({remat::policy::matmuls()}));
  ASSERT_EQ(chain.stages.size(), 3u);
  const int64_t first = chain.stages[0].policies.at(0).saved_bytes;
  EXPECT_GT(first, static_cast<int64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes()));
  for (size_t i = 1; i < 3; ++i)
    EXPECT_EQ(chain.stages[i].policies.at(0).saved_bytes, first) << "stage " << i;
}

// A backward that makes its parameters' gradients (none before it, as after zero_grad) peaks before the last
// of them is made: bwd_grads_tmp_bytes is that backward's peak, measured in the same run as bwd_tmp_bytes
// (gradients pre-allocated) from where each gradient is handed over. Checked against the backward run so.
TEST_F(ProfileTest, MeasuresTheBackwardsPeakHadItMadeItsGradients) {
  torch::manual_seed(5);
  torch::nn::Sequential seq(torch::nn::Linear(64, 256), torch::nn::ReLU(), torch::nn::Linear(256, 64));
  const torch::Tensor x = torch::randn({512, 64});
  const remat::Chain chain = remat::profile_chain(
      {{"mlp", [seq](const torch::Tensor& t) mutable { return seq->forward(t); }, seq.ptr()}}, x,
      remat::ProfileOptions().warmup(0).repeats(1).policies({remat::policy::matmuls()}));
  const remat::Stage& s = chain.stages[0];
  ASSERT_TRUE(s.bwd_grads_tmp_bytes.has_value());
  int64_t grads = 0;
  for (const auto& p : seq->parameters())
    grads += static_cast<int64_t>(p.nbytes());
  EXPECT_GE(*s.bwd_grads_tmp_bytes, s.bwd_tmp_bytes);
  EXPECT_LT(*s.bwd_grads_tmp_bytes, s.bwd_tmp_bytes + grads);  // the last Linear's gradient comes last
  // The backward run with the gradients made by it, as the profiler runs it (output and d handed over).
  for (const auto& p : seq->parameters())
    EXPECT_FALSE(p.grad().defined());
  torch::Tensor out = seq->forward(x);
  torch::Tensor d = torch::ones_like(out);
  remat::memory::PeakWindow window;
  std::vector<torch::Tensor> targets;
  for (const auto& p : seq->parameters())
    targets.push_back(p);
  remat::detail::backward_from(std::move(out), std::move(d), targets, /*keep_graph=*/false,
                               /*create_graph=*/false, /*accumulate=*/true);
  // The sample needs no gradient: the stage makes no input gradient, and its peaks are taken less the input's
  // bytes all the same (the step's model charges them at its backward).
  const int64_t no_input_grad = static_cast<int64_t>(x.nbytes());
  EXPECT_EQ(*s.bwd_grads_tmp_bytes, window.peak_over_base() - no_input_grad);
  // Under the matmuls policy the backward recomputes the ReLU first: its own peaks, measured the same way,
  // against the same backward run so, from what the policy keeps.
  const remat::PolicyCost& c = s.policies.at(0);
  ASSERT_TRUE(c.bwd_tmp_bytes && c.bwd_grads_tmp_bytes);
  for (const bool made : {false, true}) {
    for (const auto& p : seq->parameters())
      p.mutable_grad() = made ? torch::Tensor() : torch::zeros_like(p);
    torch::Tensor kept = remat::checkpoint([seq](const torch::Tensor& t) mutable { return seq->forward(t); },
                                           x, remat::CheckpointOptions().policy(remat::policy::matmuls()));
    torch::Tensor dk = torch::ones_like(kept);
    remat::memory::PeakWindow w;
    remat::detail::backward_from(std::move(kept), std::move(dk), targets, false, false, true);
    EXPECT_EQ(made ? *c.bwd_grads_tmp_bytes : *c.bwd_tmp_bytes, w.peak_over_base() - no_input_grad) << made;
  }
  // Streamed (Fa@stream), the same pair: its backward's peak with what it saves brought back at its use
  // (stream_bwd_bytes), and had it made its gradients, again before the last of them.
  for (const auto& p : seq->parameters())
    p.mutable_grad() = torch::Tensor();
  const remat::Chain streamed = remat::profile_chain(
      {{"mlp", [seq](const torch::Tensor& t) mutable { return seq->forward(t); }, seq.ptr()}}, x,
      remat::ProfileOptions().warmup(0).repeats(1).offload_min_bytes(1024));
  const remat::OffloadCost& o = *streamed.stages[0].offload;
  ASSERT_TRUE(o.can_stream());
  EXPECT_GE(o.stream_bwd_grads_bytes, o.stream_bwd_bytes);
  EXPECT_LT(o.stream_bwd_grads_bytes, o.stream_bwd_bytes + grads);
  EXPECT_EQ(remat::chain_from_json(remat::to_json(streamed)).stages[0].offload->stream_bwd_grads_bytes,
            o.stream_bwd_grads_bytes);
}

// A backward whose peak comes right after a large gradient is handed over (weights large beside the rows:
// a Linear's weight gradient of 256 KiB, 16 KiB of activations): bwd_grads_tmp_bytes counts each gradient as
// made once it is accumulated (compat::AfterAccumulated), not from its hand-over, while it is still alive in
// the count. Before (found 2026-12-07), 240 KiB high: each weight's gradient held twice.
TEST_F(ProfileTest, ABackwardsPeakHadItMadeItsGradientsHoldsEachGradientOnce) {
  torch::manual_seed(6);
  torch::nn::Sequential seq(torch::nn::Linear(256, 256), torch::nn::Tanh(), torch::nn::Linear(256, 256));
  const torch::Tensor x = torch::randn({16, 256});
  const remat::Chain chain = remat::profile_chain(
      {{"mlp", [seq](const torch::Tensor& t) mutable { return seq->forward(t); }, seq.ptr()}}, x,
      remat::ProfileOptions().warmup(0).repeats(1));
  const remat::Stage& s = chain.stages[0];
  ASSERT_TRUE(s.bwd_grads_tmp_bytes.has_value());
  std::vector<torch::Tensor> targets;
  for (const auto& p : seq->parameters())
    targets.push_back(p);
  torch::Tensor out = seq->forward(x);
  torch::Tensor d = torch::ones_like(out);
  remat::memory::PeakWindow window;
  remat::detail::backward_from(std::move(out), std::move(d), targets, /*keep_graph=*/false,
                               /*create_graph=*/false, /*accumulate=*/true);
  const int64_t measured = window.peak_over_base() - static_cast<int64_t>(x.nbytes());
  if (remat::detail::compat::AfterAccumulated::kExact) {
    EXPECT_EQ(*s.bwd_grads_tmp_bytes, measured);
  } else {  // LibTorch 1.13: from the hand-over, high by up to the largest gradient
    EXPECT_GE(*s.bwd_grads_tmp_bytes, measured);
    EXPECT_LE(*s.bwd_grads_tmp_bytes, measured + static_cast<int64_t>(seq[0]->parameters()[0].nbytes()));
  }
}

TEST_F(ProfileTest, LeavesTheModelAsItWas) {
  torch::manual_seed(4);
  torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::Dropout(0.5));
  std::vector<torch::Tensor> buffers;
  for (const auto& buf : seq->buffers())
    buffers.push_back(buf.clone());
  const auto input = torch::randn({4, 8});
  const auto rng = at::detail::getDefaultCPUGenerator().get_state();
  remat::profile_chain(seq, input);
  for (const auto& p : seq->parameters())
    EXPECT_FALSE(p.grad().defined());
  auto after = seq->buffers();
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_TRUE(torch::equal(after[i], buffers[i])) << i;
  EXPECT_TRUE(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), rng));
}

TEST_F(ProfileTest, BadInputIsAClearError) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 4));
  EXPECT_THROW_WITH(remat::profile_chain(seq, torch::Tensor()), "remat::profile_chain", "undefined");
  EXPECT_THROW_WITH(remat::profile_chain(seq, torch::randn({2, 4}), remat::ProfileOptions().repeats(0)),
                    "repeats", "got 0");
  EXPECT_THROW_WITH(remat::profile_chain(std::vector<remat::StageFn>{}, torch::randn({2, 4})), "no stages");
}

// Runs one step of `forward` (loss = sum(out * weight), so that d_n is materialised as in the model) and
// returns the peak over parameters, gradients and inputs, plus the input (which the model counts).
template <typename Forward>
int64_t measured_peak(torch::nn::Module& model, Forward forward, const torch::Tensor& input,
                      const torch::Tensor& weight) {
  for (auto& p : model.parameters())
    p.mutable_grad() = torch::zeros_like(p);
  remat::memory::PeakScope scope;
  (forward() * weight).sum().backward();
  return scope.peak_over_base() + static_cast<int64_t>(input.nbytes());
}

TEST_F(ProfileTest, ResidualMlpPlansRunWithinTenPercentOfThePrediction) {
  torch::manual_seed(0);
  remat::models::ResidualMlp mlp(remat::models::ResidualMlpOptions().depth(12).width(256));
  auto& seq = mlp->blocks();
  const auto x = torch::randn({64, 256});
  const auto weight = torch::randn({64, 256});
  const remat::Chain chain = remat::profile_chain(seq, x);

  seq->forward(x).mul(weight).sum().backward();
  const auto plain_grads = grads_of(*seq);
  const int64_t none = remat::no_checkpoint(chain).predicted.peak_bytes;
  const int64_t least = remat::min_feasible_budget(chain);
  std::vector<remat::Plan> plans{remat::no_checkpoint(chain), remat::checkpoint_all(chain),
                                 remat::sqrt_n(chain), remat::uniform(chain, 4)};
  for (double f : {0.0, 0.25, 0.5, 0.75})
    plans.push_back(remat::optimal(chain, least + int64_t(f * (none - least))));
  for (const auto& plan : plans) {
    remat::CheckpointedSequential exec(seq, plan, remat::CheckpointOptions().preserve_rng_state(false));
    const int64_t peak = measured_peak(
        *exec, [&] { return exec->forward(x); }, x, weight);
    const double predicted = static_cast<double>(plan.predicted.peak_bytes);
    // docs/planning.md's tolerance for small chains: the measured peak is at most 10% above the prediction
    // (the executor holds up to about three activations that simulate() does not charge) and never below it.
    EXPECT_GE(static_cast<double>(peak), 0.99 * predicted) << plan.planner << " " << plan.to_string();
    EXPECT_LE(static_cast<double>(peak), 1.10 * predicted) << plan.planner << " " << plan.to_string();
    EXPECT_EQ(exec->forward_calls(), plan.predicted.forward_calls) << plan.planner;
    clear_grads(*seq);
    exec->forward(x).mul(weight).sum().backward();
    expect_all_close(grads_of(*seq), plain_grads, 1e-5);
  }
}

TEST_F(ProfileTest, BertPlansRunWithinTenPercentOfThePrediction) {
  torch::manual_seed(0);
  auto config = remat::models::BertConfig()
                    .vocab_size(200)
                    .hidden_size(128)
                    .num_hidden_layers(6)
                    .num_attention_heads(4)
                    .intermediate_size(512)
                    .max_position_embeddings(128)
                    .hidden_dropout_prob(0.1)
                    .attention_probs_dropout_prob(0.1);
  remat::models::BertModel bert(config);
  const auto ids = torch::randint(0, 200, {8, 64});
  const auto weight = torch::randn({8, 64, 128});
  const remat::Chain chain = remat::profile_chain(bert->stages(ids), ids);
  ASSERT_EQ(chain.size(), 7);
  EXPECT_EQ(chain.stages[0].name, "embeddings");
  EXPECT_EQ(chain.stages[6].name, "layer5");

  torch::manual_seed(9);
  bert->forward(ids).mul(weight).sum().backward();
  const auto plain_grads = grads_of(*bert);
  const int64_t none = remat::no_checkpoint(chain).predicted.peak_bytes;
  const int64_t least = remat::min_feasible_budget(chain);
  for (double f : {0.1, 0.4, 0.8}) {
    const remat::Plan plan = remat::optimal(chain, least + int64_t(f * (none - least)));
    bert->use_plan(plan);
    torch::manual_seed(9);
    const int64_t peak = measured_peak(
        *bert, [&] { return bert->forward(ids); }, ids, weight);
    const double predicted = static_cast<double>(plan.predicted.peak_bytes);
    EXPECT_GE(static_cast<double>(peak), 0.99 * predicted) << plan.to_string();
    EXPECT_LE(static_cast<double>(peak), 1.10 * predicted) << plan.to_string();
    clear_grads(*bert);
    torch::manual_seed(9);
    bert->forward(ids).mul(weight).sum().backward();
    expect_all_close(grads_of(*bert), plain_grads, 1e-5);
  }
}

}  // namespace

namespace {
// ProfileOptions::keep measures Fk exactly, and a plan of Fk stages trains as the plain step does, with the
// predicted peak.
TEST_F(ProfileTest, KeepMeasuresWhatFkKeepsAndFkPlansTrainAsThePlainStep) {
  const int64_t b = 16, w = 32;
  auto work = remat::make_workload(remat::WorkloadConfig().model("mlp").depth(4).width(w).batch(b));
  const auto options = remat::ProfileOptions().warmup(1).repeats(2).keep({remat::kMatmul});
  const remat::Chain chain = remat::profile_workload(*work, &options);
  EXPECT_EQ(chain.keep, std::vector<std::string>{remat::kMatmul});
  for (const auto& s : chain.stages) {
    ASSERT_TRUE(s.has_keep()) << s.name;
    // A block x + fc2(gelu(fc1(x))), hidden 4w (the workload's MLP has no dropout): Fa keeps fc1's output
    // (GELU saves it), GELU's output (fc2 saves it) and the output; Fk keeps fc1's and fc2's outputs and the
    // output, and recomputes GELU.
    EXPECT_EQ(s.saved_bytes, b * (4 * w + 4 * w + w) * 4) << s.name;
    EXPECT_EQ(*s.keep_saved_bytes, b * (4 * w + w + w) * 4) << s.name;
    EXPECT_GT(*s.keep_bwd_ms, 0);
  }
  remat::Plan plan;
  plan.num_stages = chain.size();
  for (int64_t i = 0; i < chain.size(); ++i)
    plan.ops.push_back({remat::OpKind::kForwardKeep, i});
  plan.ops.push_back({remat::OpKind::kLoss, -1});
  for (int64_t i = chain.size(); i-- > 0;)
    plan.ops.push_back({remat::OpKind::kBackward, i});
  plan.keep = chain.keep;
  const auto predicted = remat::simulate(chain, plan);

  auto step = [&](const std::optional<remat::Plan>& p) {
    torch::manual_seed(5);
    for (auto& param : work->module().parameters())
      param.mutable_grad() = torch::Tensor();
    auto out = p ? remat::run_plan(work->stages(), *p, work->input()) : work->forward();
    work->loss_of(out).backward();
    return grads_of(work->module());
  };
  const auto plain = step(std::nullopt);
  expect_all_close(step(plan), plain, 1e-6);
  const auto stats = remat::measure_step(
      work->module(), [&] { return work->loss_of(remat::run_plan(work->stages(), plan, work->input())); },
      remat::MeasureOptions().warmup(1).steps(1));
  // The meter's peak includes the chain's input, as simulate's does; the loss adds its output's gradient.
  EXPECT_NEAR(static_cast<double>(stats.peak_bytes), static_cast<double>(predicted.peak_bytes),
              0.1 * static_cast<double>(predicted.peak_bytes));
}

// profile_step with keep tags: the chain inside the step carries the tags its keep_ fields were measured
// with (it had none, and validate() refused every such chain).
TEST_F(ProfileTest, ProfileStepWithKeepTagsGivesChainsThatValidate) {
  auto work = remat::make_workload(remat::WorkloadConfig().model("mlp").depth(3).width(16).batch(4));
  auto stages = work->stages();
  const remat::StageFn prefix{"embed", [](const torch::Tensor& x) { return x * 2; }, nullptr};
  const remat::StageFn suffix{"loss", [](const torch::Tensor& h) { return h.pow(2).mean(); }, nullptr};
  const auto profile =
      remat::profile_step(prefix, stages, suffix, work->input(),
                          remat::ProfileOptions().warmup(0).repeats(1).keep({remat::kMatmul}));
  EXPECT_EQ(profile.chain.keep, std::vector<std::string>{remat::kMatmul});
  EXPECT_EQ(profile.step.keep, profile.chain.keep);
  ASSERT_EQ(profile.chain.size(), 3);
  for (const auto& s : profile.chain.stages)
    EXPECT_TRUE(s.has_keep()) << s.name;
  EXPECT_NO_THROW(remat::validate(profile.chain));
  // And a plan that keeps the matrix multiplications comes from it.
  const auto plan = remat::make_plan(profile.chain, "all-keep-matmul", 0);
  EXPECT_EQ(plan.count(remat::OpKind::kForwardKeep), 3);
}

// Policies profile untagged models for Fk[name]: the ResidualMlp profiled under policy::matmuls keeps what
// its remat::keep tags keep (its two linears' outputs), plans run every stage as Fk[matmuls] with the plain
// step's gradients, a custom policy resolves through CheckpointOptions::policy, and an unknown one is
// refused.
TEST_F(ProfileTest, PoliciesProfileFkAndPlansRunUnderThem) {
  const int64_t b = 16, w = 32;
  auto work = remat::make_workload(remat::WorkloadConfig().model("mlp").depth(3).width(w).batch(b));
  const auto options = remat::ProfileOptions().warmup(0).repeats(1).policies(
      {remat::policy::matmuls(), remat::Policy([](const std::string&) { return false; }).named("nothing")});
  const remat::Chain chain = remat::profile_workload(*work, &options);
  EXPECT_EQ(chain.policies, (std::vector<std::string>{"matmuls", "nothing"}));
  for (const auto& s : chain.stages) {
    ASSERT_EQ(s.policies.size(), 2u) << s.name;
    EXPECT_EQ(s.policies[0].saved_bytes, b * (4 * w + w + w) * 4) << s.name;  // fc1's, fc2's and the output
    EXPECT_EQ(s.policies[1].saved_bytes, s.output_bytes) << s.name;  // checkpointing: the output only
  }
  const auto twice = remat::ProfileOptions().policies({remat::policy::matmuls(), remat::policy::matmuls()});
  EXPECT_THROW_WITH(remat::profile_workload(*work, &twice), "two policies are named 'matmuls'");

  const remat::Plan plan = remat::make_plan(chain, "all-policy-matmuls", 0);
  const remat::Plan custom = remat::make_plan(chain, "all-policy-nothing", 0);
  auto step = [&](const std::optional<remat::Plan>& p, const remat::CheckpointOptions& o = {}) {
    torch::manual_seed(5);
    for (auto& param : work->module().parameters())
      param.mutable_grad() = torch::Tensor();
    auto out = p ? remat::run_plan(work->stages(), *p, work->input(), o) : work->forward();
    work->loss_of(out).backward();
    return grads_of(work->module());
  };
  const auto plain = step(std::nullopt);
  expect_all_close(step(plan), plain, 0.0);
  const auto nothing = remat::Policy([](const std::string&) { return false; }).named("nothing");
  expect_all_close(step(custom, remat::CheckpointOptions().policy(nothing)), plain, 0.0);
  EXPECT_THROW_WITH(step(custom), "remat::run_plan", "policy 'nothing', which is not one of remat's presets");
  const auto stats = remat::measure_step(
      work->module(), [&] { return work->loss_of(remat::run_plan(work->stages(), plan, work->input())); },
      remat::MeasureOptions().warmup(1).steps(1));
  EXPECT_NEAR(static_cast<double>(stats.peak_bytes), static_cast<double>(plan.predicted.peak_bytes),
              0.1 * static_cast<double>(plan.predicted.peak_bytes));
}

// A policy may keep more than keeping everything does: on a Linear then a ReLU, Fa keeps the output alone
// (ReLU saves what it returns), the matmuls policy the product too. The profile charges what it keeps (it
// charged at most Fa's, and a step of Fk[matmuls] on every stage held about half as much again as predicted),
// and the difference the plans' peaks predict is the one measured.
TEST_F(ProfileTest, APolicyThatKeepsMoreThanKeepingEverythingIsChargedWhatItKeeps) {
  torch::manual_seed(2);
  const int64_t b = 64, w = 64, out = b * w * 4;
  torch::nn::ModuleList layers;
  std::vector<remat::StageFn> stages;
  for (int k = 0; k < 4; ++k) {
    torch::nn::Linear lin(w, w);
    layers->push_back(lin);
    stages.push_back({"layer" + std::to_string(k),
                      [lin](const torch::Tensor& t) mutable { return torch::relu(lin(t)); }, lin.ptr()});
  }
  const torch::Tensor x = torch::randn({b, w});
  const remat::Chain chain = remat::profile_chain(
      stages, x, remat::ProfileOptions().warmup(0).repeats(1).policies({remat::policy::matmuls()}));
  for (const auto& s : chain.stages) {
    EXPECT_EQ(s.saved_bytes, out) << s.name;
    // The product and the output, and no more than the region's generator state beside them.
    EXPECT_GE(s.policies.at(0).saved_bytes, 2 * out) << s.name;
    EXPECT_LT(s.policies.at(0).saved_bytes, 2 * out + 8192) << s.name;
  }
  auto peak = [&](const remat::Plan& plan) {
    return remat::measure_step(
               *layers, [&] { return remat::run_plan(stages, plan, x).pow(2).mean(); },
               remat::MeasureOptions().warmup(1).steps(1))
        .peak_bytes;
  };
  const remat::Plan all = remat::make_plan(chain, "none", 0);
  const remat::Plan kept = remat::make_plan(chain, "all-policy-matmuls", 0);
  const int64_t predicted = kept.predicted.peak_bytes - all.predicted.peak_bytes;
  EXPECT_GE(predicted, 3 * out);  // each stage's product, the last one's recomputed output aside
  EXPECT_NEAR(static_cast<double>(peak(kept) - peak(all)), static_cast<double>(predicted), 8192.0)
      << predicted;
}
}  // namespace
