// remat launch: run a program in N processes with torchrun's environment (remat::distributed::launch).

#include <remat/distributed.h>

#include "common.h"

namespace remat::cli {
namespace {

struct LaunchArgs {
  std::vector<std::string> command;
  int64_t nproc_per_node = 1, nnodes = 1, node_rank = 0, master_port = 29500;
  std::string master_addr = "127.0.0.1", log_dir;
};

}  // namespace

Subcommand add_launch(CLI::App& app) {
  auto a = std::make_shared<LaunchArgs>();
  auto* cmd = app.add_subcommand(
      "launch",
      "Run a program in N processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)");
  cmd->add_option("--nproc-per-node", a->nproc_per_node, "processes on this machine")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--nnodes", a->nnodes, "machines")->check(CLI::Range(1, 100000))->capture_default_str();
  cmd->add_option("--node-rank", a->node_rank, "this machine's index")->capture_default_str();
  cmd->add_option("--master-addr", a->master_addr, "rank 0's address")->capture_default_str();
  cmd->add_option("--master-port", a->master_port, "rank 0's port (0: a free one, one machine only)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--log-dir", a->log_dir, "write each rank's output to LOG_DIR/rank_<RANK>.log");
  cmd->add_option("command", a->command, "the program and its arguments (after --)")->required();
  cmd->prefix_command();
  return {cmd, [a, cmd] {
            std::vector<std::string> command = a->command;
            for (const auto& extra : cmd->remaining())
              command.push_back(extra);
            return distributed::launch(distributed::LaunchOptions()
                                           .nproc_per_node(a->nproc_per_node)
                                           .nnodes(a->nnodes)
                                           .node_rank(a->node_rank)
                                           .master_addr(a->master_addr)
                                           .master_port(a->master_port)
                                           .log_dir(a->log_dir),
                                       command);
          }};
}

}  // namespace remat::cli
