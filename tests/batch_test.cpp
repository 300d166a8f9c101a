// The largest batch (remat/planner/batch.h): profiles carried to another batch, and the search, shared by the
// C++ harness (remat max-batch) and the Python package (remat.max_batch).

#include <gtest/gtest.h>
#include <remat/planner/batch.h>
#include <remat/planner/per_layer.h>

#include <stdexcept>
#include <vector>

namespace {

// A chain whose figures are `fixed + per * batch`, with a policy, an offload and groups.
remat::Chain chain_at(int64_t batch) {
  remat::Chain c;
  c.input_bytes = 1000 * batch;
  c.policies = {"matmuls"};
  c.keep = {"matmul"};
  c.to_host_gb_per_s = batch == 2 ? 10 : 20;
  c.to_device_gb_per_s = 12;
  for (int i = 0; i < 3; ++i) {
    remat::Stage s;
    s.name = "layer" + std::to_string(i);
    s.fwd_ms = 1 + 0.5 * batch;
    s.bwd_ms = 2 + 1.0 * batch;
    s.output_bytes = 1000 * batch;
    s.saved_bytes = 6000 * batch;
    s.fwd_tmp_bytes = 500 * batch;
    s.fwd_nosave_tmp_bytes = 900 * batch;
    s.bwd_tmp_bytes = 64 + 700 * batch;
    s.keep_saved_bytes = 3000 * batch;
    s.keep_fwd_ms = 1.0 * batch;
    s.keep_bwd_ms = 2.0 * batch;
    s.offload =
        remat::OffloadCost{5000 * batch, true, false, 2000 * batch, 3000 * batch, 256, 3500 * batch, 128};
    s.policies.push_back({"matmuls", 3000 * batch, 1.0 * batch, 2.0 * batch, std::nullopt});
    s.groups = {{"aten::mm#0", 2000 * batch, 0.25 * batch}, {"aten::gelu#0", 1000 * batch, 0.01 * batch}};
    c.stages.push_back(s);
  }
  return c;
}

TEST(Batch, AChainOnALineInTheBatchIsCarriedExactlyAndKeepsItsShape) {
  const remat::Chain a = chain_at(2), b = chain_at(4);
  for (int64_t batch : {1, 3, 4, 48}) {
    const remat::Chain c = remat::chain_at_batch(a, 2, b, 4, batch);
    const remat::Chain want = chain_at(batch);
    EXPECT_EQ(c.input_bytes, want.input_bytes);
    ASSERT_EQ(c.stages.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      const auto& s = c.stages[i];
      const auto& w = want.stages[i];
      EXPECT_EQ(s.name, w.name);
      EXPECT_DOUBLE_EQ(s.fwd_ms, w.fwd_ms);
      EXPECT_DOUBLE_EQ(s.bwd_ms, w.bwd_ms);
      EXPECT_EQ(s.saved_bytes, w.saved_bytes);
      EXPECT_EQ(s.bwd_tmp_bytes, w.bwd_tmp_bytes);
      EXPECT_EQ(s.fwd_nosave_tmp_bytes, w.fwd_nosave_tmp_bytes);
      EXPECT_EQ(*s.keep_saved_bytes, *w.keep_saved_bytes);
      EXPECT_EQ(s.offload->bytes, w.offload->bytes);
      EXPECT_EQ(s.offload->window_bytes, 256);
      EXPECT_EQ(s.offload->ahead_bytes, 128);
      EXPECT_EQ(s.offload->stream_bwd_bytes, w.offload->stream_bwd_bytes);
      EXPECT_EQ(s.offload->stream_bwd_grads_bytes, w.offload->stream_bwd_grads_bytes);
      EXPECT_EQ(s.policies[0].saved_bytes, w.policies[0].saved_bytes);
      EXPECT_EQ(s.groups[0].bytes, w.groups[0].bytes);
      EXPECT_DOUBLE_EQ(s.groups[1].recompute_ms, w.groups[1].recompute_ms);
    }
    EXPECT_DOUBLE_EQ(c.to_host_gb_per_s, 15);  // a device's, not the batch's: the mean of both readings
  }
  // Below the profiles, figures stop at 0 and saved bytes stay between the output's and all a stage saves.
  remat::Chain a2 = a;
  a2.stages[0].bwd_tmp_bytes = 5000;  // falls with the batch: 5000 at 2, 2864 at 4
  const remat::Chain low = remat::chain_at_batch(a2, 2, b, 4, 1);
  EXPECT_EQ(low.stages[0].bwd_tmp_bytes, 6068);
  const remat::Chain far = remat::chain_at_batch(b, 4, a2, 2, 200);
  EXPECT_EQ(far.stages[0].bwd_tmp_bytes, 0);
  // The forward without saving, measured in one profile only: the other's fwd_tmp_bytes stands in for it
  // (1800 at 2, 2000 at 4), as the planners read it.
  remat::Chain unmeasured = b;
  unmeasured.stages[2].fwd_nosave_tmp_bytes.reset();
  EXPECT_EQ(remat::chain_at_batch(a, 2, unmeasured, 4, 3).stages[2].fwd_nosave_tmp_bytes, 1900);
  unmeasured.stages[2].fwd_tmp_bytes = 0;
  EXPECT_EQ(remat::chain_at_batch(a, 2, unmeasured, 4, 3).stages[2].fwd_nosave_tmp_bytes, 900);
  // A streamed backward's peak with its gradients made, measured in one profile only: not measured.
  remat::Chain unread = b;
  unread.stages[1].offload->stream_bwd_grads_bytes = -1;
  const remat::Chain half = remat::chain_at_batch(a, 2, unread, 4, 3);
  EXPECT_EQ(half.stages[1].offload->stream_bwd_grads_bytes, -1);
  EXPECT_EQ(half.stages[1].offload->stream_bwd_bytes, 9000);
  EXPECT_EQ(half.stages[0].offload->stream_bwd_grads_bytes, 3500 * 3);
  // What a streamed stage's input brought back adds to its backward likewise: on the line where both profiles
  // measured it (100 at 2, 300 at 4), else not measured.
  remat::Chain backs_a = a, backs_b = b;
  backs_a.stages[0].offload->stream_bwd_input_bytes = 100;
  backs_b.stages[0].offload->stream_bwd_input_bytes = 300;
  EXPECT_EQ(remat::chain_at_batch(backs_a, 2, backs_b, 4, 3).stages[0].offload->stream_bwd_input_bytes, 200);
  EXPECT_EQ(remat::chain_at_batch(a, 2, backs_b, 4, 3).stages[0].offload->stream_bwd_input_bytes, -1);
  // What comes back ahead likewise, and within the window on the line.
  unread.stages[1].offload->ahead_bytes = -1;
  EXPECT_EQ(remat::chain_at_batch(a, 2, unread, 4, 3).stages[1].offload->ahead_bytes, -1);
  remat::Chain wide = b;
  wide.stages[0].offload->window_bytes = 512,
  wide.stages[0].offload->ahead_bytes = 512;  // 128 at 2, 512 at 4
  EXPECT_EQ(remat::chain_at_batch(a, 2, wide, 4, 3).stages[0].offload->ahead_bytes, 320);
  EXPECT_EQ(remat::chain_at_batch(a, 2, wide, 4, 8).stages[0].offload->ahead_bytes, 1024);  // the window
  // A stage's output saved in either profile: saved on the line (Stage::saves_output).
  remat::Chain ua = a, ub = b;
  ua.stages[0].saves_output = ua.stages[1].saves_output = false;
  ub.stages[1].saves_output = false;
  // Likewise its input (Stage::saves_input).
  ua.stages[0].saves_input = ua.stages[2].saves_input = false;
  ub.stages[2].saves_input = false;
  // And whether it has a backward (Stage::has_backward): where either profile has one.
  ua.stages[0].has_backward = ub.stages[0].has_backward = ua.stages[1].has_backward = false;
  // And whether a policy holds the stage's output (PolicyCost::saves_output): where either profile saw it.
  ua.stages[0].policies[0].saves_output = ub.stages[0].policies[0].saves_output = false;
  ua.stages[1].policies[0].saves_output = false;
  // And what holding its gradient adds (Stage::bwd_grad_held_bytes): on the line where either measured it
  // (the other's stand-in its output's bytes), within the output; unset where neither did.
  ua.stages[0].bwd_grad_held_bytes = 200, ub.stages[0].bwd_grad_held_bytes = 400;  // 100 a sample
  ua.stages[1].bwd_grad_held_bytes = 0;                                            // the other: 4000
  // And a policy's own (PolicyCost::bwd_grad_held_bytes; the other's stand-in the stage's figure).
  ua.stages[0].policies[0].bwd_grad_held_bytes = 100;  // 100 at 2, the stage's 400 at 4
  const remat::Chain line = remat::chain_at_batch(ua, 2, ub, 4, 3);
  EXPECT_EQ(line.stages[0].bwd_grad_held_bytes, 300);
  EXPECT_EQ(line.stages[1].bwd_grad_held_bytes, 2000);  // 0 at 2 and the stand-in, 4000, at 4
  // (at 8: 12,000 on the line, clamped to the output's 8,000)
  EXPECT_EQ(remat::chain_at_batch(ua, 2, ub, 4, 8).stages[1].bwd_grad_held_bytes, 8000);
  EXPECT_FALSE(line.stages[2].bwd_grad_held_bytes.has_value());
  EXPECT_EQ(line.stages[0].policies[0].bwd_grad_held_bytes, 250);
  EXPECT_FALSE(line.stages[1].policies[0].bwd_grad_held_bytes.has_value());
  EXPECT_FALSE(line.stages[0].policies[0].saves_output);
  EXPECT_TRUE(line.stages[1].policies[0].saves_output);
  EXPECT_TRUE(line.stages[0].saves_output);
  EXPECT_FALSE(line.stages[1].saves_output);
  EXPECT_TRUE(line.stages[2].saves_output);
  EXPECT_TRUE(line.stages[0].saves_input);
  EXPECT_TRUE(line.stages[1].saves_input);
  EXPECT_FALSE(line.stages[2].saves_input);
  EXPECT_FALSE(line.stages[0].has_backward);
  EXPECT_TRUE(line.stages[1].has_backward);
}

TEST(Batch, ProfilesOfDifferentChainsOrAtOneBatchAreRefused) {
  const remat::Chain a = chain_at(2), b = chain_at(4);
  remat::Chain other = b;
  other.stages[1].name = "block1";
  EXPECT_THROW(remat::chain_at_batch(a, 2, other, 4, 8), std::invalid_argument);
  other = b;
  other.stages[2].groups[0].name = "aten::addmm#0";
  EXPECT_THROW(remat::chain_at_batch(a, 2, other, 4, 8), std::invalid_argument);
  other = b;
  other.stages.pop_back();
  EXPECT_THROW(remat::chain_at_batch(a, 2, other, 4, 8), std::invalid_argument);
  EXPECT_THROW(remat::chain_at_batch(a, 2, b, 2, 8), std::invalid_argument);
  EXPECT_THROW(remat::chain_at_batch(a, 2, b, 4, 0), std::invalid_argument);
  try {
    remat::chain_at_batch(a, 2, b, 2, 8);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("remat::chain_at_batch"), std::string::npos) << e.what();
  }
}

TEST(Batch, AContextIsCarriedOnTheSameLine) {
  remat::StepContext a, b;
  a.rest_peak_bytes = 100 + 10 * 2, b.rest_peak_bytes = 100 + 10 * 4;
  a.rest_grads_bytes = b.rest_grads_bytes = 4096;  // parameters' gradients: the same at every batch
  a.stage_grads_bytes = b.stage_grads_bytes = {512, 512};
  a.rest_ms = 1, b.rest_ms = 2;
  a.checkpoint_all_peak_bytes = 2000, b.checkpoint_all_peak_bytes = 4000;
  const remat::StepContext c = remat::context_at_batch(a, 2, b, 4, 10);
  EXPECT_EQ(c.rest_peak_bytes, 200);
  EXPECT_EQ(c.rest_grads_bytes, 4096);
  EXPECT_EQ(c.stage_grads_bytes, (std::vector<int64_t>{512, 512}));
  EXPECT_DOUBLE_EQ(c.rest_ms, 5);
  // A measured peak is not carried (its largest moment may change with the batch): kept where measured.
  EXPECT_EQ(c.checkpoint_all_peak_bytes, -1);
  EXPECT_EQ(remat::context_at_batch(a, 2, b, 4, 2).checkpoint_all_peak_bytes, 2000);
  EXPECT_EQ(remat::context_at_batch(a, 2, b, 4, 4).checkpoint_all_peak_bytes, 4000);
  // What runs between stages: on the line, as the rest's peak.
  a.between_backward_peak_bytes = {0, 1000 + 100 * 2}, b.between_backward_peak_bytes = {0, 1000 + 100 * 4};
  // It frees more at each batch: its figure goes below 0 too.
  a.between_held_bytes = {0, 64 - 10 * 2}, b.between_held_bytes = {0, 64 - 10 * 4};
  a.between_forward_held_bytes = {0, 10 * 2}, b.between_forward_held_bytes = {0, 10 * 4};
  a.side_bytes = 300, b.side_bytes = 500;
  a.side_grads_bytes = {0, 100 * 2}, b.side_grads_bytes = {0, 100 * 4};
  a.side_freed_bytes = {50 * 2, 0}, b.side_freed_bytes = {50 * 4, 0};
  a.outputs_held_in_backward = {true, false}, b.outputs_held_in_backward = {true, true};
  a.output_held_in_backward = false;
  a.outputs_held_to_end = {false, true}, b.outputs_held_to_end = {false, false};
  a.between_frees_output = {false, false}, b.between_frees_output = {false, true};
  a.inputs_held_in_forward = {true, false}, b.inputs_held_in_forward = {true, true};
  a.output_grad_held_in_backward = {true, false}, b.output_grad_held_in_backward = {false, false};
  const remat::StepContext d = remat::context_at_batch(a, 2, b, 4, 10);
  EXPECT_EQ(d.between_backward_peak_bytes, (std::vector<int64_t>{0, 2000}));
  EXPECT_EQ(d.between_held_bytes, (std::vector<int64_t>{0, -36}));
  EXPECT_EQ(d.between_forward_held_bytes, (std::vector<int64_t>{0, 100}));
  {  // what the forward between leaves held may be negative (it frees more), and is not floored at 0 either
    remat::StepContext fa = a, fb = b;
    fa.between_forward_held_bytes = {0, -30}, fb.between_forward_held_bytes = {0, -10};
    EXPECT_EQ(remat::context_at_batch(fa, 2, fb, 4, 1).between_forward_held_bytes,
              (std::vector<int64_t>{0, -40}));
    EXPECT_EQ(remat::context_at_batch(fa, 2, fb, 4, 10).between_forward_held_bytes,
              (std::vector<int64_t>{0, 50}));
  }
  EXPECT_EQ(d.side_grads_bytes, (std::vector<int64_t>{0, 1000}));
  EXPECT_EQ(d.side_bytes, 1100);
  EXPECT_EQ(d.side_freed_bytes, (std::vector<int64_t>{500, 0}));
  EXPECT_TRUE(d.side_grads_late_bytes.empty());  // read by neither
  {  // arriving after its backward's peak: whole at both batches, whole at the third; else none of it
    remat::StepContext la = a, lb = b;
    la.side_grads_late_bytes = la.side_grads_bytes, lb.side_grads_late_bytes = lb.side_grads_bytes;
    EXPECT_EQ(remat::context_at_batch(la, 2, lb, 4, 10).side_grads_late_bytes,
              (std::vector<int64_t>{0, 1000}));
    lb.side_grads_late_bytes = {0, 100};
    EXPECT_EQ(remat::context_at_batch(la, 2, lb, 4, 10).side_grads_late_bytes, (std::vector<int64_t>{0, 0}));
    lb.side_grads_late_bytes.clear();
    EXPECT_TRUE(remat::context_at_batch(la, 2, lb, 4, 10).side_grads_late_bytes.empty());
  }
  EXPECT_EQ(d.outputs_held_in_backward, (std::vector<bool>{true, true}));       // held where either is
  EXPECT_EQ(d.inputs_held_in_forward, (std::vector<bool>{true, true}));         // held where either is
  EXPECT_EQ(d.output_grad_held_in_backward, (std::vector<bool>{true, false}));  // likewise
  EXPECT_TRUE(d.output_held_in_backward);                                       // held where either is
  EXPECT_EQ(d.outputs_held_to_end, (std::vector<bool>{false, true}));           // held where either is
  EXPECT_EQ(d.between_frees_output, (std::vector<bool>{false, true}));          // charged where either is
  b.output_held_in_backward = false;
  EXPECT_FALSE(remat::context_at_batch(a, 2, b, 4, 10).output_held_in_backward);
  b.output_held_in_backward = true;
  EXPECT_FALSE(d.rest_frees_output);
  b.rest_frees_output = true;  // charged where either let go of it
  EXPECT_TRUE(remat::context_at_batch(a, 2, b, 4, 10).rest_frees_output);
  b.rest_frees_output = false;
  a.rest_takes_last_input = false;  // taken where either took it (the default, not read: taken)
  EXPECT_TRUE(remat::context_at_batch(a, 2, b, 4, 10).rest_takes_last_input);
  b.rest_takes_last_input = false;
  EXPECT_FALSE(remat::context_at_batch(a, 2, b, 4, 10).rest_takes_last_input);
  a.last_input_let_go_in_rest = true;  // let go of where both let go of it (the default, not read: held)
  EXPECT_FALSE(remat::context_at_batch(a, 2, b, 4, 10).last_input_let_go_in_rest);
  b.last_input_let_go_in_rest = true;
  EXPECT_TRUE(remat::context_at_batch(a, 2, b, 4, 10).last_input_let_go_in_rest);
  a.residual_grad_shared = {true, false};  // shared (charged) where either's is
  b.residual_grad_shared = {false, false};
  EXPECT_EQ(remat::context_at_batch(a, 2, b, 4, 10).residual_grad_shared, (std::vector<bool>{true, false}));
  b.residual_grad_shared.clear();  // read on one only: refused, as the other per-stage figures
  EXPECT_THROW(remat::context_at_batch(a, 2, b, 4, 10), std::invalid_argument);
  a.residual_grad_shared.clear();
  // Each line stops at 0 on its own: side_bytes is raised to hold its gradients.
  EXPECT_EQ(remat::context_at_batch(a, 2, b, 4, 1).side_grads_bytes, (std::vector<int64_t>{0, 100}));
  a.side_bytes = 100, b.side_bytes = 500;
  EXPECT_EQ(remat::context_at_batch(a, 2, b, 4, 1).side_bytes, 100);
  b.between_backward_peak_bytes.clear();
  EXPECT_THROW(remat::context_at_batch(a, 2, b, 4, 10), std::invalid_argument);
  b.between_backward_peak_bytes = a.between_backward_peak_bytes;
  b.side_freed_bytes.clear();
  EXPECT_THROW(remat::context_at_batch(a, 2, b, 4, 10), std::invalid_argument);
  b.side_freed_bytes = {50 * 4, 0};
  b.between_forward_held_bytes.clear();
  EXPECT_THROW(remat::context_at_batch(a, 2, b, 4, 10), std::invalid_argument);
  b.between_forward_held_bytes = a.between_forward_held_bytes;
  b.outputs_held_in_backward.clear();
  EXPECT_THROW(remat::context_at_batch(a, 2, b, 4, 10), std::invalid_argument);
  b.outputs_held_in_backward = a.outputs_held_in_backward;
  b.between_frees_output.clear();
  EXPECT_THROW(remat::context_at_batch(a, 2, b, 4, 10), std::invalid_argument);
  b.between_frees_output = a.between_frees_output;
  b.stage_grads_bytes = {512};
  EXPECT_THROW(remat::context_at_batch(a, 2, b, 4, 10), std::invalid_argument);
}

// Masks (StepContext::taken_bytes) on the line, as the batch makes them, where both contexts list the same
// ones taken and saved by the same stages; else none (charged to the step's end).
TEST(Batch, MasksAreCarriedOnTheLineWhereBothContextsListTheSame) {
  remat::StepContext a, b;
  a.before_saved_bytes = 1000 * 2 + 500, b.before_saved_bytes = 1000 * 4 + 500;
  a.stage_grads_bytes = b.stage_grads_bytes = {0, 0};
  a.taken_bytes = {1000 * 2}, b.taken_bytes = {1000 * 4};
  a.taken_by = b.taken_by = {{true, false}};
  a.taken_saved_by = b.taken_saved_by = {{false, false}};
  const remat::StepContext c = remat::context_at_batch(a, 2, b, 4, 10);
  EXPECT_EQ(c.before_saved_bytes, 10500);
  EXPECT_EQ(c.taken_bytes, (std::vector<int64_t>{10000}));
  EXPECT_EQ(c.taken_by, a.taken_by);
  b.taken_saved_by = {{true, false}};
  EXPECT_TRUE(remat::context_at_batch(a, 2, b, 4, 10).taken_bytes.empty());
  b.taken_saved_by = a.taken_saved_by;
  b.taken_bytes.clear(), b.taken_by.clear(), b.taken_saved_by.clear();
  EXPECT_TRUE(remat::context_at_batch(a, 2, b, 4, 10).taken_bytes.empty());
}

TEST(Batch, TheSearchFindsTheLargestAcceptedBatchInFewCalls) {
  for (int64_t answer : {0, 1, 2, 3, 7, 8, 100, 1023, 1024, 5000}) {
    int calls = 0;
    const int64_t got = remat::largest_batch(
        [&](int64_t b) {
          ++calls;
          return b <= answer;
        },
        4096);
    EXPECT_EQ(got, std::min<int64_t>(answer, 4096)) << answer;
    EXPECT_LE(calls, 2 * 13 + 2) << answer;
  }
  EXPECT_EQ(remat::largest_batch([](int64_t) { return true; }, 1), 1);
  EXPECT_EQ(remat::largest_batch([](int64_t) { return true; }, 6), 6);
  EXPECT_EQ(remat::largest_batch([](int64_t) { return true; }, int64_t{1} << 62), int64_t{1} << 62);
  EXPECT_THROW(remat::largest_batch([](int64_t) { return true; }, 0), std::invalid_argument);
  // The batches the per-layer planner accepts for a budget, on the carried chain.
  const remat::Chain a = chain_at(2), b = chain_at(4);
  const int64_t budget = 200000;
  const int64_t best = remat::largest_batch(
      [&](int64_t n) { return remat::per_layer_min_budget(remat::chain_at_batch(a, 2, b, 4, n)) <= budget; },
      4096);
  EXPECT_GT(best, 0);
  EXPECT_LE(remat::per_layer_min_budget(remat::chain_at_batch(a, 2, b, 4, best)), budget);
  EXPECT_GT(remat::per_layer_min_budget(remat::chain_at_batch(a, 2, b, 4, best + 1)), budget);
}

}  // namespace
