// ProcessGroup and init_process_group: c10d's TCPStore rendezvous and ProcessGroupGloo.
#include "remat/distributed/process_group.h"

// ProcessGroupGloo.hpp declares its class only under USE_C10D_GLOO (LibTorch's own build defines it; its
// CMake package does not). Its gloo types come from libgloo-dev's headers and are only ever held by pointer.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/util/Exception.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <exception>
#include <string>

namespace remat::distributed {

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
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

class GlooWork final : public ProcessGroup::Work {
 public:
  GlooWork(std::shared_ptr<ProcessGroup::Impl> impl, c10::intrusive_ptr<c10d::Work> work)
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
  try {
    impl_->gloo->allreduce(tensors, opts)->wait(impl_->timeout);
  } catch (const std::exception& e) {
    fail(*impl_, "all_reduce", e);
  }
}

std::shared_ptr<ProcessGroup::Work> ProcessGroup::all_reduce_async(std::vector<torch::Tensor> tensors) {
  c10d::AllreduceOptions opts;
  opts.timeout = impl_->timeout;
  try {
    return std::make_shared<GlooWork>(impl_, impl_->gloo->allreduce(tensors, opts));
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
  try {
    impl_->gloo->broadcast(tensors, opts)->wait(impl_->timeout);
  } catch (const std::exception& e) {
    fail(*impl_, "broadcast", e);
  }
}

void ProcessGroup::barrier() {
  c10d::BarrierOptions opts;
  opts.timeout = impl_->timeout;
  try {
    impl_->gloo->barrier(opts)->wait(impl_->timeout);
  } catch (const std::exception& e) {
    fail(*impl_, "barrier", e);
  }
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  TORCH_CHECK(options.backend() == "gloo", "remat::distributed::init_process_group: backend '",
              options.backend(),
              "' is not supported by this build; use \"gloo\" (it also reduces CUDA tensors, through host "
              "copies)");
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
    impl->gloo =
        c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, impl->rank, impl->size, gloo_options);
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
