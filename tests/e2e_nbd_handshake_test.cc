// End-to-end: the handshake. Listing and describing exports, TCP as well as Unix sockets, the
// old NBD_OPT_EXPORT_NAME, and handshakes that are broken or too slow.
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tests/e2e_nbd_fixture.h"

namespace shareblk::testing::e2e {
namespace {

TEST_F(E2eTest, ServesOverTcpToo) {
  const int port = tcp_port();
  ASSERT_GT(port, 0) << daemon_->log();
  Nbd tcp(nbd_create());
  ASSERT_TRUE(tcp);
  nbd_set_export_name(tcp.get(), "disk");
  ASSERT_EQ(nbd_connect_tcp(tcp.get(), "127.0.0.1", std::to_string(port).c_str()), 0)
      << nbd_get_error();
  const std::string data = random_bytes(3 * kMiB + 5, 25);
  ASSERT_TRUE(nbd_write(tcp.get(), 1 * kMiB + 1, data));
  ASSERT_EQ(nbd_flush(tcp.get(), 0), 0) << nbd_get_error();
  Nbd unix_socket = open_nbd(socket_, "disk");
  ASSERT_TRUE(unix_socket);
  EXPECT_TRUE(same_bytes(nbd_read(unix_socket.get(), 1 * kMiB + 1, data.size()), data));
  EXPECT_TRUE(same_bytes(nbd_read(tcp.get(), 1 * kMiB + 1, data.size()), data));

  // qemu's nbd:// URIs are TCP; the qemu-io tests proper need it, here it is a second client.
  if (have_program("qemu-io")) {
    const std::string tcp_uri = "nbd://127.0.0.1:" + std::to_string(port) + "/ro";
    RunResult read = run({"qemu-io", "-r", "-f", "raw", "-c", "read -P 0 0 1M", tcp_uri});
    EXPECT_EQ(read.status, 0) << read.output;
  }
}

int collect_export_name(void* user_data, const char* name, const char* /*description*/) {
  static_cast<std::vector<std::string>*>(user_data)->push_back(name);
  return 0;
}

// What `nbdinfo --list` does: list the exports, ask about each, then pick one.
TEST_F(E2eTest, ListsExportsAndDescribesThemBeforeChoosing) {
  Nbd h(nbd_create());
  ASSERT_TRUE(h);
  ASSERT_EQ(nbd_set_opt_mode(h.get(), true), 0) << nbd_get_error();
  ASSERT_EQ(nbd_connect_unix(h.get(), socket_.c_str()), 0) << nbd_get_error();
  std::vector<std::string> names;
  ASSERT_GE(nbd_opt_list(h.get(), nbd_list_callback{collect_export_name, &names, nullptr}), 0)
      << nbd_get_error();
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"disk", "ro"}));

  ASSERT_EQ(nbd_set_export_name(h.get(), "ro"), 0);
  ASSERT_EQ(nbd_opt_info(h.get()), 0) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(h.get()), 1);
  EXPECT_EQ(nbd_get_size(h.get()), static_cast<int64_t>(kDiskSize));
  ASSERT_EQ(nbd_set_export_name(h.get(), "no-such-export"), 0);
  EXPECT_EQ(nbd_opt_info(h.get()), -1);

  ASSERT_EQ(nbd_set_export_name(h.get(), "disk"), 0);
  ASSERT_EQ(nbd_opt_go(h.get()), 0) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(h.get()), 0);
  const std::string data = random_bytes(4096, 24);
  ASSERT_TRUE(nbd_write(h.get(), 0, data));
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 0, data.size()), data));
}

// The oldest way into transmission, NBD_OPT_EXPORT_NAME, with and without the 124 zero bytes
// after its reply: a byte too many or too few and the first reply would be misread.
TEST_F(E2eTest, ExportNameOptionEntersTransmission) {
  const std::string original = random_bytes(4096, 23);
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, 0, original));
  for (bool no_zeroes : {false, true}) {
    SCOPED_TRACE(no_zeroes ? "NO_ZEROES" : "with zeroes");
    RawClient c(socket_);
    ASSERT_TRUE(read_greeting(c));
    ASSERT_TRUE(send_u32(c, nbd::kClientFixedNewstyle | (no_zeroes ? nbd::kClientNoZeroes : 0)));
    ASSERT_TRUE(send_option(c, nbd::kOptExportName, "ro"));
    std::string reply(10 + (no_zeroes ? 0 : nbd::kExportNameZeroes), '\1');
    ASSERT_TRUE(c.recv_all(reply.data(), reply.size()));
    const auto* p = reinterpret_cast<const uint8_t*>(reply.data());
    EXPECT_EQ(nbd::get64(p), kDiskSize);
    EXPECT_NE(nbd::get16(p + 8) & nbd::kFlagReadOnly, 0);
    EXPECT_EQ(reply.substr(10), std::string(reply.size() - 10, '\0'));

    ASSERT_TRUE(send_request(c, nbd::kCmdRead, 7, 0, 4096));
    SimpleReply read;
    ASSERT_TRUE(read_simple_reply(c, read, {{7, 4096}}));
    EXPECT_EQ(read.cookie, 7u);
    EXPECT_EQ(read.error, 0u);
    EXPECT_TRUE(same_bytes(read.data, original));
  }
}

TEST_F(E2eTest, BrokenHandshakesAreCutOff) {
  struct Case {
    const char* what;
    std::function<bool(RawClient&)> send;
  };
  const std::vector<Case> cases = {
      {"garbage instead of client flags",
       [](RawClient& c) { return c.send_all(random_bytes(64, 16)); }},
      {"unknown client flags",
       [](RawClient& c) { return send_u32(c, nbd::kClientFixedNewstyle | (1u << 7)); }},
      {"bad option magic",
       [](RawClient& c) {
         return send_u32(c, nbd::kClientFixedNewstyle) &&
                send_option(c, nbd::kOptList, "", 0x4e4f544d41474943);
       }},
      // Cut off at once, not after waiting for 4 GiB that will never come.
      {"huge option length",
       [](RawClient& c) {
         uint8_t header[nbd::kOptionHeaderSize];
         nbd::put64(header, nbd::kOptMagic);
         nbd::put32(header + 8, nbd::kOptGo);
         nbd::put32(header + 12, 0xffffffff);
         return send_u32(c, nbd::kClientFixedNewstyle) && c.send_all(header, sizeof header);
       }},
      {"endless option haggling",
       [](RawClient& c) {
         if (!send_u32(c, nbd::kClientFixedNewstyle)) return false;
         // The server may hang up before the last ones are sent.
         for (int i = 0; i < 300; ++i) send_option(c, nbd::kOptStructuredReply, "");
         return true;
       }},
      {"NBD_OPT_EXPORT_NAME of an unknown export",
       [](RawClient& c) {
         return send_u32(c, nbd::kClientFixedNewstyle) &&
                send_option(c, nbd::kOptExportName, "no-such-export");
       }},
      {"NBD_OPT_ABORT",
       [](RawClient& c) {
         return send_u32(c, nbd::kClientFixedNewstyle) && send_option(c, nbd::kOptAbort, "");
       }},
  };
  for (const Case& test_case : cases) {
    SCOPED_TRACE(test_case.what);
    RawClient c(socket_);
    ASSERT_TRUE(c.connected());
    ASSERT_TRUE(read_greeting(c));
    ASSERT_TRUE(test_case.send(c));
    EXPECT_TRUE(c.closed_by_server());
  }
  expect_serving();
}

// The handshake timeout is one deadline for the whole handshake, not a wait per recv: a client
// trickling a valid handshake a byte at a time, never silent for long, is cut off once it is up.
// Otherwise such clients would hold --max-connections slots forever, and every client out.
TEST_F(E2eTest, TricklingHandshakeIsCutOffAtTheDeadline) {
  const std::string socket = dir_ / "trickle.sock";
  Daemon daemon({"--export", "disk=" + disk_, "--listen-unix", socket, "--workers", "1",
                 "--handshake-timeout-ms", "1000"},
                socket);
  // A well-behaved client is well within the deadline.
  ASSERT_TRUE(open_nbd(socket, "disk"));

  // Client flags and NBD_OPT_GO "disk": 30 bytes, one every 200 ms, so 6 s in all.
  std::string bytes(4 + nbd::kOptionHeaderSize + 10, '\0');
  auto* p = reinterpret_cast<uint8_t*>(bytes.data());
  nbd::put32(p, nbd::kClientFixedNewstyle | nbd::kClientNoZeroes);
  nbd::put64(p + 4, nbd::kOptMagic);
  nbd::put32(p + 12, nbd::kOptGo);
  nbd::put32(p + 16, 10);
  nbd::put32(p + 20, 4);
  std::memcpy(p + 24, "disk", 4);  // and no information requests

  RawClient c(socket);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(read_greeting(c));
  size_t sent = 0;
  bool closed = false;
  while (!closed && sent < bytes.size()) {
    if (!c.send_all(&bytes[sent], 1)) break;  // the server hung up in between
    ++sent;
    closed = c.closed_by_server(200ms);
  }
  if (!closed) closed = c.closed_by_server(2s);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(closed) << "the trickling client finished its handshake after " << sent << " bytes";
  EXPECT_LT(elapsed, 2500ms) << "cut off only after " << sent << " of " << bytes.size() << " bytes";
  EXPECT_LT(sent, bytes.size());
  // The daemon is still serving.
  EXPECT_TRUE(open_nbd(socket, "disk"));
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

}  // namespace
}  // namespace shareblk::testing::e2e
