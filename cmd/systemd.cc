#include "cmd/systemd.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace shareblk::cmd {

bool take_passed_sockets(PassedSockets& out, std::string& error) {
  char** names = nullptr;
  const int count = sd_listen_fds_with_names(1, &names);  // 1: unsets LISTEN_*
  if (count < 0) {
    error = std::string("socket activation: ") + std::strerror(-count);
    return false;
  }
  bool ok = true;
  for (int i = 0; i < count; ++i) {
    const int fd = SD_LISTEN_FDS_START + i;
    const std::string name = names != nullptr && names[i] != nullptr ? names[i] : "";
    // systemd passes them without FD_CLOEXEC: no child (lvm2's tools, fusermount) may keep
    // one open.
    (void)!::fcntl(fd, F_SETFD, FD_CLOEXEC);
    if (ok && sd_is_socket(fd, AF_UNSPEC, SOCK_STREAM, 1) <= 0) {
      error = "socket activation: descriptor " + std::to_string(fd) + " (" + name +
              ") is not a listening stream socket";
      ok = false;
    } else if (ok && (name == "control" || name == "nbd")) {
      (name == "control" ? out.control : out.nbd).push_back(fd);
      continue;
    } else if (ok) {
      error = "socket activation: descriptor " + std::to_string(fd) + " is named '" + name +
              "'; shareblkd's .socket units name theirs FileDescriptorName=control or nbd";
      ok = false;
    }
    ::close(fd);
  }
  if (names != nullptr) {
    for (int i = 0; i < count; ++i) std::free(names[i]);  // NOLINT(*-no-malloc)
    std::free(static_cast<void*>(names));                 // NOLINT(*-no-malloc)
  }
  if (!ok) {
    for (const int fd : out.control) ::close(fd);
    for (const int fd : out.nbd) ::close(fd);
    out = {};
  }
  return ok;
}

void notify_ready(const std::string& status) {
  const std::string message =
      "READY=1\nMAINPID=" + std::to_string(::getpid()) + "\nSTATUS=" + status;
  sd_notify(0, message.c_str());
}

void notify_reloading() {
  sd_notify(0, "RELOADING=1\nSTATUS=reloading");
}

void notify_stopping() {
  sd_notify(0, "STOPPING=1\nSTATUS=stopping");
}

std::chrono::microseconds watchdog_interval() {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) <= 0) return std::chrono::microseconds(0);
  return std::chrono::microseconds(usec / 2);
}

void notify_watchdog() {
  sd_notify(0, "WATCHDOG=1");
}

WatchdogThread::WatchdogThread() {
  const std::chrono::microseconds interval = watchdog_interval();
  if (interval.count() == 0) return;
  thread_ = std::thread([this, interval] {
    std::unique_lock lock(mutex_);
    do {
      notify_watchdog();
    } while (!stop_.wait_for(lock, interval, [this] { return stopping_; }));
  });
}

WatchdogThread::~WatchdogThread() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  stop_.notify_all();
  thread_.join();
}

}  // namespace shareblk::cmd
