// launch(): torchrun's local part. Starts the processes of one machine with torchrun's environment and
// supervises them: one failure stops the rest.
#include "remat/distributed/launch.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace remat::distributed {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "remat::distributed::free_port: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(ok, "remat::distributed::free_port: could not find a free port: ", std::strerror(err));
  return ntohs(addr.sin_port);
}

namespace {

int exit_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int launch(const LaunchOptions& options, const std::vector<std::string>& command) {
  const char* who = "remat::distributed::launch: ";
  TORCH_CHECK(!command.empty() && !command[0].empty(), who, "no command to run");
  TORCH_CHECK(options.nproc_per_node() >= 1 && options.nproc_per_node() <= 1024, who,
              "nproc_per_node must be in [1, 1024], got ", options.nproc_per_node());
  TORCH_CHECK(options.nnodes() >= 1, who, "nnodes must be >= 1, got ", options.nnodes());
  TORCH_CHECK(options.node_rank() >= 0 && options.node_rank() < options.nnodes(), who,
              "node_rank must be in [0, ", options.nnodes(), "), got ", options.node_rank());
  TORCH_CHECK(options.master_port() >= 0 && options.master_port() <= 65535, who,
              "master_port must be in [0, 65535], got ", options.master_port());
  TORCH_CHECK(options.master_port() != 0 || options.nnodes() == 1, who,
              "master_port 0 (a free port) works on one machine only; give every machine the same port");
  TORCH_CHECK(!options.master_addr().empty(), who, "master_addr is empty");
  TORCH_CHECK(options.failure_grace().count() >= 0, who, "failure_grace must be >= 0 ms, got ",
              options.failure_grace().count());
  if (!options.log_dir().empty()) {
    ::mkdir(options.log_dir().c_str(), 0777);
    struct stat st {};
    TORCH_CHECK(::stat(options.log_dir().c_str(), &st) == 0 && S_ISDIR(st.st_mode), who, "log_dir '",
                options.log_dir(), "' is not a directory and could not be made");
  }

  const int64_t nproc = options.nproc_per_node();
  const int64_t world = nproc * options.nnodes();
  const int port = options.master_port() == 0 ? free_port() : static_cast<int>(options.master_port());

  // The environment: this process's, with torchrun's variables set for each rank.
  std::map<std::string, std::string> base;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq != nullptr) base[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  base["WORLD_SIZE"] = std::to_string(world);
  base["LOCAL_WORLD_SIZE"] = std::to_string(nproc);
  base["GROUP_RANK"] = std::to_string(options.node_rank());
  base["MASTER_ADDR"] = options.master_addr();
  base["MASTER_PORT"] = std::to_string(port);

  std::vector<pid_t> pids;
  auto stop_all = [&](int sig) {
    for (pid_t pid : pids)
      if (pid > 0) ::kill(pid, sig);
  };
  for (int64_t local = 0; local < nproc; ++local) {
    const int64_t rank = options.node_rank() * nproc + local;
    std::map<std::string, std::string> env = base;
    env["RANK"] = std::to_string(rank);
    env["LOCAL_RANK"] = std::to_string(local);
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : env)
      env_strings.push_back(k + "=" + v);
    std::vector<char*> envp, argv;
    for (auto& s : env_strings)
      envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = command;
    for (auto& s : args)
      argv.push_back(s.data());
    argv.push_back(nullptr);
    const std::string log = options.log_dir().empty()
                                ? std::string()
                                : options.log_dir() + "/rank_" + std::to_string(rank) + ".log";

    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      stop_all(SIGKILL);
      for (pid_t p : pids)
        ::waitpid(p, nullptr, 0);
      TORCH_CHECK(false, who, "fork failed: ", std::strerror(err));
    }
    if (pid == 0) {
      if (!log.empty()) {
        const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
          ::dup2(fd, STDOUT_FILENO);
          ::dup2(fd, STDERR_FILENO);
          ::close(fd);
        }
      }
      environ = envp.data();
      ::execvp(argv[0], argv.data());
      const std::string msg =
          std::string(who) + "cannot run '" + command[0] + "': " + std::strerror(errno) + "\n";
      (void)!::write(STDERR_FILENO, msg.data(), msg.size());
      ::_exit(127);
    }
    pids.push_back(pid);
  }

  // Wait for all. After the first failure the others get failure_grace to exit on their own (and report
  // what they saw), then SIGTERM, then SIGKILL 10 s later.
  using SteadyClock = std::chrono::steady_clock;
  int result = 0;
  size_t running = pids.size();
  bool stopping = false;
  int next_signal = SIGTERM;
  auto signal_at = SteadyClock::time_point::max();
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, stopping ? WNOHANG : 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pid == 0) {  // stopping, nobody exited yet
      if (SteadyClock::now() >= signal_at) {
        stop_all(next_signal);
        signal_at = next_signal == SIGTERM ? SteadyClock::now() + std::chrono::seconds(10)
                                           : SteadyClock::time_point::max();
        next_signal = SIGKILL;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    bool ours = false;
    for (pid_t& p : pids) {
      if (p == pid) {
        p = -1;
        ours = true;
      }
    }
    if (!ours) continue;
    --running;
    const int code = exit_status(status);
    if (code != 0 && result == 0) {
      result = code;
      stopping = true;
      signal_at = SteadyClock::now() + options.failure_grace();
    }
  }
  return result;
}

}  // namespace remat::distributed
