// A request whose payload stops arriving is cut off after --payload-timeout-ms (issue 19):
// before, a WRITE header that promised bytes it never sent held its connection, and the payload
// memory reserved for it, for as long as the client lived.
#include <signal.h>

#include <chrono>
#include <string>
#include <thread>

#include "tests/e2e_nbd_fixture.h"

namespace shareblk::testing::e2e {
namespace {

class PayloadDeadlineTest : public E2eTest {
 protected:
  std::string deadline_socket() const { return dir_ / "deadline.sock"; }
  std::unique_ptr<Daemon> start_with_deadline(const std::string& ms) {
    return std::make_unique<Daemon>(
        std::vector<std::string>{"--export", "disk=" + disk_, "--listen-unix", deadline_socket(),
                                 "--listen-tcp", "127.0.0.1:0", "--workers", "1",
                                 "--payload-timeout-ms", ms},
        deadline_socket());
  }
  // Sends a WRITE of `data` at `offset` in 16 pieces 150 ms apart (2.25 s in all, several
  // 500 ms deadlines; a client thread woken late by up to 350 ms on a busy machine still keeps
  // within one), then expects it answered without error.
  static void write_in_pieces(RawClient& c, uint64_t cookie, uint64_t offset,
                              const std::string& data, const Daemon& daemon) {
    ASSERT_TRUE(
        send_request(c, nbd::kCmdWrite, cookie, offset, static_cast<uint32_t>(data.size())));
    const size_t piece = data.size() / 16;
    for (size_t at = 0; at < data.size(); at += piece) {
      if (at > 0) std::this_thread::sleep_for(150ms);
      ASSERT_TRUE(c.send_all(data.substr(at, piece)));
    }
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply)) << daemon.log();
    EXPECT_EQ(reply.cookie, cookie);
    EXPECT_EQ(reply.error, 0u);
  }
};

// Over TCP a large payload wakes the worker only once it is all there (SO_RCVLOWAT), so bytes
// can have arrived that the worker has not seen: they count as the payload coming.
TEST_F(PayloadDeadlineTest, OverTcpALargePayloadThatKeepsComingIsTakenWhole) {
  auto daemon = start_with_deadline("500");
  RawClient c("127.0.0.1", logged_tcp_port(*daemon, "127.0.0.1"));
  ASSERT_TRUE(handshake(c, "disk"));
  const std::string data = random_bytes(kMiB, 11);
  write_in_pieces(c, 1, 0, data, *daemon);
  // And with nothing more sent after it, a write that follows is answered: the worker does not
  // wait for more bytes than the next request brings.
  const std::string next = random_bytes(200 * kKiB, 12);
  ASSERT_TRUE(send_request(c, nbd::kCmdWrite, 2, kMiB, static_cast<uint32_t>(next.size())));
  ASSERT_TRUE(c.send_all(next));
  SimpleReply reply;
  ASSERT_TRUE(read_simple_reply(c, reply)) << daemon->log();
  EXPECT_EQ(reply.cookie, 2u);
  EXPECT_EQ(reply.error, 0u);
  Nbd h = open_nbd(deadline_socket(), "disk");
  ASSERT_TRUE(h);
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 0, data.size()), data));
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), kMiB, next.size()), next));
  EXPECT_EQ(daemon->log().find("cutting it off"), std::string::npos) << daemon->log();
  h.reset();
  c.close();
  EXPECT_EQ(daemon->stop(SIGTERM), 0) << daemon->log();
}

// Bytes that came and then stopped are not progress for ever: the payload still stalls.
TEST_F(PayloadDeadlineTest, OverTcpALargePayloadThatStopsIsCutOff) {
  auto daemon = start_with_deadline("500");
  RawClient c("127.0.0.1", logged_tcp_port(*daemon, "127.0.0.1"));
  ASSERT_TRUE(handshake(c, "disk"));
  const auto sent = std::chrono::steady_clock::now();
  ASSERT_TRUE(send_request(c, nbd::kCmdWrite, 1, 0, static_cast<uint32_t>(kMiB)));
  ASSERT_TRUE(c.send_all(std::string(300 * kKiB, 'x')));  // of 1 MiB, and then nothing
  ASSERT_TRUE(c.closed_by_server(5s)) << "the stalled writer still holds its connection";
  const auto waited = std::chrono::steady_clock::now() - sent;
  EXPECT_GE(waited, 450ms);
  EXPECT_LE(waited, 2s);
  EXPECT_NE(daemon->log().find("sent none of a request's payload for 500 ms; cutting it off"),
            std::string::npos)
      << daemon->log();
  Nbd h = open_nbd(deadline_socket(), "disk");
  ASSERT_TRUE(h);
  EXPECT_EQ(nbd_read(h.get(), 0, 4096), std::string(4096, '\0'));
  h.reset();
  EXPECT_EQ(daemon->stop(SIGTERM), 0) << daemon->log();
}

TEST_F(PayloadDeadlineTest, AWriteWhosePayloadStopsIsCutOffWhileOthersAreServed) {
  auto daemon = start_with_deadline("500");
  Nbd other = open_nbd(deadline_socket(), "disk");  // on the same (only) worker
  ASSERT_TRUE(other);
  RawClient c(deadline_socket());
  ASSERT_TRUE(handshake(c, "disk"));
  // Taken before sending: the server cannot start counting earlier, so the lower bound below
  // holds however late this thread runs.
  const auto sent = std::chrono::steady_clock::now();
  ASSERT_TRUE(send_request(c, nbd::kCmdWrite, 1, 0, static_cast<uint32_t>(kMiB)));
  ASSERT_TRUE(c.send_all(std::string(10, 'x')));  // of 1 MiB, and then nothing

  bool closed = false;
  int served = 0;
  while (!closed && std::chrono::steady_clock::now() - sent < 5s) {
    closed = c.closed_by_server(50ms);
    const std::string data = random_bytes(4096, static_cast<uint64_t>(served));
    ASSERT_TRUE(nbd_write(other.get(), 8 * kMiB, data));
    ASSERT_TRUE(same_bytes(nbd_read(other.get(), 8 * kMiB, data.size()), data));
    ++served;
  }
  const auto waited = std::chrono::steady_clock::now() - sent;
  ASSERT_TRUE(closed) << "the silent writer still holds its connection after 5 s";
  EXPECT_GE(waited, 450ms);
  EXPECT_LE(waited, 2s);
  std::cout << "[ stats    ] cut off after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(waited).count()
            << " ms; the other client was served " << served << " times meanwhile\n";
  EXPECT_NE(daemon->log().find("sent none of a request's payload for 500 ms; cutting it off"),
            std::string::npos)
      << daemon->log();
  // Nothing of the unfinished write reached the disk.
  EXPECT_EQ(nbd_read(other.get(), 0, 4096), std::string(4096, '\0'));
  other.reset();
  EXPECT_EQ(daemon->stop(SIGTERM), 0) << daemon->log();
}

// The deadline is for a payload that stops, not for a slow one: every byte that arrives starts
// it again, so a payload trickling in over several deadlines is taken whole.
TEST_F(PayloadDeadlineTest, APayloadThatKeepsComingIsTakenWhole) {
  auto daemon = start_with_deadline("500");
  RawClient c(deadline_socket());
  ASSERT_TRUE(handshake(c, "disk"));
  const std::string data = random_bytes(64 * kKiB, 7);
  write_in_pieces(c, 1, 0, data, *daemon);
  Nbd h = open_nbd(deadline_socket(), "disk");
  ASSERT_TRUE(h);
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 0, data.size()), data));
  EXPECT_EQ(daemon->log().find("cutting it off"), std::string::npos) << daemon->log();
  h.reset();
  c.close();
  EXPECT_EQ(daemon->stop(SIGTERM), 0) << daemon->log();
}

}  // namespace
}  // namespace shareblk::testing::e2e
