// Randomized differential testing: programs generated from a seed, each run plainly and under a random
// checkpointing strategy, with every gradient, BatchNorm buffer and the RNG stream compared. Programs may use
// parameters their regions do not declare and a tensor computed outside every region (captured), and may
// wrap their first block in nested regions of both modes, a few deep or past LibTorch's per-thread depth of
// 60; the plain and the checkpointed run come in either order, so that backward passes of both kinds follow
// each other in the process. Since issue 41 they also draw what users do around checkpointing: remat::Offload
// scopes around blocks (random thresholds, a bounded pool, copies carried out late), opened and closed in
// every order (one may stay open through the backward pass); views and transposes of saved tensors (since
// 2026-12-04 also views at offsets into a storage and views with gaps, saved beside the whole); complex
// tensors with their conjugate and negative views saved; a saved tensor written in place (an invalid program:
// remat must give the plain run's error or the gradient of the values saved, the valid twin's, never
// another); micro-batches of several batch sizes accumulated into one step; autograd::grad over part of the
// targets. The bytes alive after each step must be the plain run's (nothing leaked).
//
//   ./test                                   runs the fixed budget (Fuzz.Chains, Fuzz.Regions)
//   REMAT_FUZZ_SEED=S REMAT_FUZZ_COUNT=N build/tests/remat_tests --gtest_filter=Fuzz.Long
//                                            runs N programs from seed S (any number; prints progress)
//   REMAT_FUZZ_SEED=S build/tests/remat_tests --gtest_filter=Fuzz.One
//                                            runs the one program of seed S, printing it
//
// A failure prints the seed, the command that reproduces it, the program, and the smallest failing program
// the shrinker finds.

#include <ATen/Parallel.h>
#include <remat/checkpoint.h>
#include <remat/memory.h>
#include <remat/offload.h>
#include <remat/planner/chain.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>
#include <remat/planner/strategy.h>
#include <remat/policy.h>
#include <remat/sequential.h>

#include <cstdlib>
#include <functional>
#include <random>
#include <sstream>
#include <unordered_set>

#include "support.h"

namespace {

using remat::CheckpointMode;
using remat::CheckpointOptions;

// ---------------------------------------------------------------------------------------------------------
// Programs as data

enum class OpCode {
  kLinear,     // a Linear of the block
  kShared,     // a Linear shared by every block that uses the same pool index
  kConv,       // conv2d on the activation viewed as [B, 2, W/4, 2]
  kMatmul,     // h @ P, P a [W, W] parameter
  kAttention,  // bmm, softmax, bmm on h viewed as [B, 2, W/2]
  kGelu,
  kRelu,
  kSoftmax,
  kLayerNorm,
  kBatchNorm,     // train mode: running statistics updated
  kDropout,       // draws from the global CPU generator
  kReluInplace,   // (h + 0.1).relu_()
  kAddInplace,    // (2h).add_(bias parameter)
  kMulInplace,    // (h + 0.5).mul_(sigmoid(h))
  kTranspose,     // view, transpose, reshape
  kNarrowCat,     // narrow into halves, cat them swapped
  kSelectStack,   // select rows of a [B, 2, W/2] view, stack them
  kSplitCat,      // split into quarters, cat reversed
  kReduce,        // h - mean over features + 0.1 * sum over the batch
  kArgmaxGather,  // an integer intermediate: h + h.gather(argmax(h))
  kAux,           // h * aux (the region's second input, which may not require grad)
  kIndexIn,       // h + h.gather(idx), idx the integer output of the previous region
  kSavedView,     // u = 2h; gelu(u) + sin(u^T)^T: u saved whole and through a transposed view
  kComplex,       // h as complex c: |c|^2 (c * conj(c), a conjugate view saved) and imag(conj(c)) * real(c)
                  // (a negative view saved)
  kWriteSaved,    // s = sigmoid(h), written in place (s.mul_(2)) after sigmoid saved it: invalid
  kOffsetViews,  // u = 2h cut into its first and last rows (dense views, the second at an offset), each saved
                 // itself and transposed, beside u whole
  kOffsetGaps,   // kOffsetViews, and u's right half saved (a view with gaps, which keeps u on the device)
  kCount
};

const char* op_text(OpCode c) {
  static const char* names[] = {
      "linear",      "shared",     "conv",         "matmul",      "attention",    "gelu",          "relu",
      "softmax",     "layer_norm", "batch_norm",   "dropout",     "relu_",        "add_",          "mul_",
      "transpose",   "narrow+cat", "select+stack", "split+cat",   "reduce",       "argmax+gather", "aux",
      "gather(idx)", "saved-view", "complex",      "write-saved", "offset-views", "offset-gaps"};
  return names[static_cast<int>(c)];
}

struct OpSpec {
  OpCode code = OpCode::kRelu;
  int64_t shared = 0;  // kShared: the pool index
};

// 0: not checkpointed, 1: kNonReentrant, 2: kReentrant.
using Mode = int;
const char* mode_text(Mode m) {
  return m == 0 ? "plain" : m == 1 ? "nonreentrant" : "reentrant";
}

struct BlockSpec {
  std::vector<OpSpec> ops;
  Mode mode = 0;         // kPerBlock and kNested: how this block is checkpointed
  int64_t group = 0;     // kNested: blocks of one group run inside one outer checkpoint
  bool int_out = false;  // regions: also return argmax(h) as an integer output
};

enum class Strategy { kPerBlock, kNested, kSequential, kSegments, kPlan };
const char* strategy_text(Strategy s) {
  switch (s) {
    case Strategy::kPerBlock:
      return "per-block";
    case Strategy::kNested:
      return "nested";
    case Strategy::kSequential:
      return "checkpoint_sequential";
    case Strategy::kSegments:
      return "checkpoint_segments";
    case Strategy::kPlan:
      return "plan";
  }
  return "?";
}

struct Program {
  uint64_t seed = 0;
  bool regions =
      false;  // several inputs and outputs per block (h, aux, idx); otherwise a chain of one tensor
  int64_t batch = 4, width = 8;
  int64_t pool = 2;  // shared Linears
  bool input_requires_grad = true;
  bool aux_requires_grad = false;
  std::vector<BlockSpec> blocks;
  Strategy strategy = Strategy::kPerBlock;
  std::vector<Mode> outer_modes;    // kNested, per group
  int64_t segments = 1;             // kSequential
  std::vector<int64_t> starts;      // kSegments
  bool checkpoint_last = false;     // kSequential, kSegments
  bool segments_reentrant = false;  // kSequential, kSegments: the segments' mode
  uint64_t plan_seed = 0;           // kPlan: the plan is made from this seed and the block count
  bool use_grad_api = false;        // torch::autograd::grad instead of backward()
  bool second_backward = false;     // retain_graph, then a second backward (gradients double)
  bool preserve_rng = true;
  bool early_stop = true;  // kNonReentrant regions' early stopping
  // Matrix multiplications (linear, shared, conv, matmul) run as remat::keep(kMatmul) calls, kept by
  // kNonReentrant regions; kPlan's chain has Fk.
  bool keep = false;
  // The operator-level policy of kNonReentrant regions and segments, and of kPlan's Fk[name] stages: 0 none,
  // 1 matmuls, 2 recompute_pointwise, 3 "by-name", which keeps the operators whose name hashes odd with the
  // seed (a different random set of kept operators per program: dropout, softmax, norms...).
  int policy = 0;
  // Checkpointed regions do not declare their modules (kReentrant finds the parameters in its forward pass).
  bool undeclared = false;
  // Every block adds a tensor computed outside the blocks from a parameter (it requires grad), captured.
  bool captured = false;
  // kPerBlock and kNested: block 0 runs inside these nested regions, outermost first.
  std::vector<Mode> wrap;
  // kPerBlock, the checkpointed run: remat::Offload scopes, each opened before block `open` and closed after
  // block `close` (blocks.size(): after the backward pass); scopes closing at one point close in their order
  // here, whatever the order they opened in.
  struct OffloadScope {
    size_t open = 0, close = 0;
    int64_t min_bytes = 0;
    bool bounded = false;  // a pool of 1 KiB: the rest stays on the device
    int delay = 0;         // OffloadOptions::copy_delay
  };
  std::vector<OffloadScope> offloads;
  // Micro-batches of these batch sizes, each a forward and backward pass, accumulated into one step (empty:
  // one of `batch`).
  std::vector<int64_t> micro;
  bool partial_grad = false;  // autograd::grad asks for every other target only
  bool twin = false;  // kWriteSaved writes a copy: the valid twin of a program that writes a saved tensor

  // Whether a stage's input may require grad where the plain run's does not, so that its operations save
  // tensors the plain run does not: a kReentrant region's outputs all require grad when an input does (a
  // custom Function, as in PyTorch's reentrant checkpoint); the plan executor makes every stage's input a
  // leaf that requires grad.
  bool records_more_graph() const {
    if (strategy == Strategy::kPlan) return true;
    if (std::find(wrap.begin(), wrap.end(), 2) != wrap.end()) return true;
    switch (strategy) {
      case Strategy::kPerBlock:
        return std::any_of(blocks.begin(), blocks.end(), [](const BlockSpec& b) { return b.mode == 2; });
      case Strategy::kNested:
        return std::any_of(blocks.begin(), blocks.end(), [](const BlockSpec& b) { return b.mode == 2; }) ||
               std::find(outer_modes.begin(), outer_modes.end(), 2) != outer_modes.end();
      case Strategy::kSequential:
      case Strategy::kSegments:
        return segments_reentrant;
      case Strategy::kPlan:
        return true;
    }
    return false;
  }

  bool writes_saved() const {
    for (const auto& b : blocks)
      for (const auto& op : b.ops)
        if (op.code == OpCode::kWriteSaved) return true;
    return false;
  }

  std::string str() const {
    std::ostringstream os;
    os << (regions ? "regions" : "chain") << " batch " << batch << " width " << width << ", input "
       << (input_requires_grad ? "requires grad" : "constant");
    if (regions) os << ", aux " << (aux_requires_grad ? "requires grad" : "constant");
    os << "; strategy " << strategy_text(strategy);
    if (strategy == Strategy::kSequential) os << "(" << segments << ")";
    if (strategy == Strategy::kSegments) os << "(starts " << c10::IntArrayRef(starts) << ")";
    if (strategy == Strategy::kPlan) os << "(plan seed " << plan_seed << ")";
    if (checkpoint_last) os << " last segment checkpointed";
    if ((strategy == Strategy::kSequential || strategy == Strategy::kSegments) && segments_reentrant)
      os << ", segments kReentrant";
    os << "; " << (use_grad_api ? "autograd::grad" : "backward()") << (second_backward ? " twice" : "")
       << (preserve_rng ? "" : ", rng not preserved") << (early_stop ? "" : ", no early stop")
       << (keep ? ", matmuls kept" : "") << (policy ? ", policy " + policy_name() : "")
       << (undeclared ? ", modules undeclared" : "") << (captured ? ", a tensor captured" : "");
    if (!wrap.empty()) {
      os << ", block 0 wrapped " << wrap.size() << " deep (";
      for (size_t k = 0; k < wrap.size() && k < 8; ++k)
        os << (k ? " " : "") << mode_text(wrap[k]);
      os << (wrap.size() > 8 ? " ...)" : ")");
    }
    for (const auto& o : offloads) {
      os << ", Offload(min_bytes " << o.min_bytes << (o.bounded ? ", 1 KiB pool" : "")
         << (o.delay ? ", copy delay " + std::to_string(o.delay) : "") << ") blocks " << o.open << ".."
         << (o.close == blocks.size() ? std::string("backward") : std::to_string(o.close));
    }
    if (!micro.empty()) os << ", micro-batches " << c10::IntArrayRef(micro);
    if (partial_grad) os << ", grad of every other target";
    if (twin) os << ", twin";
    os << "\n";
    for (size_t b = 0; b < blocks.size(); ++b) {
      os << "  block " << b << " [" << mode_text(blocks[b].mode);
      if (strategy == Strategy::kNested) {
        os << ", group " << blocks[b].group << " (" << mode_text(outer_modes[blocks[b].group]) << ")";
      }
      os << (blocks[b].int_out ? ", int output" : "") << "]:";
      for (const auto& op : blocks[b].ops) {
        os << " " << op_text(op.code);
        if (op.code == OpCode::kShared) os << "#" << op.shared;
      }
      os << "\n";
    }
    return os.str();
  }

  std::string policy_name() const {
    static const char* names[] = {"", "matmuls", "recompute_pointwise", "by-name"};
    return names[policy];
  }
  // The policy itself (an empty one for 0).
  remat::Policy make_policy() const {
    if (policy == 0) return {};
    if (policy < 3) return remat::policy::preset(policy_name());
    const uint64_t salt = seed;
    return remat::Policy("by-name", [salt](const remat::OpCall& c) {
      return ((std::hash<std::string>()(c.name) ^ salt) >> 3) & 1;
    });
  }
};

// Whether the strategy's structure still fits the blocks (after the shrinker removed some).
void normalize(Program& p) {
  const int64_t n = static_cast<int64_t>(p.blocks.size());
  if (p.strategy != Strategy::kPerBlock) p.offloads.clear();
  std::vector<Program::OffloadScope> scopes;
  for (auto o : p.offloads) {
    if (static_cast<int64_t>(o.open) >= n) continue;
    o.close = std::min(std::max(o.close, o.open), static_cast<size_t>(n));
    scopes.push_back(o);
  }
  p.offloads = scopes;
  if (p.strategy == Strategy::kSequential)
    p.segments = std::min<int64_t>(std::max<int64_t>(p.segments, 1), n);
  if (p.strategy == Strategy::kSegments) {
    std::vector<int64_t> s{0};
    for (int64_t v : p.starts) {
      if (v > s.back() && v < n) s.push_back(v);
    }
    p.starts = s;
  }
  if (p.strategy == Strategy::kNested) {
    // Groups renumbered 0.. in order of appearance (they stay consecutive).
    int64_t last = -1, next = -1;
    std::vector<Mode> modes;
    for (auto& b : p.blocks) {
      if (b.group != last) {
        last = b.group;
        ++next;
        modes.push_back(p.outer_modes[static_cast<size_t>(last)]);
      }
      b.group = next;
    }
    p.outer_modes = modes;
  }
}

Program generate(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  Program p;
  p.seed = seed;
  p.regions = coin(0.4);
  p.batch = pick(2, 5);
  p.width = 4 * pick(1, 4);
  p.pool = pick(1, 3);
  p.input_requires_grad = coin(0.8);
  p.aux_requires_grad = coin(0.5);
  const int64_t n = pick(1, 6);
  const int64_t last_code = static_cast<int64_t>(p.regions ? OpCode::kIndexIn : OpCode::kArgmaxGather);
  for (int64_t b = 0; b < n; ++b) {
    BlockSpec block;
    const int64_t ops = pick(1, 5);
    for (int64_t k = 0; k < ops; ++k) {
      OpSpec op;
      op.code = static_cast<OpCode>(pick(0, last_code));
      op.shared = pick(0, p.pool - 1);
      block.ops.push_back(op);
    }
    block.mode = static_cast<Mode>(pick(0, 2));
    block.int_out = p.regions && coin(0.3);
    p.blocks.push_back(block);
  }
  const int64_t kinds = p.regions ? 2 : 5;
  p.strategy = static_cast<Strategy>(pick(0, kinds - 1));
  if (p.strategy == Strategy::kNested) {
    int64_t group = 0;
    for (int64_t b = 0; b < n; ++b) {
      if (b > 0 && coin(0.4)) ++group;
      p.blocks[b].group = group;
    }
    for (int64_t g = 0; g <= group; ++g)
      p.outer_modes.push_back(static_cast<Mode>(pick(1, 2)));
  }
  p.segments = pick(1, n);
  for (int64_t b = 1; b < n; ++b) {
    if (coin(0.5)) p.starts.push_back(b);
  }
  p.starts.insert(p.starts.begin(), 0);
  p.checkpoint_last = coin(0.3);
  p.plan_seed = rng();
  p.segments_reentrant =
      (p.plan_seed >> 7) & 1;                // from a draw already made: earlier seeds keep their programs
  p.early_stop = !((p.plan_seed >> 8) & 1);  // from a draw already made, as above
  p.keep = (p.plan_seed >> 9) & 1;           // likewise
  p.policy = static_cast<int>((p.plan_seed >> 10) & 3);  // likewise
  p.undeclared = (p.plan_seed >> 12) & 1;                // likewise
  // Likewise; not under the plan executor, which refuses a captured tensor that requires grad (an error
  // naming it, tested in sequential_test.cpp): its stages run as nested backward passes.
  p.captured = ((p.plan_seed >> 13) & 3) == 0 && p.strategy != Strategy::kPlan;
  {
    // Likewise: a quarter of the programs wrap their first block 1 to 4 deep; one in 32 wraps it 61 to 68
    // deep.
    const uint64_t bits = p.plan_seed * 0x9E3779B97F4A7C15ull;
    size_t depth = 0;
    if (((bits >> 20) & 31) == 0) {
      depth = 61 + ((bits >> 25) & 7);
    } else if (((bits >> 28) & 3) == 0) {
      depth = 1 + ((bits >> 30) & 3);
    }
    for (size_t k = 0; k < depth; ++k)
      p.wrap.push_back(static_cast<Mode>(1 + (((bits >> (33 + k % 31)) & 1) ^ ((k / 31) & 1))));
  }
  p.use_grad_api = coin(0.35);
  p.second_backward = coin(0.25);
  p.preserve_rng = true;
  {
    // What users do around checkpointing (issue 41), from a stream of its own: the draws above are unchanged.
    std::mt19937_64 more(seed * 0xD1B54A32D192ED03ull + 41);
    auto pick2 = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(more); };
    auto coin2 = [&](double q) { return std::bernoulli_distribution(q)(more); };
    auto insert = [&](OpCode code) {
      auto& ops = p.blocks[static_cast<size_t>(pick2(0, n - 1))].ops;
      ops.insert(ops.begin() + pick2(0, static_cast<int64_t>(ops.size())), OpSpec{code, 0});
    };
    if (coin2(0.3)) insert(OpCode::kSavedView);
    if (coin2(0.25)) insert(OpCode::kComplex);
    if (coin2(0.08)) insert(OpCode::kWriteSaved);
    if (p.strategy == Strategy::kPerBlock && coin2(0.5)) {
      const int64_t scopes = pick2(1, 3);
      for (int64_t k = 0; k < scopes; ++k) {
        Program::OffloadScope o;
        o.open = static_cast<size_t>(pick2(0, n - 1));
        o.close = static_cast<size_t>(pick2(static_cast<int64_t>(o.open), n));
        static const int64_t thresholds[] = {0, 64, int64_t{1} << 30};
        o.min_bytes = thresholds[pick2(0, 2)];
        o.bounded = coin2(0.2);
        o.delay = coin2(0.3) ? static_cast<int>(pick2(1, 3)) : 0;
        p.offloads.push_back(o);
      }
    }
    if (coin2(0.25)) {
      const int64_t m = pick2(2, 3);
      for (int64_t k = 0; k < m; ++k)
        p.micro.push_back(pick2(2, 5));
    }
    p.partial_grad = p.use_grad_api && coin2(0.5);
  }
  {
    // Saved views at offsets (found 2026-12-04 in C++ remat::Offload: a dense view at an offset brought back
    // or found on the device came back from its storage's start, a silently wrong gradient no program here
    // drew), from a stream of their own: the draws above are unchanged.
    std::mt19937_64 views(seed * 0x9FB21C651E98DF25ull + 42);
    auto pick3 = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(views);
    };
    for (OpCode code : {OpCode::kOffsetViews, OpCode::kOffsetGaps}) {
      if (!std::bernoulli_distribution(0.25)(views)) continue;
      auto& ops = p.blocks[static_cast<size_t>(pick3(0, n - 1))].ops;
      ops.insert(ops.begin() + pick3(0, static_cast<int64_t>(ops.size())), OpSpec{code, 0});
    }
  }
  normalize(p);
  return p;
}

// A random valid plan for n stages, from the planner layer: a random chain and one of its planners.
// With a policy name, the chain has its costs too (no new draws) and the plan may run stages as Fk[name]:
// "all" then runs every stage so.
remat::Plan make_random_plan(uint64_t seed, int64_t n, bool keep, const std::string& policy = "") {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  remat::Chain chain;
  chain.input_bytes = pick(1, 8) * 1024;
  for (int64_t i = 0; i < n; ++i) {
    remat::Stage s;
    s.name = "s" + std::to_string(i);
    s.fwd_ms = static_cast<double>(pick(1, 20));
    s.bwd_ms = static_cast<double>(pick(1, 40));
    s.output_bytes = pick(1, 8) * 1024;
    s.saved_bytes = s.output_bytes + pick(0, 16) * 1024;
    s.fwd_tmp_bytes = pick(0, 4) * 1024;
    s.bwd_tmp_bytes = pick(0, 4) * 1024;
    if (keep) {  // from the draws above: every seed keeps its chain
      s.keep_saved_bytes = s.output_bytes + (s.saved_bytes - s.output_bytes) / 2;
      s.keep_fwd_ms = s.fwd_ms;
      s.keep_bwd_ms = s.bwd_ms + s.fwd_ms / 4;
    }
    if (!policy.empty()) {
      s.policies.push_back(remat::PolicyCost{policy, s.output_bytes + (s.saved_bytes - s.output_bytes) / 3,
                                             s.fwd_ms, s.bwd_ms + s.fwd_ms / 2});
    }
    chain.stages.push_back(s);
  }
  if (keep) chain.keep = {remat::kMatmul};
  if (!policy.empty()) chain.policies = {policy};
  switch (pick(0, 5)) {
    case 0:
      return remat::no_checkpoint(chain);
    case 1:
      return policy.empty() ? remat::checkpoint_all(chain)
                            : remat::make_plan(chain, "all-policy-" + policy, -1);
    case 2:
      return remat::uniform(chain, pick(1, n), pick(0, 1) == 1);
    case 3:
      return remat::revolve(chain, pick(0, n));
    default: {
      const int64_t lo = remat::min_feasible_budget(chain);
      const int64_t hi = remat::simulate(chain, remat::no_checkpoint(chain)).peak_bytes;
      return remat::optimal(chain, lo + (hi > lo ? pick(0, hi - lo) : 0));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// The modules of a program, built from its seed (the same weights in every run)

struct BlockImpl : torch::nn::Module {
  BlockImpl(const Program& p, const BlockSpec& spec, const std::vector<torch::nn::Linear>& pool,
            const torch::Tensor* captured)
      : spec_(spec), keep_(p.keep), twin_(p.twin), captured_(p.captured ? captured : nullptr) {
    const int64_t w = p.width;
    int64_t k = 0;
    for (const auto& op : spec.ops) {
      const std::string name = std::to_string(k++);
      switch (op.code) {
        case OpCode::kLinear:
          linear.push_back(register_module("linear" + name, torch::nn::Linear(w, w)));
          break;
        case OpCode::kShared:
          // Registered in every block that uses it: parameters() of a container lists it once.
          shared.push_back(register_module("shared" + name, pool[static_cast<size_t>(op.shared)]));
          break;
        case OpCode::kConv:
          conv.push_back(register_module("conv" + name,
                                         torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 2, 3).padding(1))));
          break;
        case OpCode::kMatmul:
          matrix.push_back(register_parameter("matrix" + name, torch::randn({w, w}) * 0.3));
          break;
        case OpCode::kLayerNorm:
          norm.push_back(
              register_module("norm" + name, torch::nn::LayerNorm(torch::nn::LayerNormOptions({w}))));
          break;
        case OpCode::kBatchNorm:
          bn.push_back(register_module("bn" + name, torch::nn::BatchNorm1d(w)));
          break;
        case OpCode::kAddInplace:
          bias.push_back(register_parameter("bias" + name, torch::randn({w}) * 0.1));
          break;
        default:
          break;
      }
    }
  }

  // The block on its inputs: {h} for a chain; {h, aux} or {h, aux, idx} for a region. Returns {h} for a
  // chain, {h, aux'} (+ {idx'} when int_out) for a region.
  // A matrix multiplication: a remat::keep call when the program keeps them.
  torch::Tensor mm(const remat::TensorFn& f, const torch::Tensor& x) {
    return keep_ ? remat::keep(remat::kMatmul, f, x) : f(x);
  }

  std::vector<torch::Tensor> run(const std::vector<torch::Tensor>& in) {
    torch::Tensor h = in[0];
    const int64_t b = h.size(0), w = h.size(1);
    size_t li = 0, si = 0, ci = 0, mi = 0, ni = 0, bi = 0, ai = 0;
    for (const auto& op : spec_.ops) {
      switch (op.code) {
        case OpCode::kLinear:
          h = mm([&](const torch::Tensor& t) { return linear[li](t); }, h), ++li;
          break;
        case OpCode::kShared:
          h = mm([&](const torch::Tensor& t) { return shared[si](t); }, h), ++si;
          break;
        case OpCode::kConv:
          h = mm([&](const torch::Tensor& t) { return conv[ci](t); }, h.reshape({b, 2, w / 4, 2}))
                  .reshape({b, w});
          ++ci;
          break;
        case OpCode::kMatmul:
          h = mm([&](const torch::Tensor& t) { return t.matmul(matrix[mi]); }, h), ++mi;
          break;
        case OpCode::kAttention: {
          auto q = h.reshape({b, 2, w / 2});
          auto s = torch::softmax(torch::bmm(q, q.transpose(1, 2)), -1);
          h = torch::bmm(s, q).reshape({b, w});
          break;
        }
        case OpCode::kGelu:
          h = torch::gelu(h);
          break;
        case OpCode::kRelu:
          h = torch::relu(h);
          break;
        case OpCode::kSoftmax:
          h = torch::softmax(h, 1);
          break;
        case OpCode::kLayerNorm:
          h = norm[ni++](h);
          break;
        case OpCode::kBatchNorm:
          h = bn[bi++](h);
          break;
        case OpCode::kDropout:
          h = torch::dropout(h, 0.25, /*train=*/true);
          break;
        case OpCode::kReluInplace:
          h = (h + 0.1).relu_();
          break;
        case OpCode::kAddInplace:
          h = (h * 2).add_(bias[ai++]);
          break;
        case OpCode::kMulInplace:
          h = (h + 0.5).mul_(torch::sigmoid(h));
          break;
        case OpCode::kTranspose:
          h = h.reshape({b, 2, w / 2}).transpose(1, 2).reshape({b, w});
          break;
        case OpCode::kNarrowCat:
          h = torch::cat({torch::tanh(h.narrow(1, w / 2, w / 2)), h.narrow(1, 0, w / 2)}, 1);
          break;
        case OpCode::kSelectStack: {
          auto v = h.reshape({b, 2, w / 2});
          h = torch::stack({v.select(1, 1) * 2, v.select(1, 0)}, 1).reshape({b, w});
          break;
        }
        case OpCode::kSplitCat: {
          auto parts = h.split(w / 4, 1);
          std::vector<torch::Tensor> rev(parts.rbegin(), parts.rend());
          rev[0] = torch::sigmoid(rev[0]);
          h = torch::cat(rev, 1);
          break;
        }
        case OpCode::kReduce:
          h = h - h.mean(1, true) + 0.1 * h.sum(0, true);
          break;
        case OpCode::kArgmaxGather:
          h = h + h.gather(1, h.argmax(1, true));
          break;
        case OpCode::kAux:
          if (in.size() > 1) h = h * in[1];
          break;
        case OpCode::kIndexIn:
          if (in.size() > 2) h = h + h.gather(1, in[2]);
          break;
        case OpCode::kSavedView: {
          const torch::Tensor u = h * 2;
          h = torch::gelu(u) + torch::sin(u.t()).t();
          break;
        }
        case OpCode::kComplex: {
          const torch::Tensor c = torch::view_as_complex(h.contiguous().reshape({b, w / 2, 2}));
          const torch::Tensor z = c * c.conj();
          h = torch::cat({torch::real(z) * 0.5, torch::imag(c.conj()) * torch::real(c)}, 1);
          break;
        }
        case OpCode::kWriteSaved: {
          torch::Tensor t = torch::sigmoid(h);  // saves its output...
          if (twin_) t = t.clone();
          t.mul_(2);  // ...written here (the twin writes a copy)
          h = t + h;
          break;
        }
        case OpCode::kOffsetViews:
        case OpCode::kOffsetGaps: {
          if (b < 2) break;
          const torch::Tensor u = h * 2;
          const torch::Tensor top = u.narrow(0, 0, b / 2), bottom = u.narrow(0, b / 2, b - b / 2);
          torch::Tensor v = torch::cat({torch::sin(top) + torch::cos(top.t()).t(),
                                        bottom * torch::sigmoid(bottom) + torch::sin(bottom.t()).t()},
                                       0);
          if (op.code == OpCode::kOffsetGaps) {
            v = v + torch::cat({u.narrow(1, 0, w / 2), torch::sin(u.narrow(1, w / 2, w / 2))}, 1);
          }
          h = torch::gelu(u) + v;
          break;
        }
        case OpCode::kCount:
          break;
      }
    }
    if (captured_ != nullptr) h = h + *captured_;  // computed outside every region, requires grad
    if (in.size() == 1) return {h};
    std::vector<torch::Tensor> out{h, in[1] * 0.9 + torch::tanh(h) * 0.1};
    if (spec_.int_out) out.push_back(h.argmax(1, true));
    return out;
  }
  torch::Tensor forward(const torch::Tensor& x) { return run({x})[0]; }

  BlockSpec spec_;
  bool keep_ = false;
  bool twin_ = false;
  const torch::Tensor* captured_ = nullptr;
  std::vector<torch::nn::Linear> linear, shared;
  std::vector<torch::nn::Conv2d> conv;
  std::vector<torch::Tensor> matrix, bias;
  std::vector<torch::nn::LayerNorm> norm;
  std::vector<torch::nn::BatchNorm1d> bn;
};
TORCH_MODULE(Block);

// Everything one run produces that must not depend on the strategy.
struct Outcome {
  torch::Tensor loss;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;  // gradients, buffers, the RNG's next draws
  // Per tensor: compared within kSumTolerance rather than bitwise. Only the gradients of parameters shared
  // by several blocks: their contributions are summed in an order that depends on the schedule.
  std::vector<bool> tolerant;
  std::string error;  // a c10::Error, if the run threw
  // Tensor bytes alive at the end (the model, its gradients, the inputs, what is compared): a step that
  // leaves more than the plain one holds what it should have freed.
  int64_t alive_after = 0;
};

struct Instance {
  torch::nn::Sequential seq;  // the blocks, in order (registered once each)
  std::vector<Block> blocks;
  std::vector<torch::nn::Linear> pool;
  torch::Tensor x, aux;
  torch::Tensor source;                     // a parameter outside the blocks (Program::captured)
  std::unique_ptr<torch::Tensor> captured;  // computed from it at the forward's start; the blocks read it
};

Instance build(const Program& p) {
  torch::manual_seed(static_cast<int64_t>(p.seed % 1000003));
  Instance in;
  for (int64_t k = 0; k < p.pool; ++k)
    in.pool.push_back(torch::nn::Linear(p.width, p.width));
  in.captured = std::make_unique<torch::Tensor>();
  if (p.captured) in.source = (torch::randn({p.width}) * 0.2).requires_grad_(true);
  in.seq = torch::nn::Sequential();
  for (const auto& spec : p.blocks) {
    in.blocks.push_back(Block(p, spec, in.pool, in.captured.get()));
    in.seq->push_back(in.blocks.back());
  }
  in.x = torch::randn({p.batch, p.width});
  if (p.input_requires_grad) in.x.requires_grad_(true);
  in.aux = torch::rand({p.batch, p.width}) + 0.5;
  if (p.aux_requires_grad) in.aux.requires_grad_(true);
  return in;
}

CheckpointOptions options_for(Mode m, const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                              const Program& p) {
  std::vector<std::string> keep;
  if (p.keep && m != 2) keep.push_back(remat::kMatmul);
  return CheckpointOptions()
      .mode(m == 2 ? CheckpointMode::kReentrant : CheckpointMode::kNonReentrant)
      .modules(p.undeclared ? std::vector<std::shared_ptr<torch::nn::Module>>{} : modules)
      .preserve_rng_state(p.preserve_rng)
      .early_stop(p.early_stop)
      .keep(keep)
      .policy(m == 1 ? p.make_policy() : remat::Policy());
}

// Runs block b (a region) with the given mode (kReentrant finds what it uses that requires grad, declared or
// not, inputs requiring grad or not).
std::vector<torch::Tensor> run_region(Instance& in, size_t b, Mode mode,
                                      const std::vector<torch::Tensor>& args, const Program& p) {
  Block block = in.blocks[b];
  if (mode == 0) return block->run(args);
  std::vector<std::shared_ptr<torch::nn::Module>> modules{block.ptr()};
  return remat::checkpoint([block](const std::vector<torch::Tensor>& a) mutable { return block->run(a); },
                           args, options_for(mode, modules, p));
}

// Block 0 (as run_region with `mode`) inside p.wrap's regions from `level` in. Captures only what outlives
// the backward pass (the instance and the program).
std::vector<torch::Tensor> run_wrapped(Instance* in, const Program* p, size_t level, Mode mode,
                                       const std::vector<torch::Tensor>& args) {
  if (level == p->wrap.size()) return run_region(*in, 0, mode, args, *p);
  std::vector<std::shared_ptr<torch::nn::Module>> modules{in->blocks[0].ptr()};
  return remat::checkpoint(
      [in, p, level, mode](const std::vector<torch::Tensor>& a) {
        return run_wrapped(in, p, level + 1, mode, a);
      },
      args, options_for(p->wrap[level], modules, *p));
}

// The forward pass of the program under its strategy (plain when `plain`); returns the loss. Offload scopes
// that stay open through the backward pass go to `after_backward`.
torch::Tensor forward(const Program& p, Instance& in, bool plain,
                      std::vector<std::unique_ptr<remat::Offload>>* after_backward) {
  const size_t n = p.blocks.size();
  if (p.captured) *in.captured = torch::tanh(in.source) * 0.5;
  std::vector<torch::Tensor> state{in.x};
  if (p.regions) state.push_back(in.aux);
  auto finish = [&](const std::vector<torch::Tensor>& s) {
    torch::Tensor loss = s[0].pow(2).sum();
    if (s.size() > 1) loss = loss + (s[1] * s[0]).sum();
    if (s.size() > 2) loss = loss + s[0].gather(1, s[2]).sum();
    return loss;
  };
  if (plain) {
    for (size_t b = 0; b < n; ++b)
      state = run_region(in, b, 0, state, p);
    return finish(state);
  }
  // Regions consume {h, aux} or {h, aux, idx}; an integer output of one block feeds the next.
  auto step = [&](size_t b, Mode mode, std::vector<torch::Tensor> s) {
    return run_region(in, b, mode, s, p);
  };
  const remat::SequentialOptions seq_opts =
      remat::SequentialOptions()
          .checkpoint(CheckpointOptions()
                          .preserve_rng_state(p.preserve_rng)
                          .mode(p.segments_reentrant ? remat::CheckpointMode::kReentrant
                                                     : remat::CheckpointMode::kNonReentrant)
                          .keep(p.keep && !p.segments_reentrant ? std::vector<std::string>{remat::kMatmul}
                                                                : std::vector<std::string>{})
                          .policy(p.segments_reentrant ? remat::Policy() : p.make_policy()))
          .checkpoint_last_segment(p.checkpoint_last);
  switch (p.strategy) {
    case Strategy::kPerBlock: {
      std::vector<std::unique_ptr<remat::Offload>> open(p.offloads.size());
      for (size_t b = 0; b < n; ++b) {
        for (size_t k = 0; k < p.offloads.size(); ++k) {
          const Program::OffloadScope& o = p.offloads[k];
          if (o.open != b) continue;
          remat::OffloadOptions options;
          options.min_bytes(o.min_bytes).copy_delay(o.delay);
          if (o.bounded) options.pool(std::make_shared<remat::HostPool>(1024, false));
          open[k] = std::make_unique<remat::Offload>(options);
        }
        state = b == 0 ? run_wrapped(&in, &p, 0, p.blocks[0].mode, state) : step(b, p.blocks[b].mode, state);
        for (size_t k = 0; k < p.offloads.size(); ++k) {
          if (p.offloads[k].close == b) open[k].reset();  // in this order, whatever the order of opening
        }
      }
      for (auto& o : open) {
        if (o) after_backward->push_back(std::move(o));
      }
      return finish(state);
    }
    case Strategy::kNested: {
      size_t b = 0;
      while (b < n) {
        const int64_t g = p.blocks[b].group;
        size_t e = b;
        while (e < n && p.blocks[e].group == g)
          ++e;
        std::vector<std::shared_ptr<torch::nn::Module>> modules;
        for (size_t k = b; k < e; ++k)
          modules.push_back(in.blocks[k].ptr());
        const Mode outer = p.outer_modes[static_cast<size_t>(g)];
        const size_t first = b, last = e;
        // Kept until the backward pass: it captures only what outlives it (the program and the instance).
        Instance* inst = &in;
        const Program* prog = &p;
        auto group_fn = [inst, prog, first, last](const std::vector<torch::Tensor>& s0) {
          std::vector<torch::Tensor> s = s0;
          for (size_t k = first; k < last; ++k)
            s = k == 0 ? run_wrapped(inst, prog, 0, prog->blocks[0].mode, s)
                       : run_region(*inst, k, prog->blocks[k].mode, s, *prog);
          return s;
        };
        state = remat::checkpoint(group_fn, state, options_for(outer, modules, p));
        b = e;
      }
      return finish(state);
    }
    case Strategy::kSequential:
      return finish({remat::checkpoint_sequential(in.seq, p.segments, in.x, seq_opts)});
    case Strategy::kSegments:
      return finish({remat::checkpoint_segments(in.seq, p.starts, in.x, seq_opts)});
    case Strategy::kPlan: {
      std::vector<remat::StageFn> stages;
      for (size_t b = 0; b < n; ++b) {
        Block block = in.blocks[b];
        stages.push_back(remat::StageFn{"b" + std::to_string(b),
                                        [block](const torch::Tensor& t) mutable { return block->forward(t); },
                                        block.ptr()});
      }
      const remat::Plan plan =
          make_random_plan(p.plan_seed, static_cast<int64_t>(n), p.keep, p.policy_name());
      return finish(
          {remat::run_plan(stages, plan, in.x,
                           CheckpointOptions().preserve_rng_state(p.preserve_rng).policy(p.make_policy()))});
    }
  }
  return {};
}

// One complete run: build, then per micro-batch forward and backward (or grad), then collect everything
// comparable.
Outcome run(const Program& p, bool plain) {
  Outcome out;
  const int64_t at_start = remat::memory::active_bytes();
  Instance in = build(p);
  try {
    std::vector<torch::Tensor> targets;  // the parameters, then the captured tensor's source
    std::vector<std::string> names;
    std::vector<bool> tolerant;
    std::unordered_set<c10::TensorImpl*> shared_by_blocks;
    for (int64_t k = 0; k < p.pool; ++k) {
      int64_t users = 0;
      for (const auto& b : p.blocks) {
        users += std::any_of(b.ops.begin(), b.ops.end(),
                             [&](const OpSpec& op) { return op.code == OpCode::kShared && op.shared == k; });
      }
      if (users < 2) continue;
      for (const auto& t : in.pool[static_cast<size_t>(k)]->parameters())
        shared_by_blocks.insert(t.unsafeGetTensorImpl());
    }
    for (const auto& np : in.seq->named_parameters()) {
      targets.push_back(np.value());
      names.push_back("grad " + np.key());
      tolerant.push_back(shared_by_blocks.count(np.value().unsafeGetTensorImpl()) > 0);
    }
    if (p.captured) {  // every block adds it: contributions summed in a schedule's order
      targets.push_back(in.source);
      names.push_back("grad of the captured tensor's source");
      tolerant.push_back(true);
    }
    const size_t num_params = targets.size();
    std::vector<torch::Tensor> grads(num_params);  // autograd::grad's, summed over the micro-batches
    const std::vector<int64_t> sizes = p.micro.empty() ? std::vector<int64_t>{p.batch} : p.micro;
    for (size_t m = 0; m < sizes.size(); ++m) {
      const std::string tag = p.micro.empty() ? "" : "[" + std::to_string(m) + "]";
      if (!p.micro.empty()) {  // the micro-batch's inputs, drawn in the same order in every run
        in.x = torch::randn({sizes[m], p.width}).requires_grad_(p.input_requires_grad);
        in.aux = (torch::rand({sizes[m], p.width}) + 0.5).requires_grad_(p.aux_requires_grad);
      }
      std::vector<std::unique_ptr<remat::Offload>> after_backward;
      torch::Tensor loss = forward(p, in, plain, &after_backward);
      out.loss = out.loss.defined() ? out.loss + loss.detach() : loss.detach().clone();
      std::vector<torch::Tensor> step_targets(targets.begin(), targets.begin() + num_params);
      std::vector<std::string> step_names(names.begin(), names.begin() + num_params);
      if (in.x.requires_grad()) {
        step_targets.push_back(in.x);
        step_names.push_back("grad x" + tag);
      }
      if (p.regions && in.aux.requires_grad()) {
        step_targets.push_back(in.aux);
        step_names.push_back("grad aux" + tag);
      }
      // autograd::grad over part of the graph: every other target.
      std::vector<size_t> asked;
      for (size_t k = 0; k < step_targets.size(); ++k) {
        if (!p.partial_grad || k % 2 == 0) asked.push_back(k);
      }
      std::vector<torch::Tensor> step_grads(step_targets.size());
      const int rounds = p.second_backward ? 2 : 1;
      for (int r = 0; r < rounds; ++r) {
        const bool retain = r + 1 < rounds;
        if (!loss.requires_grad()) break;
        if (p.use_grad_api) {
          std::vector<torch::Tensor> want;
          for (size_t k : asked)
            want.push_back(step_targets[k]);
          if (want.empty()) break;
          auto g = torch::autograd::grad({loss}, want, {}, retain, false, /*allow_unused=*/true);
          for (size_t j = 0; j < g.size(); ++j) {
            torch::Tensor& acc = step_grads[asked[j]];
            if (g[j].defined()) acc = acc.defined() ? acc + g[j] : g[j];
          }
        } else {
          loss.backward({}, retain);
        }
      }
      loss = torch::Tensor();
      after_backward.clear();  // Offload scopes open through the backward pass end now
      for (size_t k = 0; k < num_params; ++k) {
        if (step_grads[k].defined()) grads[k] = grads[k].defined() ? grads[k] + step_grads[k] : step_grads[k];
      }
      for (size_t k = num_params; k < step_targets.size(); ++k) {  // this micro-batch's inputs
        torch::Tensor g = p.use_grad_api ? step_grads[k] : step_targets[k].grad();
        out.tensors.emplace_back(step_names[k], g.defined() ? g.detach().clone() : torch::Tensor());
        out.tolerant.push_back(false);
        if (p.use_grad_api && step_targets[k].grad().defined()) {
          out.tensors.emplace_back(step_names[k] + " (.grad under autograd::grad)",
                                   step_targets[k].grad().clone());
          out.tolerant.push_back(false);
        }
      }
    }
    for (size_t k = 0; k < num_params; ++k) {
      torch::Tensor g = p.use_grad_api ? grads[k] : targets[k].grad();
      out.tensors.emplace_back(names[k], g.defined() ? g.detach().clone() : torch::Tensor());
      out.tolerant.push_back(tolerant[k]);
      if (p.use_grad_api && targets[k].grad().defined()) {
        out.tensors.emplace_back(names[k] + " (.grad under autograd::grad)", targets[k].grad().clone());
        out.tolerant.push_back(false);
      }
    }
    for (const auto& nb : in.seq->named_buffers()) {
      out.tensors.emplace_back("buffer " + nb.key(), nb.value().clone());
      out.tolerant.push_back(false);
    }
    out.tensors.emplace_back("rng after the step", torch::rand({8}));
    out.tolerant.push_back(false);
    out.alive_after = remat::memory::active_bytes() - at_start;
  } catch (const c10::Error& e) {
    out.error = e.what_without_backtrace();
    // A backward pass that threw leaves its other nodes' tasks, with the gradients they were handed, in this
    // thread's ready queue until the next backward pass here drops them (LibTorch's engine): one now, so
    // that the next program's bytes are its own.
    torch::ones({1}, torch::requires_grad()).sum().backward();
  }
  return out;
}

// Relative tolerance for sums whose order depends on the schedule (see Outcome::tolerant).
constexpr double kSumTolerance = 1e-5;

// Empty when the outcomes agree; otherwise what differs.
std::string compare(const Outcome& plain, const Outcome& got) {
  std::ostringstream os;
  if (!plain.error.empty())
    return "";  // the program itself is invalid (the plain run throws): nothing to test
  if (!got.error.empty()) return "the checkpointed run threw: " + got.error;
  if (!plain.loss.equal(got.loss))
    os << "loss " << plain.loss.item<double>() << " vs " << got.loss.item<double>() << "; ";
  if (plain.alive_after != got.alive_after)
    os << "bytes alive after the step " << plain.alive_after << " vs " << got.alive_after << "; ";
  if (plain.tensors.size() != got.tensors.size()) {
    os << plain.tensors.size() << " compared tensors vs " << got.tensors.size();
    return os.str();
  }
  for (size_t k = 0; k < plain.tensors.size(); ++k) {
    const auto& [name, a] = plain.tensors[k];
    const auto& b = got.tensors[k].second;
    if (a.defined() != b.defined()) {
      os << name << " defined " << a.defined() << " vs " << b.defined() << "; ";
    } else if (a.defined() && !a.equal(b)) {
      const double diff = remat::testing::max_abs_diff(a, b);
      const double scale = std::max(1.0, a.numel() ? a.abs().max().item<double>() : 0.0);
      if (!plain.tolerant[k] || diff > kSumTolerance * scale) os << name << " differs by " << diff << "; ";
    }
  }
  return os.str();
}

// Whether an error is autograd's for a saved tensor written in place, or remat's for one written while its
// copy to the host was in flight.
bool written_error(const std::string& e) {
  return e.find("modified by an inplace operation") != std::string::npos ||
         e.find("modified by an in-place operation while its copy") != std::string::npos;
}

// The plain and the checkpointed run, in an order that varies with the seed.
std::string check(const Program& p) {
  Outcome plain, got;
  if (p.seed % 2) {
    got = run(p, false);
    plain = run(p, true);
  } else {
    plain = run(p, true);
    got = run(p, false);
  }
  if (!plain.error.empty() && p.writes_saved() && !p.twin && written_error(plain.error)) {
    // It writes a saved tensor: the plain run's error, or the gradient of the values saved (a recompute or a
    // copy on the host still has them), which is its valid twin's; nothing else.
    if (!got.error.empty())
      return written_error(got.error) ? "" : "the checkpointed run threw another error: " + got.error;
    Program twin = p;
    twin.twin = true;
    return compare(run(twin, true), got);
  }
  // A write to what operations save where the plain run saved nothing (their input requires grad only under
  // remat: records_more_graph) is refused by autograd: a limit of those ways, docs/RELIABILITY.md.
  if (plain.error.empty() && written_error(got.error) && p.writes_saved() && p.records_more_graph())
    return "";
  return compare(plain, got);
}

// Smaller programs that still fail: blocks removed, ops removed, options simplified, until nothing helps.
Program shrink(Program p) {
  bool progress = true;
  int budget = 400;
  auto try_candidate = [&](const Program& c) {
    if (budget-- <= 0) return false;
    if (c.blocks.empty()) return false;
    if (!check(c).empty()) {
      p = c;
      return true;
    }
    return false;
  };
  while (progress && budget > 0) {
    progress = false;
    for (size_t b = 0; b < p.blocks.size() && !progress; ++b) {
      Program c = p;
      c.blocks.erase(c.blocks.begin() + static_cast<long>(b));
      normalize(c);
      progress = try_candidate(c);
    }
    for (size_t b = 0; b < p.blocks.size() && !progress; ++b) {
      for (size_t k = 0; k < p.blocks[b].ops.size() && !progress; ++k) {
        Program c = p;
        c.blocks[b].ops.erase(c.blocks[b].ops.begin() + static_cast<long>(k));
        progress = try_candidate(c);
      }
    }
    if (!p.wrap.empty() && !progress) {  // a shallower wrap
      Program c = p;
      c.wrap.resize(c.wrap.size() > 4 ? c.wrap.size() / 2 : c.wrap.size() - 1);
      progress = try_candidate(c);
    }
    for (size_t k = 0; k < p.offloads.size() && !progress; ++k) {
      Program c = p;
      c.offloads.erase(c.offloads.begin() + static_cast<long>(k));
      progress = try_candidate(c);
    }
    for (int option = 0; option < 10 && !progress; ++option) {
      Program c = p;
      if (option == 0 && c.second_backward)
        c.second_backward = false;
      else if (option == 1 && c.use_grad_api)
        c.use_grad_api = false;
      else if (option == 2 && c.regions && c.aux_requires_grad)
        c.aux_requires_grad = false;
      else if (option == 3 && !c.input_requires_grad)
        c.input_requires_grad = true;
      else if (option == 4 && c.policy != 0)
        c.policy = 0;
      else if (option == 5 && c.keep)
        c.keep = false;
      else if (option == 6 && c.undeclared)
        c.undeclared = false;
      else if (option == 7 && c.captured)
        c.captured = false;
      else if (option == 8 && !c.micro.empty())
        c.micro.clear();
      else if (option == 9 && c.partial_grad)
        c.partial_grad = false;
      else
        continue;
      progress = try_candidate(c);
    }
  }
  return p;
}

uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 10);
}

// Runs programs of seeds [first, first + count) whose family matches `regions` (any when null); returns how
// many ran. A failure is reported with its reproduction and the shrunk program.
int64_t run_range(uint64_t first, uint64_t count, const bool* regions, bool verbose = false) {
  remat::testing::meter_on();  // Outcome::alive_after
  int64_t ran = 0;
  for (uint64_t seed = first; seed < first + count; ++seed) {
    Program p = generate(seed);
    if (regions != nullptr && p.regions != *regions) continue;
    if (verbose) std::cout << "seed " << seed << ": " << p.str();
    const std::string diff = check(p);
    ++ran;
    if (!diff.empty()) {
      const Program small = shrink(p);
      ADD_FAILURE() << "fuzz seed " << seed << ": " << diff << "\n  reproduce: REMAT_FUZZ_SEED=" << seed
                    << " build/tests/remat_tests --gtest_filter=Fuzz.One\n  program: " << p.str()
                    << "  smallest failing program the shrinker found (" << check(small) << "):\n  "
                    << small.str();
      return ran;
    }
  }
  return ran;
}

// The programs are tiny: one intra-op thread runs them fastest, and keeps oneDNN's OpenMP teams from
// spinning against the other tests ctest runs at the same time. Restored at the end of each test.
class OneThread {
 public:
  OneThread() : previous_(at::get_num_threads()) { at::set_num_threads(1); }
  ~OneThread() { at::set_num_threads(previous_); }

 private:
  int previous_;
};

// The fixed budget ./test runs: seeds 1..N, split by family so ctest runs them in parallel.
constexpr uint64_t kBudget = 1500;

TEST(Fuzz, Chains) {
  OneThread one;
  const bool chains = false;
  const int64_t ran = run_range(1, kBudget, &chains);
  RecordProperty("programs", static_cast<int>(ran));
  std::cout << "fuzz: " << ran << " chain programs of seeds 1.." << kBudget << " ran" << std::endl;
  if (!HasFailure()) EXPECT_GT(ran, static_cast<int64_t>(kBudget / 2));
}

TEST(Fuzz, Regions) {
  OneThread one;
  const bool regions = true;
  const int64_t ran = run_range(1, kBudget, &regions);
  RecordProperty("programs", static_cast<int>(ran));
  std::cout << "fuzz: " << ran << " region programs of seeds 1.." << kBudget << " ran" << std::endl;
  if (!HasFailure()) EXPECT_GT(ran, static_cast<int64_t>(kBudget / 4));
}

TEST(Fuzz, One) {
  OneThread one;
  const uint64_t seed = env_u64("REMAT_FUZZ_SEED", 1);
  run_range(seed, 1, nullptr, /*verbose=*/true);
}

TEST(Fuzz, Long) {
  OneThread one;
  const uint64_t seed = env_u64("REMAT_FUZZ_SEED", 1000000);
  const uint64_t count = env_u64("REMAT_FUZZ_COUNT", 0);
  if (count == 0) GTEST_SKIP() << "set REMAT_FUZZ_COUNT (and REMAT_FUZZ_SEED) to run a long fuzz";
  const uint64_t chunk = 1000;
  for (uint64_t s = seed; s < seed + count; s += chunk) {
    run_range(s, std::min(chunk, seed + count - s), nullptr);
    if (HasFailure()) return;
    std::cout << "fuzz: " << (s + std::min(chunk, seed + count - s) - seed) << " programs passed"
              << std::endl;
  }
}

// The two defects of remat's autograd mechanics as fixed programs: a kReentrant region whose function calls
// another, both using a parameter neither declares (it got a wrong gradient, silently); and a
// kNonReentrant block inside 80 nested kReentrant regions, after plain backward passes (it crashed on 2.15).
TEST(Fuzz, RegressionCases) {
  OneThread one;
  remat::testing::meter_on();
  remat::testing::meter_on();
  Program nested;
  nested.seed = 2;
  nested.width = 8;
  nested.pool = 1;
  nested.undeclared = true;
  nested.strategy = Strategy::kNested;
  nested.outer_modes = {2};
  for (Mode m : {0, 2}) {
    BlockSpec b;
    b.ops = {OpSpec{OpCode::kShared, 0}, OpSpec{OpCode::kGelu, 0}};
    b.mode = m;
    nested.blocks.push_back(b);
  }
  EXPECT_EQ(check(nested), "") << nested.str();
  EXPECT_EQ(check(nested), "") << "AGAIN " << nested.str();
  EXPECT_EQ(check(nested), "") << "AGAIN2 " << nested.str();
  Program deep = nested;
  deep.seed = 4;
  deep.strategy = Strategy::kPerBlock;
  deep.blocks[0].mode = 1;
  deep.wrap.assign(80, 2);
  EXPECT_EQ(check(deep), "") << deep.str();
}

// The generator and the comparison can fail: a deliberately wrong strategy is caught.
TEST(Fuzz, TheComparisonCatchesAWrongGradient) {
  Program p = generate(3);
  Outcome plain = run(p, true);
  Outcome wrong = plain;
  ASSERT_FALSE(wrong.tensors.empty());
  wrong.tensors[0].second =
      wrong.tensors[0].second.defined() ? wrong.tensors[0].second + 1e-7 : torch::ones({1});
  EXPECT_NE(compare(plain, wrong), "");
  // And a checkpointed run whose RNG is not preserved differs where the program draws random numbers.
  for (uint64_t seed = 1; seed < 200; ++seed) {
    Program q = generate(seed);
    bool dropout = false;
    for (const auto& b : q.blocks)
      for (const auto& op : b.ops)
        dropout = dropout || op.code == OpCode::kDropout;
    if (!dropout || q.strategy != Strategy::kPerBlock) continue;
    for (auto& b : q.blocks)
      b.mode = 1;
    q.preserve_rng = false;
    Program with_rng = q;
    with_rng.preserve_rng = true;
    EXPECT_EQ(compare(run(with_rng, true), run(with_rng, false)), "") << with_rng.str();
    // The plain run ignores preserve_rng; the checkpointed one draws fresh masks.
    EXPECT_NE(compare(run(with_rng, true), run(q, false)), "") << q.str();
    return;
  }
  FAIL() << "no per-block program with dropout in the first 200 seeds";
}

}  // namespace
