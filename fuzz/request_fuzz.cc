// Fuzzes the transmission phase: request parsing, admission, the backend and reply encoding.
//
// The first input byte picks the session the handshake would have agreed on (structured
// replies, base:allocation, read-only); the rest is what the client sends after the handshake.
// It goes to a real Connection on a real io_uring Worker through a socketpair, and the client
// side reads replies until the server closes. Structured replies are checked for framing: every
// chunk header is well formed and its length accounts exactly for the bytes up to the next.
//
// Before that, the input also goes through the request codec: decode then encode must give the
// same bytes back.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fuzz/fuzz_volume.h"
#include "target/handshake.h"
#include "target/nbd_proto.h"
#include "target/worker.h"
#include "tests/closed_count.h"

namespace shareblk::fuzz {
namespace {

using namespace nbd;  // NOLINT(google-build-using-namespace): the wire vocabulary

// A connection that makes no progress for this long is a hang, and a finding.
constexpr int kStallMs = 10000;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "request_fuzz: %s\n", what);
  std::abort();
}

struct Environment {
  testing::ClosedCount registry;
  // A 1 GiB payload budget, and the send timeout the daemon has by default.
  target::Worker worker{registry, target::Worker::kDefaultPayloadBudget,
                        target::ServerOptions{}.send_timeout};
  std::shared_ptr<backend::Volume> volume = scratch_volume(1 << 20);
};

Environment& environment() {
  // Started once and never stopped: the worker outlives every input.
  static Environment* env = [] {
    auto* e = new Environment();
    if (std::error_code ec = e->worker.start()) {
      std::fprintf(stderr, "worker: %s\n", ec.message().c_str());
      std::abort();
    }
    return e;
  }();
  return *env;
}

void check_codec(const uint8_t* data, size_t size) {
  for (size_t i = 0; i + kRequestSize <= size; i += kRequestSize) {
    uint8_t again[kRequestSize];
    encode_request(again, decode_request(data + i));
    if (std::memcmp(again, data + i, kRequestSize) != 0) fail("request codec round trip");
  }
}

// Sends `input`, half-closes, and collects everything the server writes until it closes.
std::string exchange(int fd, const uint8_t* input, size_t size) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::string out;
  size_t sent = 0;
  bool shut = false;
  char buf[64 * 1024];
  for (;;) {
    if (sent == size && !shut) {
      ::shutdown(fd, SHUT_WR);  // the server sees end of file after the last request
      shut = true;
    }
    pollfd p{fd, static_cast<short>(POLLIN | (shut ? 0 : POLLOUT)), 0};
    int n = ::poll(&p, 1, kStallMs);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) fail("the connection stalled");
    if (!shut && (p.revents & POLLOUT)) {
      ssize_t w = ::send(fd, input + sent, size - sent, MSG_NOSIGNAL);
      if (w > 0) {
        sent += static_cast<size_t>(w);
      } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
        sent = size;  // the server stopped reading and closed (bad magic)
      }
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t r = ::recv(fd, buf, sizeof buf, 0);
      if (r > 0) {
        out.append(buf, static_cast<size_t>(r));
      } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
        break;
      }
    }
  }
  ::close(fd);
  return out;
}

void check_structured(const std::string& out) {
  const auto* p = reinterpret_cast<const uint8_t*>(out.data());
  size_t pos = 0;
  while (pos < out.size()) {
    if (out.size() - pos < kChunkHeaderSize) fail("truncated chunk header");
    if (get32(p + pos) != kStructuredReplyMagic) fail("bad chunk magic");
    const uint16_t type = get16(p + pos + 6);
    const uint32_t length = get32(p + pos + 16);
    pos += kChunkHeaderSize;
    if (out.size() - pos < length) fail("chunk longer than what was sent");
    const uint8_t* payload = p + pos;
    switch (type) {
      case kReplyNone:
        if (length != 0) fail("NONE chunk with a payload");
        break;
      case kReplyOffsetData:
        if (length < 8) fail("OFFSET_DATA chunk too short");
        break;
      case kReplyOffsetHole:
        if (length != 12) fail("OFFSET_HOLE chunk of the wrong size");
        if (get32(payload + 8) == 0) fail("empty hole");
        break;
      case kReplyBlockStatus:
        if (length < 12 || (length - 4) % 8 != 0) fail("BLOCK_STATUS chunk of the wrong size");
        if (get32(payload) != target::kBaseAllocationId) fail("unknown metadata context id");
        break;
      case kReplyError:
      case kReplyErrorOffset: {
        if (length < 6) fail("error chunk too short");
        const uint32_t message = get16(payload + 4);
        if (length != 6 + message + (type == kReplyErrorOffset ? 8 : 0)) {
          fail("error chunk length does not match its message");
        }
        if (get32(payload) == 0) fail("error chunk with error 0");
        break;
      }
      default:
        fail("unknown chunk type");
    }
    pos += length;
  }
}

}  // namespace
}  // namespace shareblk::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shareblk;  // NOLINT(google-build-using-namespace)
  if (size == 0) return 0;
  fuzz::Environment& env = fuzz::environment();
  const uint8_t config = data[0];
  fuzz::check_codec(data + 1, size - 1);

  target::Session session;
  session.export_name = "fuzz";
  session.exp.volume = env.volume;
  session.exp.mode = (config & 4) ? backend::AttachMode::ReadOnly : backend::AttachMode::ReadWrite;
  session.exp.group = "fuzz";
  session.structured_replies = (config & 1) != 0;
  // The handshake only selects base:allocation after structured replies.
  session.base_allocation = session.structured_replies && (config & 2) != 0;
  session.transmission_flags = target::transmission_flags(session.exp, session.structured_replies);

  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    std::perror("socketpair");
    std::abort();
  }
  const uint64_t closed = env.registry.closed() + 1;
  env.worker.adopt(fds[1], std::move(session));
  const std::string out = fuzz::exchange(fds[0], data + 1, size - 1);
  // The client's end of file is not the end of the connection (tests/closed_count.h). Until it
  // is counted closed, its requests in flight are referenced only from the kernel's rings,
  // which the leak checker that runs after each input cannot see.
  if (!env.registry.wait(closed, std::chrono::milliseconds(fuzz::kStallMs))) {
    fuzz::fail("the connection did not close after its client left");
  }
  if (config & 1) fuzz::check_structured(out);
  return 0;
}
