#pragma once
// Helpers shared by the remat tests.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <remat/checkpoint.h>
#include <remat/memory.h>
#include <remat/planner/chain.h>
#include <remat/planner/plan.h>

#include <sstream>
#include <string>
#include <vector>

namespace remat::testing {

/// Expects `stmt` to throw c10::Error whose message contains every one of `needles`.
#define EXPECT_THROW_WITH(stmt, ...)                                                                    \
  do {                                                                                                  \
    bool thrown_ = false;                                                                               \
    try {                                                                                               \
      stmt;                                                                                             \
    } catch (const c10::Error& e_) {                                                                    \
      thrown_ = true;                                                                                   \
      const std::string msg_ = e_.what();                                                               \
      for (const std::string& needle_ : std::vector<std::string>{__VA_ARGS__}) {                        \
        EXPECT_NE(msg_.find(needle_), std::string::npos) << "missing '" << needle_ << "' in: " << msg_; \
      }                                                                                                 \
    }                                                                                                   \
    EXPECT_TRUE(thrown_) << "expected c10::Error from: " #stmt;                                         \
  } while (0)

/// The plan of `num_stages` stages whose operations `text` lists, space-separated ("Fa0@host Fc1 L B1 B0").
inline remat::Plan plan_of_text(int64_t num_stages, const std::string& text) {
  std::string ops;
  std::istringstream words(text);
  for (std::string word; words >> word;)
    ops += (ops.empty() ? "\"" : ", \"") + word + "\"";
  return remat::plan_from_json("{\"num_stages\": " + std::to_string(num_stages) + ", \"ops\": [" + ops +
                               "]}");
}

/// Gives `plan` what run_plan needs of the profiled `chain` to run its group assignments and streamed stages:
/// each stage's group names (Plan::group_names) and the chain's window for each stage that can stream, -1
/// for the others (Plan::stream_windows).
inline void name_groups_and_windows(remat::Plan& plan, const remat::Chain& chain) {
  plan.group_names.clear();
  plan.stream_windows.clear();
  for (const auto& st : chain.stages) {
    plan.group_names.emplace_back();
    for (const auto& g : st.groups)
      plan.group_names.back().push_back(g.name);
    plan.stream_windows.push_back(st.offload && st.offload->can_stream() ? st.offload->window_bytes : -1);
  }
}

/// Largest absolute difference between two tensors of the same shape (0 for two undefined tensors,
/// infinity when only one is defined or the shapes differ).
inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() && !b.defined()) return 0.0;
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  if (a.numel() == 0) return 0.0;
  return (a.detach().to(torch::kDouble) - b.detach().to(torch::kDouble)).abs().max().item<double>();
}

/// Copies of the .grad of every parameter of `module` (undefined where there is none).
inline std::vector<torch::Tensor> grads_of(const torch::nn::Module& module) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : module.parameters())
    grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return grads;
}

/// Expects two lists of gradients to agree within `tol` element-wise.
inline void expect_all_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                             double tol = 1e-6) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].defined(), b[i].defined()) << "gradient " << i;
    EXPECT_LE(max_abs_diff(a[i], b[i]), tol) << "gradient " << i;
  }
}

/// Zeroes (undefines) the gradients of a module.
inline void clear_grads(torch::nn::Module& module) {
  for (auto& p : module.parameters())
    p.mutable_grad() = torch::Tensor();
}

/// Names the instances of tests parameterized by CheckpointMode: "NonReentrant", "Reentrant".
inline std::string mode_name(const ::testing::TestParamInfo<remat::CheckpointMode>& info) {
  return info.param == remat::CheckpointMode::kReentrant ? "Reentrant" : "NonReentrant";
}

/// Installs the CPU meter once per test process.
inline void meter_on() {
  remat::memory::track_cpu();
}

/// A matmul v.mm(w) that records v's address modulo `Modulus` bytes when it saves v and when autograd hands v
/// back for its backward pass (seen(), in that order): whether a saved tensor comes back at its alignment.
template <int64_t Modulus>
struct MatmulSeeingAlignment : torch::autograd::Function<MatmulSeeingAlignment<Modulus>> {
  static std::vector<int64_t>& seen() {
    static std::vector<int64_t> s;
    return s;
  }
  static int64_t align(const torch::Tensor& t) {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % Modulus);
  }
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& v,
                               const torch::Tensor& w) {
    ctx->save_for_backward({v, w});
    seen().push_back(align(v));
    return v.mm(w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    seen().push_back(align(saved[0]));
    return {torch::Tensor(), saved[0].t().mm(g[0])};
  }
};

}  // namespace remat::testing
