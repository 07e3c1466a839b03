// shareblkd under systemd, without systemd (docs/install.md): the notices it sends to
// NOTIFY_SOCKET, and socket activation with the listening sockets passed as systemd passes
// them (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES). Also --version of both commands.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
using std::chrono::milliseconds;
using std::chrono::seconds;

// A datagram socket bound where NOTIFY_SOCKET points, as systemd's manager listens.
class FakeNotifySocket {
 public:
  explicit FakeNotifySocket(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      throw std::runtime_error("cannot bind " + path + ": " + std::strerror(errno));
    }
  }
  ~FakeNotifySocket() { ::close(fd_); }
  FakeNotifySocket(const FakeNotifySocket&) = delete;
  FakeNotifySocket& operator=(const FakeNotifySocket&) = delete;

  // The next message, or "" when none comes within `timeout`.
  std::string next(milliseconds timeout) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return "";
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  }
  // Waits for a message holding `line` (a whole line), skipping others; "" on timeout.
  std::string wait_for(const std::string& line, milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left =
          std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      const std::string message = next(left);
      std::istringstream lines(message);
      for (std::string l; std::getline(lines, l);) {
        if (l == line) return message;
      }
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// Sets an environment variable for the daemons a test starts, and unsets it afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() { ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

TEST(Systemd, NotifiesReadyWatchdogAndStoppingOnTheNotifySocket) {
  st::TempDir dir;
  FakeNotifySocket notify(dir / "notify.sock");
  const ScopedEnv notify_env("NOTIFY_SOCKET", dir / "notify.sock");
  const ScopedEnv watchdog_env("WATCHDOG_USEC", "200000");  // WatchdogSec=200ms
  const std::string control = dir / "shareblk.sock";
  st::Daemon daemon({"--state-dir", dir.path().string(), "--listen-unix", dir / "nbd.sock",
                     "--listen-tcp", "127.0.0.1:0", "--workers", "1"},
                    control);

  const std::string ready = notify.wait_for("READY=1", seconds(10));
  ASSERT_FALSE(ready.empty()) << daemon.log();
  EXPECT_NE(ready.find("MAINPID=" + std::to_string(daemon.pid()) + "\n"), std::string::npos)
      << ready;
  // Ready means serving: the control socket answers (it was bound before READY=1 was sent).
  EXPECT_TRUE(st::rpc_ok(control, "volume_list").is_array());

  // Every 100 ms (half the watchdog's time): a few within a second.
  const auto start = std::chrono::steady_clock::now();
  int pings = 0;
  while (pings < 3 && std::chrono::steady_clock::now() - start < seconds(2)) {
    if (!notify.wait_for("WATCHDOG=1", milliseconds(500)).empty()) ++pings;
  }
  EXPECT_EQ(pings, 3) << daemon.log();

  ASSERT_EQ(::kill(daemon.pid(), SIGTERM), 0);
  EXPECT_FALSE(notify.wait_for("STOPPING=1", seconds(10)).empty()) << daemon.log();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

TEST(Systemd, WithoutWatchdogSecNoWatchdogNoticeIsSent) {
  // (Without NOTIFY_SOCKET at all, as every other end-to-end test runs it, nothing is sent.)
  st::TempDir dir;
  FakeNotifySocket notify(dir / "notify.sock");
  const ScopedEnv notify_env("NOTIFY_SOCKET", dir / "notify.sock");
  ::unsetenv("WATCHDOG_USEC");
  const std::string control = dir / "shareblk.sock";
  st::Daemon daemon({"--state-dir", dir.path().string(), "--listen-unix", dir / "nbd.sock",
                     "--listen-tcp", "127.0.0.1:0", "--workers", "1"},
                    control);
  ASSERT_FALSE(notify.wait_for("READY=1", seconds(10)).empty()) << daemon.log();
  EXPECT_EQ(notify.wait_for("WATCHDOG=1", milliseconds(500)), "");
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// A listening Unix stream socket at `path`, or a TCP one on 127.0.0.1 with a free port.
int listening_unix(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);  // inherited, as systemd's are
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 16) != 0) {
    throw std::runtime_error("cannot listen on " + path + ": " + std::strerror(errno));
  }
  return fd;
}

int listening_tcp(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 16) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error(std::string("cannot listen on TCP: ") + std::strerror(errno));
  }
  port = ntohs(addr.sin_port);
  return fd;
}

// shareblkd started as systemd starts a socket-activated service: `fds` at 3, 4, ... in the
// child, LISTEN_PID the child's own pid (known only after fork), LISTEN_FDNAMES their names.
class ActivatedDaemon {
 public:
  ActivatedDaemon(const std::vector<std::string>& args, const std::vector<int>& fds,
                  const std::string& names, const std::string& log_path)
      : log_(log_path) {
    std::vector<std::string> argv{st::Daemon::binary()};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargs;
    for (auto& a : argv) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    // The environment is made before fork; the child only writes its pid into LISTEN_PID's
    // room (no allocation after fork in a process that may have threads).
    std::vector<std::string> env{"LISTEN_FDS=" + std::to_string(fds.size()),
                                 "LISTEN_FDNAMES=" + names, "LISTEN_PID=0000000000"};
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, "LISTEN_", 7) != 0) env.emplace_back(*e);
    }
    std::vector<char*> cenv;
    for (auto& e : env) cenv.push_back(e.data());
    cenv.push_back(nullptr);
    char* pid_digits = env[2].data() + std::strlen("LISTEN_PID=");
    // Out of the way of 3, 4, ... first (above every descriptor the test has), then into place.
    std::vector<int> moved;
    for (const int fd : fds) moved.push_back(::fcntl(fd, F_DUPFD_CLOEXEC, 100));
    const int log_fd = ::open(log_path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
    pid_ = ::fork();
    if (pid_ == 0) {
      for (size_t i = 0; i < moved.size(); ++i) ::dup2(moved[i], 3 + static_cast<int>(i));
      ::dup2(log_fd, 1);  // dup2 clears FD_CLOEXEC
      ::dup2(log_fd, 2);
      int n = 0;
      char digits[16];
      for (pid_t pid = ::getpid(); pid > 0; pid /= 10)
        digits[n++] = static_cast<char>('0' + pid % 10);
      for (int i = 0; i < n; ++i) pid_digits[i] = digits[n - 1 - i];
      pid_digits[n] = '\0';
      ::execve(cargs[0], cargs.data(), cenv.data());
      ::_exit(127);
    }
    for (const int fd : moved) ::close(fd);
    ::close(log_fd);
  }
  ~ActivatedDaemon() { stop(); }
  ActivatedDaemon(const ActivatedDaemon&) = delete;
  ActivatedDaemon& operator=(const ActivatedDaemon&) = delete;

  // SIGTERM (unless it exited already) and the exit status; 128+signal when killed.
  int stop() {
    if (pid_ <= 0) return status_;
    ::kill(pid_, SIGTERM);
    return wait(seconds(30));
  }
  int wait(seconds timeout) {
    if (pid_ <= 0) return status_;
    status_ = st::wait_exit(pid_, timeout);
    pid_ = -1;
    return status_;
  }
  std::string log() const {
    std::ifstream in(log_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  pid_t pid_ = -1;
  int status_ = -1;
  std::string log_;
};

// True when a client can connect to the Unix socket at `path` (a listening socket takes the
// connection into its backlog even when nobody accepts it).
bool connects(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

TEST(Systemd, ServesThePassedControlAndNbdSocketsAndLeavesThemListening) {
  st::TempDir dir;
  st::TempDir sockets;  // outside the state directory, as /run/shareblk is
  const std::string control = sockets / "shareblk.sock";
  const std::string nbd = sockets / "nbd.sock";
  int port = 0;
  const std::vector<int> fds{listening_unix(control), listening_unix(nbd), listening_tcp(port)};
  {
    // The passed sockets replace the configured ones (one config file for both ways to start).
    ActivatedDaemon daemon({"--state-dir", dir.path().string(), "--workers", "1",
                            "--control-socket", dir / "configured.sock", "--listen-unix",
                            dir / "configured-nbd.sock", "--listen-tcp", "127.0.0.1:0"},
                           fds, "control:nbd:nbd", dir / "daemon.log");
    // No wait for the socket to appear: it listens already, and the first call waits in its
    // backlog until the daemon accepts it.
    const std::string volume = st::rpc_ok(
        control, "volume_create", {{"name", "v"}, {"size", "1M"}, {"multiattach", true}})["id"];
    // The passed Unix socket is the one connection_info names, and it serves the attachment.
    const nlohmann::json unix_att =
        st::rpc_ok(control, "attachment_create",
                   {{"volume_id", volume},
                    {"instance_uuid", "a"},
                    {"connector", {{"host", "a"}, {"transport", "unix"}}}});
    const std::string uri = unix_att["connection_info"]["data"]["uri"];
    EXPECT_NE(uri.find("socket=" + nbd), std::string::npos) << uri;
    auto h = st::nbd_connect(uri);
    ASSERT_TRUE(h) << uri << "\n" << daemon.log();
    EXPECT_EQ(nbd_get_size(h.get()), 1 << 20);
    h.reset();
    // So is the passed TCP socket, with its port in the URI.
    const nlohmann::json tcp_att =
        st::rpc_ok(control, "attachment_create",
                   {{"volume_id", volume},
                    {"instance_uuid", "b"},
                    {"connector", {{"host", "b"}, {"transport", "tcp"}, {"ip", "127.0.0.1"}}}});
    const std::string tcp_uri = tcp_att["connection_info"]["data"]["uri"];
    EXPECT_NE(tcp_uri.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << tcp_uri;
    auto t = st::nbd_connect(tcp_uri);
    ASSERT_TRUE(t) << tcp_uri << "\n" << daemon.log();
    t.reset();
    // Nothing was bound where the passed sockets replace the configured ones.
    EXPECT_FALSE(std::filesystem::exists(dir / "configured.sock"));
    EXPECT_FALSE(std::filesystem::exists(dir / "configured-nbd.sock"));
    const std::string log = daemon.log();
    const size_t tcp_line = log.find("listening on tcp:");
    ASSERT_NE(tcp_line, std::string::npos) << log;
    EXPECT_EQ(log.substr(tcp_line, log.find('\n', tcp_line) - tcp_line),
              "listening on tcp:127.0.0.1:" + std::to_string(port))
        << log;
    EXPECT_EQ(log.find("listening on tcp:", tcp_line + 1), std::string::npos) << log;
    EXPECT_EQ(daemon.stop(), 0) << daemon.log();
  }
  // The sockets are systemd's: still there and listening after the daemon stopped, so that the
  // next connection can start it again.
  EXPECT_TRUE(connects(control));
  EXPECT_TRUE(connects(nbd));
  for (const int fd : fds) ::close(fd);
}

TEST(Systemd, RefusesAPassedSocketWithoutItsName) {
  st::TempDir dir;
  const std::vector<int> fds{listening_unix(dir / "x.sock")};
  ActivatedDaemon daemon({"--state-dir", dir.path().string()}, fds, "shareblkd.socket",
                         dir / "daemon.log");
  EXPECT_EQ(daemon.wait(seconds(20)), 1);
  EXPECT_NE(daemon.log().find("FileDescriptorName=control or nbd"), std::string::npos)
      << daemon.log();
  ::close(fds[0]);
}

TEST(Systemd, StandaloneModeServesPassedNbdSocketsAndRefusesAControlSocket) {
  st::TempDir dir;
  st::make_file(dir / "disk.img", 1 << 20, 0x5a);
  const std::string nbd = dir / "nbd.sock";
  {
    const std::vector<int> fds{listening_unix(nbd)};
    ActivatedDaemon daemon({"--export", "disk=" + dir / "disk.img", "--workers", "1"}, fds, "nbd",
                           dir / "daemon.log");
    auto h = st::nbd_connect("nbd+unix:///disk?socket=" + nbd);
    ASSERT_TRUE(h) << daemon.log();
    EXPECT_EQ(st::nbd_read(h.get(), 0, 4), st::pattern(0x5a, 4));
    h.reset();
    EXPECT_EQ(daemon.stop(), 0) << daemon.log();
    ::close(fds[0]);
  }
  const std::vector<int> fds{listening_unix(dir / "control.sock")};
  ActivatedDaemon daemon({"--export", "disk=" + dir / "disk.img"}, fds, "control",
                         dir / "daemon2.log");
  EXPECT_EQ(daemon.wait(seconds(20)), 2) << daemon.log();
  ::close(fds[0]);
}

TEST(Version, BothCommandsPrintTheProjectVersion) {
  const st::RunResult daemon = st::run({st::Daemon::binary(), "--version"}, seconds(10));
  EXPECT_EQ(daemon.status, 0);
  EXPECT_EQ(daemon.output, "shareblkd " SHAREBLK_VERSION "\n");
  const st::RunResult cli = st::run({SHAREBLK_CLI_PATH, "--version"}, seconds(10));
  EXPECT_EQ(cli.status, 0);
  EXPECT_EQ(cli.output, "shareblk " SHAREBLK_VERSION "\n");
}

}  // namespace
