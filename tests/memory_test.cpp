#include <remat/memory.h>

#include <dlfcn.h>

#include <cstdlib>

#include "support.h"

namespace {

class MemoryTest : public ::testing::Test {
 protected:
  void SetUp() override { remat::testing::meter_on(); }
};

TEST_F(MemoryTest, TrackCpuIsIdempotent) {
  // A second call keeps the same counting allocator: counts go on, nothing is counted twice.
  remat::memory::track_cpu();
  const int64_t before = remat::memory::active_bytes();
  const int64_t count = remat::memory::cpu_allocation_count();
  auto a = torch::empty({250}, torch::kFloat);
  remat::memory::track_cpu();
  EXPECT_TRUE(remat::memory::is_tracking_cpu());
  auto b = torch::empty({250}, torch::kFloat);
  EXPECT_EQ(remat::memory::active_bytes() - before, 2000);
  EXPECT_EQ(remat::memory::cpu_allocation_count() - count, 2);
  a = torch::Tensor();
  b = torch::Tensor();
  EXPECT_EQ(remat::memory::active_bytes(), before);
}

TEST_F(MemoryTest, CountsExactBytesOfStorages) {
  const int64_t before = remat::memory::active_bytes();
  {
    auto t = torch::empty({1000}, torch::kFloat);
    EXPECT_EQ(remat::memory::active_bytes() - before, 4000);
    auto d = torch::empty({10, 10}, torch::kDouble);
    EXPECT_EQ(remat::memory::active_bytes() - before, 4800);
    auto view = t.view({10, 100});  // a view owns no storage
    EXPECT_EQ(remat::memory::active_bytes() - before, 4800);
  }
  EXPECT_EQ(remat::memory::active_bytes(), before);
}

TEST_F(MemoryTest, PeakAndReset) {
  const int64_t base = remat::memory::active_bytes();
  remat::memory::reset_peak();
  EXPECT_EQ(remat::memory::peak_bytes(), base);
  { auto t = torch::empty({256}, torch::kFloat); }
  EXPECT_EQ(remat::memory::peak_bytes(), base + 1024);
  EXPECT_EQ(remat::memory::active_bytes(), base);
  remat::memory::reset_peak();
  EXPECT_EQ(remat::memory::peak_bytes(), base);
}

TEST_F(MemoryTest, PeakScopeMeasuresAboveEntry) {
  auto kept = torch::empty({100}, torch::kFloat);
  remat::memory::PeakScope scope;
  {
    auto a = torch::empty({1000}, torch::kFloat);
    auto b = torch::empty({500}, torch::kFloat);
  }
  auto c = torch::empty({10}, torch::kFloat);
  EXPECT_EQ(scope.peak_over_base(), 6000);
  EXPECT_EQ(scope.active_over_base(), 40);
}

TEST_F(MemoryTest, KernelsThatUseRawAllocateWork) {
  // gelu and friends allocate through Allocator::raw_allocate, which needs context == data: the results are
  // right and the bytes are counted and released like any other storage.
  auto x = torch::randn({64, 64}, torch::requires_grad());
  const int64_t before = remat::memory::active_bytes();
  const int64_t count = remat::memory::cpu_allocation_count();
  {
    auto y = torch::gelu(x);
    EXPECT_GE(remat::memory::active_bytes() - before, 64 * 64 * 4);
    y.sum().backward();
    auto expected = 0.5 * (1 + torch::erf(x.detach() / std::sqrt(2.0))) +
                    x.detach() * torch::exp(-x.detach().pow(2) / 2) / std::sqrt(2 * M_PI);
    EXPECT_LE(remat::testing::max_abs_diff(x.grad(), expected), 1e-5);
  }
  EXPECT_GT(remat::memory::cpu_allocation_count(), count);
  x.mutable_grad() = torch::Tensor();
  EXPECT_EQ(remat::memory::active_bytes(), before);
}

TEST_F(MemoryTest, UnsupportedDevicesAreClearErrors) {
  EXPECT_THROW_WITH(remat::memory::active_bytes(c10::Device(c10::kMeta)), "remat::memory",
                    "unsupported device");
  if (!torch::cuda::is_available()) {
    EXPECT_THROW((void)remat::memory::peak_bytes(torch::kCUDA), c10::Error);
  }
}

TEST_F(MemoryTest, CInterfaceLibraryCountsTheSame) {
  const char* path = std::getenv("REMAT_METER_LIB");
  if (path == nullptr) GTEST_SKIP() << "REMAT_METER_LIB not set (ctest sets it)";
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  using Install = int (*)();
  using Bytes = int64_t (*)();
  auto install = reinterpret_cast<Install>(dlsym(lib, "remat_meter_install"));
  auto active = reinterpret_cast<Bytes>(dlsym(lib, "remat_meter_active_bytes"));
  auto peak = reinterpret_cast<Bytes>(dlsym(lib, "remat_meter_peak_bytes"));
  auto reset = reinterpret_cast<void (*)()>(dlsym(lib, "remat_meter_reset_peak"));
  ASSERT_TRUE(install && active && peak && reset);
  ASSERT_EQ(install(), 0);
  const int64_t before = active();
  reset();
  {
    auto t = torch::empty({2500}, torch::kFloat);
    EXPECT_EQ(active() - before, 10000);
  }
  EXPECT_EQ(active(), before);
  EXPECT_EQ(peak() - before, 10000);
}

}  // namespace
