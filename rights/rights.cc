#include "rights/rights.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

namespace shareblk::rights {

namespace {

// A child that does not answer in this time (a path on a hung network file system) is killed.
constexpr auto kChildDeadline = std::chrono::seconds(60);

// Raw system calls: after fork() in a threaded process only async-signal-safe calls are
// allowed, and glibc's set*id wrappers synchronise with threads the child does not have.
// Linux keeps credentials per thread, so the raw call changes exactly this process.
int take_on(const Credentials& who, bool root) {
  if (!root) return 0;  // run_as checked that `who` is this process's own user
  if (::syscall(SYS_setgroups, who.groups.size(), who.groups.data()) != 0) return errno;
  if (::syscall(SYS_setresgid, who.gid, who.gid, who.gid) != 0) return errno;
  // With every uid non-zero, the kernel clears the permitted and effective capabilities.
  if (::syscall(SYS_setresuid, who.uid, who.uid, who.uid) != 0) return errno;
  return 0;
}

// One byte carrying one descriptor (SCM_RIGHTS), both ways of open_as's socket pair. Built in
// place, with no allocation: the child fills it after fork().
struct OneDescriptor {
  char byte = 0;
  iovec data{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr header{};

  OneDescriptor() {
    header.msg_iov = &data;
    header.msg_iovlen = 1;
    header.msg_control = control;
    header.msg_controllen = sizeof control;
  }
  OneDescriptor(const OneDescriptor&) = delete;
  OneDescriptor& operator=(const OneDescriptor&) = delete;
};

}  // namespace

std::optional<Credentials> peer_of(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred) {
    return std::nullopt;
  }
  Credentials who{cred.uid, cred.gid, {}};
  std::vector<gid_t> groups(64);
  for (int tries = 0; tries < 4; ++tries) {
    len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
      groups.resize(len / sizeof(gid_t));
      who.groups = std::move(groups);
      return who;
    }
    if (errno != ERANGE) return std::nullopt;
    groups.resize(len / sizeof(gid_t) + 1);
  }
  return std::nullopt;
}

bool in_group(const Credentials& who, gid_t gid) {
  if (who.uid == 0 || who.gid == gid) return true;
  for (gid_t g : who.groups) {
    if (g == gid) return true;
  }
  return false;
}

int run_as(const Credentials& who, const std::function<int()>& step) {
  const bool root = ::geteuid() == 0;
  if (!root && who.uid != ::geteuid()) return EPERM;
  const pid_t pid = ::fork();
  if (pid < 0) return errno;
  if (pid == 0) {
    int err = take_on(who, root);
    if (err == 0) err = step();
    ::_exit(err > 0 && err < 256 ? err : (err == 0 ? 0 : EIO));
  }
  const auto deadline = std::chrono::steady_clock::now() + kChildDeadline;
  int status = 0;
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) return ECHILD;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      return ETIMEDOUT;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : ECHILD;
}

int open_as(const Credentials& who, const std::string& path, int flags, mode_t mode, int& fd) {
  fd = -1;
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, pair) != 0) return errno;
  const char* name = path.c_str();
  const int err = run_as(who, [&]() -> int {
    const int opened = ::open(name, flags | O_CLOEXEC, mode);
    if (opened < 0) return errno;
    OneDescriptor message;
    cmsghdr* c = CMSG_FIRSTHDR(&message.header);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &opened, sizeof(int));
    return ::sendmsg(pair[1], &message.header, MSG_NOSIGNAL) == 1 ? 0 : errno;
  });
  if (err == 0) {
    OneDescriptor message;
    if (::recvmsg(pair[0], &message.header, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) == 1) {
      const cmsghdr* c = CMSG_FIRSTHDR(&message.header);
      if (c != nullptr && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
      }
    }
  }
  ::close(pair[0]);
  ::close(pair[1]);
  if (err != 0) return err;
  return fd >= 0 ? 0 : EIO;
}

std::string refusal(const Credentials& who, const std::string& what, const std::string& path,
                    int err) {
  if (err == EPERM && ::geteuid() != 0 && who.uid != ::geteuid()) {
    return "the daemon runs as uid " + std::to_string(::geteuid()) + " and cannot " + what + " " +
           path + " with the rights of uid " + std::to_string(who.uid) + ": call it as that user";
  }
  return "uid " + std::to_string(who.uid) + " may not " + what + " " + path + " (" +
         std::strerror(err) + ")";
}

}  // namespace shareblk::rights
