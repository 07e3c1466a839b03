// One transmission-phase Connection on a real io_uring Worker, driven over a socketpair: for
// orderings that a whole daemon cannot force, and for the request checks and reply chunks,
// byte by byte.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include "backend/backend.h"
#include "target/nbd_proto.h"
#include "target/worker.h"
#include "tests/support.h"
#include "tests/worker_fixture.h"

namespace shareblk::testing {
namespace {

using namespace std::chrono_literals;

// The data of one simple READ reply of `length` bytes, waiting up to `wait` for it; empty when
// it does not come whole.
std::string recv_read_reply(int fd, size_t length, std::chrono::seconds wait) {
  std::string reply(16 + length, '\0');
  timeval tv{static_cast<time_t>(wait.count()), 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::recv(fd, reply.data(), reply.size(), MSG_WAITALL) != static_cast<ssize_t>(reply.size())) {
    return {};
  }
  return reply.substr(16);
}

// Exactly `length` bytes, waiting up to 5 s for them; nothing when they do not all come.
std::optional<std::string> recv_exact(int fd, size_t length) {
  std::string bytes(length, '\0');
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (length > 0 && ::recv(fd, bytes.data(), length, MSG_WAITALL) != static_cast<ssize_t>(length)) {
    return std::nullopt;
  }
  return bytes;
}

struct SimpleReply {
  uint32_t error = 0;
  uint64_t cookie = 0;
};

// A simple reply's header (its data, if any, is left to read).
std::optional<SimpleReply> recv_simple_reply(int fd) {
  const std::optional<std::string> bytes = recv_exact(fd, nbd::kSimpleReplySize);
  if (!bytes) return std::nullopt;
  const auto* p = reinterpret_cast<const uint8_t*>(bytes->data());
  if (nbd::get32(p) != nbd::kSimpleReplyMagic) return std::nullopt;
  return SimpleReply{nbd::get32(p + 4), nbd::get64(p + 8)};
}

struct Chunk {
  uint16_t flags = 0;
  uint16_t type = 0;
  uint64_t cookie = 0;
  std::string payload;
  bool is_error() const { return (type & (1u << 15)) != 0; }
};

// The chunks of one structured reply, up to the one marked DONE.
std::optional<std::vector<Chunk>> recv_structured_reply(int fd) {
  std::vector<Chunk> chunks;
  do {
    const std::optional<std::string> header = recv_exact(fd, nbd::kChunkHeaderSize);
    if (!header) return std::nullopt;
    const auto* p = reinterpret_cast<const uint8_t*>(header->data());
    if (nbd::get32(p) != nbd::kStructuredReplyMagic) return std::nullopt;
    std::optional<std::string> payload = recv_exact(fd, nbd::get32(p + 16));
    if (!payload) return std::nullopt;
    chunks.push_back(
        {nbd::get16(p + 4), nbd::get16(p + 6), nbd::get64(p + 8), std::move(*payload)});
  } while (!(chunks.back().flags & nbd::kReplyFlagDone));
  return chunks;
}

// Four clients that each send eight 32 MiB READs and never read a reply; their ends, or
// fewer on failure.
std::vector<int> greedy_clients(WorkerOnAFile& w) {
  constexpr uint32_t kRead = 32 << 20;
  std::vector<int> clients;
  for (int c = 0; c < 4; ++c) {
    const int fd = w.connect(backend::AttachMode::ReadOnly);
    if (fd < 0) return clients;
    clients.push_back(fd);
    for (uint64_t i = 0; i < 8; ++i) {
      if (!send_request(fd, nbd::kCmdRead, i, i * kRead, kRead)) return clients;
    }
  }
  return clients;
}

// Sends a WRITE of `total` bytes and the first `part` of its payload, waits until the rest is an
// armed receive, then holds the worker in a task while `part` more bytes arrive and the
// connection's group is closed (`now`: abort, else drain). When the task returns, the re-armed
// wakeup completes at submission, ahead of the receive: the worker runs the close first and
// then the receive, in one batch of completions.
bool close_group_mid_payload(WorkerOnAFile& w, int client, uint32_t total, size_t part, bool now) {
  const std::string bytes(part, 'w');
  if (!send_request(client, nbd::kCmdWrite, 1, 0, total) ||
      !send_all(client, bytes.data(), bytes.size())) {
    return false;
  }
  std::this_thread::sleep_for(50ms);
  w.worker().post([](target::Worker&) { std::this_thread::sleep_for(200ms); });
  std::this_thread::sleep_for(50ms);
  if (!send_all(client, bytes.data(), bytes.size())) return false;
  w.worker().close_group("group", now);
  return true;
}

// A request that completes inside dispatch (here: refused at admission, a read-only export)
// while the connection is already aborted must not close it under the receive handler that
// dispatched it. The worker runs the abort first and then the receive that completes the
// payload, in one batch of completions; AddressSanitizer saw the handler use the freed
// connection.
// Keeps every log line, for tests of what the target logs.
class CapturedLog : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::string text() {
    std::lock_guard lock(mutex_);
    return text_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    text_.append(msg.payload.begin(), msg.payload.end()).append("\n");
  }
  void flush_() override {}

 private:
  std::string text_;
};

// An attachment's export name admits clients: no part of it may reach a log, the bad-magic
// warning's included (it printed the name's first 8 characters).
TEST(ConnectionTest, ABadMagicIsLoggedByGroupNotByExportName) {
  auto sink = std::make_shared<CapturedLog>();
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("test", sink));
  WorkerOnAFile w(1 << 20);
  ASSERT_TRUE(w.started());
  const int client = w.connect(backend::AttachMode::ReadWrite);  // export "volume", group "group"
  ASSERT_GE(client, 0);
  uint8_t header[nbd::kRequestSize];
  nbd::encode_request(header, nbd::Request{0xdeadbeef, 0, nbd::kCmdRead, 1, 0, 512});
  ASSERT_TRUE(send_all(client, header, sizeof header));
  EXPECT_TRUE(w.registry().wait(1, 5s)) << "the connection did not close";
  w.worker().stop();
  ::close(client);
  spdlog::set_default_logger(previous);
  const std::string log = sink->text();
  EXPECT_NE(log.find("bad request magic 0xdeadbeef from a client of group"), std::string::npos)
      << log;
  EXPECT_EQ(log.find("volume"), std::string::npos) << log;
}

// A client that breaks the framing over and over (connecting again each time) cannot flood
// the log: one line a second for the reason, the next one counting what was left out.
TEST(ConnectionTest, BadMagicsAreLoggedOnceASecond) {
  auto sink = std::make_shared<CapturedLog>();
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("test", sink));
  WorkerOnAFile w(1 << 20);
  ASSERT_TRUE(w.started());
  uint8_t header[nbd::kRequestSize];
  nbd::encode_request(header, nbd::Request{0xdeadbeef, 0, nbd::kCmdRead, 1, 0, 512});
  auto break_one = [&](uint64_t closed) {
    const int client = w.connect(backend::AttachMode::ReadWrite);
    ASSERT_GE(client, 0);
    ASSERT_TRUE(send_all(client, header, sizeof header));
    EXPECT_TRUE(w.registry().wait(closed, 5s)) << "the connection did not close";
    ::close(client);
  };
  for (uint64_t i = 1; i <= 50; ++i) break_one(i);
  std::this_thread::sleep_for(1100ms);
  break_one(51);
  w.worker().stop();
  spdlog::set_default_logger(previous);
  const std::string log = sink->text();
  size_t lines = 0;
  for (size_t at = 0; (at = log.find("bad request magic", at)) != std::string::npos; ++at) ++lines;
  EXPECT_GE(lines, 2U) << log;
  EXPECT_LE(lines, 3U) << log;  // 50 in a second or two, then one after a pause
  EXPECT_NE(log.find("more like it since the last line"), std::string::npos) << log;
}

TEST(ConnectionTest, AbortBeforeTheLastPayloadBytesArrive) {
  WorkerOnAFile w(1 << 20);
  ASSERT_TRUE(w.started());
  const int client = w.connect(backend::AttachMode::ReadOnly);
  ASSERT_GE(client, 0);

  // The abort runs first, then the receive that completes the payload (its second half).
  ASSERT_TRUE(close_group_mid_payload(w, client, 8192, 4096, /*now=*/true));

  EXPECT_TRUE(w.registry().wait(1, 5s)) << "the connection did not close";
  w.worker().stop();
  ::close(client);
}

// A detach (drain) that stops reading while a WRITE's payload is half in: the receive armed
// for the rest may still complete with some bytes, and after it nothing reads the rest. The
// unfinished request is dropped unanswered, and the connection closes instead of waiting for
// it forever.
TEST(ConnectionTest, DrainWhileAWritePayloadIsHalfIn) {
  WorkerOnAFile w(1 << 20);
  ASSERT_TRUE(w.started());
  const int client = w.connect(backend::AttachMode::ReadWrite);
  ASSERT_GE(client, 0);

  // The drain runs first, then the receive completes with a second quarter, not the rest.
  ASSERT_TRUE(close_group_mid_payload(w, client, 16384, 4096, /*now=*/false));

  EXPECT_TRUE(w.registry().wait(1, 5s)) << "the connection did not close";
  w.worker().stop();
  ::close(client);
  EXPECT_EQ(read_file(w.path(), 0, 16384), std::string(16384, '\0'))
      << "a partial payload was written";
}

// Clients that send READs and never take the replies hold their payload buffers. Each
// connection is limited (128 MiB), but their sum was not: a thousand connections could hold
// 128 GiB. Past the worker's budget, no connection reads new requests until replies free some.
TEST(ConnectionTest, ClientsThatTakeNoRepliesStayWithinTheWorkersBudget) {
  constexpr uint64_t kBudget = 64 << 20;
  constexpr uint32_t kRead = 32 << 20;
  WorkerOnAFile w(256 << 20, kBudget);
  ASSERT_TRUE(w.started());
  auto payload_bytes = [&w] {
    std::promise<uint64_t> bytes;
    w.worker().post([&bytes](target::Worker& worker) { bytes.set_value(worker.payload_bytes()); });
    return bytes.get_future().get();
  };

  const std::vector<int> greedy = greedy_clients(w);
  ASSERT_EQ(greedy.size(), 4u);
  std::this_thread::sleep_for(500ms);
  // At most one request past the budget: the check comes before each request.
  EXPECT_LE(payload_bytes(), kBudget + kRead);

  // A client that does read waits for the budget, and is served once the greedy ones leave.
  const int client = w.connect(backend::AttachMode::ReadOnly);
  ASSERT_GE(client, 0);
  ASSERT_TRUE(send_request(client, nbd::kCmdRead, 99, 0, 4096));
  for (int fd : greedy) ::close(fd);
  EXPECT_EQ(recv_read_reply(client, 4096, 5s), std::string(4096, '\0'))
      << "the waiting client was not served";
  EXPECT_TRUE(w.registry().wait(4, 5s)) << "the greedy connections did not close";
  EXPECT_EQ(payload_bytes(), 0u);
  w.worker().stop();
  ::close(client);
}

// The same greedy clients, but hung rather than gone: they never read and never close. Before
// the send timeout, the reading client waited behind them for as long as they lived.
TEST(ConnectionTest, ClientsThatTakeNoRepliesAreCutOffAfterTheSendTimeout) {
  constexpr uint64_t kBudget = 64 << 20;
  WorkerOnAFile w(256 << 20, kBudget, 500ms);
  ASSERT_TRUE(w.started());
  const std::vector<int> hung = greedy_clients(w);
  ASSERT_EQ(hung.size(), 4u);
  std::this_thread::sleep_for(200ms);

  const int client = w.connect(backend::AttachMode::ReadOnly);
  ASSERT_GE(client, 0);
  ASSERT_TRUE(send_request(client, nbd::kCmdRead, 99, 0, 4096));
  EXPECT_EQ(recv_read_reply(client, 4096, 10s), std::string(4096, '\0'))
      << "the reading client was not served while the hung clients held the budget";
  EXPECT_TRUE(w.registry().wait(4, 5s)) << "the hung connections were not cut off";

  // A hung client finds its connection closed: what it had not taken, then end-of-file.
  timeval short_wait{5, 0};
  ::setsockopt(hung[0], SOL_SOCKET, SO_RCVTIMEO, &short_wait, sizeof short_wait);
  std::string sink(1 << 20, '\0');
  ssize_t n = 0;
  while ((n = ::recv(hung[0], sink.data(), sink.size(), 0)) > 0) {
  }
  EXPECT_EQ(n, 0) << "no end-of-file on a cut-off connection";
  w.worker().stop();
  for (int fd : hung) ::close(fd);
  ::close(client);
}

// A client that takes its replies slowly is not hung: every send that makes progress starts
// the timeout again, and a 4 MiB reply read in 64 KiB steps outlasts the timeout several times.
TEST(ConnectionTest, ASlowReaderIsNotCutOff) {
  constexpr uint32_t kRead = 4 << 20;
  WorkerOnAFile w(8 << 20, target::Worker::kDefaultPayloadBudget, 1000ms);
  ASSERT_TRUE(w.started());
  make_file(w.path(), 8 << 20, 's');  // same inode: the open volume sees it
  const int client = w.connect(backend::AttachMode::ReadOnly);
  ASSERT_GE(client, 0);
  ASSERT_TRUE(send_request(client, nbd::kCmdRead, 1, 0, kRead));

  timeval tv{5, 0};
  ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string got;
  std::string step(64 << 10, '\0');
  const auto start = std::chrono::steady_clock::now();
  while (got.size() < 16 + kRead) {
    const size_t want = std::min(step.size(), 16 + kRead - got.size());
    const ssize_t n = ::recv(client, step.data(), want, 0);
    ASSERT_GT(n, 0) << "the connection ended after " << got.size() << " bytes";
    got.append(step.data(), static_cast<size_t>(n));
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_GT(std::chrono::steady_clock::now() - start, 2s) << "the reader was not slow";
  EXPECT_EQ(got.substr(16), std::string(kRead, 's'));
  w.worker().stop();
  ::close(client);
}

// NBD_FLAG_SEND_FUA is advertised (the fixture's session has the handshake's flags), so every
// command must be accepted with FUA, which may be ignored where a command writes nothing (proto.md
// "Command flags"). READ, FLUSH and CACHE with it got EINVAL.
TEST(ConnectionTest, FuaIsAcceptedOnEveryCommand) {
  constexpr uint32_t kLength = 4096;
  WorkerOnAFile w(1 << 20);
  ASSERT_TRUE(w.started());
  make_file(w.path(), 1 << 20, 'f');  // same inode: the open volume sees it
  const int client = w.connect(backend::AttachMode::ReadWrite);
  ASSERT_GE(client, 0);

  struct Case {
    const char* what;
    uint16_t type;
    uint32_t length;
  };
  const Case cases[] = {
      {"READ", nbd::kCmdRead, kLength},   {"WRITE", nbd::kCmdWrite, kLength},
      {"FLUSH", nbd::kCmdFlush, 0},       {"TRIM", nbd::kCmdTrim, kLength},
      {"CACHE", nbd::kCmdCache, kLength}, {"WRITE_ZEROES", nbd::kCmdWriteZeroes, kLength},
  };
  const std::string written(kLength, 'w');
  uint64_t cookie = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ASSERT_TRUE(send_request(client, c.type, ++cookie, 0, c.length, nbd::kCmdFlagFua));
    if (c.type == nbd::kCmdWrite) {
      ASSERT_TRUE(send_all(client, written.data(), written.size()));
    }
    const std::optional<SimpleReply> reply = recv_simple_reply(client);
    ASSERT_TRUE(reply);
    EXPECT_EQ(reply->cookie, cookie);
    EXPECT_EQ(reply->error, 0u);
    if (c.type == nbd::kCmdRead && reply->error == 0) {
      EXPECT_EQ(recv_exact(client, kLength), std::string(kLength, 'f'));
    }
    if (c.type == nbd::kCmdWrite) {
      EXPECT_EQ(read_file(w.path(), 0, kLength), written);
    }
  }
  w.worker().stop();
  ::close(client);
}

// The same with structured replies, where DF reads and BLOCK_STATUS come in: FUA is one more
// flag they accept, and their replies are those they get without it.
TEST(ConnectionTest, FuaIsAcceptedOnEveryCommandWithStructuredReplies) {
  constexpr uint32_t kLength = 4096;
  WorkerOnAFile w(1 << 20);
  ASSERT_TRUE(w.started());
  make_file(w.path(), 1 << 20, 'f');
  const int client = w.connect(backend::AttachMode::ReadOnly, /*structured_replies=*/true,
                               /*base_allocation=*/true);
  ASSERT_GE(client, 0);

  struct Case {
    const char* what;
    uint16_t type;
    uint16_t flags;
    uint32_t length;
    uint16_t first_chunk;
  };
  const Case cases[] = {
      {"READ", nbd::kCmdRead, 0, kLength, nbd::kReplyOffsetData},
      {"READ with DF", nbd::kCmdRead, nbd::kCmdFlagDf, kLength, nbd::kReplyOffsetData},
      {"FLUSH", nbd::kCmdFlush, 0, 0, nbd::kReplyNone},
      {"CACHE", nbd::kCmdCache, 0, kLength, nbd::kReplyNone},
      {"BLOCK_STATUS", nbd::kCmdBlockStatus, 0, kLength, nbd::kReplyBlockStatus},
      {"BLOCK_STATUS with REQ_ONE", nbd::kCmdBlockStatus, nbd::kCmdFlagReqOne, kLength,
       nbd::kReplyBlockStatus},
  };
  uint64_t cookie = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ASSERT_TRUE(send_request(client, c.type, ++cookie, 0, c.length, nbd::kCmdFlagFua | c.flags));
    const std::optional<std::vector<Chunk>> reply = recv_structured_reply(client);
    ASSERT_TRUE(reply);
    ASSERT_EQ(reply->size(), 1u);
    const Chunk& chunk = reply->front();
    EXPECT_EQ(chunk.cookie, cookie);
    EXPECT_EQ(chunk.type, c.first_chunk) << "error chunk: " << chunk.is_error();
    if (chunk.type == nbd::kReplyOffsetData) {
      EXPECT_EQ(chunk.payload.substr(8), std::string(kLength, 'f'));
    }
  }
  w.worker().stop();
  ::close(client);
}

// An error chunk with an offset (NBD_REPLY_TYPE_ERROR_OFFSET) must name one within the request
// (proto.md "Structured reply types"), so a request that names no byte gets one without
// (NBD_REPLY_TYPE_ERROR). A zero-length READ past the end got ERROR_OFFSET with its own offset,
// and libnbd dropped the connection for it as a server bug.
TEST(ConnectionTest, ReadErrorChunksNameOnlyOffsetsInsideTheRequest) {
  constexpr uint64_t kSize = 1 << 20;
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  WorkerOnAFile w(kSize);
  ASSERT_TRUE(w.started());
  const int client = w.connect(backend::AttachMode::ReadOnly, /*structured_replies=*/true);
  ASSERT_GE(client, 0);

  struct Case {
    const char* what;
    uint64_t offset;
    uint32_t length;
  };
  const Case cases[] = {
      {"zero-length READ past the end", kSize + 4096, 0},
      {"zero-length READ at the last offset", kMax, 0},
      {"READ past the end", kSize, 4096},
      {"READ whose end wraps around 2^64", kMax - 4095, 8192},
  };
  uint64_t cookie = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ASSERT_TRUE(send_request(client, nbd::kCmdRead, ++cookie, c.offset, c.length));
    const std::optional<std::vector<Chunk>> reply = recv_structured_reply(client);
    ASSERT_TRUE(reply) << "no whole structured reply";
    ASSERT_EQ(reply->size(), 1u);
    const Chunk& chunk = reply->front();
    EXPECT_EQ(chunk.cookie, cookie);
    ASSERT_TRUE(chunk.type == nbd::kReplyError || chunk.type == nbd::kReplyErrorOffset)
        << "chunk type " << chunk.type;
    ASSERT_GE(chunk.payload.size(), 6u);
    const auto* p = reinterpret_cast<const uint8_t*>(chunk.payload.data());
    EXPECT_EQ(nbd::get32(p), nbd::kEinval);
    const size_t message = nbd::get16(p + 4);
    const size_t trailer = chunk.type == nbd::kReplyErrorOffset ? 8 : 0;
    ASSERT_EQ(chunk.payload.size(), 6 + message + trailer);
    if (chunk.type == nbd::kReplyErrorOffset) {
      // Inside [offset, offset + length), as a client computes it: in 64 bits.
      const uint64_t at = nbd::get64(p + 6 + message);
      EXPECT_TRUE(c.length > 0 && c.offset <= kMax - c.length && at >= c.offset &&
                  at < c.offset + c.length)
          << "error offset " << at;
    }
  }
  // The connection goes on: a READ gets its bytes.
  ASSERT_TRUE(send_request(client, nbd::kCmdRead, ++cookie, 0, 4096));
  const std::optional<std::vector<Chunk>> reply = recv_structured_reply(client);
  ASSERT_TRUE(reply);
  for (const Chunk& chunk : *reply) EXPECT_FALSE(chunk.is_error()) << "chunk type " << chunk.type;
  w.worker().stop();
  ::close(client);
}

}  // namespace
}  // namespace shareblk::testing
