#include <remat/planner/planner.h>
#include <remat/sequential.h>

#include "autocast.h"
#include "support.h"

#include <string>

namespace {

using remat::testing::clear_grads;
using remat::testing::expect_all_close;
using remat::testing::grads_of;
using remat::testing::max_abs_diff;

// A module that counts its forward calls.
struct CountingImpl : torch::nn::Module {
  explicit CountingImpl(int64_t w, std::shared_ptr<int64_t> counter)
      : fc(register_module("fc", torch::nn::Linear(w, w))), calls(std::move(counter)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++*calls;
    return torch::tanh(fc(x)) + x;
  }
  torch::nn::Linear fc;
  std::shared_ptr<int64_t> calls;
};
TORCH_MODULE(Counting);

torch::nn::Sequential mixed_chain(int64_t w = 16) {
  return torch::nn::Sequential(torch::nn::Linear(w, w), torch::nn::GELU(), torch::nn::Dropout(0.3),
                               torch::nn::Linear(w, w), torch::nn::BatchNorm1d(w), torch::nn::Tanh(),
                               torch::nn::Linear(w, w), torch::nn::ReLU());
}

struct Reference {
  std::vector<torch::Tensor> grads, buffers;
  torch::Tensor x_grad, output;
};

Reference plain_step(torch::nn::Sequential& seq, const torch::Tensor& x, uint64_t seed) {
  clear_grads(*seq);
  x.mutable_grad() = torch::Tensor();
  torch::manual_seed(seed);
  Reference r;
  r.output = seq->forward(x);
  r.output.pow(2).sum().backward();
  r.grads = grads_of(*seq);
  for (const auto& b : seq->buffers())
    r.buffers.push_back(b.clone());
  r.x_grad = x.grad().clone();
  return r;
}

// The plain step from zeroed BatchNorm statistics, then the model put back to that start (statistics zeroed,
// no gradients) for the checkpointed run to be compared with it.
Reference reference_from_zeroed_buffers(torch::nn::Sequential& seq, const torch::Tensor& x, uint64_t seed) {
  for (auto& b : seq->buffers())
    b.zero_();
  Reference ref = plain_step(seq, x, seed);
  for (auto& b : seq->buffers())
    b.zero_();
  clear_grads(*seq);
  x.mutable_grad() = torch::Tensor();
  return ref;
}

// The checkpointed step just run matches `ref`: parameter and input gradients, and every buffer exactly.
void expect_step_matches(torch::nn::Sequential& seq, const torch::Tensor& x, const Reference& ref,
                         const std::string& what) {
  expect_all_close(grads_of(*seq), ref.grads, 1e-6);
  EXPECT_LE(max_abs_diff(x.grad(), ref.x_grad), 1e-6) << what;
  const auto buffers = seq->buffers();
  ASSERT_EQ(buffers.size(), ref.buffers.size()) << what;
  for (size_t i = 0; i < buffers.size(); ++i)
    EXPECT_TRUE(torch::equal(buffers[i], ref.buffers[i])) << what << ", buffer " << i;
}

remat::Chain unit_chain(int64_t n) {
  return remat::uniform_chain(n, 1.0, 2.0, 1000, 3000);
}

// ---------------------------------------------------------------------------------------------------------
// checkpoint_sequential

TEST(CheckpointSequential, EveryNumberOfSegmentsGivesEqualGradients) {
  torch::manual_seed(0);
  auto seq = mixed_chain();
  const auto x = torch::randn({12, 16}, torch::requires_grad());
  for (bool last : {false, true}) {
    for (int64_t k = 1; k <= static_cast<int64_t>(seq->size()); ++k) {
      const Reference ref = reference_from_zeroed_buffers(seq, x, 42);
      torch::manual_seed(42);
      auto y =
          remat::checkpoint_sequential(seq, k, x, remat::SequentialOptions().checkpoint_last_segment(last));
      EXPECT_EQ(max_abs_diff(y, ref.output), 0.0) << "segments " << k;
      y.pow(2).sum().backward();
      expect_step_matches(seq, x, ref, "segments " + std::to_string(k));
    }
  }
}

TEST(CheckpointSequential, BadSegmentsNameTheValueAndModuleCountBeforeAnyModuleRuns) {
  auto calls = std::make_shared<int64_t>(0);
  torch::nn::Sequential seq(Counting(4, calls), Counting(4, calls), Counting(4, calls));
  const auto x = torch::randn({2, 4});
  EXPECT_THROW_WITH(remat::checkpoint_sequential(seq, 0, x), "remat::checkpoint_sequential", "got 0",
                    "3 modules");
  EXPECT_THROW_WITH(remat::checkpoint_sequential(seq, 4, x), "got 4", "3 modules");
  EXPECT_THROW_WITH(remat::checkpoint_segments(seq, {0, 2, 2}, x), "remat::checkpoint_segments", "3 modules");
  torch::nn::Sequential empty;
  EXPECT_THROW_WITH(remat::checkpoint_sequential(empty, 1, x), "empty", "0 modules", "segments was 1");
  EXPECT_EQ(*calls, 0);
}

TEST(CheckpointSequential, SegmentsAnywhereGiveEqualGradientsAndLeaveTheRngAsFound) {
  torch::manual_seed(1);
  auto seq = mixed_chain();  // dropout and BatchNorm inside
  const auto x = torch::randn({10, 16}, torch::requires_grad());
  for (const std::vector<int64_t>& starts :
       std::vector<std::vector<int64_t>>{{0}, {0, 1}, {0, 3, 4}, {0, 2, 5, 7}}) {
    const Reference ref = reference_from_zeroed_buffers(seq, x, 8);
    const auto rng_after_plain = torch::rand({4});
    torch::manual_seed(8);
    remat::checkpoint_segments(seq, starts, x).pow(2).sum().backward();
    // The program's next random numbers are those of the plain run: the recomputes left the RNG as found.
    EXPECT_TRUE(torch::rand({4}).equal(rng_after_plain)) << c10::IntArrayRef(starts);
    expect_step_matches(seq, x, ref, "starts " + c10::str(c10::IntArrayRef(starts)));
  }
}

TEST(Executor, LeavesTheRngAsFound) {
  torch::manual_seed(1);
  auto seq = mixed_chain();
  const auto x = torch::randn({10, 16}, torch::requires_grad());
  const remat::Chain chain = unit_chain(static_cast<int64_t>(seq->size()));
  for (const auto& plan : {remat::checkpoint_all(chain), remat::optimal(chain, 9000)}) {
    plain_step(seq, x, 3);
    const auto after_plain = torch::rand({4});
    torch::manual_seed(3);
    remat::CheckpointedSequential exec(seq, plan);
    exec->forward(x).pow(2).sum().backward();
    EXPECT_TRUE(torch::rand({4}).equal(after_plain)) << plan.to_string();
  }
}

// A stage that runs again keeps the generators' state of its first run's start for its replays (on the CPU,
// the CPU generator's, 5,056 bytes) and its end's digest to check them: the state goes at its last run,
// before its backward. Before (found 2026-12-02), every stage's start and end states stayed to the end of the
// backward pass (neighbours sharing one), and a planned step held a state per such stage above its prediction
// where its peak came late in the backward pass (the gradients made), and one more in the forward pass. Here,
// where stage 0 runs again in the backward pass, stage 1's and 2's are gone (before, five states were held
// there); with retain_graph, a second backward pass replays them all again.
TEST(Executor, GeneratorStatesGoAtTheStagesLastRun) {
  remat::memory::track_cpu();
  const int64_t state = static_cast<int64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes());
  auto held_at_replay = [](bool preserve, bool twice) {
    int64_t calls = 0, held = -1;
    std::vector<remat::StageFn> stages;
    for (int i = 0; i < 4; ++i)
      stages.push_back({"drop", [i, &calls, &held](const torch::Tensor& x) {
                          if (i == 0 && ++calls == 2) held = remat::memory::active_bytes();
                          return torch::dropout(x, 0.5, true);
                        }});
    const auto x = torch::randn({64}, torch::requires_grad());
    torch::manual_seed(7);
    const int64_t before = remat::memory::active_bytes();
    auto loss = remat::run_plan(stages, remat::checkpoint_stages(4, {0, 1, 2}), x,
                                remat::CheckpointOptions().preserve_rng_state(preserve))
                    .sum();
    loss.backward({}, /*retain_graph=*/twice);
    const torch::Tensor once = x.grad().clone();
    if (twice) {
      loss.backward();
      if (preserve) EXPECT_TRUE(torch::equal(x.grad(), 2 * once));  // the same masks replayed
    }
    return held - before;
  };
  // At stage 0's replay: its own start state, and the one its replay saves to put back after (its end state,
  // only compared with, is a digest).
  EXPECT_EQ(held_at_replay(true, false) - held_at_replay(false, false), 2 * state);
  // With retain_graph the graph keeps every stage's start for the next pass, and the replay runs on a copy.
  EXPECT_EQ(held_at_replay(true, true) - held_at_replay(false, true), 4 * state);
}

TEST(CheckpointSequential, RecomputesEachCheckpointedSegmentOnce) {
  auto calls = std::make_shared<int64_t>(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 6; ++i)
    seq->push_back(Counting(8, calls));
  const auto x = torch::randn({4, 8}, torch::requires_grad());
  auto y = remat::checkpoint_sequential(seq, 3, x);
  EXPECT_EQ(*calls, 6);
  y.sum().backward();
  EXPECT_EQ(*calls, 10);  // the two checkpointed segments (4 modules) again; the last segment is kept
}

TEST(CheckpointSequential, KeepsOnlySegmentBoundariesAlive) {
  remat::testing::meter_on();
  const int64_t b = 32, w = 64;
  torch::nn::Sequential seq;
  for (int i = 0; i < 8; ++i)
    seq->push_back(torch::nn::Linear(w, w)), seq->push_back(torch::nn::Tanh());
  const auto x = torch::randn({b, w});
  int64_t plain = 0, ckpt = 0;
  {
    const int64_t before = remat::memory::active_bytes();
    auto y = seq->forward(x);
    plain = remat::memory::active_bytes() - before;
  }
  {
    const int64_t before = remat::memory::active_bytes();
    auto y = remat::checkpoint_sequential(seq, 4, x,
                                          remat::SequentialOptions().checkpoint_last_segment(true).checkpoint(
                                              remat::CheckpointOptions().preserve_rng_state(false)));
    ckpt = remat::memory::active_bytes() - before;
  }
  const int64_t act = b * w * 4;
  // Plain: every Tanh output (saved by its own backward and by the next Linear's); Tanh saves its result, so
  // the Linear outputs are freed.
  EXPECT_EQ(plain, 8 * act);
  // Checkpointed: the three inner segment boundaries and the output.
  EXPECT_EQ(ckpt, 4 * act);
}

// ---------------------------------------------------------------------------------------------------------
// The plan executor

// Forward calls per stage of one checkpointed step, counted by wrappers around the stages (not by the
// executor).
std::vector<int64_t> counted_calls(torch::nn::Sequential& seq, const torch::Tensor& x,
                                   const remat::Plan& plan) {
  auto counts = std::make_shared<std::vector<int64_t>>(seq->size(), 0);
  std::vector<remat::StageFn> stages = remat::stages_of(seq);
  for (size_t i = 0; i < stages.size(); ++i) {
    remat::TensorFn inner = stages[i].fn;
    stages[i].fn = [inner, counts, i](const torch::Tensor& t) {
      ++(*counts)[i];
      return inner(t);
    };
  }
  clear_grads(*seq);
  remat::run_plan(stages, plan, x).pow(2).sum().backward();
  clear_grads(*seq);
  return *counts;
}

TEST(Executor, EveryPlannerGivesEqualGradientsAndPredictedForwardCalls) {
  torch::manual_seed(1);
  auto seq = mixed_chain();
  const auto x = torch::randn({10, 16}, torch::requires_grad());
  const remat::Chain chain = unit_chain(static_cast<int64_t>(seq->size()));
  std::vector<remat::Plan> plans{remat::no_checkpoint(chain), remat::checkpoint_all(chain),
                                 remat::sqrt_n(chain),        remat::uniform(chain, 3),
                                 remat::revolve(chain, 1),    remat::revolve(chain, 2)};
  for (int64_t budget : {9000, 12000, 16000, 24000})
    plans.push_back(remat::optimal(chain, budget));
  for (const auto& plan : plans) {
    const Reference ref = reference_from_zeroed_buffers(seq, x, 5);
    remat::CheckpointedSequential exec(seq, plan);
    torch::manual_seed(5);
    exec->forward(x).pow(2).sum().backward();
    expect_step_matches(seq, x, ref, plan.to_string());
    EXPECT_EQ(exec->forward_calls(), plan.predicted.forward_calls) << plan.to_string();
    // The executor's own counter agrees with one kept outside it.
    EXPECT_EQ(counted_calls(seq, x, plan), plan.predicted.forward_calls) << plan.to_string();
  }
}

TEST(Executor, MultiLevelPlanRecomputesStagesSeveralTimes) {
  auto calls = std::make_shared<int64_t>(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 10; ++i)
    seq->push_back(Counting(8, calls));
  const remat::Chain chain = unit_chain(10);
  const auto plan = remat::optimal(chain, remat::min_feasible_budget(chain));
  const auto& fc = plan.predicted.forward_calls;
  ASSERT_GT(*std::max_element(fc.begin(), fc.end()), 2) << plan.to_string();
  remat::CheckpointedSequential exec(seq, plan);
  const auto x = torch::randn({3, 8}, torch::requires_grad());
  exec->forward(x).sum().backward();
  EXPECT_EQ(exec->forward_calls(), fc);
  int64_t total = 0;
  for (int64_t c : fc)
    total += c;
  EXPECT_EQ(*calls, total);
}

TEST(Executor, AutogradGradAndRetainGraph) {
  torch::manual_seed(2);
  torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                            torch::nn::GELU());
  const auto x = torch::randn({4, 8}, torch::requires_grad());
  std::vector<torch::Tensor> wrt{x};
  for (const auto& p : seq->parameters())
    wrt.push_back(p);
  const auto plain = torch::autograd::grad({seq->forward(x).pow(2).sum()}, wrt);
  remat::CheckpointedSequential exec(seq, remat::checkpoint_all(unit_chain(4)));
  const auto got = torch::autograd::grad({exec->forward(x).pow(2).sum()}, wrt);
  expect_all_close(got, plain, 1e-6);
  for (const auto& p : seq->parameters())
    EXPECT_FALSE(p.grad().defined());

  auto loss = exec->forward(x).pow(2).sum();
  loss.backward({}, /*retain_graph=*/true);
  loss.backward();
  std::vector<torch::Tensor> twice = grads_of(*seq);
  for (size_t i = 1; i < plain.size(); ++i)
    EXPECT_LE(max_abs_diff(twice[i - 1], 2 * plain[i]), 1e-5);
}

TEST(Executor, AutogradGradOverPartOfTheGraphRunsOnlyWhatItAsksFor) {
  // Found by the fuzz: under torch::autograd::grad for the last stage's weight alone, the executor ran every
  // stage's whole backward (and the recomputes before them). A stage whose operations wrote a tensor they
  // saved (a gradient the asked ones do not read, which the plain run never unpacks) raised autograd's error
  // there.
  torch::manual_seed(3);
  torch::nn::Linear a(8, 8), b(8, 8);
  int first_runs = 0;
  std::vector<remat::StageFn> stages{
      {"a", [&](const torch::Tensor& t) { return ++first_runs, a(t); }, a.ptr()},
      {"b",
       [&](const torch::Tensor& t) {
         auto s = torch::sigmoid(t);  // saves s...
         s.mul_(2);                   // ...written: only d/dt reads it
         return b(s);
       },
       b.ptr()}};
  const auto x = torch::randn({4, 8}, torch::requires_grad());
  auto plain_fn = [&](const torch::Tensor& t) { return stages[1].fn(stages[0].fn(t)); };
  const auto plain = torch::autograd::grad({plain_fn(x).pow(2).sum()}, {b->weight});
  EXPECT_THROW_WITH(plain_fn(x).pow(2).sum().backward(), "modified by an inplace operation");
  first_runs = 0;
  const auto got = torch::autograd::grad(
      {remat::run_plan(stages, remat::checkpoint_all(unit_chain(2)), x).pow(2).sum()}, {b->weight});
  EXPECT_TRUE(torch::equal(got[0], plain[0]));
  EXPECT_EQ(first_runs, 1);  // stage a: its forward pass only, no recompute for a gradient nobody asked for
}

// A stage whose forward reads a buffer and then updates it in place (an EMA), run again by the plan: its
// later runs read the value its first run read, and leave the one it left. Before 2026-12-07 they read the
// updated value: every gradient wrong, silently.
TEST(Executor, AStageThatReadsAndUpdatesABufferRunsAgainAsItsFirstRunFoundIt) {
  struct EmaImpl : torch::nn::Module {
    EmaImpl() : fc(register_module("fc", torch::nn::Linear(8, 8))) {
      avg = register_buffer("avg", torch::full({8}, 0.5));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      torch::Tensor y = torch::tanh(fc(x) * (avg + 1));
      torch::NoGradGuard no_grad;
      avg.mul_(0.5).add_(x.mean(0), 0.5);
      return y;
    }
    torch::nn::Linear fc{nullptr};
    torch::Tensor avg;
  };
  auto make = [] {
    torch::manual_seed(5);
    torch::nn::Sequential seq;
    for (int i = 0; i < 3; ++i)
      seq->push_back(std::make_shared<EmaImpl>());
    return seq;
  };
  auto plain = make();
  auto planned = make();
  const auto x = torch::randn({6, 8});
  for (int step = 0; step < 2; ++step) {
    plain->forward(x).pow(2).sum().backward();
    remat::run_plan(remat::stages_of(planned), remat::checkpoint_all(unit_chain(3)), x)
        .pow(2)
        .sum()
        .backward();
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(torch::equal(planned[i]->buffers()[0], plain[i]->buffers()[0])) << step << " " << i;
    }
    expect_all_close(grads_of(*planned), grads_of(*plain), 0.0);
  }
}

// Found by the fuzz (seed 2): a stage kept in the forward pass (the last segment) owns a leaf whose .grad
// survived into a second backward with retain_graph, so the input's gradient came out 3x instead of 2x.
TEST(Executor, SecondBackwardWithRetainGraphAddsExactlyOneMoreGradient) {
  torch::manual_seed(4);
  torch::nn::Sequential seq(torch::nn::Linear(6, 6), torch::nn::Tanh(), torch::nn::Identity());
  const auto x = torch::randn({3, 6}, torch::requires_grad());
  seq->forward(x).pow(2).sum().backward();
  const auto once = x.grad().clone();
  const auto once_params = grads_of(*seq);
  for (int64_t segments : {1, 2, 3}) {
    clear_grads(*seq);
    x.mutable_grad() = torch::Tensor();
    auto loss = remat::checkpoint_sequential(seq, segments, x).pow(2).sum();
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    EXPECT_LE(max_abs_diff(x.grad(), 2 * once), 1e-6) << segments << " segments";
    const auto twice = grads_of(*seq);
    for (size_t i = 0; i < twice.size(); ++i)
      EXPECT_LE(max_abs_diff(twice[i], 2 * once_params[i]), 1e-6) << segments << " segments, parameter " << i;
  }
}

// Found by the fuzz (seed 240): a layer registered twice in one stage (a shared layer) listed its parameters
// twice, and under torch::autograd::grad their gradient was summed twice.
struct TwiceImpl : torch::nn::Module {
  explicit TwiceImpl(torch::nn::Linear shared)
      : a(register_module("a", shared)), b(register_module("b", std::move(shared))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Twice);

TEST(Executor, ALayerRegisteredTwiceInAStageGetsItsGradientOnce) {
  torch::manual_seed(5);
  torch::nn::Linear shared(5, 5);
  torch::nn::Sequential seq{Twice(shared), torch::nn::Tanh()};
  const auto x = torch::randn({2, 5}, torch::requires_grad());
  const std::vector<torch::Tensor> wrt{x, shared->weight, shared->bias};
  const auto plain = torch::autograd::grad({seq->forward(x).sum()}, wrt);
  for (int64_t segments : {1, 2}) {
    const auto got = torch::autograd::grad({remat::checkpoint_sequential(seq, segments, x).sum()}, wrt);
    expect_all_close(got, plain, 1e-6);
  }
}

TEST(Executor, ParametersTrainedWhenTheInputNeedsNoGrad) {
  torch::manual_seed(3);
  torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8));
  const auto x = torch::randn({4, 8});
  seq->forward(x).sum().backward();
  auto plain = grads_of(*seq);
  clear_grads(*seq);
  remat::CheckpointedSequential exec(seq, remat::checkpoint_all(unit_chain(3)));
  exec->forward(x).sum().backward();
  expect_all_close(grads_of(*seq), plain, 1e-6);
}

TEST(Executor, ReplanIsOneCallAndBadPlansAreClearErrors) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Tanh(), torch::nn::Linear(4, 4));
  const remat::Chain chain = unit_chain(3);
  remat::CheckpointedSequential exec(seq, remat::no_checkpoint(chain));
  const int64_t budget = remat::min_feasible_budget(chain);
  exec->replan(chain, budget);
  EXPECT_EQ(exec->plan().planner, "optimal");
  EXPECT_EQ(exec->plan().budget_bytes, budget);
  EXPECT_LE(remat::simulate(chain, exec->plan()).peak_bytes, budget);
  EXPECT_LT(remat::simulate(chain, exec->plan()).peak_bytes,
            remat::no_checkpoint(chain).predicted.peak_bytes);
  EXPECT_EQ(exec->plan().ops, remat::optimal(chain, budget).ops);
  // The new plan is the one that runs.
  const auto x = torch::randn({2, 4}, torch::requires_grad());
  exec->forward(x).sum().backward();
  EXPECT_EQ(exec->forward_calls(), exec->plan().predicted.forward_calls);
  EXPECT_THROW_WITH(exec->set_plan(remat::no_checkpoint(unit_chain(4))), "remat::CheckpointedSequential",
                    "4 stages", "3 modules");
  remat::Plan broken = remat::no_checkpoint(chain);
  broken.ops.pop_back();
  EXPECT_THROW_WITH(exec->set_plan(broken), "invalid plan", "d_0");
  // A group assignment (Fk1{kh}) whose groups the plan does not name (Plan::group_names) cannot be run.
  remat::Plan grouped = remat::no_checkpoint(chain);
  grouped.ops[1] = remat::parse_op("Fk1{kh}");
  EXPECT_THROW_WITH(exec->set_plan(grouped), "under a group assignment (Fk1{kh})",
                    "does not name the stage's saved groups");
  // Nor a streamed stage (Fa1@stream) whose window the plan does not give (Plan::stream_windows).
  remat::Plan streamed = remat::no_checkpoint(chain);
  streamed.ops[1] = remat::parse_op("Fa1@stream");
  EXPECT_THROW_WITH(exec->set_plan(streamed), "streams stage 1 (Fa1@stream)", "gives no window for it");
  EXPECT_THROW_WITH(exec->replan(unit_chain(5), 1 << 20), "5 stages", "3 modules");
  EXPECT_THROW_WITH(remat::run_plan(remat::stages_of(seq), remat::no_checkpoint(chain), torch::Tensor()),
                    "remat::run_plan", "undefined");
}

TEST(Executor, UnderNoGradRunsTheStagesOnce) {
  auto calls = std::make_shared<int64_t>(0);
  torch::nn::Sequential seq(Counting(4, calls), Counting(4, calls));
  remat::CheckpointedSequential exec(seq, remat::checkpoint_all(unit_chain(2)));
  torch::NoGradGuard no_grad;
  auto y = exec->forward(torch::randn({2, 4}));
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(*calls, 2);
}

}  // namespace

namespace {
// Records whether grad mode was on in each forward call.
struct GradModeProbeImpl : torch::nn::Module {
  GradModeProbeImpl() : fc(register_module("fc", torch::nn::Linear(6, 6))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    grad_enabled.push_back(torch::GradMode::is_enabled());
    return torch::tanh(fc(x));
  }
  torch::nn::Linear fc;
  std::vector<bool> grad_enabled;
};
TORCH_MODULE(GradModeProbe);
}  // namespace

TEST(CheckpointSequential, RunsTheSegmentsInTheModeAsked) {
  for (const auto mode : {remat::CheckpointMode::kNonReentrant, remat::CheckpointMode::kReentrant}) {
    torch::manual_seed(0);
    GradModeProbe a, b, c, d;
    torch::nn::Sequential seq(a, b, c, d);
    const auto x = torch::randn({3, 6});  // no grad on the input: the parameters alone must be trained
    seq->forward(x).pow(2).sum().backward();
    const auto plain = grads_of(*seq);
    clear_grads(*seq);
    for (auto* m : {&a, &b, &c, &d})
      (*m)->grad_enabled.clear();
    const auto opts = remat::SequentialOptions().checkpoint(remat::CheckpointOptions().mode(mode));
    remat::checkpoint_sequential(seq, 2, x, opts).pow(2).sum().backward();
    expect_all_close(grads_of(*seq), plain, 0.0);
    // The checkpointed segment (a, b): kReentrant runs it without grad first, kNonReentrant with grad;
    // either way it runs again with grad in the backward pass. The last segment (c, d) runs once, with grad.
    const bool first = mode == remat::CheckpointMode::kNonReentrant;
    EXPECT_EQ(a->grad_enabled, (std::vector<bool>{first, true})) << static_cast<int>(mode);
    EXPECT_EQ(b->grad_enabled, (std::vector<bool>{first, true})) << static_cast<int>(mode);
    EXPECT_EQ(c->grad_enabled, (std::vector<bool>{true})) << static_cast<int>(mode);
  }
}

// Stages given as lambdas with no StageFn::module: the executor must still train the parameters they use
// under backward(), and leave BatchNorm's statistics updated once, as the plain run does.
TEST(Executor, StagesWithoutTheirModuleAreTrainedAndUpdatedOnce) {
  torch::manual_seed(0);
  auto seq = mixed_chain();
  const auto x = torch::randn({6, 16}, torch::requires_grad());
  std::vector<remat::StageFn> stages;
  for (auto& any : *seq) {
    torch::nn::AnyModule m = any;
    stages.push_back({"", [m](const torch::Tensor& t) mutable { return m.forward(t); }, nullptr});
  }
  const remat::Chain chain = unit_chain(static_cast<int64_t>(stages.size()));
  for (const remat::Plan& plan : {remat::checkpoint_all(chain), remat::uniform(chain, 3)}) {
    const Reference ref = reference_from_zeroed_buffers(seq, x, 5);
    torch::manual_seed(5);
    remat::run_plan(stages, plan, x).pow(2).sum().backward();
    ASSERT_EQ(seq->buffers().size(), 3u);
    expect_step_matches(seq, x, ref, plan.to_string());
  }
}

// A stage function that uses a tensor computed outside the plan (requiring grad) without taking it as its
// input: the executor runs each stage's backward as a nested pass, which cannot hand that tensor's gradient
// back; an error naming its shape, not a lost gradient.
TEST(Executor, ACapturedTensorThatRequiresGradIsAnError) {
  auto w = torch::randn({8}, torch::requires_grad());
  auto scale = w * 2;  // outside the stages, requires grad
  std::vector<remat::StageFn> stages;
  for (int i = 0; i < 2; ++i)
    stages.push_back({"s" + std::to_string(i),
                      [&scale](const torch::Tensor& t) { return torch::tanh(t * scale); }, nullptr});
  const auto x = torch::randn({4, 8}, torch::requires_grad());
  auto out = remat::run_plan(stages, remat::checkpoint_all(unit_chain(2)), x);
  EXPECT_THROW_WITH(out.sum().backward(), "remat::run_plan: stage 1", "[8]", "computed outside",
                    "stage's input");
}

TEST(Executor, RefusesOptionsItCannotHonour) {
  auto seq = mixed_chain();
  const auto x = torch::randn({4, 16}, torch::requires_grad());
  const remat::Plan plan = remat::checkpoint_all(unit_chain(static_cast<int64_t>(seq->size())));
  EXPECT_THROW_WITH(remat::run_plan(remat::stages_of(seq), plan, x,
                                    remat::CheckpointOptions().mode(remat::CheckpointMode::kReentrant)),
                    "remat::run_plan", "kReentrant", "checkpoint_sequential");
  EXPECT_THROW_WITH(
      remat::run_plan(remat::stages_of(seq), plan, x, remat::CheckpointOptions().modules({seq.ptr()})),
      "remat::run_plan", "modules has 1", "StageFn::module");
  EXPECT_THROW_WITH(remat::CheckpointedSequential(
                        seq, plan, remat::CheckpointOptions().mode(remat::CheckpointMode::kReentrant)),
                    "remat::CheckpointedSequential", "kReentrant");
}

namespace {
// Records whether autocast's cache was on in each forward call; multiplies by its own weight, not a view of
// it (autocast caches the casts of leaves that require grad and are no views).
struct CacheProbeImpl : torch::nn::Module {
  CacheProbeImpl() : w(register_parameter("w", torch::randn({64, 64}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    cache_on.push_back(at::autocast::is_autocast_cache_enabled());
    return torch::relu(torch::mm(x, w));
  }
  torch::Tensor w;
  std::vector<bool> cache_on;
};
TORCH_MODULE(CacheProbe);
}  // namespace

// Every stage of a training step runs with autocast's cache off, kept or not, its recompute too, so that none
// leaves its weights' casts there until the caller's autocast region ends: where the backward runs inside
// the region, a kept stage's casts would outlive its backward. Before (2026-12-03), the stages ran with the
// caller's cache: both plans left the two weights' bf16 casts (2 x 8,192 bytes) held after the backward.
// Under NoGradGuard the stages run with the caller's cache, as they would without remat.
TEST(Executor, EveryStageOfATrainingStepRunsWithAutocastsCacheOff) {
  remat::memory::track_cpu();
  torch::manual_seed(0);
  torch::nn::Sequential seq{CacheProbe(), CacheProbe()};
  auto probe = [&](size_t i) { return seq->ptr(i)->as<CacheProbeImpl>(); };
  const auto x = torch::randn({8, 64});
  const remat::Chain chain = unit_chain(2);
  for (const remat::Plan& plan : {remat::no_checkpoint(chain), remat::checkpoint_all(chain)}) {
    clear_grads(*seq);
    probe(0)->cache_on.clear(), probe(1)->cache_on.clear();
    const int64_t base = remat::memory::active_bytes();
    {
      remat::testing::CpuAutocast autocast;
      remat::run_plan(remat::stages_of(seq), plan, x).to(torch::kFloat).sum().backward();
      // Inside the region: nothing but the weights' gradients is left.
      EXPECT_EQ(remat::memory::active_bytes() - base, 2 * probe(0)->w.nbytes()) << plan.to_string();
    }
    const size_t runs = plan.to_string().find("Fc") == std::string::npos ? 1 : 2;
    EXPECT_EQ(probe(0)->cache_on, std::vector<bool>(runs, false)) << plan.to_string();
    EXPECT_EQ(probe(1)->cache_on, std::vector<bool>(runs, false)) << plan.to_string();
  }
  probe(0)->cache_on.clear();
  torch::NoGradGuard no_grad;
  remat::testing::CpuAutocast autocast;
  remat::run_plan(remat::stages_of(seq), remat::checkpoint_all(chain), x);
  EXPECT_EQ(probe(0)->cache_on, std::vector<bool>{true});
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
}
