// The end-to-end NBD suite's shared parts; what each is for is in e2e_nbd_fixture.h.
#include "tests/e2e_nbd_fixture.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

namespace shareblk::testing::e2e {

// --- Bytes ---

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

long proc_status_kib(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

// --- libnbd ---

Nbd open_nbd(const std::string& socket, const std::string& export_name,
             const ClientOptions& options) {
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

std::string nbd_read(nbd_handle* h, uint64_t offset, size_t length, uint32_t flags) {
  std::string data(length, '\0');
  if (nbd_pread(h, data.data(), length, offset, flags) != 0) {
    ADD_FAILURE() << "nbd_pread(offset " << offset << ", length " << length
                  << "): " << nbd_get_error();
    return {};
  }
  return data;
}

bool nbd_write(nbd_handle* h, uint64_t offset, const std::string& data, uint32_t flags) {
  if (nbd_pwrite(h, data.data(), data.size(), offset, flags) != 0) {
    ADD_FAILURE() << "nbd_pwrite(offset " << offset << ", length " << data.size()
                  << "): " << nbd_get_error();
    return false;
  }
  return true;
}

namespace {

int count_chunk(void* user_data, const void* /*subbuf*/, size_t /*count*/, uint64_t /*offset*/,
                unsigned status, int* /*error*/) {
  auto* chunks = static_cast<Chunks*>(user_data);
  if (status == LIBNBD_READ_DATA) ++chunks->data;
  if (status == LIBNBD_READ_HOLE) ++chunks->holes;
  return 0;
}
}  // namespace

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

uint32_t status_at(const std::vector<Extent>& extents, uint64_t offset) {
  for (const Extent& e : extents) {
    if (offset >= e.offset && offset < e.offset + e.length) return e.flags;
  }
  ADD_FAILURE() << "no extent covers byte " << offset;
  return 0xffffffff;
}

// --- RawClient ---

RawClient::RawClient(const std::string& socket_path) {
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

RawClient::RawClient(const std::string& ipv4_address, int port) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (fd_ >= 0 && (::inet_pton(AF_INET, ipv4_address.c_str(), &addr.sin_addr) != 1 ||
                   ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)) {
    ::close(fd_);
    fd_ = -1;
  }
  set_timeouts();
}

void RawClient::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool RawClient::send_all(const void* data, size_t length) {
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

bool RawClient::recv_all(void* data, size_t length) {
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

bool RawClient::closed_by_server(std::chrono::milliseconds timeout) {
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

void RawClient::set_timeouts() {
  timeval timeout{10, 0};
  if (fd_ >= 0) {
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  }
}

// --- The raw protocol ---

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

bool send_option(RawClient& c, uint32_t option, const std::string& data, uint64_t magic) {
  uint8_t header[nbd::kOptionHeaderSize];
  nbd::put64(header, magic);
  nbd::put32(header + 8, option);
  nbd::put32(header + 12, static_cast<uint32_t>(data.size()));
  return c.send_all(header, sizeof header) && c.send_all(data);
}

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
                  uint16_t flags, uint32_t magic) {
  uint8_t bytes[nbd::kRequestSize];
  nbd::encode_request(bytes, nbd::Request{magic, flags, type, cookie, offset, length});
  return c.send_all(bytes, sizeof bytes);
}

bool read_simple_reply(RawClient& c, SimpleReply& reply,
                       const std::map<uint64_t, uint32_t>& read_lengths) {
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

// --- The fixture ---

void E2eTest::SetUp() {
  disk_ = dir_ / "disk.img";
  socket_ = dir_ / "nbd.sock";
  make_file(disk_, kDiskSize);
  start_daemon();
}

void E2eTest::start_daemon(const std::vector<std::string>& extra) {
  if (daemon_ && !stopped_) {
    EXPECT_EQ(daemon_->stop(SIGTERM), 0);
  }
  daemon_.reset();
  stopped_ = false;
  std::vector<std::string> args{
      "--export", "disk=" + disk_, "--export",    "ro=" + disk_ + ",ro", "--listen-unix",
      socket_,    "--listen-tcp",  "127.0.0.1:0", "--workers",           "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  daemon_ = std::make_unique<Daemon>(args, socket_);
}

void E2eTest::stop_daemon() {
  if (!daemon_ || stopped_) return;
  stopped_ = true;
  const int status = daemon_->stop(SIGTERM);
  EXPECT_EQ(status, 0) << "shareblkd did not exit cleanly; its log:\n" << daemon_->log();
}

void E2eTest::expect_serving(uint64_t seed) {
  Nbd h = open_nbd(socket_, "disk");
  ASSERT_TRUE(h);
  const std::string data = random_bytes(8 * kKiB, seed);
  ASSERT_TRUE(nbd_write(h.get(), 60 * kMiB, data));
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 60 * kMiB, data.size()), data));
}

}  // namespace shareblk::testing::e2e
