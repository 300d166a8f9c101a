// Chain: JSON in the documented keys, and validation that names the stage.
#include <gtest/gtest.h>

#include <remat/planner/chain.h>

#include <cmath>
#include <cstdio>
#include <fstream>

namespace {

remat::Chain sample() {
  remat::Chain c;
  c.input_bytes = 4096;
  c.stages.push_back({"embed", 1.5, 3.25, 8192, 16384, 100, 200});
  c.stages.push_back({"layer0", 2.0, 4.0, 8192, 40000, 0, 512});
  return c;
}

void expect_invalid(const remat::Chain& c, const std::string& needle) {
  try {
    remat::validate(c);
    ADD_FAILURE() << "expected std::invalid_argument containing " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Chain, JsonRoundTrip) {
  const remat::Chain c = sample();
  const remat::Chain d = remat::chain_from_json(remat::to_json(c));
  ASSERT_EQ(d.size(), 2);
  EXPECT_EQ(d.input_bytes, 4096);
  EXPECT_EQ(d.stages[0].name, "embed");
  EXPECT_DOUBLE_EQ(d.stages[0].bwd_ms, 3.25);
  EXPECT_EQ(d.stages[1].saved_bytes, 40000);
  EXPECT_EQ(d.stages[1].bwd_tmp_bytes, 512);
  EXPECT_EQ(remat::to_json(d), remat::to_json(c));
  EXPECT_EQ(d.activation_bytes(0), 4096);
  EXPECT_EQ(d.activation_bytes(2), 8192);
}

TEST(Chain, JsonKeysAreExactlyTheDocumentedOnes) {
  const std::string j = remat::to_json(sample());
  for (const char* key : {"\"input_bytes\"", "\"stages\"", "\"name\"", "\"fwd_ms\"", "\"bwd_ms\"",
                          "\"output_bytes\"", "\"saved_bytes\"", "\"fwd_tmp_bytes\"", "\"bwd_tmp_bytes\""}) {
    EXPECT_NE(j.find(key), std::string::npos) << key;
  }
}

TEST(Chain, TmpKeysOptional) {
  const auto c = remat::chain_from_json(
      R"({"input_bytes": 10, "stages": [{"name": "a", "fwd_ms": 1, "bwd_ms": 2, "output_bytes": 5, "saved_bytes": 7}]})");
  EXPECT_EQ(c.stages[0].fwd_tmp_bytes, 0);
  EXPECT_EQ(c.stages[0].bwd_tmp_bytes, 0);
}

TEST(Chain, TheTransientWithoutSavingRoundTripsAndDefaultsToTheSavingOne) {
  remat::Chain c = sample();
  c.stages[1].fwd_nosave_tmp_bytes = 3000;
  const std::string j = remat::to_json(c);
  EXPECT_NE(j.find("\"fwd_nosave_tmp_bytes\": 3000"), std::string::npos) << j;
  const remat::Chain d = remat::chain_from_json(j);
  EXPECT_FALSE(d.stages[0].fwd_nosave_tmp_bytes.has_value());  // absent stays absent
  EXPECT_EQ(d.stages[0].nosave_tmp_bytes(), 100);              // and reads as fwd_tmp_bytes
  EXPECT_EQ(d.stages[1].nosave_tmp_bytes(), 3000);
  EXPECT_EQ(remat::to_json(d), j);
  auto bad = c;
  bad.stages[1].fwd_nosave_tmp_bytes = -1;
  expect_invalid(bad, "stage 1 ('layer0') has negative fwd_nosave_tmp_bytes");
}

TEST(Chain, OptionalTimesRoundTripAndDefaultToTheForward) {
  remat::Chain c = sample();
  c.stages[1].fwd_nosave_ms = 1.25;
  c.stages[1].checkpoint_fwd_ms = 1.5;
  c.stages[1].checkpoint_bwd_ms = 5.75;
  const std::string j = remat::to_json(c);
  for (const char* key : {"\"fwd_nosave_ms\"", "\"checkpoint_fwd_ms\"", "\"checkpoint_bwd_ms\""})
    EXPECT_NE(j.find(key), std::string::npos) << key;
  const remat::Chain d = remat::chain_from_json(j);
  EXPECT_FALSE(d.stages[0].fwd_nosave_ms.has_value());  // absent stays absent
  EXPECT_EQ(remat::to_json(d), j);
  EXPECT_DOUBLE_EQ(d.stages[1].nosave_ms(), 1.25);
  EXPECT_DOUBLE_EQ(d.stages[1].per_call_fwd_ms(), 1.5);
  EXPECT_DOUBLE_EQ(d.stages[1].per_call_bwd_ms(), 5.75);
  // Unset: every forward costs fwd_ms, and a per-call checkpoint recomputes all of it.
  EXPECT_DOUBLE_EQ(d.stages[0].nosave_ms(), 1.5);
  EXPECT_DOUBLE_EQ(d.stages[0].per_call_fwd_ms(), 1.5);
  EXPECT_DOUBLE_EQ(d.stages[0].per_call_bwd_ms(), 1.5 + 3.25);
  auto bad = c;
  bad.stages[1].checkpoint_bwd_ms = -1;
  expect_invalid(bad, "stage 1 ('layer0') has negative checkpoint_bwd_ms");
  bad.stages[1].checkpoint_bwd_ms = NAN;
  expect_invalid(bad, "non-finite checkpoint_bwd_ms");
  EXPECT_THROW(
      remat::chain_from_json(
          R"({"input_bytes": 1, "stages": [{"fwd_ms": 1, "bwd_ms": 1, "output_bytes": 1, "saved_bytes": 1, "fwd_nosave_ms": "x"}]})"),
      std::invalid_argument);
}

TEST(Chain, ValidationNamesTheStage) {
  expect_invalid(remat::Chain{}, "no stages");
  auto c = sample();
  c.stages[1].saved_bytes = 10;
  expect_invalid(c, "stage 1 ('layer0') has saved_bytes (10) < output_bytes (8192)");
  c = sample();
  c.stages[0].fwd_ms = -1;
  expect_invalid(c, "stage 0 ('embed') has negative fwd_ms");
  c = sample();
  c.stages[0].bwd_ms = NAN;
  expect_invalid(c, "non-finite bwd_ms");
  c = sample();
  c.stages[1].fwd_tmp_bytes = -5;
  expect_invalid(c, "stage 1 ('layer0') has negative fwd_tmp_bytes (-5)");
  c = sample();
  c.input_bytes = -1;
  expect_invalid(c, "negative input_bytes");
}

TEST(Chain, BadJsonIsAClearError) {
  auto expect_error = [](const std::string& text, const std::string& needle) {
    try {
      remat::chain_from_json(text);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error("{", "malformed JSON");
  expect_error("[]", "expected an object");
  expect_error(R"({"stages": []})", "has no \"input_bytes\"");
  expect_error(R"({"input_bytes": 1, "stages": []})", "no stages");
  expect_error(R"({"input_bytes": 1, "stages": [{"fwd_ms": 1, "bwd_ms": 1, "output_bytes": 1}]})",
               "stage 0 has no \"saved_bytes\"");
  expect_error(
      R"({"input_bytes": 1, "stages": [{"fwd_ms": "x", "bwd_ms": 1, "output_bytes": 1, "saved_bytes": 1}]})",
      "\"fwd_ms\" must be a number");
  expect_error(R"({"input_bytes": 1.5, "stages": []})", "whole number");
}

TEST(Chain, FilesRoundTripAndMissingFileIsAnError) {
  const std::string path = ::testing::TempDir() + "/remat_chain_test.json";
  remat::save_chain(sample(), path);
  EXPECT_EQ(remat::to_json(remat::load_chain(path)), remat::to_json(sample()));
  std::remove(path.c_str());
  EXPECT_THROW(remat::load_chain(path), std::invalid_argument);
}

}  // namespace
