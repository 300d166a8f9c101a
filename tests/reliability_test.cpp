// remat under fire: several threads at once, exceptions thrown by the checkpointed function in the forward
// pass and in the recompute, and an allocation failing at every point of a checkpointed step.

#include <remat/checkpoint.h>
#include <remat/memory.h>
#include <remat/sequential.h>

#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "support.h"

namespace {

using remat::CheckpointMode;
using remat::CheckpointOptions;
using remat::testing::clear_grads;
using remat::testing::grads_of;
using remat::testing::max_abs_diff;

// How a step checkpoints its blocks: remat::checkpoint per block in a mode, or the plan executor
// (checkpoint_sequential).
enum class Way { kNonReentrant, kReentrant, kSequential };
std::string way_name(const ::testing::TestParamInfo<Way>& info) {
  return info.param == Way::kNonReentrant ? "NonReentrant"
         : info.param == Way::kReentrant  ? "Reentrant"
                                          : "Sequential";
}

// A block of Linear, optional BatchNorm, GELU, optional dropout.
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t width, bool batch_norm, double dropout)
      : fc(register_module("fc", torch::nn::Linear(width, width))), p(dropout) {
    if (batch_norm) bn = register_module("bn", torch::nn::BatchNorm1d(width));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = fc(x);
    if (bn) h = bn(h);
    h = torch::gelu(h);
    return p > 0 ? torch::dropout(h, p, is_training()) : h;
  }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn{nullptr};
  double p;
};
TORCH_MODULE(MlpBlock);

torch::nn::Sequential make_model(int64_t seed, int64_t depth, int64_t width, bool batch_norm,
                                 double dropout) {
  torch::manual_seed(seed);
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < depth; ++i)
    seq->push_back(MlpBlock(width, batch_norm, dropout));
  return seq;
}

// preserve_rng_state for the steps of this thread.
thread_local bool preserve_rng = true;

// One checkpointed forward pass of `seq` on x: per block in a mode (the module overload), or the executor.
torch::Tensor forward(torch::nn::Sequential& seq, const torch::Tensor& x, Way way) {
  const auto opts = CheckpointOptions().preserve_rng_state(preserve_rng);
  if (way == Way::kSequential) {
    return remat::checkpoint_sequential(seq, 2, x, remat::SequentialOptions().checkpoint(opts));
  }
  const auto mode = way == Way::kReentrant ? CheckpointMode::kReentrant : CheckpointMode::kNonReentrant;
  torch::Tensor h = x;
  for (size_t i = 0; i < seq->size(); ++i)
    h = remat::checkpoint(MlpBlock(seq->ptr<MlpBlockImpl>(i)), h, CheckpointOptions(opts).mode(mode));
  return h;
}

// `steps` training steps (plain SGD); returns every step's gradients, then the final parameters.
std::vector<torch::Tensor> train(torch::nn::Sequential& seq, int64_t seed, int64_t steps, Way way) {
  std::vector<torch::Tensor> out;
  torch::Generator data = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  for (int64_t s = 0; s < steps; ++s) {
    auto x = at::randn({8, 16}, data);
    clear_grads(*seq);
    forward(seq, x.requires_grad_(true), way).pow(2).mean().backward();
    torch::NoGradGuard no_grad;
    for (auto& p : seq->parameters()) {
      out.push_back(p.grad().clone());
      p.sub_(0.05 * p.grad());
    }
  }
  for (const auto& p : seq->parameters())
    out.push_back(p.detach().clone());
  return out;
}

void expect_identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                      const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(a[i].equal(b[i])) << what << ": tensor " << i << " differs by " << max_abs_diff(a[i], b[i]);
}

// Runs body(t) for t in [0, n) on n threads at once; returns what each threw ("" when nothing).
std::vector<std::string> run_threads(int n, const std::function<void(int)>& body) {
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      try {
        body(t);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(t)] = e.what();
      }
    });
  }
  for (auto& th : threads)
    th.join();
  return errors;
}

class Threads : public ::testing::TestWithParam<Way> {};
INSTANTIATE_TEST_SUITE_P(Ways, Threads,
                         ::testing::Values(Way::kNonReentrant, Way::kReentrant, Way::kSequential), way_name);

// ---------------------------------------------------------------------------------------------------------
// Threads

TEST_P(Threads, ModelsTrainedAtTheSameTimeEqualTheSameRunsOneAfterAnother) {
  constexpr int kThreads = 3;
  constexpr int64_t kSteps = 6;
  std::vector<std::vector<torch::Tensor>> alone(kThreads), together(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    auto seq = make_model(100 + t, 4, 16, /*batch_norm=*/true, /*dropout=*/0);
    alone[t] = train(seq, 200 + t, kSteps, GetParam());
  }
  std::vector<torch::nn::Sequential> models;
  for (int t = 0; t < kThreads; ++t)
    models.push_back(make_model(100 + t, 4, 16, true, 0));
  const auto errors =
      run_threads(kThreads, [&](int t) { together[t] = train(models[t], 200 + t, kSteps, GetParam()); });
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(errors[t], "");
    expect_identical(together[t], alone[t], "thread " + std::to_string(t));
    // BatchNorm statistics too.
    auto ref = make_model(100 + t, 4, 16, true, 0);
    train(ref, 200 + t, kSteps, GetParam());
    expect_identical(models[t]->buffers(), ref->buffers(), "buffers of thread " + std::to_string(t));
  }
}

TEST_P(Threads, DropoutIsExactWhileNoOtherThreadDraws) {
  // Thread 0 trains with dropout; the others train without random ops at the same time, with
  // preserve_rng_state(false) as docs/checkpointing.md says (a region whose forward pass saw the generator
  // move, here because thread 0 drew, would replay it and disturb thread 0). Thread 0's masks are replayed
  // exactly: its run equals the same run alone, and so do the others'.
  constexpr int kThreads = 3;
  constexpr int64_t kSteps = 5;
  auto reference = [&](int t) {
    auto seq = make_model(300 + t, 3, 16, false, t == 0 ? 0.3 : 0.0);
    torch::manual_seed(77);
    return train(seq, 400 + t, kSteps, GetParam());
  };
  std::vector<std::vector<torch::Tensor>> alone;
  for (int t = 0; t < kThreads; ++t)
    alone.push_back(reference(t));
  std::vector<torch::nn::Sequential> models;
  for (int t = 0; t < kThreads; ++t)
    models.push_back(make_model(300 + t, 3, 16, false, t == 0 ? 0.3 : 0.0));
  torch::manual_seed(77);
  std::vector<std::vector<torch::Tensor>> together(kThreads);
  const auto errors = run_threads(kThreads, [&](int t) {
    preserve_rng = t == 0;
    together[t] = train(models[t], 400 + t, kSteps, GetParam());
  });
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(errors[t], "");
    expect_identical(together[t], alone[t], "thread " + std::to_string(t));
  }
}

TEST_P(Threads, ADrawByAnotherThreadDuringTheForwardPassIsAClearError) {
  // Another thread draws from the default generator while a region with dropout runs forward: the recompute
  // would replay other numbers, so remat refuses instead of returning gradients for a mask never used.
  // Sequential: remat::run_plan's stage run again (Fc0 L Fa0 B0), its end state kept as a digest.
  const auto mode =
      GetParam() == Way::kReentrant ? CheckpointMode::kReentrant : CheckpointMode::kNonReentrant;
  torch::nn::Linear fc(8, 8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const torch::Tensor& t) {
    auto h = torch::dropout(fc(t), 0.5, true);
    if (calls++ == 0) std::async(std::launch::async, [] { torch::rand({16}); }).wait();  // another thread
    return torch::dropout(h, 0.5, true);  // drawn after the other thread's numbers in the forward pass only
  };
  auto y = GetParam() == Way::kSequential
               ? remat::run_plan({remat::StageFn{"drop", fn, fc.ptr()}}, remat::checkpoint_stages(1, {0}), x)
               : remat::checkpoint(fn, x, CheckpointOptions().mode(mode).modules({fc.ptr()}));
  EXPECT_THROW_WITH(y.sum().backward(), "drew other random numbers", "nother thread",
                    "preserve_rng_state(false)");
}

TEST_P(Threads, OneModelSharedUnderAMutexEqualsTheStepsOneAfterAnother) {
  constexpr int kThreads = 3;
  constexpr int kSteps = 4;
  auto seq = make_model(500, 3, 16, false, 0);
  auto input = [](int t, int s) {
    torch::Generator g = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + 10 * t + s));
    return at::randn({8, 16}, g);
  };
  auto step = [&](const torch::Tensor& x) {
    clear_grads(*seq);
    forward(seq, x, GetParam()).pow(2).mean().backward();
    return grads_of(*seq);
  };
  std::map<std::pair<int, int>, std::vector<torch::Tensor>> alone, together;
  for (int t = 0; t < kThreads; ++t)
    for (int s = 0; s < kSteps; ++s)
      alone[{t, s}] = step(input(t, s));
  std::mutex mutex;
  const auto errors = run_threads(kThreads, [&](int t) {
    for (int s = 0; s < kSteps; ++s) {
      auto x = input(t, s);
      std::lock_guard<std::mutex> lock(mutex);  // the step and the map
      together[{t, s}] = step(x);
    }
  });
  for (const auto& e : errors)
    EXPECT_EQ(e, "");
  for (const auto& [key, grads] : alone)
    expect_identical(together[key], grads,
                     "thread " + std::to_string(key.first) + " step " + std::to_string(key.second));
}

// ---------------------------------------------------------------------------------------------------------
// Exceptions

struct Snapshot {
  torch::Tensor rng;
  std::vector<torch::Tensor> buffers;
  int64_t active = 0;
};
Snapshot snapshot(torch::nn::Module& m) {
  Snapshot s;
  s.rng = at::detail::getDefaultCPUGenerator().get_state();
  for (const auto& b : m.buffers())
    s.buffers.push_back(b.clone());
  s.active = remat::memory::active_bytes();
  return s;
}
void expect_same_state(const Snapshot& before, torch::nn::Module& m, const std::string& what) {
  EXPECT_TRUE(before.rng.equal(at::detail::getDefaultCPUGenerator().get_state())) << what << ": RNG moved";
  auto now = m.buffers();
  ASSERT_EQ(now.size(), before.buffers.size());
  for (size_t i = 0; i < now.size(); ++i)
    EXPECT_TRUE(now[i].equal(before.buffers[i])) << what << ": buffer " << i << " changed";
}

struct Boom : std::runtime_error {
  Boom() : std::runtime_error("boom from fn") {}
};

class Exceptions : public ::testing::TestWithParam<Way> {
 protected:
  void SetUp() override { remat::testing::meter_on(); }
};
INSTANTIATE_TEST_SUITE_P(Ways, Exceptions,
                         ::testing::Values(Way::kNonReentrant, Way::kReentrant, Way::kSequential), way_name);

// A model whose second block throws when `throw_on` equals its call count (1: the forward pass, 2: the
// recompute); the block has BatchNorm and dropout, which run before the throw.
struct ThrowingImpl : torch::nn::Module {
  ThrowingImpl()
      : fc(register_module("fc", torch::nn::Linear(16, 16))),
        bn(register_module("bn", torch::nn::BatchNorm1d(16))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::dropout(bn(fc(x)), 0.3, true);
    if (++calls == throw_on) throw Boom();
    if (calls == throw_on_c10) TORCH_CHECK(false, "c10 error from fn");
    return h.tanh();  // saves its result: a recompute (which stops at the last save) reaches the throws above
  }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
  int calls = 0, throw_on = -1, throw_on_c10 = -1;
};
TORCH_MODULE(Throwing);

torch::nn::Sequential throwing_model(Throwing& thrower) {
  torch::manual_seed(9);
  thrower = Throwing();
  return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::Tanh(), thrower, torch::nn::GELU());
}

torch::Tensor step_forward(torch::nn::Sequential& seq, const torch::Tensor& x, Way way) {
  if (way == Way::kSequential)
    return remat::checkpoint_sequential(seq, 4, x, remat::SequentialOptions().checkpoint_last_segment(true));
  const auto mode = way == Way::kReentrant ? CheckpointMode::kReentrant : CheckpointMode::kNonReentrant;
  torch::Tensor h = x;
  for (size_t i = 0; i < seq->size(); ++i) {
    std::shared_ptr<torch::nn::Module> m = seq->ptr(i);
    h = remat::checkpoint([seq, i](const torch::Tensor& t) mutable { return seq->begin()[i].forward(t); }, h,
                          CheckpointOptions().mode(mode).modules({m}));
  }
  return h;
}

// The next plain and checkpointed steps agree after an exception.
void expect_next_steps_agree(torch::nn::Sequential& seq, Throwing& thrower, Way way) {
  thrower->throw_on = -1;
  thrower->throw_on_c10 = -1;
  auto x = torch::randn({6, 16}, torch::requires_grad());
  torch::manual_seed(5);
  clear_grads(*seq);
  seq->forward(x).pow(2).sum().backward();
  auto plain = grads_of(*seq);
  // The plain step updated BatchNorm's running statistics; the gradients use batch statistics only.
  torch::manual_seed(5);
  clear_grads(*seq);
  step_forward(seq, x, way).pow(2).sum().backward();
  auto got = grads_of(*seq);
  ASSERT_EQ(plain.size(), got.size());
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(plain[i].equal(got[i]))
        << "gradient " << i << " differs by " << max_abs_diff(plain[i], got[i]);
}

TEST_P(Exceptions, ThrowInTheForwardPassReachesTheCallerAndLeavesNothingBehind) {
  Throwing thrower(nullptr);
  auto seq = throwing_model(thrower);
  auto x = torch::randn({6, 16}, torch::requires_grad());
  for (bool c10_error : {false, true}) {
    thrower->calls = 0;
    (c10_error ? thrower->throw_on_c10 : thrower->throw_on) = 1;
    Snapshot before = snapshot(*seq);
    if (c10_error) {
      EXPECT_THROW_WITH(step_forward(seq, x, GetParam()), "c10 error from fn");
    } else {
      EXPECT_THROW(step_forward(seq, x, GetParam()), Boom);
    }
    expect_same_state(before, *seq, c10_error ? "c10::Error" : "std::exception");
    EXPECT_EQ(remat::memory::active_bytes(), before.active) << "bytes left behind";
    thrower->throw_on = thrower->throw_on_c10 = -1;
  }
  expect_next_steps_agree(seq, thrower, GetParam());
}

TEST_P(Exceptions, ThrowInTheRecomputeReachesTheCallerWithRematsContext) {
  Throwing thrower(nullptr);
  auto seq = throwing_model(thrower);
  auto x = torch::randn({6, 16}, torch::requires_grad());
  const int64_t base = remat::memory::active_bytes();
  {
    thrower->calls = 0;
    thrower->throw_on_c10 = 2;  // the recompute
    auto loss = step_forward(seq, x, GetParam()).pow(2).sum();
    Snapshot before = snapshot(*seq);  // after the forward pass: BatchNorm updated once, RNG moved on
    EXPECT_THROW_WITH(loss.backward(), "c10 error from fn", "remat::", "while r");
    expect_same_state(before, *seq, "after the failed backward");
  }
  x.mutable_grad() = torch::Tensor();
  clear_grads(*seq);
  EXPECT_EQ(remat::memory::active_bytes(), base) << "bytes left behind once the graph is gone";
  expect_next_steps_agree(seq, thrower, GetParam());
}

// ---------------------------------------------------------------------------------------------------------
// Out of memory: the n-th allocation of a checkpointed step fails, for every n

class OutOfMemory : public ::testing::TestWithParam<Way> {
 protected:
  void SetUp() override { remat::testing::meter_on(); }
  void TearDown() override {
    remat::memory::testing::fail_cpu_allocation_at(0);
    remat::memory::testing::limit_cpu_bytes(-1);
  }
};
INSTANTIATE_TEST_SUITE_P(Ways, OutOfMemory,
                         ::testing::Values(Way::kNonReentrant, Way::kReentrant, Way::kSequential), way_name);

TEST_P(OutOfMemory, EveryAllocationOfAStepFailsCleanlyAndTheNextStepSucceeds) {
  auto seq = make_model(11, 3, 16, /*batch_norm=*/true, /*dropout=*/0.2);
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto step = [&] {
    clear_grads(*seq);
    x.mutable_grad() = torch::Tensor();
    torch::manual_seed(3);
    forward(seq, x, GetParam()).pow(2).sum().backward();
  };
  step();
  const auto reference = grads_of(*seq);
  clear_grads(*seq);
  x.mutable_grad() = torch::Tensor();
  const int64_t base = remat::memory::active_bytes();
  const int64_t before = remat::memory::cpu_allocation_count();
  step();
  const int64_t allocations = remat::memory::cpu_allocation_count() - before;
  clear_grads(*seq);
  x.mutable_grad() = torch::Tensor();
  ASSERT_GT(allocations, 10);
  ASSERT_EQ(remat::memory::active_bytes(), base);

  const int64_t refused_before = remat::memory::testing::refused_cpu_allocations();
  for (int64_t n = 1; n <= allocations; ++n) {
    remat::memory::testing::fail_cpu_allocation_at(n);
    bool threw = false;
    try {
      step();
    } catch (const c10::Error& e) {
      threw = true;
      EXPECT_NE(std::string(e.what()).find("refused"), std::string::npos)
          << "allocation " << n << ": " << e.what();
    }
    remat::memory::testing::fail_cpu_allocation_at(0);
    EXPECT_TRUE(threw) << "allocation " << n << " of " << allocations << " failed silently";
    clear_grads(*seq);
    x.mutable_grad() = torch::Tensor();
    EXPECT_EQ(remat::memory::active_bytes(), base) << "bytes leaked after allocation " << n << " failed";
  }
  EXPECT_EQ(remat::memory::testing::refused_cpu_allocations() - refused_before, allocations);
  std::cout << "out of memory: each of the " << allocations << " CPU allocations of a step failed in turn"
            << std::endl;
  // The next step succeeds and computes the same gradients (BatchNorm's statistics moved on with each
  // step, but the gradients use batch statistics only).
  step();
  const auto after = grads_of(*seq);
  ASSERT_EQ(after.size(), reference.size());
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_TRUE(after[i].equal(reference[i])) << "gradient " << i;
}

TEST(OutOfMemoryLimit, AByteBudgetBelowTheCheckpointedPeakFailsAndAboveItSucceeds) {
  remat::testing::meter_on();
  auto seq = make_model(12, 8, 32, false, 0);
  auto x = torch::randn({512, 32}, torch::requires_grad());
  auto step = [&](Way way) {
    clear_grads(*seq);
    x.mutable_grad() = torch::Tensor();
    remat::memory::PeakScope scope;
    forward(seq, x, way).pow(2).sum().backward();
    return scope.peak_over_base();
  };
  const int64_t base = remat::memory::active_bytes();
  const int64_t plain_peak = [&] {
    clear_grads(*seq);
    remat::memory::PeakScope scope;
    seq->forward(x).pow(2).sum().backward();
    return scope.peak_over_base();
  }();
  const int64_t ckpt_peak = step(Way::kNonReentrant);
  ASSERT_LT(ckpt_peak, plain_peak);
  clear_grads(*seq);
  x.mutable_grad() = torch::Tensor();
  // A budget between the two peaks: the plain step runs out of memory, the checkpointed one fits.
  remat::memory::testing::limit_cpu_bytes(remat::memory::active_bytes() + (ckpt_peak + plain_peak) / 2);
  EXPECT_THROW_WITH(seq->forward(x).pow(2).sum().backward(), "refused");
  clear_grads(*seq);
  EXPECT_NO_THROW(step(Way::kNonReentrant));
  remat::memory::testing::limit_cpu_bytes(-1);
  clear_grads(*seq);
  x.mutable_grad() = torch::Tensor();
  EXPECT_EQ(remat::memory::active_bytes(), base);
}

TEST(OutOfMemoryLimit, HooksNeedTheMeter) {
  // The hooks are documented to need track_cpu(); in this process the meter may already be on, so only the
  // argument check is exercised here.
  remat::testing::meter_on();
  EXPECT_THROW_WITH(remat::memory::testing::fail_cpu_allocation_at(-1), "fail_cpu_allocation_at", "-1");
}

}  // namespace
