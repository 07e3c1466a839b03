// shareblkd under systemd: readiness and stop notices, the watchdog, socket activation. Each
// call does nothing when systemd did not start the daemon (no NOTIFY_SOCKET, no LISTEN_FDS),
// so the daemon runs the same by hand. docs/install.md says how the units use them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shareblk::cmd {

// The sockets a .socket unit passed (LISTEN_FDS), by the name its FileDescriptorName= gives
// them: "control" for the control socket, "nbd" for NBD listeners (Unix or TCP).
struct PassedSockets {
  std::vector<int> control;
  std::vector<int> nbd;
};

// Takes the passed sockets and unsets LISTEN_* so that no child inherits them. False, with
// `error`, when a descriptor has another name (a unit without FileDescriptorName=) or is no
// socket; the descriptors are closed then.
bool take_passed_sockets(PassedSockets& out, std::string& error);

// READY=1 (with MAINPID and `status`): every listener listens and clients can be served.
void notify_ready(const std::string& status);
// RELOADING=1 while SIGHUP's reload runs; notify_ready() says when it is done.
void notify_reloading();
// STOPPING=1: a stop signal arrived and the daemon is shutting down.
void notify_stopping();

// How often to send WATCHDOG=1 (half of WatchdogSec=, as sd_watchdog_enabled(3) advises);
// zero when the unit sets no watchdog.
std::chrono::microseconds watchdog_interval();
void notify_watchdog();

// Sends WATCHDOG=1 every watchdog_interval() from a thread of its own while it lives; starts
// no thread when there is no watchdog.
class WatchdogThread {
 public:
  WatchdogThread();
  ~WatchdogThread();
  WatchdogThread(const WatchdogThread&) = delete;
  WatchdogThread& operator=(const WatchdogThread&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace shareblk::cmd
