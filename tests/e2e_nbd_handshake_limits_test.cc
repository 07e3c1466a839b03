// Handshakes cannot starve service (issue 19): 1,030 sockets that connected and never
// negotiated held --max-connections for 30 s, and new clients on TCP and Unix were refused
// for 74 of 75 s, each refusal a log line. Now handshakes have a limit of their own and one
// per peer, and refusals are logged once a second with a count.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <libnbd.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e_nbd_fixture.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;

int tcp_connect(int port) {
  return st::connect_loopback(port);
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(HandshakeLimits, HalfOpenSocketsFromOnePeerLeaveOthersServed) {
  st::TempDir dir;
  const std::string disk = dir / "disk.img";
  st::make_file(disk, 1 << 20, 0x5a);
  const std::string sock = dir / "nbd.sock";
  st::Daemon daemon({"--export", "disk=" + disk, "--listen-unix", sock, "--listen-tcp",
                     "127.0.0.1:0", "--workers", "1", "--max-connections", "64", "--max-handshakes",
                     "8", "--max-handshakes-per-peer", "4", "--handshake-timeout-ms", "30000"},
                    sock);
  // Polls the log: the socket that says the daemon is up exists before this line is written.
  const int port = st::e2e::logged_tcp_port(daemon, "127.0.0.1");
  ASSERT_GT(port, 0) << daemon.log();
  const std::string uri = "nbd+unix:///disk?socket=" + sock;
  int err = 0;
  st::NbdHandle established = st::nbd_connect(uri, &err);
  ASSERT_TRUE(established) << err;

  // 300 sockets from one host that connect and never say a word.
  std::vector<int> silent;
  for (int i = 0; i < 300; ++i) {
    const int fd = tcp_connect(port);
    if (fd >= 0) silent.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));

  // The connection that was there is served, and a new client from elsewhere gets in.
  EXPECT_EQ(st::nbd_read(established.get(), 0, 4096), std::string(4096, 0x5a));
  for (int i = 0; i < 3; ++i) {
    st::NbdHandle fresh = st::nbd_connect(uri, &err);
    ASSERT_TRUE(fresh) << "a new client was refused while one peer sat on handshakes: " << err;
    EXPECT_EQ(st::nbd_read(fresh.get(), 512, 512), std::string(512, 0x5a));
  }
  // 296 refusals, in a few rate-limited lines that count the rest.
  const std::string log = daemon.log();
  const size_t lines = count(log, "refusing a connection");
  EXPECT_GE(lines, 1u) << log;
  EXPECT_LE(lines, 4u) << log;
  EXPECT_NE(log.find("too many handshakes from one peer"), std::string::npos) << log;
  for (int fd : silent) ::close(fd);
  EXPECT_EQ(daemon.stop(SIGTERM), 0);
}

}  // namespace
