#pragma once
// Helpers shared by the planner library's tests (plain C++: no LibTorch).

#include <gtest/gtest.h>

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
