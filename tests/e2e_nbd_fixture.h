// What the end-to-end NBD suite (e2e_tests, the files tests/e2e_nbd_*_test.cc) shares: the
// fixture that runs shareblkd, libnbd helpers, and a raw protocol client that misbehaves on
// purpose.
//
// Every E2eTest starts its own daemon on a fresh 64 MiB sparse file, served twice: read-write as
// "disk" and read-only as "ro", on a Unix socket and on a free TCP port of 127.0.0.1. TearDown
// stops the daemon and requires a clean exit, so a crash, a hang at shutdown or a sanitizer report
// (the asan and tsan presets instrument the daemon too) fails the test that caused it.
#pragma once

#include <gtest/gtest.h>
#include <libnbd.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "target/nbd_proto.h"
#include "tests/support.h"

namespace shareblk::testing::e2e {

using namespace std::chrono_literals;

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kDiskSize = 64 * kMiB;

// --- Bytes ---

// Pseudo-random bytes from a seed (splitmix64: fast even in a debug build, unlike <random>).
std::string random_bytes(size_t length, uint64_t seed);
// Compares without printing megabytes: names the first differing byte instead.
::testing::AssertionResult same_bytes(const std::string& actual, const std::string& expected);
void write_file_at(const std::string& path, uint64_t offset, const std::string& data);
// A field of /proc/PID/status in KiB (VmRSS, VmHWM), or -1.
long proc_status_kib(pid_t pid, const std::string& field);

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
             const ClientOptions& options = {});
// The bytes at [offset, offset+length), or an empty string (and a test failure).
std::string nbd_read(nbd_handle* h, uint64_t offset, size_t length, uint32_t flags = 0);
bool nbd_write(nbd_handle* h, uint64_t offset, const std::string& data, uint32_t flags = 0);

// How a structured read reply came: data chunks and hole chunks.
struct Chunks {
  int data = 0;
  int holes = 0;
};
// The bytes at [offset, offset+length) read with `flags`, and how the reply was cut up.
std::string nbd_read_chunks(nbd_handle* h, uint64_t offset, size_t length, uint32_t flags,
                            Chunks& chunks);

// One base:allocation extent as the server described it.
struct Extent {
  uint64_t offset;
  uint64_t length;
  uint32_t flags;
};
// An nbd_extent_callback that appends the base:allocation extents to the std::vector<Extent> at
// `user_data`.
int collect_extents(void* user_data, const char* context, uint64_t offset, uint32_t* entries,
                    size_t count, int* error);
// The allocation status of [offset, offset+length), asking again where an answer fell short.
std::vector<Extent> block_status(nbd_handle* h, uint64_t offset, uint64_t length);
// The base:allocation flags of the byte at `offset`.
uint32_t status_at(const std::vector<Extent>& extents, uint64_t offset);

// --- A raw protocol client, for the requests no well-behaved client sends ---

class RawClient {
 public:
  explicit RawClient(const std::string& socket_path);
  // Over TCP to `ipv4_address`:`port`.
  RawClient(const std::string& ipv4_address, int port);
  // Takes over `fd`, a connected socket (or -1: not connected).
  explicit RawClient(int fd) : fd_(fd) { set_timeouts(); }
  ~RawClient() { close(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return fd_ >= 0; }
  void close();

  bool send_all(const void* data, size_t length);
  bool send_all(const std::string& data) { return send_all(data.data(), data.size()); }
  bool recv_all(void* data, size_t length);

  // True when the server ends the connection within `timeout`. Whatever it still sends first
  // (option replies, say) is read and dropped.
  bool closed_by_server(std::chrono::milliseconds timeout = 5s);

 private:
  // A server that stops answering fails the test instead of hanging it.
  void set_timeouts();

  int fd_ = -1;
};

bool read_greeting(RawClient& c);
bool send_u32(RawClient& c, uint32_t value);
bool send_option(RawClient& c, uint32_t option, const std::string& data,
                 uint64_t magic = nbd::kOptMagic);

struct OptionReply {
  uint32_t option = 0;
  uint32_t type = 0;
  std::string data;
};
bool read_option_reply(RawClient& c, OptionReply& reply);

struct ExportInfo {
  uint64_t size = 0;
  uint16_t flags = 0;
};
// The fixed newstyle handshake, ending with NBD_OPT_GO on `name`. Structured replies are not
// negotiated, so every transmission reply is a simple one.
std::optional<ExportInfo> handshake(RawClient& c, const std::string& name);

bool send_request(RawClient& c, uint16_t type, uint64_t cookie, uint64_t offset, uint32_t length,
                  uint16_t flags = 0, uint32_t magic = nbd::kRequestMagic);

struct SimpleReply {
  uint32_t error = 0;
  uint64_t cookie = 0;
  std::string data;
};
// Reads one simple reply; a successful reply to a READ listed in `read_lengths` (cookie ->
// length) carries that many bytes of data.
bool read_simple_reply(RawClient& c, SimpleReply& reply,
                       const std::map<uint64_t, uint32_t>& read_lengths = {});

// `length` bytes that parse as a stream of 512-byte READ requests carrying kBogusCookie. Sent
// as a payload the server must skip: a reply with that cookie would show it parsed the payload.
inline constexpr uint64_t kBogusCookie = 0xbadc00c1e;
std::string requests_as_payload(size_t length);

using testing::logged_tcp_port;  // tests/support.h

// --- The fixture ---

class E2eTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override { stop_daemon(); }

  // Stops the daemon and requires a clean exit. Tests call it early to look at the backing file
  // once no connection can still be changing it.
  void stop_daemon();
  // (Re)starts the daemon on the fixture's exports and sockets, with `extra` options.
  void start_daemon(const std::vector<std::string>& extra = {});

  // The port the daemon picked for 127.0.0.1:0, from its log; 0 when it never said.
  int tcp_port() const { return logged_tcp_port(*daemon_, "127.0.0.1"); }

  std::string uri(const std::string& export_name) const {
    return "nbd+unix:///" + export_name + "?socket=" + socket_;
  }

  // A new client can connect, write and read back: the daemon is alive and serving.
  void expect_serving(uint64_t seed = 99);

  TempDir dir_;
  std::string disk_;
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
  bool stopped_ = false;
};

}  // namespace shareblk::testing::e2e
