// remat_soak: trains a small checkpointed model for many steps in each mode and checks that nothing
// accumulates: the tensor bytes alive at the start of every step (remat's meter) are equal after the first
// step, and the process's resident memory stays within a bound.
//
//   remat_soak --steps 10000                 every mode, 10,000 steps each (bench/benchmarks.sh soak)
//   remat_soak --steps 300 --rss-bound 8MiB  the short version ./test runs
//
// Exit status 0 when every check holds, 1 otherwise (with a line saying which and where).

#include <remat/checkpoint.h>
#include <remat/memory.h>
#include <remat/planner/units.h>
#include <remat/sequential.h>
#include <torch/torch.h>

#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

namespace {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t w)
      : fc(register_module("fc", torch::nn::Linear(w, w))),
        bn(register_module("bn", torch::nn::BatchNorm1d(w))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x + torch::dropout(torch::gelu(bn(fc(x))), 0.1, is_training());
  }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(Block);

int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

struct Args {
  int64_t steps = 10000;
  int64_t rss_bound = 16 << 20;
  std::string modes = "nonreentrant,reentrant,sequential";
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--steps") {
      const std::string v = value();
      size_t used = 0;
      a.steps = std::stoll(v, &used);
      if (used != v.size() || a.steps < 2)
        throw std::invalid_argument("--steps must be a whole number >= 2, got '" + v + "'");
    } else if (arg == "--rss-bound") {
      a.rss_bound = remat::parse_size(value());
    } else if (arg == "--modes") {
      a.modes = value();
    } else if (arg == "--help" || arg == "-h") {
      std::cout << "remat_soak [--steps N] [--rss-bound SIZE] [--modes nonreentrant,reentrant,sequential]\n";
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown argument '" + arg + "'");
    }
  }
  return a;
}

// Runs one mode; returns false (after printing why) when a check fails.
bool soak(const std::string& mode, const Args& a) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 6; ++i)
    seq->push_back(Block(64));
  auto x = torch::randn({32, 64});
  auto target = torch::randn({32, 64});
  torch::optim::SGD opt(seq->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto step = [&] {
    opt.zero_grad();
    torch::Tensor h;
    if (mode == "sequential") {
      h = remat::checkpoint_sequential(seq, 3, x);
    } else if (mode == "nonreentrant" || mode == "reentrant") {
      const auto m =
          mode == "reentrant" ? remat::CheckpointMode::kReentrant : remat::CheckpointMode::kNonReentrant;
      h = x;
      for (size_t i = 0; i < seq->size(); ++i)
        h = remat::checkpoint(Block(seq->ptr<BlockImpl>(i)), h, remat::CheckpointOptions().mode(m));
    } else {
      throw std::invalid_argument("unknown mode '" + mode + "'");
    }
    (h - target).pow(2).mean().backward();
    opt.step();
  };
  const auto start = std::chrono::steady_clock::now();
  int64_t first_active = -1, rss_start = 0, rss_max = 0;
  for (int64_t s = 0; s < a.steps; ++s) {
    const int64_t active = remat::memory::active_bytes();
    if (s == 1) first_active = active;  // the first step allocated gradients and momentum buffers
    if (s > 1 && active != first_active) {
      std::cout << "FAIL " << mode << ": " << active << " tensor bytes alive at the start of step " << s
                << ", " << first_active << " at the start of step 1\n";
      return false;
    }
    step();
    const int64_t rss = resident_bytes();
    if (s == std::min<int64_t>(100, a.steps / 10)) rss_start = rss;
    rss_max = std::max(rss_max, rss);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t growth = rss_max - rss_start;
  std::cout << mode << ": " << a.steps << " steps in " << seconds
            << " s; tensor bytes at every step start: " << first_active << "; resident "
            << remat::format_bytes(rss_start) << " -> max " << remat::format_bytes(rss_max) << " (growth "
            << remat::format_bytes(growth) << ", bound " << remat::format_bytes(a.rss_bound) << ")\n";
  if (growth > a.rss_bound) {
    std::cout << "FAIL " << mode << ": resident memory grew by " << growth << " bytes, more than the bound\n";
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    remat::memory::track_cpu();
    bool ok = true;
    size_t from = 0;
    while (from <= a.modes.size()) {
      const size_t comma = a.modes.find(',', from);
      const std::string mode =
          a.modes.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
      ok = soak(mode, a) && ok;
      if (comma == std::string::npos) break;
      from = comma + 1;
    }
    std::cout << (ok ? "soak: every check held" : "soak: FAILED") << "\n";
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::cerr << "remat_soak: " << msg.substr(0, msg.find('\n')) << "\n";
    return 1;
  }
}
