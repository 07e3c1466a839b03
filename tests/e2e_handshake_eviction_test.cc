// Handshake places cannot be monopolised by a few hosts (issue 39): silent sockets from
// several addresses, each within --max-handshakes-per-peer, that reconnect as they are cut.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <libnbd.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Silent sockets from several hosts, each within --max-handshakes-per-peer, that reconnect
// as soon as they are cut: `kHosts` source addresses (127.0.0.2, ...), `kPerHost` sockets each.
// Every byte the server sends (its greeting) is read and ignored; nothing is ever sent.
class SilentHosts {
 public:
  static constexpr int kHosts = 8;
  static constexpr int kPerHost = 16;

  explicit SilentHosts(int port) : port_(port) {
    for (int host = 0; host < kHosts; ++host) {
      for (int i = 0; i < kPerHost; ++i) sockets_.push_back({connect_from(host), host});
    }
    thread_ = std::thread([this] { run(); });
  }
  ~SilentHosts() {
    stop_ = true;
    thread_.join();
    for (const Socket& s : sockets_) {
      if (s.fd >= 0) ::close(s.fd);
    }
  }
  SilentHosts(const SilentHosts&) = delete;
  SilentHosts& operator=(const SilentHosts&) = delete;

  int connected() const { return connected_; }
  uint64_t reconnects() const { return reconnects_; }

 private:
  struct Socket {
    int fd;
    int host;
  };

  int connect_from(int host) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    // The source port is chosen at connect(): bind() alone would reserve one for every
    // destination, and the churn below would run out of them.
    int one = 1;
    ::setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
    sockaddr_in from{};
    from.sin_family = AF_INET;
    from.sin_addr.s_addr = htonl(INADDR_LOOPBACK + 2 + static_cast<uint32_t>(host));
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port_));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0 ||
        ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
      ::close(fd);
      return -1;
    }
    ++connected_;
    return fd;
  }

  void run() {
    std::vector<pollfd> polled(sockets_.size());
    char junk[256];
    while (!stop_) {
      for (size_t i = 0; i < sockets_.size(); ++i) {
        if (sockets_[i].fd < 0) {
          sockets_[i].fd = connect_from(sockets_[i].host);
          if (sockets_[i].fd >= 0) ++reconnects_;
        }
        polled[i] = {sockets_[i].fd, POLLIN, 0};
      }
      if (::poll(polled.data(), polled.size(), 10) <= 0) continue;
      for (size_t i = 0; i < sockets_.size(); ++i) {
        if (polled[i].fd < 0 || polled[i].revents == 0) continue;
        const ssize_t n = ::recv(polled[i].fd, junk, sizeof junk, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {  // cut: come back
          ::close(sockets_[i].fd);
          sockets_[i].fd = -1;
        }
      }
    }
  }

  const int port_;
  std::vector<Socket> sockets_;
  std::atomic<bool> stop_{false};
  std::atomic<int> connected_{0};
  std::atomic<uint64_t> reconnects_{0};
  std::thread thread_;
};

// Clients that each open `uri`, negotiate in full and read once: how many were served.
int honest_clients_served(const std::string& uri, int clients) {
  int served = 0;
  for (int i = 0; i < clients; ++i) {
    st::NbdHandle h = st::nbd_connect(uri);
    if (!h) continue;
    std::string data(512, '\0');
    if (nbd_pread(h.get(), data.data(), data.size(), 512, 0) == 0 &&
        data == std::string(512, 0x5a)) {
      ++served;
    }
  }
  return served;
}

// Issue 39: 16 silent sockets from each of 8 addresses held all 128 handshake places (each
// address within its 16), and while they reconnected as they were cut, 0 of 50 new clients got
// in, over TCP and over the Unix socket alike. Now Unix clients have places of their own, and a
// full table closes the handshake that has gone longest without progress instead of refusing
// the newcomer.
TEST(HandshakeLimits, SilentHostsThatReconnectCannotHoldEveryPlace) {
  st::TempDir dir;
  const std::string disk = dir / "disk.img";
  st::make_file(disk, 1 << 20, 0x5a);
  const std::string sock = dir / "nbd.sock";
  st::Daemon daemon({"--export", "disk=" + disk, "--listen-unix", sock, "--listen-tcp",
                     "127.0.0.1:0", "--workers", "1", "--max-handshakes", "128",
                     "--max-handshakes-per-peer", "16", "--handshake-timeout-ms", "20000"},
                    sock);
  const int port = st::logged_tcp_port(daemon, "127.0.0.1");
  ASSERT_GT(port, 0) << daemon.log();
  int unix_served = 0;
  int tcp_served = 0;
  uint64_t reconnects = 0;
  double seconds = 0;
  {
    SilentHosts silent(port);
    // Until the server has taken them all in: every one connected, and the table full.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ASSERT_GE(silent.connected(), SilentHosts::kHosts * SilentHosts::kPerHost);
    const auto start = std::chrono::steady_clock::now();
    unix_served = honest_clients_served("nbd+unix:///disk?socket=" + sock, 50);
    tcp_served = honest_clients_served("nbd://127.0.0.1:" + std::to_string(port) + "/disk", 50);
    reconnects = silent.reconnects();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "honest clients served: unix " << unix_served << "/50, tcp " << tcp_served
              << "/50, in " << seconds << " s; the silent hosts reconnected " << reconnects
              << " times\n";
  }
  EXPECT_EQ(unix_served, 50) << "Unix clients have handshake places of their own";
  EXPECT_GE(tcp_served, 45) << "a full table makes room for a newcomer";
  // Thousands of refusals and evictions, in lines rate-limited to about one a second each.
  const std::string log = daemon.log();
  EXPECT_NE(log.find("handshake table is full"), std::string::npos) << "the table was full";
  EXPECT_LE(count(log, "refusing a connection") + count(log, "handshake table is full"),
            static_cast<size_t>(3 * (seconds + 3)))
      << log.substr(0, 4000);
  EXPECT_EQ(daemon.stop(SIGTERM), 0);
}

}  // namespace
