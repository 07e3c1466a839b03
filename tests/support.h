// Helpers shared by shareblk's tests: temporary directories, child processes, the daemon.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <new>
#include <string>
#include <vector>

namespace shareblk::testing {

// CI has every tool, device and privilege these tests need; there a missing one is a failure.
bool in_ci();

// Skips the test with `reason` when `condition` is false, or fails it under CI=true.
#define SHAREBLK_REQUIRE(condition, reason)                                        \
  do {                                                                             \
    if (!(condition)) {                                                            \
      if (::shareblk::testing::in_ci()) FAIL() << "required under CI: " << reason; \
      GTEST_SKIP() << reason;                                                      \
    }                                                                              \
  } while (0)

bool have_program(const std::string& name);
// A TCP connection to 127.0.0.1:port, -1 when it cannot connect. A `timeout` above zero bounds
// its sends and receives (and the connect).
int connect_loopback(int port, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
bool is_root();
// Whether the daemon under test has its crash and pause points (SHAREBLK_TEST_HOOKS, set by
// the presets; a plain build has none, as an installed daemon must not).
bool daemon_has_test_hooks();
#define SHAREBLK_REQUIRE_TEST_HOOKS()                            \
  SHAREBLK_REQUIRE(::shareblk::testing::daemon_has_test_hooks(), \
                   "the daemon was built without -DSHAREBLK_TEST_HOOKS=ON")

// A fresh directory, removed with everything in it.
class TempDir {
 public:
  // In the system's temp directory; throws when it cannot be made.
  TempDir();
  // Under `parent` (/dev/shm for tmpfs); ok() is false when it cannot be made there.
  TempDir(const std::filesystem::path& parent, std::nothrow_t);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  bool ok() const { return !path_.empty(); }
  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// Creates a file of `size` bytes; `fill` < 0 leaves it sparse, else every byte is `fill`.
void make_file(const std::string& path, uint64_t size, int fill = -1);
std::string read_file(const std::string& path, uint64_t offset, size_t length);

struct RunResult {
  int status = -1;     // exit code, or 128+signal
  std::string output;  // stdout and stderr together
};
// Runs argv (no shell) and waits at most `timeout`; a child still running then is killed.
RunResult run(const std::vector<std::string>& argv,
              std::chrono::seconds timeout = std::chrono::seconds(120));

// Waits for child `pid` to exit, at most `timeout`, then kills it (SIGKILL) and reaps it. Its
// exit status as in RunResult.
int wait_exit(pid_t pid, std::chrono::seconds timeout);

// A shareblkd child process. Waits until `ready_socket` accepts connections.
class Daemon {
 public:
  static std::string binary();
  // The privileged helper built with it (shareblk-helper).
  static std::string helper_binary();
  // `launcher`, when given, runs first and must exec the daemon's argv that follows it (prlimit,
  // capsh), so that pid() stays the daemon's.
  Daemon(const std::vector<std::string>& args, const std::string& ready_socket,
         const std::vector<std::string>& launcher = {});
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  pid_t pid() const { return pid_; }
  // Sends `sig` and waits for the exit (30 s, then SIGKILL); returns the exit status as in
  // RunResult. stop(0) sends nothing: it waits for a daemon that is to exit by itself.
  int stop(int sig = 15);
  const std::string& log_path() const { return log_; }
  std::string log() const;

 private:
  pid_t pid_ = -1;
  std::string log_;
};

bool wait_for_socket(const std::string& path, std::chrono::milliseconds timeout);

// The port `daemon` picked for ADDRESS:0, from its log (waiting up to 5 s for the line); 0
// when it never said.
int logged_tcp_port(const Daemon& daemon, const std::string& address);

}  // namespace shareblk::testing
