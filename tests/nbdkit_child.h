// nbdkit as a child process of a test: the end-to-end suites that serve the daemon's
// attachments through nbdkit and the plugin start it with this.
#pragma once

#include <sys/types.h>

#include <csignal>
#include <cstddef>
#include <string>
#include <vector>

namespace shareblk::testing {

// NAME=VALUE settings an nbdkit child needs on top of the test's environment: under the asan
// preset, the ASan runtime preloaded (see nbdkit_child.cc); empty otherwise.
std::vector<std::string> nbdkit_environment();

// An nbdkit child in the foreground, its stdout and stderr in `log`. Ready once it has written
// its pidfile, which nbdkit does after it listens. Throws std::runtime_error when it does not
// come up. Killed (SIGKILL) at the end of its scope if not stopped before.
class Nbdkit {
 public:
  Nbdkit(const std::vector<std::string>& args, const std::string& pidfile, const std::string& log);
  ~Nbdkit() { stop(SIGKILL); }
  Nbdkit(const Nbdkit&) = delete;
  Nbdkit& operator=(const Nbdkit&) = delete;

  // Not exited (a zombie has).
  bool running() const;

  // Sends `sig` and waits for the exit: the exit code, or 128+signal. nbdkit exits on SIGTERM
  // without closing the connections still open, so before a SIGTERM this waits (a while) for
  // the clients' disconnections to be done: a leak report at exit is then the plugin's.
  int stop(int sig = SIGTERM);

  std::string log() const;

 private:
  // nbdkit's open sockets: its listener, and for each connection the client's and the
  // plugin's control link.
  size_t sockets() const;

  pid_t pid_ = -1;
  size_t idle_sockets_ = 0;
  std::string log_;
};

}  // namespace shareblk::testing
