// End-to-end tests: the real shareblkd as a child process, driven by the clients users run
// (libnbd, qemu-io, qemu-img, fio) and by a raw-socket client that misbehaves on purpose.
//
// Every test starts its own daemon on a fresh 64 MiB sparse file, served twice: read-write as
// "disk" and read-only as "ro", on a Unix socket and on a free TCP port of 127.0.0.1. TearDown
// stops the daemon and requires a clean exit, so a crash, a hang at shutdown or a sanitizer report
// (the asan preset instruments the daemon too) fails the test that caused it.
#include <arpa/inet.h>
#include <fcntl.h>
#include <libnbd.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "target/nbd_proto.h"
#include "tests/support.h"

namespace shareblk::testing {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kDiskSize = 64 * kMiB;

// --- Bytes ---

// Pseudo-random bytes from a seed (splitmix64: fast even in a debug build, unlike <random>).
std::string random_bytes(size_t length, uint64_t seed) {
  std::string bytes(length, '\0');
  uint64_t state = seed;
  for (size_t i = 0; i < length; i += 8) {
    state += 0x9e3779b97f4a7c15;
    uint64_t word = state;
    word = (word ^ (word >> 30)) * 0xbf58476d1ce4e5b9;
    word = (word ^ (word >> 27)) * 0x94d049bb133111eb;
    word ^= word >> 31;
    std::memcpy(&bytes[i], &word, std::min<size_t>(8, length - i));
  }
  return bytes;
}

// Compares without printing megabytes: names the first differing byte instead.
::testing::AssertionResult same_bytes(const std::string& actual, const std::string& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "got " << actual.size() << " bytes, want " << expected.size();
  }
  if (std::memcmp(actual.data(), expected.data(), actual.size()) == 0) {
    return ::testing::AssertionSuccess();
  }
  const auto [a, e] = std::mismatch(actual.begin(), actual.end(), expected.begin());
  return ::testing::AssertionFailure()
         << "first difference at byte " << (a - actual.begin()) << " of " << actual.size()
         << ": got " << static_cast<int>(static_cast<uint8_t>(*a)) << ", want "
         << static_cast<int>(static_cast<uint8_t>(*e));
}

void write_file_at(const std::string& path, uint64_t offset, const std::string& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::pwrite(fd, data.data(), data.size(), static_cast<off_t>(offset)),
            static_cast<ssize_t>(data.size()));
  ::close(fd);
}

// A field of /proc/PID/status in KiB (VmRSS, VmHWM), or -1.
long proc_status_kib(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

// --- libnbd ---

struct NbdClose {
  void operator()(nbd_handle* h) const { nbd_close(h); }
};
using Nbd = std::unique_ptr<nbd_handle, NbdClose>;

struct ClientOptions {
  // Off: libnbd sends what it would otherwise refuse itself (writes to a read-only export,
  // requests past the end), so that the server has to answer them.
  bool strict = true;
  bool structured_replies = true;
  bool base_allocation = false;
};

// A connected libnbd handle, or null (and a test failure).
Nbd open_nbd(const std::string& socket, const std::string& export_name,
             const ClientOptions& options = {}) {
  Nbd h(nbd_create());
  if (!h) {
    ADD_FAILURE() << "nbd_create: " << nbd_get_error();
    return nullptr;
  }
  nbd_set_export_name(h.get(), export_name.c_str());
  if (!options.strict) nbd_set_strict_mode(h.get(), 0);
  nbd_set_request_structured_replies(h.get(), options.structured_replies);
  if (options.base_allocation) nbd_add_meta_context(h.get(), LIBNBD_CONTEXT_BASE_ALLOCATION);
  if (nbd_connect_unix(h.get(), socket.c_str()) == -1) {
    ADD_FAILURE() << "connecting to " << export_name << ": " << nbd_get_error();
    return nullptr;
  }
  return h;
}

// The bytes at [offset, offset+length), or an empty string (and a test failure).
std::string nbd_read(nbd_handle* h, uint64_t offset, size_t length, uint32_t flags = 0) {
  std::string data(length, '\0');
  if (nbd_pread(h, data.data(), length, offset, flags) != 0) {
    ADD_FAILURE() << "nbd_pread(offset " << offset << ", length " << length
                  << "): " << nbd_get_error();
    return {};
  }
  return data;
}

bool nbd_write(nbd_handle* h, uint64_t offset, const std::string& data, uint32_t flags = 0) {
  if (nbd_pwrite(h, data.data(), data.size(), offset, flags) != 0) {
    ADD_FAILURE() << "nbd_pwrite(offset " << offset << ", length " << data.size()
                  << "): " << nbd_get_error();
    return false;
  }
  return true;
}

// How a structured read reply came: data chunks and hole chunks.
struct Chunks {
  int data = 0;
  int holes = 0;
};

int count_chunk(void* user_data, const void* /*subbuf*/, size_t /*count*/, uint64_t /*offset*/,
                unsigned status, int* /*error*/) {
  auto* chunks = static_cast<Chunks*>(user_data);
  if (status == LIBNBD_READ_DATA) ++chunks->data;
  if (status == LIBNBD_READ_HOLE) ++chunks->holes;
  return 0;
}

// The bytes at [offset, offset+length) read with `flags`, and how the reply was cut up.
std::string nbd_read_chunks(nbd_handle* h, uint64_t offset, size_t length, uint32_t flags,
                            Chunks& chunks) {
  std::string data(length, '\0');
  if (nbd_pread_structured(h, data.data(), length, offset,
                           nbd_chunk_callback{count_chunk, &chunks, nullptr}, flags) != 0) {
    ADD_FAILURE() << "nbd_pread_structured(offset " << offset << ", length " << length
                  << "): " << nbd_get_error();
    return {};
  }
  return data;
}

// One base:allocation extent as the server described it.
struct Extent {
  uint64_t offset;
  uint64_t length;
  uint32_t flags;
};

int collect_extents(void* user_data, const char* context, uint64_t offset, uint32_t* entries,
                    size_t count, int* /*error*/) {
  if (std::strcmp(context, LIBNBD_CONTEXT_BASE_ALLOCATION) != 0) return 0;
  auto* extents = static_cast<std::vector<Extent>*>(user_data);
  for (size_t i = 0; i + 1 < count; i += 2) {
    extents->push_back({offset, entries[i], entries[i + 1]});
    offset += entries[i];
  }
  return 0;
}

// The allocation status of [offset, offset+length), asking again where an answer fell short.
std::vector<Extent> block_status(nbd_handle* h, uint64_t offset, uint64_t length) {
  std::vector<Extent> extents;
  const uint64_t end = offset + length;
  uint64_t pos = offset;
  while (pos < end) {
    const size_t before = extents.size();
    if (nbd_block_status(h, end - pos, pos, nbd_extent_callback{collect_extents, &extents, nullptr},
                         0) != 0) {
      ADD_FAILURE() << "nbd_block_status(" << pos << "): " << nbd_get_error();
      return extents;
    }
    if (extents.size() == before) {
      ADD_FAILURE() << "nbd_block_status(" << pos << ") described nothing";
      return extents;
    }
    pos = extents.back().offset + extents.back().length;
  }
  return extents;
}

// The base:allocation flags of the byte at `offset`.
uint32_t status_at(const std::vector<Extent>& extents, uint64_t offset) {
  for (const Extent& e : extents) {
    if (offset >= e.offset && offset < e.offset + e.length) return e.flags;
  }
  ADD_FAILURE() << "no extent covers byte " << offset;
  return 0xffffffff;
}

// --- A raw protocol client, for the requests no well-behaved client sends ---

class RawClient {
 public:
  explicit RawClient(const std::string& socket_path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_path.c_str(), sizeof addr.sun_path - 1);
    if (fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
    set_timeouts();
  }
  // Takes over `fd`, a connected socket (or -1: not connected).
  explicit RawClient(int fd) : fd_(fd) { set_timeouts(); }
  ~RawClient() { close(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return fd_ >= 0; }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  bool send_all(const void* data, size_t length) {
    const auto* p = static_cast<const char*>(data);
    while (length > 0) {
      const ssize_t n = ::send(fd_, p, length, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      p += n;
      length -= static_cast<size_t>(n);
    }
    return true;
  }
  bool send_all(const std::string& data) { return send_all(data.data(), data.size()); }

  bool recv_all(void* data, size_t length) {
    auto* p = static_cast<char*>(data);
    while (length > 0) {
      const ssize_t n = ::recv(fd_, p, length, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      p += n;
      length -= static_cast<size_t>(n);
    }
    return true;
  }

  // True when the server ends the connection within `timeout`. Whatever it still sends first
  // (option replies, say) is read and dropped.
  bool closed_by_server(std::chrono::milliseconds timeout = 5s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    char buf[4096];
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left <= 0ms) return false;
      pollfd p{fd_, POLLIN, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(left.count()));
      if (rc < 0 && errno == EINTR) continue;
      if (rc <= 0) return false;
      const ssize_t n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
      if (n == 0) return true;
      if (n < 0 && (errno == ECONNRESET || errno == EPIPE)) return true;
    }
  }

 private:
  // A server that stops answering fails the test instead of hanging it.
  void set_timeouts() {
    timeval timeout{10, 0};
    if (fd_ >= 0) {
      ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
      ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    }
  }

  int fd_ = -1;
};

bool read_greeting(RawClient& c) {
  uint8_t greeting[18];
  return c.recv_all(greeting, sizeof greeting) && nbd::get64(greeting) == nbd::kMagic &&
         nbd::get64(greeting + 8) == nbd::kOptMagic &&
         (nbd::get16(greeting + 16) & nbd::kFlagFixedNewstyle) != 0;
}

bool send_u32(RawClient& c, uint32_t value) {
  uint8_t bytes[4];
  nbd::put32(bytes, value);
  return c.send_all(bytes, sizeof bytes);
}

bool send_option(RawClient& c, uint32_t option, const std::string& data,
                 uint64_t magic = nbd::kOptMagic) {
  uint8_t header[nbd::kOptionHeaderSize];
  nbd::put64(header, magic);
  nbd::put32(header + 8, option);
  nbd::put32(header + 12, static_cast<uint32_t>(data.size()));
  return c.send_all(header, sizeof header) && c.send_all(data);
}

struct OptionReply {
  uint32_t option = 0;
  uint32_t type = 0;
  std::string data;
};

bool read_option_reply(RawClient& c, OptionReply& reply) {
  uint8_t header[nbd::kOptionReplyHeaderSize];
  if (!c.recv_all(header, sizeof header) || nbd::get64(header) != nbd::kOptReplyMagic) {
    return false;
  }
  reply.option = nbd::get32(header + 8);
  reply.type = nbd::get32(header + 12);
  const uint32_t length = nbd::get32(header + 16);
  if (length > 64 * kKiB) return false;
  reply.data.assign(length, '\0');
  return c.recv_all(reply.data.data(), length);
}

struct ExportInfo {
  uint64_t size = 0;
  uint16_t flags = 0;
};

// The fixed newstyle handshake, ending with NBD_OPT_GO on `name`. Structured replies are not
// negotiated, so every transmission reply is a simple one.
std::optional<ExportInfo> handshake(RawClient& c, const std::string& name) {
  if (!read_greeting(c) || !send_u32(c, nbd::kClientFixedNewstyle | nbd::kClientNoZeroes)) {
    return std::nullopt;
  }
  std::string go(4, '\0');
  nbd::put32(reinterpret_cast<uint8_t*>(go.data()), static_cast<uint32_t>(name.size()));
  go += name;
  go += std::string(2, '\0');  // no information requests
  if (!send_option(c, nbd::kOptGo, go)) return std::nullopt;
  std::optional<ExportInfo> info;
  for (;;) {
    OptionReply reply;
    if (!read_option_reply(c, reply) || reply.option != nbd::kOptGo) return std::nullopt;
    if (reply.type == nbd::kRepAck) return info;
    if (reply.type != nbd::kRepInfo) return std::nullopt;  // an error reply
    const auto* p = reinterpret_cast<const uint8_t*>(reply.data.data());
    if (reply.data.size() >= 12 && nbd::get16(p) == nbd::kInfoExport) {
      info = ExportInfo{nbd::get64(p + 2), nbd::get16(p + 10)};
    }
  }
}

bool send_request(RawClient& c, uint16_t type, uint64_t cookie, uint64_t offset, uint32_t length,
                  uint16_t flags = 0, uint32_t magic = nbd::kRequestMagic) {
  uint8_t bytes[nbd::kRequestSize];
  nbd::encode_request(bytes, nbd::Request{magic, flags, type, cookie, offset, length});
  return c.send_all(bytes, sizeof bytes);
}

struct SimpleReply {
  uint32_t error = 0;
  uint64_t cookie = 0;
  std::string data;
};

// Reads one simple reply; a successful reply to a READ listed in `read_lengths` (cookie ->
// length) carries that many bytes of data.
bool read_simple_reply(RawClient& c, SimpleReply& reply,
                       const std::map<uint64_t, uint32_t>& read_lengths = {}) {
  uint8_t header[nbd::kSimpleReplySize];
  if (!c.recv_all(header, sizeof header) || nbd::get32(header) != nbd::kSimpleReplyMagic) {
    return false;
  }
  reply.error = nbd::get32(header + 4);
  reply.cookie = nbd::get64(header + 8);
  reply.data.clear();
  const auto it = read_lengths.find(reply.cookie);
  if (reply.error == 0 && it != read_lengths.end()) {
    reply.data.assign(it->second, '\0');
    return c.recv_all(reply.data.data(), it->second);
  }
  return true;
}

// `length` bytes that parse as a stream of 512-byte READ requests carrying kBogusCookie. Sent
// as a payload the server must skip: a reply with that cookie would show it parsed the payload.
constexpr uint64_t kBogusCookie = 0xbadc00c1e;
std::string requests_as_payload(size_t length) {
  uint8_t request[nbd::kRequestSize];
  nbd::encode_request(request,
                      nbd::Request{nbd::kRequestMagic, 0, nbd::kCmdRead, kBogusCookie, 0, 512});
  std::string payload;
  payload.reserve(length + sizeof request);
  while (payload.size() < length) payload.append(reinterpret_cast<char*>(request), sizeof request);
  payload.resize(length);
  return payload;
}

// The port `daemon` picked for ADDRESS:0, from its log; 0 when it never said.
int logged_tcp_port(const Daemon& daemon, const std::string& address) {
  const std::string marker = "listening on tcp:" + address + ":";
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string log = daemon.log();
    const size_t at = log.find(marker);
    if (at != std::string::npos) return std::atoi(log.c_str() + at + marker.size());
    std::this_thread::sleep_for(10ms);
  }
  return 0;
}

// --- The fixture ---

class E2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    disk_ = dir_ / "disk.img";
    socket_ = dir_ / "nbd.sock";
    make_file(disk_, kDiskSize);
    daemon_ = std::make_unique<Daemon>(
        std::vector<std::string>{"--export", "disk=" + disk_, "--export", "ro=" + disk_ + ",ro",
                                 "--listen-unix", socket_, "--listen-tcp", "127.0.0.1:0",
                                 "--workers", "2"},
        socket_);
  }

  void TearDown() override { stop_daemon(); }

  // Stops the daemon and requires a clean exit. Tests call it early to look at the backing file
  // once no connection can still be changing it.
  void stop_daemon() {
    if (!daemon_ || stopped_) return;
    stopped_ = true;
    const int status = daemon_->stop(SIGTERM);
    EXPECT_EQ(status, 0) << "shareblkd did not exit cleanly; its log:\n" << daemon_->log();
  }

  // The port the daemon picked for 127.0.0.1:0, from its log; 0 when it never said.
  int tcp_port() const { return logged_tcp_port(*daemon_, "127.0.0.1"); }

  std::string uri(const std::string& export_name) const {
    return "nbd+unix:///" + export_name + "?socket=" + socket_;
  }

  // A new client can connect, write and read back: the daemon is alive and serving.
  void expect_serving(uint64_t seed = 99) {
    Nbd h = open_nbd(socket_, "disk");
    ASSERT_TRUE(h);
    const std::string data = random_bytes(8 * kKiB, seed);
    ASSERT_TRUE(nbd_write(h.get(), 60 * kMiB, data));
    EXPECT_TRUE(same_bytes(nbd_read(h.get(), 60 * kMiB, data.size()), data));
  }

  TempDir dir_;
  std::string disk_;
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
  bool stopped_ = false;
};

// --- libnbd ---

TEST_F(E2eTest, WriteFlushedOnOneConnectionIsReadOnEveryOther) {
  std::vector<Nbd> handles;
  for (int i = 0; i < 4; ++i) {
    handles.push_back(open_nbd(socket_, "disk"));
    ASSERT_TRUE(handles.back());
    EXPECT_EQ(nbd_can_multi_conn(handles.back().get()), 1);
    EXPECT_EQ(nbd_get_size(handles.back().get()), static_cast<int64_t>(kDiskSize));
  }
  // The read-only export of the same file sees the same bytes.
  handles.push_back(open_nbd(socket_, "ro"));
  ASSERT_TRUE(handles.back());
  EXPECT_EQ(nbd_can_multi_conn(handles.back().get()), 1);

  const std::string pattern = random_bytes(1 * kMiB, 1);
  ASSERT_TRUE(nbd_write(handles[0].get(), 3 * kMiB, pattern));
  ASSERT_EQ(nbd_flush(handles[0].get(), 0), 0) << nbd_get_error();
  for (size_t i = 1; i < handles.size(); ++i) {
    SCOPED_TRACE("handle " + std::to_string(i));
    EXPECT_TRUE(same_bytes(nbd_read(handles[i].get(), 3 * kMiB, pattern.size()), pattern));
  }
  // And it is in the file, where the next server to open it will find it.
  EXPECT_TRUE(same_bytes(read_file(disk_, 3 * kMiB, pattern.size()), pattern));
  // A cache hint is advertised and accepted, and changes nothing.
  EXPECT_EQ(nbd_can_cache(handles[1].get()), 1);
  EXPECT_EQ(nbd_cache(handles[1].get(), pattern.size(), 3 * kMiB, 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(handles[1].get(), 3 * kMiB, pattern.size()), pattern));
}

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

TEST_F(E2eTest, UnalignedWritesReadBackExactly) {
  Nbd writer = open_nbd(socket_, "disk");
  Nbd reader = open_nbd(socket_, "disk");
  ASSERT_TRUE(writer && reader);
  // Ones all around first, so that a write spilling over its range shows.
  std::string expected(64 * kKiB, '\x11');
  ASSERT_TRUE(nbd_write(writer.get(), 0, expected));

  struct Piece {
    uint64_t offset;
    size_t length;
  };
  const Piece pieces[] = {{1, 3}, {4095, 5000}, {12289, 1}, {20000, 12345}, {40959, 2}};
  uint64_t seed = 10;
  for (const Piece& piece : pieces) {
    const std::string data = random_bytes(piece.length, seed++);
    ASSERT_TRUE(nbd_write(writer.get(), piece.offset, data));
    expected.replace(piece.offset, piece.length, data);
  }
  ASSERT_EQ(nbd_flush(writer.get(), 0), 0) << nbd_get_error();
  for (const Piece& piece : pieces) {
    SCOPED_TRACE("offset " + std::to_string(piece.offset));
    EXPECT_TRUE(same_bytes(nbd_read(reader.get(), piece.offset, piece.length),
                           expected.substr(piece.offset, piece.length)));
  }
  // Unaligned reads that straddle the pieces and their neighbours.
  EXPECT_TRUE(same_bytes(nbd_read(reader.get(), 3, 9000), expected.substr(3, 9000)));
  EXPECT_TRUE(same_bytes(nbd_read(reader.get(), 0, expected.size()), expected));
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, expected.size()), expected));
}

TEST_F(E2eTest, MaximumSizedReadAndWrite) {
  Nbd h = open_nbd(socket_, "disk");
  Nbd other = open_nbd(socket_, "disk");
  ASSERT_TRUE(h && other);
  const int64_t maximum = nbd_get_block_size(h.get(), LIBNBD_SIZE_MAXIMUM);
  ASSERT_EQ(maximum, int64_t{nbd::kMaxPayload});
  const std::string data = random_bytes(static_cast<size_t>(maximum), 2);
  ASSERT_TRUE(nbd_write(h.get(), 16 * kMiB, data));
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 16 * kMiB, data.size()), data));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(other.get(), 16 * kMiB, data.size()), data));
  // Unaligned, too, so that it cannot go straight to O_DIRECT.
  const std::string shifted = random_bytes(static_cast<size_t>(maximum), 3);
  ASSERT_TRUE(nbd_write(h.get(), 7, shifted));
  EXPECT_TRUE(same_bytes(nbd_read(other.get(), 7, shifted.size()), shifted));
}

TEST_F(E2eTest, ReadOnlyExportRefusesChangesAndStaysInSync) {
  const std::string original = random_bytes(2 * kMiB, 4);
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, 0, original));
  Nbd h = open_nbd(socket_, "ro", {.strict = false});
  ASSERT_TRUE(h);
  EXPECT_EQ(nbd_is_read_only(h.get()), 1);
  EXPECT_EQ(nbd_can_multi_conn(h.get()), 1);

  // Payloads from a few bytes to more than one receive buffer: each must be read and dropped,
  // or the next request would be parsed from the middle of it.
  const std::string payload = requests_as_payload(1 * kMiB + 3);
  const size_t lengths[] = {4096, 3, 200 * kKiB, 1 * kMiB + 3};
  for (size_t length : lengths) {
    SCOPED_TRACE("write of " + std::to_string(length) + " bytes");
    EXPECT_EQ(nbd_pwrite(h.get(), payload.data(), length, 1, 0), -1);
    EXPECT_EQ(nbd_get_errno(), EPERM) << nbd_get_error();
  }
  EXPECT_EQ(nbd_pwrite(h.get(), payload.data(), 4096, 0, LIBNBD_CMD_FLAG_FUA), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM) << nbd_get_error();
  EXPECT_EQ(nbd_trim(h.get(), 64 * kKiB, 0, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM) << nbd_get_error();
  EXPECT_EQ(nbd_zero(h.get(), 64 * kKiB, 0, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM) << nbd_get_error();

  // The same connection still reads, and reads what was there.
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 0, original.size()), original));
  EXPECT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, original.size()), original));
}

// libnbd drops the connection ("no matching cookie") when a reply arrives while it is still
// sending that request's payload, so a refused WRITE is answered only once its payload is in.
TEST_F(E2eTest, RefusedWritesLeaveALibnbdConnectionUsable) {
  const std::string original = random_bytes(1 * kMiB, 7);
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, 0, original));
  Nbd h = open_nbd(socket_, "disk", {.strict = false});
  ASSERT_TRUE(h);
  const std::string payload = random_bytes(nbd::kMaxPayload + 4096, 8);
  for (int i = 0; i < 10; ++i) {
    SCOPED_TRACE("round " + std::to_string(i));
    EXPECT_EQ(nbd_pwrite(h.get(), payload.data(), 1 * kMiB, 0, LIBNBD_CMD_FLAG_REQ_ONE), -1);
    EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();
    EXPECT_EQ(nbd_pwrite(h.get(), payload.data(), payload.size(), 0, 0), -1);
    EXPECT_EQ(nbd_get_errno(), EOVERFLOW) << nbd_get_error();
    ASSERT_EQ(nbd_aio_is_ready(h.get()), 1) << "the connection was lost";
  }
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 0, original.size()), original));
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, original.size()), original));
}

TEST_F(E2eTest, RequestsPastTheEndFailAndChangeNothing) {
  const std::string tail = random_bytes(1 * kMiB, 5);
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, kDiskSize - tail.size(), tail));
  Nbd h = open_nbd(socket_, "disk", {.strict = false});
  ASSERT_TRUE(h);
  EXPECT_EQ(nbd_get_strict_mode(h.get()) & (LIBNBD_STRICT_COMMANDS | LIBNBD_STRICT_BOUNDS), 0u);
  const std::string data = random_bytes(8192, 6);

  EXPECT_EQ(nbd_pwrite(h.get(), data.data(), 4096, kDiskSize - 2048, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ENOSPC) << nbd_get_error();
  EXPECT_EQ(nbd_pwrite(h.get(), data.data(), 1, kDiskSize, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ENOSPC) << nbd_get_error();
  EXPECT_EQ(nbd_pwrite(h.get(), data.data(), 4096, 1ull << 62, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ENOSPC) << nbd_get_error();
  EXPECT_EQ(nbd_zero(h.get(), 8192, kDiskSize - 4096, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ENOSPC) << nbd_get_error();

  std::string buf(8192, '\0');
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), 4096, kDiskSize - 100, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), 1, kDiskSize, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();
  EXPECT_EQ(nbd_trim(h.get(), 8192, kDiskSize - 4096, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();

  // Nothing moved: the file neither grew nor changed, and the connection still works up to
  // the last byte.
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), kDiskSize - tail.size(), tail.size()), tail));
  EXPECT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  EXPECT_EQ(std::filesystem::file_size(disk_), kDiskSize);
  EXPECT_TRUE(same_bytes(read_file(disk_, kDiskSize - tail.size(), tail.size()), tail));
}

TEST_F(E2eTest, ZeroTrimAndBlockStatus) {
  Nbd h = open_nbd(socket_, "disk", {.base_allocation = true});
  ASSERT_TRUE(h);
  ASSERT_EQ(nbd_can_meta_context(h.get(), LIBNBD_CONTEXT_BASE_ALLOCATION), 1);
  EXPECT_EQ(nbd_can_trim(h.get()), 1);
  EXPECT_EQ(nbd_can_zero(h.get()), 1);

  // A fresh sparse file is all hole, and reads as zeroes.
  const std::string zeroes(64 * kKiB, '\0');
  std::vector<Extent> extents = block_status(h.get(), 0, 1 * kMiB);
  EXPECT_NE(status_at(extents, 0) & LIBNBD_STATE_HOLE, 0u);
  EXPECT_NE(status_at(extents, 1 * kMiB - 1) & LIBNBD_STATE_HOLE, 0u);

  // Written bytes are data; their neighbours stay holes.
  const std::string data = random_bytes(64 * kKiB, 7);
  ASSERT_TRUE(nbd_write(h.get(), 256 * kKiB, data));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  extents = block_status(h.get(), 0, 1 * kMiB);
  EXPECT_NE(status_at(extents, 0) & LIBNBD_STATE_HOLE, 0u);
  EXPECT_EQ(status_at(extents, 256 * kKiB), 0u);
  EXPECT_EQ(status_at(extents, 320 * kKiB - 1), 0u);
  EXPECT_NE(status_at(extents, 512 * kKiB) & LIBNBD_STATE_HOLE, 0u);

  // Write-zeroes reads back as zeroes and, on a sparse file, leaves a hole.
  ASSERT_EQ(nbd_zero(h.get(), data.size(), 256 * kKiB, 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 256 * kKiB, data.size()), zeroes));
  extents = block_status(h.get(), 256 * kKiB, data.size());
  EXPECT_EQ(status_at(extents, 256 * kKiB) & (LIBNBD_STATE_HOLE | LIBNBD_STATE_ZERO),
            LIBNBD_STATE_HOLE | LIBNBD_STATE_ZERO);

  // Trim too; what block status calls zero must read as zero.
  ASSERT_TRUE(nbd_write(h.get(), 256 * kKiB, data));
  ASSERT_EQ(nbd_trim(h.get(), data.size(), 256 * kKiB, 0), 0) << nbd_get_error();
  extents = block_status(h.get(), 256 * kKiB, data.size());
  const uint32_t trimmed = status_at(extents, 256 * kKiB);
  EXPECT_NE(trimmed & LIBNBD_STATE_HOLE, 0u);
  if (trimmed & LIBNBD_STATE_ZERO) {
    EXPECT_TRUE(same_bytes(nbd_read(h.get(), 256 * kKiB, data.size()), zeroes));
  }

  // Unaligned write-zeroes inside data, with FUA and with NO_HOLE: exactly that range turns
  // to zeroes.
  std::string expected = random_bytes(64 * kKiB, 8);
  ASSERT_TRUE(nbd_write(h.get(), 2 * kMiB, expected));
  ASSERT_EQ(nbd_zero(h.get(), 1000, 2 * kMiB + 17, LIBNBD_CMD_FLAG_FUA), 0) << nbd_get_error();
  expected.replace(17, 1000, 1000, '\0');
  ASSERT_EQ(nbd_zero(h.get(), 8 * kKiB, 2 * kMiB + 16 * kKiB, LIBNBD_CMD_FLAG_NO_HOLE), 0)
      << nbd_get_error();
  expected.replace(16 * kKiB, 8 * kKiB, 8 * kKiB, '\0');
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 2 * kMiB, expected.size()), expected));
  EXPECT_EQ(status_at(block_status(h.get(), 2 * kMiB, expected.size()), 2 * kMiB + 40 * kKiB), 0u);

  // A fast zero is advertised, and on a file it is fast: it succeeds.
  EXPECT_EQ(nbd_can_fast_zero(h.get()), 1);
  ASSERT_EQ(nbd_zero(h.get(), 4 * kKiB, 2 * kMiB + 48 * kKiB, LIBNBD_CMD_FLAG_FAST_ZERO), 0)
      << nbd_get_error();
  expected.replace(48 * kKiB, 4 * kKiB, 4 * kKiB, '\0');
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 2 * kMiB, expected.size()), expected));

  // REQ_ONE asks for a single extent, and gets one that starts where asked.
  std::vector<Extent> one;
  ASSERT_EQ(nbd_block_status(h.get(), 1 * kMiB, 2 * kMiB,
                             nbd_extent_callback{collect_extents, &one, nullptr},
                             LIBNBD_CMD_FLAG_REQ_ONE),
            0)
      << nbd_get_error();
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].offset, 2 * kMiB);
  EXPECT_EQ(one[0].flags, 0u);
  EXPECT_LE(one[0].length, 1 * kMiB);
}

TEST_F(E2eTest, ReadsAcrossHolesAndDataReturnTheRightBytes) {
  Nbd h = open_nbd(socket_, "disk");
  ASSERT_TRUE(h);
  // 40 data blocks with holes between them: more pieces than one structured read reply
  // describes as separate chunks.
  const uint64_t base = 4 * kMiB;
  std::string expected(80 * 4 * kKiB, '\0');
  for (uint64_t i = 0; i < 40; ++i) {
    const std::string block = random_bytes(4 * kKiB, 100 + i);
    ASSERT_TRUE(nbd_write(h.get(), base + i * 8 * kKiB, block));
    expected.replace(i * 8 * kKiB, block.size(), block);
  }
  Chunks whole;
  EXPECT_TRUE(same_bytes(nbd_read_chunks(h.get(), base, expected.size(), 0, whole), expected));
  EXPECT_GT(whole.holes, 0) << "the server sent no hole chunk: this test covers less than meant";
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), base + 5, expected.size() - 9),
                         expected.substr(5, expected.size() - 9)));
  // With DF the server may not fragment the reply: one data chunk, the same bytes.
  EXPECT_EQ(nbd_can_df(h.get()), 1);
  Chunks unfragmented;
  EXPECT_TRUE(same_bytes(
      nbd_read_chunks(h.get(), base + 3 * kKiB, 64 * kKiB, LIBNBD_CMD_FLAG_DF, unfragmented),
      expected.substr(3 * kKiB, 64 * kKiB)));
  EXPECT_EQ(unfragmented.data, 1);
  EXPECT_EQ(unfragmented.holes, 0);
}

// `fallocate -l SIZE /dev/shm/vol` gives pages that tmpfs counts as holes until written, and
// its SEEK_DATA walks them one by one: looking up holes for each read cost a scan to the end of
// the file (1 GiB: ~120 reads/s with the worker thread at 100%). Reads must not depend on how
// far the next data is.
TEST(E2eTmpfs, ReadsOfAFallocatedTmpfsVolumeDoNotScanTheFile) {
  TempDir shm("/dev/shm", std::nothrow);
  SHAREBLK_REQUIRE(shm.ok(), "no writable /dev/shm");
  TempDir dir;
  const std::string vol = shm / "vol.img";
  const std::string socket = dir / "nbd.sock";
  constexpr uint64_t kSize = 512 * kMiB;
  {
    const int fd = ::open(vol.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fallocate(fd, 0, 0, static_cast<off_t>(kSize)), 0) << std::strerror(errno);
    ::close(fd);
  }
  Daemon daemon({"--export", "mem=" + vol, "--listen-unix", socket, "--workers", "1"}, socket);
  Nbd h = open_nbd(socket, "mem");
  ASSERT_TRUE(h);
  constexpr int kReads = 200;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kReads; ++i) {
    // Spread over the first half, so that each read has a long way to the end of the file.
    const uint64_t offset = (uint64_t(i) * 7919 % (kSize / 2 / (4 * kKiB))) * 4 * kKiB;
    ASSERT_EQ(nbd_read(h.get(), offset, 4 * kKiB), std::string(4 * kKiB, '\0'));
  }
  const auto took = std::chrono::steady_clock::now() - start;
  // Scanning, each read took 2-4 ms here (0.4-0.8 s in all); without, ~0.1 ms.
  EXPECT_LT(took, 300ms) << kReads << " reads of 4 KiB took "
                         << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                         << " ms";
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

TEST_F(E2eTest, ClientWithoutStructuredReplies) {
  Nbd h = open_nbd(socket_, "disk", {.strict = false, .structured_replies = false});
  Nbd structured = open_nbd(socket_, "disk");
  ASSERT_TRUE(h && structured);
  EXPECT_EQ(nbd_get_structured_replies_negotiated(h.get()), 0);

  const std::string data = random_bytes(1 * kMiB, 9);
  ASSERT_TRUE(nbd_write(h.get(), 5 * kMiB + 3, data));
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 5 * kMiB + 3, data.size()), data));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(structured.get(), 5 * kMiB + 3, data.size()), data));
  // Holes are zeroes in a simple reply too.
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 7 * kMiB, 64 * kKiB), std::string(64 * kKiB, '\0')));

  const std::string big = random_bytes(nbd::kMaxPayload, 10);
  ASSERT_TRUE(nbd_write(structured.get(), 24 * kMiB, big));
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 24 * kMiB, big.size()), big));

  // An error reply carries no data: the stream stays in step.
  std::string buf(4096, '\0');
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), buf.size(), kDiskSize - 1, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();
  ASSERT_EQ(nbd_zero(h.get(), 4096, 5 * kMiB + 3, 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 5 * kMiB + 3, 8192),
                         std::string(4096, '\0') + data.substr(4096, 4096)));
}

// --- qemu-io, qemu-img, fio ---

TEST_F(E2eTest, QemuIoWritesAndReadsPatterns) {
  SHAREBLK_REQUIRE(have_program("qemu-io"), "qemu-io (qemu-utils) is not installed");
  RunResult write =
      run({"qemu-io", "-f", "raw", "-c", "write -P 0xab 0 1M", "-c", "write -P 0xcd 1M 512k", "-c",
           "write -P 0x5e 3000000 77777", "-c", "flush", uri("disk")});
  ASSERT_EQ(write.status, 0) << write.output;

  RunResult read =
      run({"qemu-io", "-f", "raw", "-c", "read -P 0xab 0 1M", "-c", "read -P 0xcd 1M 512k", "-c",
           "read -P 0x5e 3000000 77777", "-c", "read -P 0 1572864 1427136", uri("disk")});
  EXPECT_EQ(read.status, 0) << read.output;
  EXPECT_EQ(read.output.find("verification failed"), std::string::npos) << read.output;

  // A wrong pattern is caught: the reads above really compared something.
  RunResult wrong = run({"qemu-io", "-f", "raw", "-c", "read -P 0xac 0 4k", uri("disk")});
  EXPECT_NE(wrong.status, 0) << wrong.output;
  EXPECT_NE(wrong.output.find("verification failed"), std::string::npos) << wrong.output;

  EXPECT_TRUE(same_bytes(read_file(disk_, 0, 1 * kMiB), std::string(1 * kMiB, '\xab')));
  EXPECT_TRUE(same_bytes(read_file(disk_, 3000000, 77777), std::string(77777, '\x5e')));
}

TEST_F(E2eTest, QemuIoOnReadOnlyExport) {
  SHAREBLK_REQUIRE(have_program("qemu-io"), "qemu-io (qemu-utils) is not installed");
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, 0, std::string(1 * kMiB, '\x42')));

  RunResult read = run({"qemu-io", "-r", "-f", "raw", "-c", "read -P 0x42 0 1M", uri("ro")});
  EXPECT_EQ(read.status, 0) << read.output;

  RunResult write_ro = run({"qemu-io", "-r", "-f", "raw", "-c", "write -P 0x99 0 4k", uri("ro")});
  EXPECT_NE(write_ro.status, 0) << write_ro.output;
  // Without -r qemu asks for write access, which a read-only export does not give.
  RunResult write_rw = run({"qemu-io", "-f", "raw", "-c", "write -P 0x99 0 4k", uri("ro")});
  EXPECT_NE(write_rw.status, 0) << write_rw.output;

  EXPECT_TRUE(same_bytes(read_file(disk_, 0, 1 * kMiB), std::string(1 * kMiB, '\x42')));
}

TEST_F(E2eTest, QemuImgConvertThenCompare) {
  SHAREBLK_REQUIRE(have_program("qemu-img"), "qemu-img (qemu-utils) is not installed");
  // The export starts as all 0xff, so the zeroes of the source must really be written.
  Nbd h = open_nbd(socket_, "disk");
  ASSERT_TRUE(h);
  const std::string ones(4 * kMiB, '\xff');
  for (uint64_t offset = 0; offset < kDiskSize; offset += ones.size()) {
    ASSERT_TRUE(nbd_write(h.get(), offset, ones));
  }
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();

  // A sparse source with random data at aligned and unaligned places.
  const std::string local = dir_ / "local.img";
  make_file(local, kDiskSize);
  ASSERT_NO_FATAL_FAILURE(write_file_at(local, 0, random_bytes(3 * kMiB, 11)));
  ASSERT_NO_FATAL_FAILURE(write_file_at(local, 10 * kMiB + 123, random_bytes(1 * kMiB, 12)));
  ASSERT_NO_FATAL_FAILURE(write_file_at(local, 40 * kMiB, random_bytes(8 * kMiB, 13)));
  ASSERT_NO_FATAL_FAILURE(write_file_at(local, kDiskSize - 5000, random_bytes(5000, 14)));

  RunResult convert =
      run({"qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", local, uri("disk")});
  ASSERT_EQ(convert.status, 0) << convert.output;
  RunResult compare = run({"qemu-img", "compare", "-f", "raw", "-F", "raw", local, uri("disk")});
  EXPECT_EQ(compare.status, 0) << compare.output;
  for (uint64_t offset = 0; offset < kDiskSize; offset += 4 * kMiB) {
    ASSERT_TRUE(same_bytes(read_file(disk_, offset, 4 * kMiB), read_file(local, offset, 4 * kMiB)))
        << "at offset " << offset;
  }

  // One changed byte and compare notices: it really read the export.
  ASSERT_TRUE(nbd_write(h.get(), 20 * kMiB + 7, "x"));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  RunResult differ = run({"qemu-img", "compare", "-f", "raw", "-F", "raw", local, uri("disk")});
  EXPECT_EQ(differ.status, 1) << differ.output;
}

TEST_F(E2eTest, FioVerifiesDataAcrossFourConnections) {
  SHAREBLK_REQUIRE(have_program("fio"), "fio is not installed");
  SHAREBLK_REQUIRE(run({"fio", "--enghelp=nbd"}).status == 0, "fio has no nbd engine");
  // Four jobs, one connection each, every job in its own 4 MiB region so that what it
  // verifies is what it wrote.
  const std::vector<std::string> job{"fio",
                                     "--name=shareblk",
                                     "--ioengine=nbd",
                                     "--uri=" + uri("disk"),
                                     "--rw=randwrite",
                                     "--bs=4k",
                                     "--size=4M",
                                     "--offset_increment=4M",
                                     "--numjobs=4",
                                     "--iodepth=8",
                                     "--verify=crc32c",
                                     "--verify_fatal=1",
                                     "--verify_state_save=0",
                                     "--group_reporting"};
  std::vector<std::string> write_and_verify = job;
  write_and_verify.push_back("--do_verify=1");
  RunResult fio = run(write_and_verify);
  ASSERT_EQ(fio.status, 0) << fio.output;
  EXPECT_EQ(fio.output.find("verify:"), std::string::npos) << fio.output;
  EXPECT_NE(fio.output.find("err= 0"), std::string::npos) << fio.output;
  // Every block written was read back and verified.
  EXPECT_NE(fio.output.find("issued rwts: total=4096,4096,"), std::string::npos) << fio.output;

  // A block changed behind fio's back fails verification: the check has teeth.
  Nbd h = open_nbd(socket_, "disk");
  ASSERT_TRUE(h);
  ASSERT_TRUE(nbd_write(h.get(), 8 * kMiB + 40 * kKiB, random_bytes(4 * kKiB, 15)));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  std::vector<std::string> verify_only = job;
  verify_only.push_back("--verify_only");
  RunResult corrupted = run(verify_only);
  EXPECT_NE(corrupted.status, 0) << corrupted.output;
  EXPECT_NE(corrupted.output.find("verify:"), std::string::npos) << corrupted.output;
}

// --- Bad input and faults, over raw sockets ---

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

TEST_F(E2eTest, BadRequestMagicClosesTheConnection) {
  RawClient c(socket_);
  ASSERT_TRUE(handshake(c, "disk"));
  ASSERT_TRUE(send_request(c, nbd::kCmdRead, 1, 0, 4096, 0, 0x12345678));
  EXPECT_TRUE(c.closed_by_server());
  expect_serving();
}

TEST_F(E2eTest, InvalidRequestsGetErrorsAndTheConnectionGoesOn) {
  const std::string original = random_bytes(64 * kKiB, 18);
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, 0, original));
  RawClient c(socket_);
  const std::optional<ExportInfo> info = handshake(c, "disk");
  ASSERT_TRUE(info);
  EXPECT_EQ(info->size, kDiskSize);
  EXPECT_EQ(info->flags & nbd::kFlagReadOnly, 0);

  uint64_t cookie = 100;
  // After each refused request, a READ on the same connection gets the right bytes.
  auto expect_still_usable = [&] {
    const uint64_t read_cookie = ++cookie;
    ASSERT_TRUE(send_request(c, nbd::kCmdRead, read_cookie, 1000, 5000));
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, {{read_cookie, 5000}}));
    EXPECT_EQ(reply.cookie, read_cookie);
    EXPECT_EQ(reply.error, 0u);
    EXPECT_TRUE(same_bytes(reply.data, original.substr(1000, 5000)));
  };
  auto expect_error = [&](uint16_t type, uint16_t flags, uint64_t offset, uint32_t length,
                          uint32_t error, const std::string& payload = {}) {
    const uint64_t request_cookie = ++cookie;
    ASSERT_TRUE(send_request(c, type, request_cookie, offset, length, flags));
    ASSERT_TRUE(c.send_all(payload));
    std::map<uint64_t, uint32_t> read_lengths;
    if (type == nbd::kCmdRead) read_lengths[request_cookie] = length;
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, read_lengths));
    EXPECT_EQ(reply.cookie, request_cookie);
    EXPECT_EQ(reply.error, error);
    ASSERT_NO_FATAL_FAILURE(expect_still_usable());
  };

  {
    SCOPED_TRACE("unknown command");
    expect_error(0x77, 0, 0, 0, nbd::kEinval);
  }
  {
    SCOPED_TRACE("unknown command with a length");
    expect_error(0x78, 0, 0, 4096, nbd::kEinval);
  }
  {
    SCOPED_TRACE("READ with an unknown flag");
    expect_error(nbd::kCmdRead, 1 << 9, 0, 4096, nbd::kEinval);
  }
  {
    SCOPED_TRACE("READ with DF, which needs structured replies");
    expect_error(nbd::kCmdRead, nbd::kCmdFlagDf, 0, 4096, nbd::kEinval);
  }
  {
    SCOPED_TRACE("BLOCK_STATUS without a metadata context");
    expect_error(nbd::kCmdBlockStatus, 0, 0, 4096, nbd::kEinval);
  }
  {
    SCOPED_TRACE("READ whose end wraps around 2^64");
    expect_error(nbd::kCmdRead, 0, ~uint64_t{0} - 4095, 8192, nbd::kEinval);
  }
  {
    SCOPED_TRACE("WRITE whose end wraps around 2^64");
    expect_error(nbd::kCmdWrite, 0, ~uint64_t{0} - 4095, 8192, nbd::kEnospc,
                 requests_as_payload(8192));
  }
  {
    SCOPED_TRACE("READ larger than the maximum");
    expect_error(nbd::kCmdRead, 0, 0, nbd::kMaxPayload + 1, nbd::kEoverflow);
  }
  {
    SCOPED_TRACE("READ of 4 GiB - 1");
    expect_error(nbd::kCmdRead, 0, 0, 0xffffffff, nbd::kEoverflow);
  }
  {
    // Its payload is sent in full and must be skipped, not parsed as requests.
    SCOPED_TRACE("WRITE larger than the maximum");
    expect_error(nbd::kCmdWrite, 0, 0, nbd::kMaxPayload + 4096, nbd::kEoverflow,
                 requests_as_payload(nbd::kMaxPayload + 4096));
  }
  {
    SCOPED_TRACE("TRIM with an unknown flag");
    expect_error(nbd::kCmdTrim, 1 << 12, 0, 4096, nbd::kEinval);
  }

  // A clean disconnect, and nothing was written along the way.
  ASSERT_TRUE(send_request(c, nbd::kCmdDisc, ++cookie, 0, 0));
  EXPECT_TRUE(c.closed_by_server());
  stop_daemon();
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, original.size()), original));
}

TEST_F(E2eTest, RefusedWritePayloadIsSkippedOnReadOnlyExport) {
  RawClient c(socket_);
  const std::optional<ExportInfo> info = handshake(c, "ro");
  ASSERT_TRUE(info);
  EXPECT_NE(info->flags & nbd::kFlagReadOnly, 0);
  // Payloads that look like requests, small and larger than a receive buffer, pipelined.
  const uint32_t lengths[] = {28, 4096, 300 * 1024, 2 * 1024 * 1024 + 5};
  uint64_t cookie = 1;
  for (uint32_t length : lengths) {
    ASSERT_TRUE(send_request(c, nbd::kCmdWrite, cookie++, 0, length));
    ASSERT_TRUE(c.send_all(requests_as_payload(length)));
  }
  ASSERT_TRUE(send_request(c, nbd::kCmdTrim, cookie++, 0, 4096));
  ASSERT_TRUE(send_request(c, nbd::kCmdWriteZeroes, cookie++, 0, 4096));
  const uint64_t read_cookie = cookie++;
  ASSERT_TRUE(send_request(c, nbd::kCmdRead, read_cookie, 4096, 4096));

  std::set<uint64_t> answered;
  for (uint64_t i = 1; i < cookie; ++i) {
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, {{read_cookie, 4096}}));
    ASSERT_NE(reply.cookie, kBogusCookie) << "a payload was parsed as requests";
    EXPECT_TRUE(answered.insert(reply.cookie).second) << "cookie " << reply.cookie;
    if (reply.cookie == read_cookie) {
      EXPECT_EQ(reply.error, 0u);
      EXPECT_TRUE(same_bytes(reply.data, std::string(4096, '\0')));
    } else {
      EXPECT_EQ(reply.error, nbd::kEperm) << "cookie " << reply.cookie;
    }
  }
  EXPECT_EQ(answered.size(), cookie - 1);
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, 4 * kMiB), std::string(4 * kMiB, '\0')));
}

// A change from a read-only attachment is refused with EPERM whatever else is wrong with it:
// the client learns the one thing that matters (it may not write here), and the payload of an
// oversized or badly flagged WRITE is still skipped rather than parsed as requests.
TEST_F(E2eTest, ReadOnlyExportAnswersEpermBeforeAnyOtherError) {
  RawClient c(socket_);
  const std::optional<ExportInfo> info = handshake(c, "ro");
  ASSERT_TRUE(info);
  ASSERT_NE(info->flags & nbd::kFlagReadOnly, 0);
  struct Case {
    const char* what;
    uint16_t type;
    uint16_t flags;
    uint64_t offset;
    uint32_t length;
  };
  const Case cases[] = {
      {"WRITE with an unknown flag", nbd::kCmdWrite, 1 << 9, 0, 4096},
      {"WRITE with REQ_ONE", nbd::kCmdWrite, nbd::kCmdFlagReqOne, 0, 4096},
      {"WRITE larger than the maximum", nbd::kCmdWrite, 0, 0, nbd::kMaxPayload + 4096},
      {"WRITE past the end", nbd::kCmdWrite, 0, kDiskSize, 4096},
      {"TRIM with NO_HOLE", nbd::kCmdTrim, nbd::kCmdFlagNoHole, 0, 4096},
      {"WRITE_ZEROES with an unknown flag", nbd::kCmdWriteZeroes, 1 << 12, 0, 4096},
  };
  uint64_t cookie = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    ASSERT_TRUE(send_request(c, k.type, ++cookie, k.offset, k.length, k.flags));
    if (k.type == nbd::kCmdWrite) {
      ASSERT_TRUE(c.send_all(requests_as_payload(k.length)));
    }
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, {}));
    ASSERT_NE(reply.cookie, kBogusCookie) << "a payload was parsed as requests";
    EXPECT_EQ(reply.cookie, cookie);
    EXPECT_EQ(reply.error, nbd::kEperm);
  }
  // The connection is still in step: a READ gets its bytes.
  ASSERT_TRUE(send_request(c, nbd::kCmdRead, ++cookie, 4096, 4096));
  SimpleReply reply;
  ASSERT_TRUE(read_simple_reply(c, reply, {{cookie, 4096}}));
  EXPECT_EQ(reply.cookie, cookie);
  EXPECT_EQ(reply.error, 0u);
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, 4 * kMiB), std::string(4 * kMiB, '\0')));
}

TEST_F(E2eTest, ThreeHundredConnectionsAtOnce) {
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

// --- Client hosts that go silent ---

// Another network host: a network namespace joined to this one by a veth pair. Taking its end
// of the link down makes it silent, as a crashed host or a cut cable is: every packet to it
// is lost and it sends no FIN or RST.
class PeerHost {
 public:
  PeerHost()
      : ns_("sbpeer" + std::to_string(::getpid())),
        host_if_("sbh" + std::to_string(::getpid() % 1000000)),
        peer_if_("sbp" + std::to_string(::getpid() % 1000000)),
        subnet_("198.18." + std::to_string(::getpid() % 250) + ".") {  // RFC 2544: for tests
    ok_ = ip({"netns", "add", ns_}) &&
          ip({"link", "add", host_if_, "type", "veth", "peer", "name", peer_if_, "netns", ns_}) &&
          ip({"addr", "add", subnet_ + "1/24", "dev", host_if_}) &&
          ip({"link", "set", host_if_, "up"}) &&
          ip({"-n", ns_, "addr", "add", subnet_ + "2/24", "dev", peer_if_}) &&
          ip({"-n", ns_, "link", "set", peer_if_, "up"});
  }
  ~PeerHost() {
    ip({"link", "del", host_if_});
    ip({"netns", "del", ns_});
  }
  PeerHost(const PeerHost&) = delete;
  PeerHost& operator=(const PeerHost&) = delete;

  bool ok() const { return ok_; }
  // This machine's address on the link.
  std::string our_address() const { return subnet_ + "1"; }
  bool go_silent() const { return ip({"-n", ns_, "link", "set", peer_if_, "down"}); }

  // A TCP connection made from inside the peer host to address:port; -1 on failure. The
  // socket belongs to the namespace it was made in, whichever thread uses it later.
  int connect(const std::string& address, int port) const {
    int fd = -1;
    std::thread([&] {
      const int ns = ::open(("/run/netns/" + ns_).c_str(), O_RDONLY | O_CLOEXEC);
      if (ns < 0) return;
      const bool joined = ::setns(ns, CLONE_NEWNET) == 0;
      ::close(ns);
      if (!joined) return;
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port));
      if (::inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) return;
      fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        ::close(fd);
        fd = -1;
      }
    }).join();
    return fd;
  }

 private:
  static bool ip(std::vector<std::string> args) {
    args.insert(args.begin(), "ip");
    return run(args, 10s).status == 0;
  }

  std::string ns_, host_if_, peer_if_, subnet_;
  bool ok_ = false;
};

// Established TCP connections on this machine whose local port is `port`.
int established_on_port(int port) {
  const RunResult r =
      run({"ss", "-Htn", "state", "established", "( sport = :" + std::to_string(port) + " )"}, 10s);
  return static_cast<int>(std::count(r.output.begin(), r.output.end(), '\n'));
}

// A client host that goes silent leaves an idle connection that the kernel alone would keep
// for ever (keepalive is off by default). With --peer-timeout-ms the daemon drops it, and
// says so; while the host still answers, an idle client is left alone.
TEST(E2ePeerTimeout, AClientHostThatGoesSilentIsDropped) {
  SHAREBLK_REQUIRE(is_root() && have_program("ip") && have_program("ss"),
                   "needs root and iproute2 (ip, ss) for a second network host");
  PeerHost peer;
  SHAREBLK_REQUIRE(peer.ok(), "cannot make a network namespace joined by a veth pair");
  TempDir dir;
  const std::string disk = dir / "disk.img";
  const std::string socket = dir / "nbd.sock";
  make_file(disk, kMiB);
  Daemon daemon({"--export", "disk=" + disk, "--listen-unix", socket, "--listen-tcp",
                 peer.our_address() + ":0", "--peer-timeout-ms", "2000"},
                socket);
  const int port = logged_tcp_port(daemon, peer.our_address());
  ASSERT_GT(port, 0) << daemon.log();

  RawClient c(peer.connect(peer.our_address(), port));
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(handshake(c, "disk"));
  std::this_thread::sleep_for(5s);  // idle for 2.5 timeouts, the host answering probes
  ASSERT_TRUE(send_request(c, nbd::kCmdRead, 1, 0, 4096));
  SimpleReply reply;
  ASSERT_TRUE(read_simple_reply(c, reply, {{1, 4096}})) << "an idle live client was dropped";
  EXPECT_EQ(reply.error, 0u);
  ASSERT_EQ(established_on_port(port), 1);

  ASSERT_TRUE(peer.go_silent());
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (established_on_port(port) > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_EQ(established_on_port(port), 0) << "the silent client's connection is still there";
  EXPECT_NE(daemon.log().find("lost a client of"), std::string::npos) << daemon.log();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// --- Locked memory ---

// Runs what follows it with RLIMIT_MEMLOCK at `bytes` and without CAP_IPC_LOCK, which would
// lift the limit for root: the situation of a daemon under a service manager's small limit.
std::vector<std::string> with_locked_memory_limit(uint64_t bytes) {
  const std::string limit = std::to_string(bytes);
  return {"prlimit",
          "--memlock=" + limit + ":" + limit,
          "capsh",
          "--drop=cap_ipc_lock",
          "--",
          "-c",
          "exec \"$0\" \"$@\""};
}

// Each io_uring is locked memory (about 40 KiB on Linux 6.18). When the limit holds some
// rings but not all the workers asked for, the daemon used to refuse to start; now it runs
// the workers that fit, says so, and serves every connection with them. io_uring counts
// this memory per user, and a ring's teardown finishes a moment after its process exits:
// another daemon without CAP_IPC_LOCK started right before can make even the first ring fail.
TEST(E2eLockedMemory, RunsTheWorkersThatFitUnderTheLimit) {
  SHAREBLK_REQUIRE(is_root() && have_program("prlimit") && have_program("capsh"),
                   "needs root, prlimit and capsh to drop CAP_IPC_LOCK");
  TempDir dir;
  const std::string disk = dir / "disk.img";
  const std::string socket = dir / "nbd.sock";
  make_file(disk, 8 * kMiB);
  Daemon daemon({"--export", "disk=" + disk, "--listen-unix", socket, "--workers", "8"}, socket,
                with_locked_memory_limit(96 * kKiB));
  EXPECT_NE(daemon.log().find(" of 8 io_uring workers"), std::string::npos) << daemon.log();

  std::vector<Nbd> clients;  // more connections than workers: they share the ones running
  for (int i = 0; i < 4; ++i) {
    clients.push_back(open_nbd(socket, "disk"));
    ASSERT_TRUE(clients.back());
    const std::string data = random_bytes(64 * kKiB, static_cast<uint64_t>(i));
    ASSERT_TRUE(nbd_write(clients.back().get(), static_cast<uint64_t>(i) * kMiB, data));
    EXPECT_TRUE(same_bytes(
        nbd_read(clients.back().get(), static_cast<uint64_t>(i) * kMiB, data.size()), data));
  }
  clients.clear();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// Below a single ring nothing can run: the daemon stops at once and says why.
TEST(E2eLockedMemory, SaysWhyWhenNotEvenOneRingFits) {
  SHAREBLK_REQUIRE(is_root() && have_program("prlimit") && have_program("capsh"),
                   "needs root, prlimit and capsh to drop CAP_IPC_LOCK");
  TempDir dir;
  const std::string disk = dir / "disk.img";
  make_file(disk, kMiB);
  std::vector<std::string> argv = with_locked_memory_limit(16 * kKiB);
  argv.insert(argv.end(),
              {Daemon::binary(), "--export", "disk=" + disk, "--listen-unix", dir / "nbd.sock"});
  const RunResult r = run(argv, 20s);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("io_uring worker: Cannot allocate memory"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace shareblk::testing
