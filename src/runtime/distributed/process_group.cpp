// ProcessGroup and init_process_group: c10d's TCPStore rendezvous, and ProcessGroupGloo or (where the build
// has it: nccl.cpp) ProcessGroupNCCL.
#include "remat/distributed/process_group.h"

// ProcessGroupGloo.hpp declares its class only under USE_C10D_GLOO (LibTorch's own build defines it; its
// CMake package does not). Its gloo types come from libgloo-dev's headers and are only ever held by pointer.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include "detail/compat.h"

#ifndef REMAT_HAS_NCCL
#define REMAT_HAS_NCCL 0
#endif
#if REMAT_HAS_NCCL
#include "distributed/nccl.h"
#endif

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <exception>
#include <string>

namespace remat::distributed {

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<::remat::detail::compat::C10dBackend> pg;  // ProcessGroupGloo or ProcessGroupNCCL
  bool nccl = false;
  int device = -1;  // NCCL: the CUDA device of this rank (LOCAL_RANK)
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  std::string backend;
  std::chrono::milliseconds timeout{0};
};

namespace {

// What an exception says, without c10's backtrace.
std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// A c10d error as this library's: which operation, on which rank, and what c10d said.
[[noreturn]] void fail(const ProcessGroup::Impl& impl, const char* op, const std::exception& e) {
  TORCH_CHECK(false, "remat::distributed::", op, ": failed on rank ", impl.rank, " of ", impl.size,
              " (a peer rank exited or stopped answering, or the timeout of ", impl.timeout.count(),
              " ms passed): ", message_of(e));
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::kMin:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceOp::kMax:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
  }
  TORCH_CHECK(false, "remat::distributed: unknown ReduceOp ", static_cast<int>(op));
}

class BackendWork final : public ProcessGroup::Work {
 public:
  BackendWork(std::shared_ptr<ProcessGroup::Impl> impl, c10::intrusive_ptr<c10d::Work> work)
      : impl_(std::move(impl)), work_(std::move(work)) {}
  void wait() override {
    try {
      work_->wait(impl_->timeout);
    } catch (const std::exception& e) {
      fail(*impl_, "all_reduce", e);
    }
  }
  bool completed() override { return work_->isCompleted(); }

 private:
  std::shared_ptr<ProcessGroup::Impl> impl_;
  c10::intrusive_ptr<c10d::Work> work_;
};

// An environment variable as an integer in [lo, hi]; `required` ones must be set.
int64_t env_int(const char* name, int64_t lo, int64_t hi, bool required, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    TORCH_CHECK(!required, "remat::distributed::init_process_group: the environment variable ", name,
                " is not set (a launcher such as `remat launch` or `torchrun` sets RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT)");
    return fallback;
  }
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK(errno == 0 && end != value && *end == '\0' && parsed >= lo && parsed <= hi,
              "remat::distributed::init_process_group: ", name, "='", value, "' is not an integer in [", lo,
              ", ", hi, "]");
  return parsed;
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// NCCL reduces tensors on the rank's CUDA device: a CPU tensor given to all_reduce or broadcast
// (DataParallel's bucket order, its used-parameter mask, the model check; a plan's figures) goes there and
// back.
class Staged {
 public:
  Staged(const ProcessGroup::Impl& impl, std::vector<torch::Tensor>& tensors) : given_(tensors) {
    if (!impl.nccl) return;
    for (auto& t : tensors) {
      if (t.is_cuda()) {
        on_device_.push_back(t);
      } else {
        on_device_.push_back(t.to(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(impl.device))));
        staged_ = true;
      }
    }
  }
  std::vector<torch::Tensor>& tensors() { return staged_ ? on_device_ : given_; }
  // Copies what came back into the CPU tensors given (a copy to host memory waits for the collective).
  void finish() {
    if (!staged_) return;
    for (size_t i = 0; i < given_.size(); ++i)
      if (!given_[i].is_cuda()) given_[i].copy_(on_device_[i]);
  }

 private:
  std::vector<torch::Tensor>& given_;
  std::vector<torch::Tensor> on_device_;
  bool staged_ = false;
};

}  // namespace

ProcessGroup::ProcessGroup(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

int ProcessGroup::rank() const {
  return impl_->rank;
}
int ProcessGroup::size() const {
  return impl_->size;
}
int ProcessGroup::local_rank() const {
  return impl_->local_rank;
}
const std::string& ProcessGroup::backend() const {
  return impl_->backend;
}
std::chrono::milliseconds ProcessGroup::timeout() const {
  return impl_->timeout;
}

void ProcessGroup::all_reduce(std::vector<torch::Tensor>& tensors, ReduceOp op) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  opts.timeout = impl_->timeout;
  if (impl_->nccl && tensors.size() > 1) {  // c10d's NCCL group takes one tensor per collective
    for (auto& t : tensors) {
      std::vector<torch::Tensor> one{t};
      all_reduce(one, op);
    }
    return;
  }
  try {
    Staged staged(*impl_, tensors);
    impl_->pg->allreduce(staged.tensors(), opts)->wait(impl_->timeout);
    staged.finish();
  } catch (const std::exception& e) {
    fail(*impl_, "all_reduce", e);
  }
}

std::shared_ptr<ProcessGroup::Work> ProcessGroup::all_reduce_async(std::vector<torch::Tensor> tensors) {
  TORCH_CHECK(!impl_->nccl || tensors.size() == 1,
              "remat::distributed::ProcessGroup::all_reduce_async: NCCL reduces one tensor per call, got ",
              tensors.size());
  for (const auto& t : tensors)
    TORCH_CHECK(!impl_->nccl || t.is_cuda(),
                "remat::distributed::ProcessGroup::all_reduce_async: NCCL reduces CUDA tensors, got one on ",
                t.device(), " (use the \"gloo\" backend for a model on the CPU)");
  c10d::AllreduceOptions opts;
  opts.timeout = impl_->timeout;
  try {
    return std::make_shared<BackendWork>(impl_, impl_->pg->allreduce(tensors, opts));
  } catch (const std::exception& e) {
    fail(*impl_, "all_reduce", e);
  }
}

void ProcessGroup::broadcast(std::vector<torch::Tensor>& tensors, int root) {
  TORCH_CHECK(root >= 0 && root < impl_->size, "remat::distributed::ProcessGroup::broadcast: root ", root,
              " is not a rank of a group of ", impl_->size);
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = impl_->timeout;
  if (impl_->nccl && tensors.size() > 1) {  // one tensor per collective, as above
    for (auto& t : tensors) {
      std::vector<torch::Tensor> one{t};
      broadcast(one, root);
    }
    return;
  }
  try {
    Staged staged(*impl_, tensors);
    impl_->pg->broadcast(staged.tensors(), opts)->wait(impl_->timeout);
    staged.finish();
  } catch (const std::exception& e) {
    fail(*impl_, "broadcast", e);
  }
}

void ProcessGroup::barrier() {
  if (impl_->nccl) {
    // An all-reduce of one number, read back on the host: every rank has arrived when it returns (NCCL's own
    // barrier guesses each rank's device).
    std::vector<torch::Tensor> one{torch::zeros({1})};
    all_reduce(one);
    return;
  }
  c10d::BarrierOptions opts;
  opts.timeout = impl_->timeout;
  try {
    impl_->pg->barrier(opts)->wait(impl_->timeout);
  } catch (const std::exception& e) {
    fail(*impl_, "barrier", e);
  }
}

bool has_nccl() {
  return REMAT_HAS_NCCL != 0;
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  TORCH_CHECK(options.backend() == "gloo" || options.backend() == "nccl",
              "remat::distributed::init_process_group: backend '", options.backend(),
              "' is not one; use \"gloo\" (CPU tensors, and CUDA tensors through host copies) or \"nccl\" "
              "(CUDA tensors)");
  TORCH_CHECK(options.backend() != "nccl" || has_nccl(),
              "remat::distributed::init_process_group: backend 'nccl' is not in this build (it needs a CUDA "
              "LibTorch with c10d's ProcessGroupNCCL.hpp and nccl.h, as PyPI's torch wheel has: "
              "./test --torch pypi builds against it); use \"gloo\"");
  TORCH_CHECK(options.timeout().count() > 0,
              "remat::distributed::init_process_group: timeout must be > 0 ms, got ",
              options.timeout().count());
  auto impl = std::make_shared<ProcessGroup::Impl>();
  impl->backend = options.backend();
  impl->timeout = options.timeout();
  impl->size = static_cast<int>(env_int("WORLD_SIZE", 1, INT_MAX, true, 1));
  impl->rank = static_cast<int>(env_int("RANK", 0, impl->size - 1, true, 0));
  impl->local_rank = static_cast<int>(env_int("LOCAL_RANK", 0, INT_MAX, false, impl->rank));
  const char* addr_env = std::getenv("MASTER_ADDR");
  TORCH_CHECK(addr_env != nullptr && *addr_env != '\0',
              "remat::distributed::init_process_group: the environment variable MASTER_ADDR is not set (a "
              "launcher such as `remat launch` or `torchrun` sets RANK, WORLD_SIZE, MASTER_ADDR and "
              "MASTER_PORT)");
  const std::string addr = addr_env;
  const auto port = static_cast<std::uint16_t>(env_int("MASTER_PORT", 1, 65535, true, 0));

  const std::string where = addr + ":" + std::to_string(port);
  if (options.backend() == "nccl") {
    const auto devices = static_cast<int>(torch::cuda::device_count());
    TORCH_CHECK(impl->local_rank < devices,
                "remat::distributed::init_process_group: backend 'nccl' puts local "
                "rank ",
                impl->local_rank, " on CUDA device ", impl->local_rank, ", but this machine has ", devices,
                " CUDA device", devices == 1 ? "" : "s");
    impl->nccl = true;
    impl->device = impl->local_rank;
  }
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = port;
    store_options.isServer = impl->rank == 0;
    store_options.numWorkers = static_cast<std::size_t>(impl->size);
    store_options.waitWorkers = true;
    store_options.timeout = impl->timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>(addr, store_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "remat::distributed::init_process_group: rank ", impl->rank, " of ", impl->size,
                " could not meet the others at the TCPStore ", where, " within ", impl->timeout.count(),
                " ms (",
                impl->rank == 0 ? "a rank never arrived, or the port is taken" : "rank 0 never listened",
                "): ", message_of(e));
  }
#if REMAT_HAS_NCCL
  if (impl->nccl) {
    try {
      impl->pg = detail::make_nccl(impl->store, impl->rank, impl->size, impl->timeout, impl->device);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "remat::distributed::init_process_group: rank ", impl->rank, " of ", impl->size,
                  " could not make NCCL's process group on CUDA device ", impl->device, ": ", message_of(e));
    }
    return std::make_shared<ProcessGroup>(std::move(impl));
  }
#endif
  try {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(impl->timeout);
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    if (ifname != nullptr && *ifname != '\0') {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (is_loopback(addr)) {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    impl->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, impl->rank, impl->size, gloo_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "remat::distributed::init_process_group: rank ", impl->rank, " of ", impl->size,
                " could not connect Gloo to the other ranks (store at ", where, ", timeout ",
                impl->timeout.count(), " ms): ", message_of(e));
  }
  return std::make_shared<ProcessGroup>(std::move(impl));
}

std::function<void(std::vector<torch::Tensor>&)> same_plan_on_every_rank(
    std::shared_ptr<ProcessGroup> group) {
  TORCH_CHECK(group != nullptr, "remat::distributed::same_plan_on_every_rank: the group is null");
  return [group](std::vector<torch::Tensor>& numbers) {
    for (torch::Tensor& t : numbers) {  // one collective per tensor: Gloo reduces lists of one dtype and size
      std::vector<torch::Tensor> one{t};
      group->all_reduce(one, ReduceOp::kMax);
    }
  };
}

}  // namespace remat::distributed
