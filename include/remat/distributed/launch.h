#pragma once
/// \file
/// Starting the processes of a data-parallel job on this machine (launch.cpp; `remat launch`).

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace remat::distributed {

/// How `launch` starts processes (torchrun's flags).
struct LaunchOptions {
  /// Processes on this machine (--nproc-per-node), >= 1.
  TORCH_ARG(int64_t, nproc_per_node) = 1;
  /// Machines (--nnodes), >= 1; every machine runs `launch` with the same options but its node_rank.
  TORCH_ARG(int64_t, nnodes) = 1;
  /// This machine's index in [0, nnodes) (--node-rank).
  TORCH_ARG(int64_t, node_rank) = 0;
  /// Where rank 0 hosts the store (--master-addr).
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  /// Its port (--master-port); 0 picks a free port (single machine only).
  TORCH_ARG(int64_t, master_port) = 29500;
  /// When not empty, each process's stdout and stderr go to LOG_DIR/rank_<RANK>.log instead of this
  /// process's.
  TORCH_ARG(std::string, log_dir) = "";
  /// After one process fails, how long the others may run on (to notice the failure and say so) before
  /// they are stopped. torchrun stops them at once (0).
  TORCH_ARG(std::chrono::milliseconds, failure_grace) = std::chrono::milliseconds(0);
};

/// Runs `command` (a program and its arguments, found on PATH when it has no '/') as nproc_per_node local
/// processes with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
/// MASTER_ADDR, MASTER_PORT) and waits for them. When one fails, the others are stopped (after
/// failure_grace: SIGTERM, then SIGKILL 10 s later). Returns 0 when every process exits 0, else the first
/// failure's exit status (128 + signal number for a signal). Throws c10::Error naming the option for bad
/// options or an empty command, and when a process cannot be started.
int launch(const LaunchOptions& options, const std::vector<std::string>& command);

/// A TCP port on loopback that nobody listens on now (the kernel's pick), for MASTER_PORT on one machine
/// (another process may take it before the store binds it). Throws c10::Error naming
/// remat::distributed::free_port when no socket can be bound.
int free_port();

}  // namespace remat::distributed
