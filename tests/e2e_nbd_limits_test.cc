// End-to-end: limits, timeouts and robustness. Many connections, many requests in flight, memory
// per connection, clients that vanish or take no replies, and stopping with clients connected.
#include <signal.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e_nbd_fixture.h"

namespace shareblk::testing::e2e {
namespace {

TEST_F(E2eTest, ClientsVanishingMidwayDoNotDisturbOthers) {
  // Opened before the abuse, and must be served throughout.
  Nbd before = open_nbd(socket_, "disk");
  ASSERT_TRUE(before);
  const std::string data = random_bytes(1 * kMiB, 17);
  ASSERT_TRUE(nbd_write(before.get(), 8 * kMiB, data));
  ASSERT_EQ(nbd_flush(before.get(), 0), 0) << nbd_get_error();

  {  // gone before reading the greeting
    RawClient c(socket_);
    ASSERT_TRUE(c.connected());
  }
  {  // gone in the middle of an option header
    RawClient c(socket_);
    ASSERT_TRUE(read_greeting(c));
    ASSERT_TRUE(send_u32(c, nbd::kClientFixedNewstyle));
    ASSERT_TRUE(c.send_all(std::string("IHAVE")));
  }
  {  // gone in the middle of an option's data
    RawClient c(socket_);
    ASSERT_TRUE(read_greeting(c));
    ASSERT_TRUE(send_u32(c, nbd::kClientFixedNewstyle));
    uint8_t header[nbd::kOptionHeaderSize];
    nbd::put64(header, nbd::kOptMagic);
    nbd::put32(header + 8, nbd::kOptGo);
    nbd::put32(header + 12, 1000);
    ASSERT_TRUE(c.send_all(header, sizeof header));
    ASSERT_TRUE(c.send_all(std::string(10, 'x')));
  }
  {  // gone in the middle of a request header
    RawClient c(socket_);
    ASSERT_TRUE(handshake(c, "disk"));
    uint8_t request[nbd::kRequestSize];
    nbd::encode_request(request, nbd::Request{nbd::kRequestMagic, 0, nbd::kCmdRead, 1, 0, 4096});
    ASSERT_TRUE(c.send_all(request, 10));
  }
  {  // gone after 100 bytes of a 1 MiB write's payload: none of it may land
    RawClient c(socket_);
    ASSERT_TRUE(handshake(c, "disk"));
    ASSERT_TRUE(send_request(c, nbd::kCmdWrite, 1, 8 * kMiB, 1 * kMiB));
    ASSERT_TRUE(c.send_all(std::string(100, '\xee')));
  }
  {  // gone with requests in flight and their replies unread
    RawClient c(socket_);
    ASSERT_TRUE(handshake(c, "disk"));
    for (uint64_t cookie = 1; cookie <= 16; ++cookie) {
      ASSERT_TRUE(send_request(c, nbd::kCmdRead, cookie, 0, 2 * kMiB));
    }
  }

  EXPECT_TRUE(same_bytes(nbd_read(before.get(), 8 * kMiB, data.size()), data));
  expect_serving();
  before.reset();
  // Once the daemon has finished with every connection, the abandoned write is still absent.
  stop_daemon();
  EXPECT_TRUE(same_bytes(read_file(disk_, 8 * kMiB, data.size()), data));
}

TEST_F(E2eTest, ThreeHundredConnectionsAtOnce) {
  // 250 handshakes from one local user at once: past the defaults (128, 16 per peer), which
  // HandshakeLimits tests; here the server's capacity is the point.
  start_daemon({"--max-handshakes", "300", "--max-handshakes-per-peer", "300"});
  Nbd before = open_nbd(socket_, "disk");
  ASSERT_TRUE(before);
  // Idle in the handshake at three different points...
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < 250; ++i) {
    idle.push_back(std::make_unique<RawClient>(socket_));
    ASSERT_TRUE(idle.back()->connected()) << "connection " << i;
    if (i % 3 >= 1) {
      ASSERT_TRUE(read_greeting(*idle.back())) << "connection " << i;
    }
    if (i % 3 == 2) {
      ASSERT_TRUE(send_u32(*idle.back(), nbd::kClientFixedNewstyle)) << "connection " << i;
    }
  }
  // ...and idle in transmission.
  std::vector<Nbd> ready;
  for (int i = 0; i < 50; ++i) {
    ready.push_back(open_nbd(socket_, i % 2 ? "disk" : "ro"));
    ASSERT_TRUE(ready.back()) << "handle " << i;
  }

  const auto start = std::chrono::steady_clock::now();
  ASSERT_NO_FATAL_FAILURE(expect_serving(20));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "a new client waited too long";
  const std::string written = nbd_read(before.get(), 60 * kMiB, 8 * kKiB);
  EXPECT_TRUE(same_bytes(written, random_bytes(8 * kKiB, 20)));
  for (size_t i = 0; i < ready.size(); i += 7) {
    EXPECT_TRUE(same_bytes(nbd_read(ready[i].get(), 60 * kMiB, 8 * kKiB), written));
  }

  idle.clear();
  ready.clear();
  ASSERT_NO_FATAL_FAILURE(expect_serving(21));
}

// Stopping the daemon (SIGTERM) with clients in every state: it exits promptly and cleanly.
TEST_F(E2eTest, StopsPromptlyWithClientsConnected) {
  std::vector<std::unique_ptr<RawClient>> raw;
  auto connect = [&] {
    raw.push_back(std::make_unique<RawClient>(socket_));
    return raw.back().get();
  };
  ASSERT_TRUE(connect()->connected());     // before the greeting
  ASSERT_TRUE(read_greeting(*connect()));  // in option haggling
  RawClient* mid_payload = connect();      // a WRITE whose payload is still coming
  ASSERT_TRUE(handshake(*mid_payload, "disk"));
  ASSERT_TRUE(send_request(*mid_payload, nbd::kCmdWrite, 1, 0, 1 * kMiB));
  ASSERT_TRUE(mid_payload->send_all(std::string(1000, 'p')));
  RawClient* not_reading = connect();  // replies it never reads
  ASSERT_TRUE(handshake(*not_reading, "disk"));
  for (uint64_t cookie = 1; cookie <= 8; ++cookie) {
    ASSERT_TRUE(send_request(*not_reading, nbd::kCmdRead, cookie, 0, nbd::kMaxPayload));
  }
  Nbd idle = open_nbd(socket_, "disk");
  ASSERT_TRUE(idle);
  // Let the daemon take in what was sent before it is told to stop.
  std::this_thread::sleep_for(200ms);

  const auto start = std::chrono::steady_clock::now();
  stop_daemon();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  for (auto& c : raw) EXPECT_TRUE(c->closed_by_server(1s));
}

// One connection may not hold more than a bounded amount of memory in the server, however
// many requests it pipelines: the server stops taking requests from it until replies drain.
TEST_F(E2eTest, PipelinedLargeReadsStayWithinTheServerMemoryBound) {
  RawClient c(socket_);
  ASSERT_TRUE(handshake(c, "disk"));
  const long rss_before = proc_status_kib(daemon_->pid(), "VmRSS");
  ASSERT_GT(rss_before, 0);

  // 64 reads of 32 MiB, 2 GiB of replies, requested in one go and not read for a while.
  constexpr int kReads = 64;
  std::string requests;
  std::map<uint64_t, uint32_t> read_lengths;
  for (uint64_t cookie = 1; cookie <= kReads; ++cookie) {
    uint8_t request[nbd::kRequestSize];
    nbd::encode_request(request, nbd::Request{nbd::kRequestMagic, 0, nbd::kCmdRead, cookie,
                                              (cookie % 2) * nbd::kMaxPayload, nbd::kMaxPayload});
    requests.append(reinterpret_cast<char*>(request), sizeof request);
    read_lengths[cookie] = nbd::kMaxPayload;
  }
  ASSERT_TRUE(c.send_all(requests));

  // Far below the 2 GiB that buffering every reply would take, and generous for an
  // instrumented build. The daemon gets until its memory stops growing to show its peak.
  constexpr long kBoundKiB = 512 * 1024;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  long settled_rss = rss_before;
  auto settled_since = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() < deadline &&
         std::chrono::steady_clock::now() - settled_since < 500ms &&
         proc_status_kib(daemon_->pid(), "VmHWM") - rss_before < kBoundKiB) {
    std::this_thread::sleep_for(20ms);
    const long rss = proc_status_kib(daemon_->pid(), "VmRSS");
    if (rss - settled_rss > 1024) {
      settled_rss = rss;
      settled_since = std::chrono::steady_clock::now();
    }
  }
  const long peak = proc_status_kib(daemon_->pid(), "VmHWM");
  EXPECT_LT(peak - rss_before, kBoundKiB) << "shareblkd grew from " << rss_before / 1024
                                          << " MiB to a peak of " << peak / 1024 << " MiB";

  // Replies flow once the client reads; then it hangs up with most of them unread.
  std::set<uint64_t> answered;
  for (int i = 0; i < 6; ++i) {
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, read_lengths));
    EXPECT_EQ(reply.error, 0u);
    EXPECT_TRUE(answered.insert(reply.cookie).second) << "cookie " << reply.cookie;
  }
  c.close();
  expect_serving();
}

// A client that stays connected but takes none of its replies (a hung initiator) is cut off
// after --send-timeout-ms, and the daemon goes on serving others. Before, it kept its
// connection, and the buffers behind it, for as long as it lived.
TEST_F(E2eTest, AClientThatTakesNoRepliesIsCutOff) {
  const std::string socket = dir_ / "hung.sock";
  Daemon daemon({"--export", "disk=" + disk_, "--listen-unix", socket, "--send-timeout-ms", "500"},
                socket);
  RawClient c(socket);
  ASSERT_TRUE(handshake(c, "disk"));
  std::string requests;
  for (uint64_t cookie = 1; cookie <= 64; ++cookie) {
    uint8_t request[nbd::kRequestSize];
    nbd::encode_request(request, nbd::Request{nbd::kRequestMagic, 0, nbd::kCmdRead, cookie,
                                              (cookie % 2) * nbd::kMaxPayload, nbd::kMaxPayload});
    requests.append(reinterpret_cast<char*>(request), sizeof request);
  }
  ASSERT_TRUE(c.send_all(requests));
  std::this_thread::sleep_for(2s);  // takes nothing

  // What was already in the socket, then end-of-file.
  EXPECT_TRUE(c.closed_by_server(10s)) << "the hung client was not cut off";
  EXPECT_NE(daemon.log().find("took none of its replies for 500 ms"), std::string::npos)
      << daemon.log();
  Nbd h = open_nbd(socket, "disk");
  ASSERT_TRUE(h);
  EXPECT_EQ(nbd_read(h.get(), 0, 4096), std::string(4096, '\0'));
  h.reset();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// More requests pipelined than the server takes from one client at a time: it takes the rest
// as replies drain, and answers every one.
TEST_F(E2eTest, ThousandsOfPipelinedRequestsAreAllAnswered) {
  RawClient c(socket_);
  ASSERT_TRUE(handshake(c, "disk"));
  constexpr uint64_t kBlocks = 1000;
  constexpr uint32_t kBlock = 4096;
  const std::string data = random_bytes(kBlocks * kBlock, 22);

  std::string writes;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    uint8_t request[nbd::kRequestSize];
    nbd::encode_request(
        request, nbd::Request{nbd::kRequestMagic, 0, nbd::kCmdWrite, i + 1, i * kBlock, kBlock});
    writes.append(reinterpret_cast<char*>(request), sizeof request);
    writes.append(data, i * kBlock, kBlock);
  }
  // The replies are read on another thread as the writes go out: the server may not take
  // more requests until replies drain, and a client that never reads would wait forever.
  std::set<uint64_t> written;
  std::thread reply_reader([&] {
    for (uint64_t i = 0; i < kBlocks; ++i) {
      SimpleReply reply;
      if (!read_simple_reply(c, reply)) return;
      if (reply.error == 0) written.insert(reply.cookie);
    }
  });
  EXPECT_TRUE(c.send_all(writes));
  reply_reader.join();
  ASSERT_EQ(written.size(), kBlocks);

  std::string reads;
  std::map<uint64_t, uint32_t> read_lengths;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    uint8_t request[nbd::kRequestSize];
    nbd::encode_request(request, nbd::Request{nbd::kRequestMagic, 0, nbd::kCmdRead, i + 1,
                                              (kBlocks - 1 - i) * kBlock, kBlock});
    reads.append(reinterpret_cast<char*>(request), sizeof request);
    read_lengths[i + 1] = kBlock;
  }
  ASSERT_TRUE(c.send_all(reads));
  std::set<uint64_t> answered;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, read_lengths)) << "after " << i << " replies";
    ASSERT_EQ(reply.error, 0u);
    ASSERT_TRUE(answered.insert(reply.cookie).second) << "cookie " << reply.cookie;
    const uint64_t block = kBlocks - reply.cookie;
    ASSERT_TRUE(same_bytes(reply.data, data.substr(block * kBlock, kBlock))) << "block " << block;
  }
}

}  // namespace
}  // namespace shareblk::testing::e2e
