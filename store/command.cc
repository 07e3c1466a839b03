#include "store/command.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>

extern char** environ;

namespace shareblk::store {

namespace {

CommandResult run(const std::vector<std::string>& argv, std::chrono::seconds timeout,
                  const OutputWatcher& on_out, int input) {
  CommandResult result;
  int out[2];
  int err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return result;
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    return result;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (input >= 0) {
    posix_spawn_file_actions_adddup2(&actions, input, 0);
  } else {
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  }
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err[1], 2);
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  ::close(err[1]);
  if (rc != 0) {
    result.exec_errno = rc;
    ::close(out[0]);
    ::close(err[0]);
    return result;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  bool killed = false;
  while (open_fds > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      ::kill(pid, SIGKILL);
      killed = true;
      break;
    }
    if (::poll(fds, 2, static_cast<int>(std::min<int64_t>(left.count(), 60000))) < 0 &&
        errno != EINTR)
      break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0 && i == 0 && on_out) {
        if (!on_out(std::string_view(buf, static_cast<size_t>(n)))) {
          ::kill(pid, SIGKILL);
          killed = true;
          break;
        }
      } else if (n > 0) {
        sinks[i]->append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
    if (killed) break;
  }
  for (auto& f : fds) {
    if (f.fd >= 0) ::close(f.fd);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (killed && on_out) {
    result.err += "\n(stopped)";
  } else if (killed) {
    result.err += "\n(killed after " + std::to_string(timeout.count()) + " s)";
  } else if (WIFEXITED(status)) {
    result.status = WEXITSTATUS(status);
  }
  return result;
}

}  // namespace

CommandResult run_command(const std::vector<std::string>& argv, std::chrono::seconds timeout,
                          int input) {
  return run(argv, timeout, {}, input);
}

CommandResult run_command_watched(const std::vector<std::string>& argv, const OutputWatcher& on_out,
                                  int input) {
  return run(argv, std::chrono::hours(24 * 365), on_out, input);
}

}  // namespace shareblk::store
