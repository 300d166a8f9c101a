// Data parallel on c10d: the tests start 2 or 3 processes of this binary on loopback
// (remat::distributed::launch), each running DistributedWorker.Run with a scenario, and check what they did
// (exit codes, their logs).
#include <gtest/gtest.h>
#include <remat/distributed.h>
#include <remat/models.h>
#include <remat/planned.h>
#include <remat/planner/planner.h>
#include <remat/profile.h>
#include <remat/sequential.h>
#include <torch/cuda.h>
#include <torch/optim/sgd.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "support.h"

namespace {

using namespace std::chrono_literals;
namespace dist = remat::distributed;

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Launched {
  int status = 0;
  double seconds = 0;
  std::vector<std::string> logs;  // per rank
};

// Runs DistributedWorker.Run with `scenario` in n processes.
Launched run_workers(int n, const std::string& scenario, dist::LaunchOptions options = {}) {
  const std::string dir = ::testing::TempDir() + "remat_dp_" + std::to_string(::getpid()) + "_" + scenario;
  ::setenv("REMAT_DP_SCENARIO", scenario.c_str(), 1);
  Launched out;
  const auto start = std::chrono::steady_clock::now();
  if (options.nnodes() == 1) options.master_port(0);
  out.status = dist::launch(options.nproc_per_node(n).log_dir(dir).failure_grace(60s),
                            {self_exe(), "--gtest_filter=DistributedWorker.Run", "--gtest_brief=1"});
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::unsetenv("REMAT_DP_SCENARIO");
  for (int r = 0; r < n; ++r)
    out.logs.push_back(read_file(dir + "/rank_" + std::to_string(r) + ".log"));
  return out;
}

std::string all_logs(const Launched& l) {
  std::string s;
  for (size_t r = 0; r < l.logs.size(); ++r)
    s += "---- rank " + std::to_string(r) + "\n" + l.logs[r];
  return s;
}

// ------------------------------------------------------------------------------------------------------------
// The workers

constexpr int64_t kGlobalBatch = 12;  // divides by 2 and 3
constexpr int kSteps = 3;

// A model under a strategy: its module (for DataParallel and the optimizer) and one training loss.
struct Trainee {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(int64_t begin, int64_t count)> loss;  // rows [begin, begin+count) of the batch
  std::function<std::string()> plan;  // a Planned's plan in force, for the planned strategies
};

torch::Tensor mlp_input() {
  torch::manual_seed(11);
  return torch::randn({kGlobalBatch * 3, 16});
}
torch::Tensor bert_input() {
  torch::manual_seed(12);
  return torch::randint(0, 50, {kGlobalBatch * 3, 8}, torch::kLong);
}

std::shared_ptr<dist::ProcessGroup> g_group;  // the worker's group, for the planned strategies

// Planned's options under data parallel: the same plan on every rank.
remat::PlannedOptions planned_options(int64_t budget) {
  return remat::PlannedOptions().budget(budget).agree(dist::same_plan_on_every_rank(g_group));
}

std::string plan_of(const remat::PlannedImpl* p) {
  return p && p->plan() ? p->plan()->to_string() : "no plan";
}

Trainee make_trainee(const std::string& strategy) {
  using remat::CheckpointMode;
  using remat::CheckpointOptions;
  torch::manual_seed(0);
  Trainee t;
  if (strategy.rfind("bert", 0) == 0) {
    auto bert = remat::models::BertModel(remat::models::BertConfig()
                                             .vocab_size(50)
                                             .hidden_size(16)
                                             .num_hidden_layers(3)
                                             .num_attention_heads(2)
                                             .intermediate_size(32)
                                             .max_position_embeddings(16)
                                             .hidden_dropout_prob(0)
                                             .attention_probs_dropout_prob(0));
    if (strategy == "bert") bert->gradient_checkpointing_enable();
    if (strategy == "bert-planned") {
      bert->gradient_checkpointing_enable(planned_options(1 << 30));
      t.plan = [bert] { return plan_of(bert->planned()); };
    }
    if (strategy == "bert-reentrant")
      bert->gradient_checkpointing_enable(CheckpointOptions().mode(CheckpointMode::kReentrant));
    const torch::Tensor ids = bert_input();
    t.module = bert.ptr();
    t.loss = [bert, ids](int64_t begin, int64_t count) mutable {
      return bert->forward(ids.narrow(0, begin, count)).pow(2).mean();
    };
    return t;
  }
  auto mlp = remat::models::ResidualMlp(remat::models::ResidualMlpOptions().depth(4).width(16).hidden(24));
  const torch::Tensor x = mlp_input();
  t.module = mlp.ptr();
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  if (strategy == "none") {
    forward = [mlp](const torch::Tensor& in) mutable { return mlp->forward(in); };
  } else if (strategy == "nonreentrant" || strategy == "reentrant") {
    mlp->gradient_checkpointing_enable(CheckpointOptions().mode(
        strategy == "reentrant" ? CheckpointMode::kReentrant : CheckpointMode::kNonReentrant));
    forward = [mlp](const torch::Tensor& in) mutable { return mlp->forward(in); };
  } else if (strategy == "sequential" || strategy == "sequential-reentrant") {
    const auto mode = strategy == "sequential" ? CheckpointMode::kNonReentrant : CheckpointMode::kReentrant;
    forward = [mlp, mode](const torch::Tensor& in) mutable {
      return remat::checkpoint_sequential(
          mlp->blocks(), 2, in, remat::SequentialOptions().checkpoint(CheckpointOptions().mode(mode)));
    };
  } else if (strategy == "plan") {
    // A plan from the planner, on a chain profiled before the DataParallel exists.
    auto stages = remat::stages_of(mlp->blocks());
    const remat::Chain chain = remat::profile_chain(stages, x.narrow(0, 0, kGlobalBatch / 2));
    const remat::Plan plan = remat::sqrt_n(chain);
    for (const auto& p : mlp->parameters())
      p.mutable_grad() = torch::Tensor();
    forward = [stages, plan](const torch::Tensor& in) { return remat::run_plan(stages, plan, in); };
  } else if (strategy == "planned") {
    // Planned in place at a tight budget. The least feasible one depends on the build: zero_grad sets the
    // gradients to none in LibTorch 2.x, and Planned then charges their bytes (about 13 KB here) too.
    auto planned = remat::Planned(remat::stages_of(mlp->blocks()), planned_options(24000));
    forward = [planned](const torch::Tensor& in) mutable { return planned->forward(in); };
    t.plan = [planned] { return plan_of(planned.get()); };
  } else if (strategy == "plan-all") {
    auto stages = remat::stages_of(mlp->blocks());
    const remat::Plan plan = remat::segmented(static_cast<int64_t>(stages.size()), {0, 1, 2, 3}, true);
    forward = [stages, plan](const torch::Tensor& in) { return remat::run_plan(stages, plan, in); };
  } else {
    ADD_FAILURE() << "unknown strategy " << strategy;
    forward = [mlp](const torch::Tensor& in) mutable { return mlp->forward(in); };
  }
  t.loss = [forward, x](int64_t begin, int64_t count) {
    return forward(x.narrow(0, begin, count)).pow(2).mean();
  };
  return t;
}

const std::vector<std::string> kStrategies = {
    "none",     "nonreentrant", "reentrant",      "sequential", "sequential-reentrant", "plan",
    "plan-all", "bert",         "bert-reentrant", "planned",    "bert-planned"};

// max |a - b| / max(1, max |b|) over every parameter.
double relative_param_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  double worst = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    const double scale = std::max(1.0, pb[i].abs().max().item<double>());
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

// Every gradient within `tol` of the reference's, relative to the reference's largest element; a gradient
// the reference lacks must be missing here too.
void expect_same_grads(torch::nn::Module& m, torch::nn::Module& ref, double tol) {
  auto g = remat::testing::grads_of(m), rg = remat::testing::grads_of(ref);
  ASSERT_EQ(g.size(), rg.size());
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_EQ(g[i].defined(), rg[i].defined()) << "gradient " << i;
    if (!g[i].defined()) continue;
    const double scale = std::max(1e-3, rg[i].abs().max().item<double>());
    EXPECT_LE((g[i] - rg[i]).abs().max().item<double>() / scale, tol) << "gradient " << i;
  }
}

// Largest spread (max - min across ranks) of any gradient element.
double gradient_spread(dist::ProcessGroup& group, torch::nn::Module& m) {
  std::vector<torch::Tensor> flat;
  for (const auto& p : m.parameters())
    flat.push_back(p.grad().defined() ? p.grad().reshape({-1}) : torch::zeros({p.numel()}));
  torch::Tensor all = torch::cat(flat);
  std::vector<torch::Tensor> hi{all.clone()}, lo{all.clone()};
  group.all_reduce(hi, dist::ReduceOp::kMax);
  group.all_reduce(lo, dist::ReduceOp::kMin);
  return (hi[0] - lo[0]).abs().max().item<double>();
}

void worker_match(dist::ProcessGroup& group) {
  const int64_t shard = kGlobalBatch / group.size();
  for (const std::string& strategy : kStrategies) {
    SCOPED_TRACE("strategy " + strategy);
    // The reference: one process, the whole batch, no checkpointing, no DataParallel.
    Trainee ref = make_trainee(strategy.rfind("bert", 0) == 0 ? "bert-plain" : "none");
    torch::optim::SGD ref_opt(ref.module->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
    Trainee t = make_trainee(strategy);
    // Several buckets; BERT's pooler is not used by forward(), so BERT needs find_unused_parameters.
    const bool bert = strategy.rfind("bert", 0) == 0;
    dist::DataParallel dp(t.module, std::shared_ptr<dist::ProcessGroup>(&group, [](dist::ProcessGroup*) {}),
                          dist::DataParallelOptions().bucket_bytes(2048).find_unused_parameters(bert));
    EXPECT_GT(dp.buckets().size(), 2u);
    torch::optim::SGD opt(t.module->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      const int64_t begin = step * kGlobalBatch;
      ref_opt.zero_grad();
      ref.loss(begin, kGlobalBatch).backward();
      ref_opt.step();
      opt.zero_grad();
      t.loss(begin + group.rank() * shard, shard).backward();
      EXPECT_EQ(dp.stats().steps, step + 1) << "one reduction per step";
      EXPECT_LE(gradient_spread(group, *t.module), 1e-6)
          << "gradients differ across ranks after step " << step;
      // The averaged gradient is the whole batch's.
      expect_same_grads(*t.module, *ref.module, 1e-4);
      opt.step();
    }
    EXPECT_LE(relative_param_diff(*t.module, *ref.module), 1e-5);
    if (t.plan) {
      // Planned: one profiling step, then one plan, the same on every rank.
      const std::string plan = t.plan();
      std::cerr << "rank " << group.rank() << " " << strategy << ": " << plan << std::endl;
      EXPECT_NE(plan, "no plan");
      std::vector<torch::Tensor> hi{
          torch::tensor({static_cast<int64_t>(std::hash<std::string>()(plan) >> 1)})};
      std::vector<torch::Tensor> lo{hi[0].clone()};
      group.all_reduce(hi, dist::ReduceOp::kMax);
      group.all_reduce(lo, dist::ReduceOp::kMin);
      EXPECT_EQ(hi[0].item<int64_t>(), lo[0].item<int64_t>()) << "the ranks' plans differ";
    }
  }
}

// k-1 micro-batches under no_sync, then a synced one: one step on k times the batch.
void worker_no_sync(dist::ProcessGroup& group) {
  constexpr int k = 3;
  const int64_t shard = kGlobalBatch / group.size() / 2;  // k * N shards in 3 * kGlobalBatch / 2 rows
  for (const std::string strategy : {"nonreentrant", "reentrant", "plan-all"}) {
    SCOPED_TRACE("strategy " + strategy);
    Trainee ref = make_trainee("none");
    Trainee t = make_trainee(strategy);
    dist::DataParallel dp(t.module, std::shared_ptr<dist::ProcessGroup>(&group, [](dist::ProcessGroup*) {}));
    const int64_t rows = k * group.size() * shard;
    ref.loss(0, rows).backward();
    for (int micro = 0; micro < k; ++micro) {
      const int64_t begin = (micro * group.size() + group.rank()) * shard;
      if (micro < k - 1) {
        auto guard = dp.no_sync();
        (t.loss(begin, shard) / k).backward();
        EXPECT_GT(gradient_spread(group, *t.module), 1e-6) << "no_sync reduced gradients";
      } else {
        (t.loss(begin, shard) / k).backward();
      }
    }
    EXPECT_EQ(dp.stats().steps, 1);
    EXPECT_LE(gradient_spread(group, *t.module), 1e-6);
    expect_same_grads(*t.module, *ref.module, 1e-5);
  }
}

// Rank 1 dies in the middle of the second step; the others must fail with a message, not hang.
void worker_kill(dist::ProcessGroup& group) {
  Trainee t = make_trainee("reentrant");
  dist::DataParallel dp(t.module, std::shared_ptr<dist::ProcessGroup>(&group, [](dist::ProcessGroup*) {}));
  t.loss(0, 4).backward();
  try {
    if (group.rank() == 1) std::_Exit(9);  // mid-step: after the forward pass of the others' second step
    t.loss(0, 4).backward();
    ADD_FAILURE() << "the backward pass finished although rank 1 died";
  } catch (const c10::Error& e) {
    std::cerr << "worker caught: " << e.what_without_backtrace() << std::endl;
    std::_Exit(3);
  }
}

// Rank 1's model is wider: every rank must refuse at construction.
void worker_mismatch(dist::ProcessGroup& group) {
  auto mlp = remat::models::ResidualMlp(
      remat::models::ResidualMlpOptions().depth(2).width(group.rank() == 1 ? 12 : 16));
  try {
    dist::DataParallel dp(mlp.ptr(), std::shared_ptr<dist::ProcessGroup>(&group, [](dist::ProcessGroup*) {}));
    ADD_FAILURE() << "DataParallel accepted different models";
  } catch (const c10::Error& e) {
    std::cerr << "worker caught: " << e.what_without_backtrace() << std::endl;
    std::_Exit(4);
  }
}

// A parameter without a gradient: an error naming it (find_unused_parameters false), and reduced as absent
// (true).
void worker_unused(dist::ProcessGroup& group) {
  auto mlp = remat::models::ResidualMlp(remat::models::ResidualMlpOptions().depth(2).width(8));
  auto extra = torch::nn::Linear(8, 8);
  torch::nn::Sequential both(mlp, extra);
  const torch::Tensor x = torch::randn({4, 8});
  {
    dist::DataParallel dp(both.ptr(),
                          std::shared_ptr<dist::ProcessGroup>(&group, [](dist::ProcessGroup*) {}));
    try {
      mlp->forward(x).sum().backward();
      ADD_FAILURE() << "no error for a parameter without gradient";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("got no gradient"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("1.weight"), std::string::npos) << e.what();
    }
  }
  for (const auto& p : both->parameters())
    p.mutable_grad() = torch::Tensor();
  dist::DataParallel dp(both.ptr(), std::shared_ptr<dist::ProcessGroup>(&group, [](dist::ProcessGroup*) {}),
                        dist::DataParallelOptions().find_unused_parameters(true));
  // Rank 0 uses the extra layer, the others do not: its gradient is rank 0's / size everywhere.
  torch::Tensor out = mlp->forward(x);
  if (group.rank() == 0) out = extra->forward(out);
  out.sum().backward();
  EXPECT_TRUE(extra->weight.grad().defined());
  EXPECT_LE(gradient_spread(group, *both), 1e-6);
  EXPECT_EQ(dp.stats().steps, 1);
}

// Batches whose sizes differ between the ranks at some steps (a last batch, or batches padded to their own
// longest sequence): rank 0 always 6 rows; rank 1 6, 8, 6, 8, then 3. Under agree a rank whose shape is new
// to it makes every rank profile that step (rank 0 measures its planned shape again), and all plan at the
// next call: every step the plain DataParallel run's. Rank 1's 3 rows run the plan of its 6 (borrowed), with
// no profiling. Before, rank 1 profiled its 8 rows alone and its planning's collective met rank 0's gradient
// all-reduce: Gloo aborted the process.
void worker_ragged(dist::ProcessGroup& group) {
  const std::vector<int64_t> rows =
      group.rank() == 1 ? std::vector<int64_t>{6, 8, 6, 8, 3} : std::vector<int64_t>{6, 6, 6, 6, 6};
  auto shared = std::shared_ptr<dist::ProcessGroup>(&group, [](dist::ProcessGroup*) {});
  Trainee ref = make_trainee("none");
  dist::DataParallel ref_dp(ref.module, shared);
  torch::manual_seed(0);  // make_trainee's seed: the same weights
  auto mlp = remat::models::ResidualMlp(remat::models::ResidualMlpOptions().depth(4).width(16).hidden(24));
  auto planned = remat::Planned(remat::stages_of(mlp->blocks()), planned_options(30000));
  dist::DataParallel dp(mlp.ptr(), shared);
  const torch::Tensor x = mlp_input();
  for (size_t k = 0; k < rows.size(); ++k) {
    SCOPED_TRACE("step " + std::to_string(k));
    const torch::Tensor in = x.narrow(0, group.rank() * 8, rows[k]);
    ref.module->zero_grad();
    ref.loss(group.rank() * 8, rows[k]).backward();
    mlp->zero_grad();
    planned->forward(in).pow(2).mean().backward();
    expect_same_grads(*mlp, *ref.module, 0);
  }
  EXPECT_TRUE(planned->is_planned()) << plan_of(planned.get());
  EXPECT_EQ(planned->profiled_shapes(), group.rank() == 1 ? 2 : 1);
  EXPECT_EQ(planned->borrowed_shapes(), group.rank() == 1 ? 1 : 0);
  EXPECT_EQ(planned->plan_borrowed(), group.rank() == 1);
  std::cerr << "rank " << group.rank() << " ragged: " << plan_of(planned.get()) << std::endl;
}

TEST(DistributedWorker, Run) {
  const char* scenario = std::getenv("REMAT_DP_SCENARIO");
  if (scenario == nullptr) GTEST_SKIP() << "runs only inside the processes DataParallel's tests start";
  const std::string s = scenario;
  if (s == "alone") {  // the other rank never comes
    try {
      dist::init_process_group(dist::InitOptions().timeout(3s));
      ADD_FAILURE() << "init_process_group returned without the other rank";
    } catch (const c10::Error& e) {
      std::cerr << "worker caught: " << e.what_without_backtrace() << std::endl;
      std::_Exit(5);
    }
    return;
  }
  auto group = dist::init_process_group(dist::InitOptions().timeout(30s));
  g_group = group;
  if (s == "match") worker_match(*group);
  if (s == "no_sync") worker_no_sync(*group);
  if (s == "kill") worker_kill(*group);
  if (s == "mismatch") worker_mismatch(*group);
  if (s == "unused") worker_unused(*group);
  if (s == "ragged") worker_ragged(*group);
  group->barrier();
  g_group.reset();
}

// ------------------------------------------------------------------------------------------------------------
// The tests

TEST(DataParallel, TwoProcessesMatchOneProcessOnTheWholeBatch) {
  const Launched l = run_workers(2, "match");
  EXPECT_EQ(l.status, 0) << all_logs(l);
}

TEST(DataParallel, RanksWhoseBatchesDifferInSizeProfileTogetherUnderPlanned) {
  const Launched l = run_workers(2, "ragged");
  EXPECT_EQ(l.status, 0) << all_logs(l);
}

TEST(DataParallel, ThreeProcessesMatchOneProcessOnTheWholeBatch) {
  const Launched l = run_workers(3, "match");
  EXPECT_EQ(l.status, 0) << all_logs(l);
}

TEST(DataParallel, NoSyncAccumulatesThenOneSyncedStepEqualsTheLargerBatch) {
  const Launched l = run_workers(2, "no_sync");
  EXPECT_EQ(l.status, 0) << all_logs(l);
}

TEST(DataParallel, ParametersWithoutGradientAreAnErrorOrReducedWhenAllowed) {
  const Launched l = run_workers(2, "unused");
  EXPECT_EQ(l.status, 0) << all_logs(l);
}

TEST(DataParallel, ARankThatDiesMakesTheOthersFailWithAMessage) {
  const Launched l = run_workers(3, "kill");
  EXPECT_NE(l.status, 0);
  // The survivors saw the failure themselves (within the 30 s timeout), not the launcher's signal.
  for (int r : {0, 2}) {
    EXPECT_NE(
        l.logs[r].find("worker caught: remat::distributed::all_reduce: failed on rank " + std::to_string(r)),
        std::string::npos)
        << all_logs(l);
  }
  EXPECT_LT(l.seconds, 45) << all_logs(l);
}

TEST(DataParallel, ARankThatNeverArrivesIsAnErrorWithinTheTimeout) {
  // Rank 0 of 2 on "machine" 0 of 2: rank 1 never starts.
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  const Launched l = run_workers(1, "alone", dist::LaunchOptions().nnodes(2).node_rank(0).master_port(port));
  EXPECT_EQ(l.status, 5) << all_logs(l);
  // Rank 0 waits at the store or at Gloo's connection, depending on the LibTorch: either way it says so.
  EXPECT_NE(l.logs[0].find("worker caught: remat::distributed::init_process_group: rank 0 of 2 could not"),
            std::string::npos)
      << all_logs(l);
  EXPECT_NE(l.logs[0].find("3000 ms"), std::string::npos) << all_logs(l);
  EXPECT_EQ(l.logs[0].find("Exception raised from"), std::string::npos) << "a backtrace: " << all_logs(l);
  EXPECT_LT(l.seconds, 30) << all_logs(l);
}

TEST(DataParallel, DifferentModelsFailOnEveryRank) {
  const Launched l = run_workers(2, "mismatch");
  EXPECT_EQ(l.status, 4) << all_logs(l);
  for (int r : {0, 1}) {
    EXPECT_NE(l.logs[r].find("the ranks' models differ (rank(s) 1 differ from rank 0"), std::string::npos)
        << all_logs(l);
  }
  EXPECT_NE(l.logs[1].find("here 'parameter blocks.0.fc1.weight Float [48, 12]'"), std::string::npos)
      << all_logs(l);
}

TEST(DataParallel, InitProcessGroupNamesAMissingOrBadVariable) {
  ::unsetenv("RANK");
  ::setenv("WORLD_SIZE", "2", 1);
  try {
    dist::init_process_group();
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK is not set"), std::string::npos) << e.what();
  }
  ::setenv("RANK", "2", 1);
  try {
    dist::init_process_group();
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='2' is not an integer in [0, 1]"), std::string::npos)
        << e.what();
  }
  ::setenv("RANK", "0", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "http", 1);
  try {
    dist::init_process_group();
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_PORT='http'"), std::string::npos) << e.what();
  }
  // A backend that is none; NCCL where the build has none, or on a machine without a CUDA device.
  ::setenv("MASTER_PORT", "29400", 1);
  EXPECT_THROW_WITH(dist::init_process_group(dist::InitOptions().backend("mpi")), "backend 'mpi' is not one",
                    "\"gloo\"", "\"nccl\"");
  if (!dist::has_nccl()) {
    EXPECT_THROW_WITH(dist::init_process_group(dist::InitOptions().backend("nccl")),
                      "backend 'nccl' is not in this build");
  } else if (torch::cuda::device_count() == 0) {
    EXPECT_THROW_WITH(dist::init_process_group(dist::InitOptions().backend("nccl")),
                      "puts local rank 0 on CUDA device 0, but this machine has 0 CUDA devices");
  }
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    ::unsetenv(v);
}

TEST(DataParallel, LaunchRejectsBadOptionsAndReportsExitCodes) {
  EXPECT_THROW(dist::launch(dist::LaunchOptions().nproc_per_node(0), {"true"}), c10::Error);
  EXPECT_THROW(dist::launch(dist::LaunchOptions().node_rank(1), {"true"}), c10::Error);
  EXPECT_THROW(dist::launch(dist::LaunchOptions(), {}), c10::Error);
  EXPECT_EQ(dist::launch(dist::LaunchOptions().nproc_per_node(2).master_port(0), {"true"}), 0);
  EXPECT_EQ(dist::launch(dist::LaunchOptions().nproc_per_node(2).master_port(0),
                         {"sh", "-c", "test \"$RANK\" = 1 && exit 7; test \"$WORLD_SIZE\" = 2"}),
            7);
  EXPECT_EQ(dist::launch(dist::LaunchOptions().nproc_per_node(1).master_port(0), {"/nonexistent/program"}),
            127);
}

}  // namespace
