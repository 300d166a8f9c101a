#pragma once
// Helpers shared by the planner library's tests (plain C++: no LibTorch).

#include <gtest/gtest.h>
#include <remat/planner/chain.h>

#include <random>

#include <string>
#include <vector>

/// Expects `stmt` to throw std::invalid_argument whose message contains every one of the needles.
#define EXPECT_THROW_WITH_STD(stmt, ...)                                                 \
  do {                                                                                   \
    bool thrown_ = false;                                                                \
    try {                                                                                \
      stmt;                                                                              \
    } catch (const std::invalid_argument& e_) {                                          \
      thrown_ = true;                                                                    \
      for (const std::string& needle_ : std::vector<std::string>{__VA_ARGS__})           \
        EXPECT_NE(std::string(e_.what()).find(needle_), std::string::npos) << e_.what(); \
    }                                                                                    \
    EXPECT_TRUE(thrown_) << "expected std::invalid_argument from: " #stmt;               \
  } while (0)

// Random chains for the planners' tests: sizes in multiples of `unit` bytes, times in milliseconds.
inline remat::Chain random_chain(std::mt19937& rng, int64_t n, int64_t unit = 1) {
  std::uniform_int_distribution<int64_t> size(1, 20), extra(0, 30), tmp(0, 8);
  std::uniform_real_distribution<double> ms(0.5, 10.0);
  remat::Chain c;
  c.input_bytes = size(rng) * unit;
  for (int64_t i = 0; i < n; ++i) {
    remat::Stage s;
    s.name = "s" + std::to_string(i);
    s.fwd_ms = ms(rng);
    s.bwd_ms = 2 * ms(rng);
    s.output_bytes = size(rng) * unit;
    s.saved_bytes = s.output_bytes + extra(rng) * unit;
    s.fwd_tmp_bytes = tmp(rng) * unit;
    s.bwd_tmp_bytes = tmp(rng) * unit;
    // Most stages forward faster without saving (no graph to record); no draw, so the sequence is kept.
    if (i % 3 != 0) s.fwd_nosave_ms = s.fwd_ms * (0.55 + 0.1 * static_cast<double>(i % 4));
    // Some forwards without saving hold less above their output than one that saves holds above what it
    // saves, some more: on a quarter of the stages as much as the saving forward's whole peak, the most they
    // can (each tensor such a forward holds, the saving one holds too); again without a draw.
    if (i % 4 == 1) s.fwd_nosave_tmp_bytes = s.fwd_tmp_bytes / 2;
    if (i % 4 == 3) s.fwd_nosave_tmp_bytes = s.saved_bytes - s.output_bytes + s.fwd_tmp_bytes;
    c.stages.push_back(s);
  }
  return c;
}

// random_chain with Fk on most stages: it keeps part of what Fa keeps, and its backward costs a partial
// recompute more.
inline remat::Chain random_keep_chain(std::mt19937& rng, int64_t n, int64_t unit = 1) {
  remat::Chain c = random_chain(rng, n, unit);
  std::uniform_real_distribution<double> part(0.0, 1.0);
  for (size_t i = 0; i < c.stages.size(); ++i) {
    remat::Stage& s = c.stages[i];
    if (i % 4 == 3) continue;
    const double kept = part(rng);
    s.keep_saved_bytes =
        s.output_bytes + static_cast<int64_t>(kept * static_cast<double>(s.saved_bytes - s.output_bytes));
    s.keep_fwd_ms = s.fwd_ms * (1 + 0.1 * part(rng));
    s.keep_bwd_ms = s.bwd_ms + (1 - kept) * s.fwd_ms * (0.5 + part(rng));
  }
  c.keep = {"matmul"};
  return c;
}

// random_keep_chain with two operator-level policies too, each on most stages, each keeping its own part.
inline remat::Chain random_policy_chain(std::mt19937& rng, int64_t n, int64_t unit = 1) {
  remat::Chain c = random_keep_chain(rng, n, unit);
  std::uniform_real_distribution<double> part(0.0, 1.0);
  c.policies = {"alpha", "beta"};
  for (size_t i = 0; i < c.stages.size(); ++i) {
    remat::Stage& s = c.stages[i];
    if (i % 5 == 4) continue;  // a stage not profiled under the policies
    for (const auto& name : c.policies) {
      const double kept = part(rng);
      remat::PolicyCost pc;
      pc.policy = name;
      pc.saved_bytes =
          s.output_bytes + static_cast<int64_t>(kept * static_cast<double>(s.saved_bytes - s.output_bytes));
      // Now and then more than Fa keeps (a Linear then a ReLU: the policy keeps the product, which Fa frees):
      // now below, now above Fa's forward transient beside it.
      const bool more = name == "alpha" && i % 7 == 3;
      if (more) pc.saved_bytes = s.saved_bytes + unit * static_cast<int64_t>(1 + i % 3 * 9);
      pc.fwd_ms = s.fwd_ms * (1 + 0.1 * part(rng));
      pc.bwd_ms = s.bwd_ms + (1 - kept) * s.fwd_ms * (0.5 + part(rng));
      if (more)
        pc.fwd_ms = s.fwd_ms * 0.5, pc.bwd_ms = s.bwd_ms * 0.5;  // and faster, or no plan would take it
      if (name == "beta" && i % 3 != 0) {
        // Its backward's peak measured (PolicyCost::bwd_tmp_bytes): above or below what recomputing the rest
        // and Fa's backward transient would hold.
        const int64_t rest = s.saved_bytes - pc.saved_bytes + s.bwd_tmp_bytes;
        pc.bwd_tmp_bytes =
            std::max<int64_t>(0, rest + (i % 3 == 1 ? 1 : -1) * unit * static_cast<int64_t>(7 + i));
        if (i % 2 == 0) pc.bwd_grads_tmp_bytes = *pc.bwd_tmp_bytes + unit * static_cast<int64_t>(3 * i);
      }
      s.policies.push_back(pc);
    }
  }
  return c;
}

// random_policy_chain profiled for offloading: bandwidths that make a stage's copies take about as long as a
// stage's forward, and an OffloadCost for most ways of running most stages (part of what each keeps beyond
// its output, its input saved or not, its output saved or not), and a runtime that holds kept stages'
// outputs or not (Chain::holds_outputs).
inline remat::Chain random_offload_chain(std::mt19937& rng, int64_t n, int64_t unit = 1) {
  remat::Chain c = random_policy_chain(rng, n, unit);
  std::uniform_real_distribution<double> part(0.0, 1.0);
  std::bernoulli_distribution coin(0.5);
  const double typical = 15.0 * static_cast<double>(unit) / 5e6;  // 15 units in 5 ms
  c.to_host_gb_per_s = typical * (0.3 + 3 * part(rng));
  c.to_device_gb_per_s = typical * (0.3 + 3 * part(rng));
  auto cost = [&](int64_t kept, int64_t output, bool checkpointed) {
    remat::OffloadCost o;
    o.bytes = checkpointed ? 0 : static_cast<int64_t>(part(rng) * static_cast<double>(kept - output));
    o.input = checkpointed || coin(rng);
    o.output = !checkpointed && coin(rng);
    return o;
  };
  for (size_t i = 0; i < c.stages.size(); ++i) {
    remat::Stage& s = c.stages[i];
    if (i % 5 == 2) continue;  // a stage not profiled for offloading
    s.offload = cost(s.saved_bytes, s.output_bytes, false);
    s.checkpoint_offload = cost(s.output_bytes, s.output_bytes, true);
    if (s.has_keep()) s.keep_offload = cost(*s.keep_saved_bytes, s.output_bytes, false);
    for (auto& p : s.policies)
      if (coin(rng)) p.offload = cost(p.saved_bytes, s.output_bytes, false);
  }
  c.holds_outputs = coin(rng);  // the C++ executor's chains, or the Python package's
  return c;
}
