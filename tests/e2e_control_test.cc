// The control plane end to end: a real shareblkd in managed mode, driven through its control
// socket and the shareblk CLI, with real NBD clients (libnbd, qemu-io, nbdinfo) on the
// attachments' connection_info.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <libnbd.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <latch>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if SHAREBLK_TEST_CEPH
#include "tests/ceph_cluster.h"
#endif
#include "tests/control_client.h"
#include "tests/lvm_fixture.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace fs = std::filesystem;
namespace st = shareblk::testing;
using Json = nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr uint64_t kMiB = 1 << 20;
constexpr size_t k64K = 64 * 1024;

// One connection to the control socket: JSON-RPC 2.0, one JSON object per line each way.
class RpcConnection {
 public:
  explicit RpcConnection(const std::string& path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
    if (fd_ < 0 || ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      const std::string why = std::strerror(errno);
      if (fd_ >= 0) ::close(fd_);
      throw std::runtime_error("cannot connect to " + path + ": " + why);
    }
  }
  ~RpcConnection() { ::close(fd_); }
  RpcConnection(const RpcConnection&) = delete;
  RpcConnection& operator=(const RpcConnection&) = delete;

  bool send_raw(const std::string& bytes) {
    for (size_t done = 0; done < bytes.size();) {
      ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  // The next reply line, or nothing when none comes within `timeout` (or the daemon closed).
  std::optional<std::string> read_line(milliseconds timeout = milliseconds(10000)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (size_t nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left =
          std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[65536];
      ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

  // The next reply, parsed; null when there is none or it is not JSON.
  Json read_reply(milliseconds timeout = milliseconds(10000)) {
    std::optional<std::string> line = read_line(timeout);
    if (!line) return nullptr;
    Json reply = Json::parse(*line, nullptr, /*allow_exceptions=*/false);
    return reply.is_discarded() ? Json(nullptr) : reply;
  }

  // One call: the whole response object.
  Json call(const std::string& method, const Json& params) {
    const int id = next_id_++;
    const Json req{{"jsonrpc", "2.0"}, {"id", id}, {"method", method}, {"params", params}};
    if (!send_raw(req.dump() + "\n")) return nullptr;
    Json reply = read_reply(milliseconds(60000));
    EXPECT_TRUE(reply.is_object() && reply.value("id", Json()) == id) << method << ": " << reply;
    return reply;
  }

 private:
  int fd_ = -1;
  std::string buffer_;
  int next_id_ = 1;
};

// One JSON-RPC call on a connection of its own.
Json rpc(const std::string& socket, const std::string& method, const Json& params) {
  RpcConnection connection(socket);
  return connection.call(method, params);
}

std::string reason_of(const Json& response) {
  if (!response.is_object() || !response.contains("error")) return "(no error)";
  return response["error"]["data"].value("reason", "(no reason)");
}

using st::nbd_read;
using st::NbdHandle;
using st::new_handle;
using st::pattern;

NbdHandle nbd_open(const std::string& uri, int* errnum = nullptr) {
  return st::nbd_connect(uri, errnum);
}

// With libnbd's own checks off, so that every request reaches the server whatever the export
// advertises.
NbdHandle nbd_open_unchecked(const std::string& uri) {
  return st::nbd_connect(uri, nullptr, {.strict = false});
}

// The attachment suite runs on both volume stores: the embedded file store and the LVM store
// (real lvm2 on a loop device, without device-mapper).
class ControlE2eTest : public ::testing::TestWithParam<std::string> {
 protected:
  virtual std::string store() const { return GetParam(); }

  void SetUp() override {
    if (store() == "lvm") {
      std::string why;
      SHAREBLK_REQUIRE(st::lvm_available(why), why);
      const std::string vg = "sbc" + std::to_string(::getpid()) + "x" +
                             std::to_string(reinterpret_cast<uintptr_t>(this) % 100000);
      vg_ = std::make_unique<st::LoopVolumeGroup>(dir_, vg, 512 * kMiB);
      ASSERT_TRUE(vg_->ok()) << vg_->why();
    }
    if (store() == "rbd") {
#if SHAREBLK_TEST_CEPH
      const std::string missing = st::CephCluster::missing_programs();
      SHAREBLK_REQUIRE(missing.empty(), "the RBD store's tests need " + missing);
      ceph_ = std::make_unique<st::CephCluster>();
      const std::string why = ceph_->start();
      ASSERT_TRUE(why.empty()) << why;
#else
      SHAREBLK_REQUIRE(false, "this build has no librbd (librbd-dev, librados-dev)");
#endif
    }
    start();
  }
  // A clean shutdown is part of every test: under the sanitizers a leak or a runtime error
  // shows up only here.
  void TearDown() override {
    if (!daemon_) return;
    const int status = daemon_->stop(SIGTERM);
    const std::string log = daemon_->log();
    EXPECT_EQ(status, 0) << log;
    EXPECT_EQ(log.find("Sanitizer"), std::string::npos) << log;
    EXPECT_EQ(log.find("runtime error"), std::string::npos) << log;
    daemon_.reset();
    vg_.reset();  // after the daemon: it may still hold the PV open
#if SHAREBLK_TEST_CEPH
    ceph_.reset();  // likewise its images
#endif
  }

  void start(const std::vector<std::string>& extra = {}) {
    daemon_.reset();
    std::vector<std::string> args{
        "--state-dir",  dir_.path().string(), "--listen-unix", nbd_socket(),
        "--listen-tcp", "127.0.0.1:0",        "--workers",     "2"};
    if (vg_) {
      args.insert(args.end(),
                  {"--store", "lvm:" + vg_->vg(), "--lvm-config", vg_->daemon_config()});
    }
#if SHAREBLK_TEST_CEPH
    if (ceph_) {
      args.insert(args.end(),
                  {"--store", "rbd:" + ceph_->pool(), "--ceph-conf", ceph_->conf_path()});
    }
#endif
    args.insert(args.end(), extra.begin(), extra.end());
    daemon_ = std::make_unique<st::Daemon>(args, control_socket());
  }

  std::string control_socket() const {
    return dir_ / "shareblk.sock";
  }
  std::string nbd_socket() const {
    return dir_ / "nbd.sock";
  }
  // The volume's bytes where its store keeps them: the file, or the PV behind the LV.
  std::string stored_bytes(const std::string& volume_id, uint64_t offset, size_t length) const {
    if (vg_) return vg_->read("volume-" + volume_id, offset, length);
#if SHAREBLK_TEST_CEPH
    if (ceph_) {  // the image as the cluster has it
      const std::string out = dir_ / ("export-" + volume_id);
      fs::remove(out);
      st::RunResult r = st::run(
          {"rbd", "-c", ceph_->conf_path(), "export", ceph_->pool() + "/volume-" + volume_id, out});
      if (r.status != 0) return "rbd export failed: " + r.output;
      return st::read_file(out, offset, length);
    }
#endif
    return st::read_file(dir_ / ("volumes/" + volume_id + ".img"), offset, length);
  }
  uint64_t stored_size(const std::string& volume_id) const {
    if (vg_) return vg_->size("volume-" + volume_id);
#if SHAREBLK_TEST_CEPH
    if (ceph_) {
      st::RunResult r = st::run({"rbd", "-c", ceph_->conf_path(), "info", "--format", "json",
                                 ceph_->pool() + "/volume-" + volume_id});
      return r.status == 0 ? Json::parse(r.output).value("size", uint64_t{0}) : 0;
    }
#endif
    return fs::file_size(dir_ / ("volumes/" + volume_id + ".img"));
  }

  Json ok(const std::string& method, const Json& params) {
    Json response = rpc(control_socket(), method, params);
    EXPECT_TRUE(response.contains("result"))
        << method << " " << params << " -> " << response << "\n"
        << daemon_->log();
    return response.value("result", Json());
  }
  std::string reason(const std::string& method, const Json& params) {
    return reason_of(rpc(control_socket(), method, params));
  }

  Json create_volume(const std::string& name, uint64_t size, bool multiattach) {
    return ok("volume_create", {{"name", name}, {"size", size}, {"multiattach", multiattach}});
  }

  // An attachment through to attached, its connector on `transport`.
  Json attach(const std::string& volume_id, const std::string& instance, const std::string& mode,
              const std::string& transport = "unix", const std::string& ip = "",
              bool multi_conn = false) {
    Json connector{{"host", "host-" + instance}, {"transport", transport}};
    if (!ip.empty()) connector["ip"] = ip;
    if (multi_conn) connector["multi_conn"] = true;
    Json a = ok("attachment_create", {{"volume_id", volume_id},
                                      {"instance_uuid", instance},
                                      {"mode", mode},
                                      {"connector", connector}});
    EXPECT_EQ(a["attach_status"], "attaching") << a;
    return ok("attachment_complete", {{"attachment_id", a["id"]}});
  }

  static std::string uri_of(const Json& attachment) {
    return attachment["connection_info"]["data"]["uri"].get<std::string>();
  }
  static std::string export_of(const Json& attachment) {
    return attachment["connection_info"]["data"]["export_name"].get<std::string>();
  }

  size_t connections(const std::string& attachment_id) {
    return ok("attachment_show", {{"attachment_id", attachment_id}})
        .value("connections", size_t{9999});
  }
  bool wait_connections(const std::string& attachment_id, size_t want) {
    return st::wait_connections(control_socket(), attachment_id, want);
  }

  st::TempDir dir_;
  std::unique_ptr<st::LoopVolumeGroup> vg_;
#if SHAREBLK_TEST_CEPH
  std::unique_ptr<st::CephCluster> ceph_;  // the rbd store's, one per test
#endif
  std::unique_ptr<st::Daemon> daemon_;
};

// --- Data paths ---

TEST_P(ControlE2eTest, DataWrittenThroughRwIsReadThroughRo) {
  const std::string vol = create_volume("shared", 4 * kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  EXPECT_NE(export_of(rw), export_of(ro));
  EXPECT_EQ(rw["connection_info"]["data"]["shareable"], true);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["status"], "in-use");

  NbdHandle writer = nbd_open(uri_of(rw));
  ASSERT_TRUE(writer) << nbd_get_error();
  NbdHandle reader = nbd_open(uri_of(ro));
  ASSERT_TRUE(reader) << nbd_get_error();
  st::expect_reader_sees_writer(writer.get(), reader.get());
  if (::testing::Test::HasFatalFailure()) return;
  // And the bytes are the volume's own.
  EXPECT_EQ(stored_bytes(vol, 0, k64K), pattern('\xab', k64K));
}

TEST_P(ControlE2eTest, ReadOnlyAttachmentRefusesEveryWrite) {
  const std::string vol = create_volume("guarded", 2 * kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  {
    NbdHandle writer = nbd_open(uri_of(rw));
    ASSERT_TRUE(writer) << nbd_get_error();
    const std::string data = pattern('\x77', 2 * kMiB);
    ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
    ASSERT_EQ(nbd_flush(writer.get(), 0), 0) << nbd_get_error();
  }
  const std::string before = stored_bytes(vol, 0, 2 * kMiB);
  ASSERT_EQ(before, pattern('\x77', 2 * kMiB));

  NbdHandle reader = nbd_open_unchecked(uri_of(ro));
  ASSERT_TRUE(reader) << nbd_get_error();
  ASSERT_EQ(nbd_is_read_only(reader.get()), 1);
  st::expect_every_write_refused(reader.get(), {{0, 512},
                                                {0, k64K},
                                                {kMiB + 4096, 4096},
                                                {123, 1000},
                                                {2 * kMiB - 512, 512},
                                                {2 * kMiB, 512},
                                                {0, 0}});
  // Flags no server accepts on these commands are refused too (the server may say EINVAL).
  const std::string junk = pattern('\x01', 4096);
  EXPECT_EQ(nbd_pwrite(reader.get(), junk.data(), 4096, 0, LIBNBD_CMD_FLAG_DF), -1);
  EXPECT_EQ(nbd_trim(reader.get(), 4096, 0, LIBNBD_CMD_FLAG_NO_HOLE), -1);
  EXPECT_EQ(nbd_zero(reader.get(), 4096, 0, LIBNBD_CMD_FLAG_REQ_ONE), -1);

  // The connection survives the refusals and still reads; flush is harmless.
  EXPECT_EQ(nbd_flush(reader.get(), 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_read(reader.get(), 0, k64K), pattern('\x77', k64K));
  reader.reset();
  EXPECT_EQ(stored_bytes(vol, 0, 2 * kMiB), before) << "a read-only write got through";
}

TEST_P(ControlE2eTest, QemuIoReadsThroughReadOnlyAttachment) {
  SHAREBLK_REQUIRE(st::have_program("qemu-io"), "qemu-io is not installed");
  const std::string vol = create_volume("qemu", 2 * kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  {
    NbdHandle writer = nbd_open(uri_of(rw));
    ASSERT_TRUE(writer) << nbd_get_error();
    const std::string data = pattern('\x5a', k64K);
    ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
    ASSERT_EQ(nbd_flush(writer.get(), 0), 0) << nbd_get_error();
  }
  st::RunResult read =
      st::run({"qemu-io", "-f", "raw", "-r", uri_of(ro), "-c", "read -P 0x5a 0 64k"});
  EXPECT_EQ(read.status, 0) << read.output;
  EXPECT_NE(read.output.find("read 65536/65536 bytes"), std::string::npos) << read.output;
  EXPECT_EQ(read.output.find("Pattern verification failed"), std::string::npos) << read.output;
  // The check above can fail: the wrong pattern is noticed.
  st::RunResult wrong =
      st::run({"qemu-io", "-f", "raw", "-r", uri_of(ro), "-c", "read -P 0x00 0 64k"});
  EXPECT_NE(wrong.output.find("Pattern verification failed"), std::string::npos) << wrong.output;

  // qemu cannot write through the read-only attachment either.
  const std::string before = stored_bytes(vol, 0, 2 * kMiB);
  st::RunResult write = st::run({"qemu-io", "-f", "raw", uri_of(ro), "-c", "write -P 0x11 0 64k"});
  EXPECT_EQ(write.output.find("wrote 65536/65536"), std::string::npos) << write.output;
  EXPECT_EQ(stored_bytes(vol, 0, 2 * kMiB), before);
}

// --- Export names are capabilities ---

TEST_P(ControlE2eTest, ExportNamesAreNeitherListedNorGuessable) {
  const std::string vol = create_volume("secret", kMiB, true)["id"];
  Json unix_rw = attach(vol, "a", "rw");
  Json tcp_ro = attach(vol, "b", "ro", "tcp");
  const std::vector<std::string> names{export_of(unix_rw), export_of(tcp_ro)};

  // NBD_OPT_LIST, on both listeners.
  for (const std::string& uri : {"nbd+unix:///?socket=" + nbd_socket(),
                                 uri_of(tcp_ro).substr(0, uri_of(tcp_ro).rfind('/') + 1)}) {
    NbdHandle h = new_handle();
    ASSERT_EQ(nbd_set_opt_mode(h.get(), true), 0);
    ASSERT_EQ(nbd_connect_uri(h.get(), uri.c_str()), 0) << uri << ": " << nbd_get_error();
    std::vector<std::string> listed;
    nbd_list_callback collect{[](void* user, const char* name, const char*) {
                                static_cast<std::vector<std::string>*>(user)->push_back(name);
                                return 0;
                              },
                              &listed, nullptr};
    const int count = nbd_opt_list(h.get(), collect);
    // A server may refuse to list at all; what it must not do is reveal a name.
    if (count != -1) {
      EXPECT_EQ(count, 0) << uri;
    }
    for (const std::string& name : listed) {
      for (const std::string& secret : names) EXPECT_EQ(name.find(secret), std::string::npos);
    }
    nbd_opt_abort(h.get());
  }
  if (st::have_program("nbdinfo")) {
    st::RunResult list = st::run({"nbdinfo", "--list", "nbd+unix:///?socket=" + nbd_socket()});
    for (const std::string& secret : names) {
      EXPECT_EQ(list.output.find(secret), std::string::npos) << list.output;
    }
  }

  // An unknown name, a near miss and the empty name are refused.
  const std::string unix_uri = uri_of(unix_rw);
  std::string near_miss = names[0];
  near_miss.back() = near_miss.back() == '0' ? '1' : '0';
  for (const std::string& name :
       {std::string("0123456789abcdef0123456789abcdef"), near_miss, std::string()}) {
    int err = 0;
    EXPECT_FALSE(nbd_open("nbd+unix:///" + name + "?socket=" + nbd_socket(), &err)) << name;
    EXPECT_EQ(err, ENOENT) << "'" << name << "' should be NBD_REP_ERR_UNKNOWN";
  }
  // A deleted attachment's name is refused from then on.
  ASSERT_TRUE(nbd_open(unix_uri)) << nbd_get_error();
  ok("attachment_delete", {{"attachment_id", unix_rw["id"]}});
  int err = 0;
  EXPECT_FALSE(nbd_open(unix_uri, &err));
  EXPECT_EQ(err, ENOENT);
  // A reserved attachment has no export yet; one that is attaching serves already.
  Json reserved = ok("attachment_create", {{"volume_id", vol}, {"instance_uuid", "c"}});
  EXPECT_EQ(reserved["connection_info"], nullptr);
  Json attaching = ok("attachment_update", {{"attachment_id", reserved["id"]},
                                            {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  EXPECT_TRUE(nbd_open(uri_of(attaching))) << nbd_get_error();
}

// --- Detach ---

TEST_P(ControlE2eTest, DeleteClosesLiveConnections) {
  const std::string vol = create_volume("detach", kMiB, false)["id"];
  Json a = attach(vol, "instance", "rw");
  const std::string id = a["id"];
  NbdHandle h = nbd_open(uri_of(a));
  ASSERT_TRUE(h) << nbd_get_error();
  const std::string data = pattern('\x42', 4096);
  ASSERT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 0, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  ASSERT_TRUE(wait_connections(id, 1)) << connections(id);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["attachments"][0]["connections"], 1);

  Json deleted = ok("attachment_delete", {{"attachment_id", id}});
  EXPECT_EQ(deleted["attach_status"], "detached");
  EXPECT_EQ(deleted["connections"], 0);
  EXPECT_EQ(connections(id), 0u);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["status"], "available");

  // The connection is gone: the handle's next request fails.
  std::string buf(4096, '\0');
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), buf.size(), 0, 0), -1);
  // The name is dead, and what was written before the detach is on the volume.
  int err = 0;
  EXPECT_FALSE(nbd_open(uri_of(a), &err));
  EXPECT_EQ(err, ENOENT);
  EXPECT_EQ(stored_bytes(vol, 0, 4096), data);

  // volume_detach does the same for the volume's one attachment.
  Json again = attach(vol, "instance", "ro");
  NbdHandle second = nbd_open(uri_of(again));
  ASSERT_TRUE(second) << nbd_get_error();
  ASSERT_TRUE(wait_connections(again["id"], 1));
  Json detached = ok("volume_detach", {{"volume_id", vol}});
  EXPECT_EQ(detached["id"], again["id"]);
  EXPECT_EQ(detached["connections"], 0);
  EXPECT_EQ(nbd_pread(second.get(), buf.data(), buf.size(), 0, 0), -1);
  EXPECT_FALSE(nbd_open(uri_of(again), &err));
  EXPECT_EQ(err, ENOENT);
}

// Requests the server has taken are answered before the connection closes, and no other is
// carried out. A client writes one chunk after another while the attachment is deleted: the
// chunks acknowledged are on the volume, and the write that failed is not.
TEST_P(ControlE2eTest, DeleteAnswersRequestsInFlight) {
  constexpr size_t kChunk = 4096;
  constexpr size_t kChunks = 16 * kMiB / kChunk;
  const std::string vol = create_volume("inflight", kChunks * kChunk, false)["id"];
  Json a = attach(vol, "instance", "rw");
  NbdHandle h = nbd_open(uri_of(a));
  ASSERT_TRUE(h) << nbd_get_error();
  ASSERT_TRUE(wait_connections(a["id"], 1));

  auto chunk = [](size_t i) { return pattern(static_cast<char>('A' + i % 26), kChunk); };
  std::atomic<size_t> acknowledged{0};
  std::latch writing(1);
  std::thread writer([&] {
    for (size_t i = 0; i < kChunks; ++i) {
      const std::string data = chunk(i);
      if (nbd_pwrite(h.get(), data.data(), kChunk, i * kChunk, LIBNBD_CMD_FLAG_FUA) == -1) break;
      acknowledged = i + 1;
      if (i == 8) writing.count_down();
    }
    if (acknowledged <= 8) writing.count_down();
  });
  writing.wait();
  Json deleted = ok("attachment_delete", {{"attachment_id", a["id"]}});
  writer.join();
  EXPECT_EQ(deleted["connections"], 0);
  ASSERT_LT(acknowledged, kChunks) << "the writer finished before the detach";

  const size_t done = acknowledged;
  const std::string bytes = stored_bytes(vol, 0, (done + 1) * kChunk);
  for (size_t i = 0; i < done; ++i) {
    ASSERT_EQ(bytes.substr(i * kChunk, kChunk), chunk(i)) << "acknowledged write " << i;
  }
  EXPECT_EQ(bytes.substr(done * kChunk, kChunk), pattern('\0', kChunk))
      << "write " << done << " failed but reached the volume";
  RecordProperty("acknowledged", static_cast<int>(done));
}

TEST_P(ControlE2eTest, ExtendIsSeenByNewConnections) {
  const std::string vol = create_volume("grow", kMiB, false)["id"];
  Json a = attach(vol, "instance", "rw");
  NbdHandle before = nbd_open(uri_of(a));
  ASSERT_TRUE(before) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(before.get()), static_cast<int64_t>(kMiB));

  Json grown = ok("volume_extend", {{"volume_id", vol}, {"size", "2M"}});
  EXPECT_EQ(grown["size"], 2 * kMiB);
  EXPECT_EQ(grown["attachments"][0]["connection_info"]["data"]["size"], 2 * kMiB);
  EXPECT_GE(stored_size(vol), 2 * kMiB);  // an LV is whole extents

  NbdHandle after = nbd_open(uri_of(a));
  ASSERT_TRUE(after) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(after.get()), static_cast<int64_t>(2 * kMiB));
  const std::string data = pattern('\x6b', 4096);
  ASSERT_EQ(nbd_pwrite(after.get(), data.data(), data.size(), kMiB + kMiB / 2, 0), 0)
      << nbd_get_error();
  ASSERT_EQ(nbd_flush(after.get(), 0), 0);
  EXPECT_EQ(stored_bytes(vol, kMiB + kMiB / 2, 4096), data);
  EXPECT_EQ(reason("volume_extend", {{"volume_id", vol}, {"size", "1M"}}), "invalid_params");
}

// A connector with multi_conn: several connections at once (without it a new one replaces the
// older ones: tests/e2e_fencing_test.cc).
TEST_P(ControlE2eTest, SeveralConnectionsPerAttachment) {
  const std::string vol = create_volume("multiconn", kMiB, false)["id"];
  Json a = attach(vol, "instance", "rw", "unix", "", /*multi_conn=*/true);
  const std::string id = a["id"];
  NbdHandle first = nbd_open(uri_of(a));
  NbdHandle second = nbd_open(uri_of(a));
  ASSERT_TRUE(first && second) << nbd_get_error();
  ASSERT_TRUE(wait_connections(id, 2)) << connections(id);

  const std::string one = pattern('\x11', 4096);
  const std::string two = pattern('\x22', 4096);
  ASSERT_EQ(nbd_pwrite(first.get(), one.data(), one.size(), 0, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_pwrite(second.get(), two.data(), two.size(), 8192, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_flush(first.get(), 0), 0);
  ASSERT_EQ(nbd_flush(second.get(), 0), 0);
  EXPECT_EQ(nbd_read(second.get(), 0, 4096), one);
  EXPECT_EQ(nbd_read(first.get(), 8192, 4096), two);

  first.reset();
  ASSERT_TRUE(wait_connections(id, 1)) << connections(id);
  Json deleted = ok("attachment_delete", {{"attachment_id", id}});
  EXPECT_EQ(deleted["connections"], 0);
  std::string buf(512, '\0');
  EXPECT_EQ(nbd_pread(second.get(), buf.data(), buf.size(), 0, 0), -1);
}

// --- TCP and the connector's address ---

// Connects from `source` (a loopback address) to the TCP export in `uri`.
NbdHandle nbd_open_tcp_from(const std::string& uri, const std::string& source) {
  // nbd://HOST:PORT/NAME
  const std::string rest = uri.substr(std::strlen("nbd://"));
  const std::string hostport = rest.substr(0, rest.find('/'));
  const std::string name = rest.substr(rest.find('/') + 1);
  const std::string host = hostport.substr(0, hostport.rfind(':'));
  const int port = std::stoi(hostport.substr(hostport.rfind(':') + 1));
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &to.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
    ADD_FAILURE() << "connect from " << source << ": " << std::strerror(errno);
    ::close(fd);
    return NbdHandle(nullptr, &nbd_close);
  }
  NbdHandle h = new_handle();
  nbd_set_export_name(h.get(), name.c_str());
  if (nbd_connect_socket(h.get(), fd) == -1) return NbdHandle(nullptr, &nbd_close);
  return h;
}

TEST_P(ControlE2eTest, TcpConnectorIpLimitsWhoConnects) {
  const std::string vol = create_volume("tcp", kMiB, true)["id"];
  Json local = attach(vol, "local", "rw", "tcp", "127.0.0.1");
  Json other = attach(vol, "other", "ro", "tcp", "127.0.0.2");
  ASSERT_EQ(uri_of(local).rfind("nbd://127.0.0.1:", 0), 0u) << uri_of(local);

  NbdHandle h = nbd_open(uri_of(local));
  ASSERT_TRUE(h) << nbd_get_error();
  const std::string data = pattern('\x3c', 4096);
  ASSERT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 0, LIBNBD_CMD_FLAG_FUA), 0);
  EXPECT_EQ(nbd_read(h.get(), 0, 4096), data);

  // From 127.0.0.1 the attachment bound to 127.0.0.2 is refused...
  EXPECT_FALSE(nbd_open(uri_of(other)));
  EXPECT_EQ(connections(other["id"]), 0u);
  // ...and reached from 127.0.0.2, which also may not use the other one.
  NbdHandle from_other = nbd_open_tcp_from(uri_of(other), "127.0.0.2");
  ASSERT_TRUE(from_other) << nbd_get_error();
  EXPECT_EQ(nbd_read(from_other.get(), 0, 4096), data);
  EXPECT_FALSE(nbd_open_tcp_from(uri_of(local), "127.0.0.2"));
}

// The connector's address is compared as an address, not as text: the IPv4-mapped form of
// 127.0.0.1 is 127.0.0.1.
TEST_P(ControlE2eTest, TcpConnectorIpIsComparedAsAnAddress) {
  const std::string vol = create_volume("mapped", kMiB, true)["id"];
  Json mapped = attach(vol, "mapped", "rw", "tcp", "::ffff:127.0.0.1");
  NbdHandle h = nbd_open(uri_of(mapped));
  EXPECT_TRUE(h) << nbd_get_error();
  Json other = attach(vol, "other", "rw", "tcp", "::ffff:127.0.0.2");
  EXPECT_FALSE(nbd_open(uri_of(other)));
}

// --- Restart ---

TEST_P(ControlE2eTest, KillNineAndRestartKeepsEverything) {
  const std::string shared = create_volume("shared", 2 * kMiB, true)["id"];
  const std::string single = create_volume("single", kMiB, false)["id"];
  const std::string spare = create_volume("spare", kMiB, false)["id"];
  Json rw = attach(shared, "writer", "rw");
  Json ro_attaching =
      ok("attachment_create", {{"volume_id", shared},
                               {"instance_uuid", "reader"},
                               {"mode", "ro"},
                               {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  Json reserved = ok("attachment_create", {{"volume_id", single}, {"instance_uuid", "later"}});
  Json gone = attach(spare, "gone", "rw");
  ok("attachment_delete", {{"attachment_id", gone["id"]}});
  const Json volumes = ok("volume_list", Json::object());
  const Json attachments = ok("attachment_list", Json::object());

  const std::string data = pattern('\x9e', k64K);
  {
    NbdHandle writer = nbd_open(uri_of(rw));
    ASSERT_TRUE(writer) << nbd_get_error();
    ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), kMiB, LIBNBD_CMD_FLAG_FUA), 0);
    // Killed with the client still connected.
    EXPECT_EQ(daemon_->stop(SIGKILL), 128 + SIGKILL);
    start();
  }

  EXPECT_EQ(ok("volume_list", Json::object()), volumes);
  EXPECT_EQ(ok("attachment_list", Json::object()), attachments);
  Json rw_after = ok("attachment_show", {{"attachment_id", rw["id"]}});
  EXPECT_EQ(rw_after["attach_status"], "attached");
  EXPECT_EQ(export_of(rw_after), export_of(rw));
  EXPECT_EQ(uri_of(rw_after), uri_of(rw));

  // The exports serve again at the same names, with the same data.
  NbdHandle writer = nbd_open(uri_of(rw));
  ASSERT_TRUE(writer) << nbd_get_error();
  EXPECT_EQ(nbd_read(writer.get(), kMiB, k64K), data);
  NbdHandle reader = nbd_open(uri_of(ro_attaching));
  ASSERT_TRUE(reader) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(reader.get()), 1);
  EXPECT_EQ(nbd_read(reader.get(), kMiB, k64K), data);
  // The detached one stays dead, and the rules still hold.
  int err = 0;
  EXPECT_FALSE(nbd_open(uri_of(gone), &err));
  EXPECT_EQ(err, ENOENT);
  EXPECT_EQ(reason("attachment_create", {{"volume_id", single}, {"instance_uuid", "x"}}),
            "not_multiattach");
  EXPECT_EQ(reason("volume_delete", {{"volume_id", shared}}), "volume_in_use");
  ok("attachment_complete", {{"attachment_id", ro_attaching["id"]}});
  EXPECT_TRUE(wait_connections(rw["id"], 1));
}

// --- The daemon's configuration ---

// The control socket is its owner's alone unless the operator says otherwise
// (--control-socket-mode, --control-socket-group: e2e_access_test.cc).
TEST_P(ControlE2eTest, ControlSocketIsOwnerOnly) {
  struct stat st {};
  ASSERT_EQ(::stat(control_socket().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_TRUE(fs::exists(dir_ / "shareblk.db"));
  if (store() == "file") {
    EXPECT_TRUE(fs::is_directory(dir_ / "volumes"));
  }
}

TEST_P(ControlE2eTest, PolicyOptionsAreEnforced) {
  const std::string shared = create_volume("shared", kMiB, true)["id"];
  const std::string boot =
      ok("volume_create",
         {{"name", "boot"}, {"size", kMiB}, {"multiattach", true}, {"bootable", true}})["id"];
  start({"--allow-multiattach-bootable", "false"});
  attach(boot, "first", "rw");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", boot}, {"instance_uuid", "second"}}),
            "policy_denied");
  attach(shared, "first", "rw");
  attach(shared, "second", "ro");

  start({"--allow-multiattach", "false"});
  EXPECT_EQ(reason("volume_create", {{"name", "v"}, {"size", kMiB}, {"multiattach", true}}),
            "policy_denied");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", shared}, {"instance_uuid", "third"}}),
            "policy_denied");
  create_volume("plain", kMiB, false);
}

TEST_P(ControlE2eTest, StopsCleanlyWithClientsConnected) {
  const std::string vol = create_volume("busy", kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro", "tcp");
  NbdHandle writer = nbd_open(uri_of(rw));
  NbdHandle reader = nbd_open(uri_of(ro));
  ASSERT_TRUE(writer && reader) << nbd_get_error();
  RpcConnection idle(control_socket());
  EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  EXPECT_EQ(daemon_->log().find("Sanitizer"), std::string::npos) << daemon_->log();
  daemon_.reset();
  std::string buf(512, '\0');
  EXPECT_EQ(nbd_pread(writer.get(), buf.data(), buf.size(), 0, 0), -1);
}

// --- Concurrency ---

TEST_P(ControlE2eTest, ConcurrentCreatesYieldExactlyOneAttachment) {
  const std::string vol = create_volume("contended", kMiB, false)["id"];
  constexpr int kCallers = 50;
  std::vector<Json> replies(kCallers);
  std::latch ready(kCallers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back([&, i] {
      RpcConnection connection(control_socket());
      ready.arrive_and_wait();  // every caller connected, then all at once
      replies[i] =
          connection.call("attachment_create",
                          {{"volume_id", vol}, {"instance_uuid", "instance-" + std::to_string(i)}});
    });
  }
  for (auto& t : threads) t.join();
  int created = 0;
  int not_multiattach = 0;
  for (const Json& reply : replies) {
    if (reply.contains("result")) ++created;
    if (reason_of(reply) == "not_multiattach") ++not_multiattach;
  }
  EXPECT_EQ(created, 1);
  EXPECT_EQ(not_multiattach, kCallers - 1);
  EXPECT_EQ(ok("attachment_list", {{"volume_id", vol}}).size(), 1u);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["status"], "reserved");
}

// --- JSON-RPC on the socket ---

TEST_P(ControlE2eTest, MalformedRequestsLeaveTheConnectionUsable) {
  RpcConnection c(control_socket());
  auto expect_parse_error = [&](const std::string& what) {
    Json reply = c.read_reply();
    ASSERT_TRUE(reply.is_object()) << what;
    EXPECT_EQ(reply["error"]["code"], -32700) << what << ": " << reply;
    EXPECT_EQ(reply["id"], nullptr) << what;
  };

  ASSERT_TRUE(c.send_raw("garbage\n"));
  expect_parse_error("garbage");
  EXPECT_TRUE(c.call("volume_list", Json::object()).contains("result"));

  ASSERT_TRUE(
      c.send_raw("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"volume_create\",\"params\":"
                 "{\"name\":\"\xc3\x28\",\"size\":\"1M\"}}\n"));
  expect_parse_error("invalid UTF-8");
  ASSERT_TRUE(c.send_raw("\xff\xfe\xfd\n"));
  expect_parse_error("bytes that are no text");
  // Valid JSON that is no valid request.
  ASSERT_TRUE(c.send_raw(R"({"jsonrpc":2.0,"id":5,"method":"volume_list"})"
                         "\n"));
  Json invalid = c.read_reply();
  EXPECT_EQ(invalid["error"]["code"], -32600) << invalid;
  EXPECT_EQ(c.call("volume_list", Json::object())["result"], Json::array());

  // Over-long lines: one error each, and nothing else.
  for (size_t size : {size_t{2} << 20, size_t{5} << 20}) {
    const std::string line =
        R"({"jsonrpc":"2.0","id":77,"method":"volume_list","params":{"pad":")" +
        std::string(size, 'x') + "\"}}\n";
    ASSERT_TRUE(c.send_raw(line));
    expect_parse_error(std::to_string(size) + "-byte line");
    Json reply = c.call("volume_list", Json::object());
    EXPECT_TRUE(reply.contains("result")) << reply;
  }

  // A batch gets an array of answers.
  ASSERT_TRUE(c.send_raw(
      R"([{"jsonrpc":"2.0","id":"a","method":"volume_list"},)"
      R"({"jsonrpc":"2.0","id":"b","method":"volume_create","params":{"name":"v","size":0}},)"
      R"({"jsonrpc":"2.0","method":"volume_list"}])"
      "\n"));
  Json batch = c.read_reply();
  ASSERT_TRUE(batch.is_array()) << batch;
  ASSERT_EQ(batch.size(), 2u) << batch;
  EXPECT_EQ(batch[0]["id"], "a");
  EXPECT_TRUE(batch[0].contains("result"));
  EXPECT_EQ(batch[1]["id"], "b");
  EXPECT_EQ(reason_of(batch[1]), "invalid_params");

  // Blank lines and notifications get no reply; requests split over writes and several in
  // one write are answered in order.
  ASSERT_TRUE(c.send_raw("\n  \n{\"jsonrpc\":\"2.0\",\"method\":\"volume_list\"}\n"));
  ASSERT_TRUE(c.send_raw(R"({"jsonrpc":"2.0","id":101,)"));
  std::this_thread::sleep_for(milliseconds(20));
  ASSERT_TRUE(c.send_raw(R"("method":"volume_list"})"
                         "\n"
                         R"({"jsonrpc":"2.0","id":102,"method":"no_such_method"})"
                         "\n"));
  Json first = c.read_reply();
  Json second = c.read_reply();
  EXPECT_EQ(first["id"], 101) << first;
  EXPECT_TRUE(first.contains("result")) << first;
  EXPECT_EQ(second["id"], 102) << second;
  EXPECT_EQ(second["error"]["code"], -32601) << second;
  // Nothing else is pending.
  EXPECT_FALSE(c.read_line(milliseconds(200)).has_value());
}

// --- The CLI ---

INSTANTIATE_TEST_SUITE_P(Stores, ControlE2eTest, ::testing::Values("file", "lvm", "rbd"),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param;
                         });

// The CLI does not depend on the store: it runs on the file store only.
class ControlCliTest : public ControlE2eTest {
 protected:
  std::string store() const override { return "file"; }
  st::RunResult cli(std::vector<std::string> args, const std::string& socket = "") {
    std::vector<std::string> argv{SHAREBLK_CLI_PATH, "--socket",
                                  socket.empty() ? control_socket() : socket};
    argv.insert(argv.end(), args.begin(), args.end());
    return st::run(argv, seconds(30));
  }
};

TEST_F(ControlCliTest, CommandsTablesAndJson) {
  st::RunResult created = cli({"volume-create", "cli-vol", "2M", "--multiattach"});
  ASSERT_EQ(created.status, 0) << created.output;
  EXPECT_NE(created.output.find("cli-vol"), std::string::npos) << created.output;

  st::RunResult listed = cli({"--json", "volume-list"});
  ASSERT_EQ(listed.status, 0) << listed.output;
  Json volumes = Json::parse(listed.output, nullptr, false);
  ASSERT_TRUE(volumes.is_array()) << listed.output;
  ASSERT_EQ(volumes.size(), 1u);
  EXPECT_EQ(volumes[0]["name"], "cli-vol");
  EXPECT_EQ(volumes[0]["size"], 2 * kMiB);
  EXPECT_EQ(volumes[0]["multiattach"], true);
  const std::string vol = volumes[0]["id"];

  st::RunResult table = cli({"volume-list"});
  ASSERT_EQ(table.status, 0) << table.output;
  EXPECT_NE(table.output.find(vol), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("available"), std::string::npos) << table.output;

  // An attachment through the CLI, used by a real client.
  st::RunResult attached = cli({"--json", "attachment-create", vol, "instance-1", "--mode", "ro",
                                "--connector-host", "h1", "--transport", "unix"});
  ASSERT_EQ(attached.status, 0) << attached.output;
  Json a = Json::parse(attached.output, nullptr, false);
  ASSERT_TRUE(a.is_object()) << attached.output;
  EXPECT_EQ(a["mode"], "ro");
  EXPECT_EQ(a["attach_status"], "attaching");
  NbdHandle h = nbd_open(uri_of(a));
  ASSERT_TRUE(h) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(h.get()), 1);

  st::RunResult raw =
      cli({"--json", "call", "attachment_show", Json{{"attachment_id", a["id"]}}.dump()});
  ASSERT_EQ(raw.status, 0) << raw.output;
  EXPECT_EQ(Json::parse(raw.output, nullptr, false)["id"], a["id"]) << raw.output;

  st::RunResult shown = cli({"attachment-show", a["id"]});
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_NE(shown.output.find(uri_of(a)), std::string::npos) << shown.output;
  EXPECT_EQ(cli({"attachment-complete", a["id"]}).status, 0);
  st::RunResult in_use = cli({"volume-update", vol, "--multiattach", "false"});
  EXPECT_EQ(in_use.status, 1) << in_use.output;
  EXPECT_NE(in_use.output.find("volume_in_use"), std::string::npos) << in_use.output;
  st::RunResult detached = cli({"--json", "volume-detach", vol});
  ASSERT_EQ(detached.status, 0) << detached.output;
  EXPECT_EQ(Json::parse(detached.output, nullptr, false)["attach_status"], "detached")
      << detached.output;
  std::string buf(512, '\0');
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), buf.size(), 0, 0), -1);
  EXPECT_EQ(cli({"volume-update", vol, "--multiattach", "false", "--name", "renamed"}).status, 0);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["name"], "renamed");
}

// Volumes by name or id prefix, attachments by id prefix: what an operator types. Two matches
// are a usage error that lists them, and no call is made.
TEST_F(ControlCliTest, VolumesAndAttachmentsAreFoundByNameOrUniqueIdPrefix) {
  const std::string alpha = create_volume("alpha", kMiB, true)["id"];
  create_volume("twin", kMiB, false);
  create_volume("twin", kMiB, false);
  st::RunResult by_name = cli({"--json", "volume-show", "alpha"});
  ASSERT_EQ(by_name.status, 0) << by_name.output;
  EXPECT_EQ(Json::parse(by_name.output)["id"], alpha);
  st::RunResult by_prefix = cli({"--json", "volume-show", alpha.substr(0, 13)});
  ASSERT_EQ(by_prefix.status, 0) << by_prefix.output;
  EXPECT_EQ(Json::parse(by_prefix.output)["id"], alpha);

  st::RunResult twins = cli({"volume-delete", "twin"});
  EXPECT_EQ(twins.status, 2) << twins.output;
  EXPECT_NE(twins.output.find("'twin' matches 2 volumes"), std::string::npos) << twins.output;
  EXPECT_EQ(ok("volume_list", Json::object()).size(), 3u) << "nothing was deleted";

  st::RunResult attached = cli({"--json", "attachment-create", "alpha", "vm-1"});
  ASSERT_EQ(attached.status, 0) << attached.output;
  const std::string a = Json::parse(attached.output)["id"];
  EXPECT_EQ(Json::parse(attached.output)["volume_id"], alpha);
  st::RunResult shown = cli({"--json", "attachment-show", a.substr(0, 8)});
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_EQ(Json::parse(shown.output)["id"], a);
  st::RunResult gone = cli({"volume-show", "no-such-volume"});
  EXPECT_EQ(gone.status, 1) << gone.output;
  EXPECT_NE(gone.output.find("not_found"), std::string::npos) << gone.output;
}

// `shareblk help` lists every command; each has --help with a usage line and an example, and a
// missing argument names it.
TEST_F(ControlCliTest, EveryCommandHasHelpWithAnExample) {
  st::RunResult help = cli({"help"});
  ASSERT_EQ(help.status, 0) << help.output;
  std::vector<std::string> commands;
  std::istringstream lines(help.output);
  std::string line;
  while (std::getline(lines, line) && line != "commands:") {
  }
  while (std::getline(lines, line) && !line.empty()) {
    if (line.starts_with("  ")) {
      const std::string name = line.substr(2, line.find(' ', 2) - 2);
      if (name != "call" && name != "help") commands.push_back(name);
    }
  }
  EXPECT_GE(commands.size(), 15u) << help.output;
  for (const std::string& c : commands) {
    st::RunResult r = cli({c, "--help"});
    EXPECT_EQ(r.status, 0) << c << ": " << r.output;
    EXPECT_NE(r.output.find("usage: shareblk [--socket PATH] [--json] " + c), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("  shareblk " + c), std::string::npos) << "no example: " << r.output;
    EXPECT_EQ(cli({"help", c}).output, r.output);
  }
  st::RunResult missing = cli({"volume-show"});
  EXPECT_EQ(missing.status, 2);
  EXPECT_NE(missing.output.find("volume-show: missing VOLUME"), std::string::npos)
      << missing.output;
  st::RunResult old = cli({"volume_list"});
  EXPECT_EQ(old.status, 0) << old.output;
  EXPECT_NE(old.output.find("'volume_list' is now 'volume-list'"), std::string::npos);
}

TEST_F(ControlCliTest, ExitStatusTellsWhatWentWrong) {
  const std::string vol = create_volume("v", kMiB, false)["id"];
  ok("attachment_create", {{"volume_id", vol}, {"instance_uuid", "i"}});

  // Refused by the daemon: 1, with the reason.
  st::RunResult in_use = cli({"volume-delete", vol});
  EXPECT_EQ(in_use.status, 1) << in_use.output;
  EXPECT_NE(in_use.output.find("volume_in_use"), std::string::npos) << in_use.output;
  st::RunResult bad_size = cli({"volume-create", "x", "1000"});
  EXPECT_EQ(bad_size.status, 1) << bad_size.output;
  EXPECT_NE(bad_size.output.find("invalid_params"), std::string::npos) << bad_size.output;
  st::RunResult missing = cli({"volume-show", "00000000-0000-4000-8000-000000000000"});
  EXPECT_EQ(missing.status, 1) << missing.output;
  EXPECT_NE(missing.output.find("not_found"), std::string::npos) << missing.output;
  EXPECT_EQ(ok("volume_list", Json::object()).size(), 1u);

  // Bad usage: 2, without a call.
  EXPECT_EQ(cli({"volume-frobnicate"}).status, 2);
  EXPECT_EQ(cli({"volume-show"}).status, 2);
  EXPECT_EQ(cli({}).status, 2);

  // No daemon: 3.
  st::RunResult unreachable = cli({"volume-list"}, dir_ / "nobody-listens.sock");
  EXPECT_EQ(unreachable.status, 3) << unreachable.output;
}

// --- Limits: a client beyond what the daemon can serve is refused, and the daemon goes on ---

class ControlLimitsTest : public ControlE2eTest {
 protected:
  std::string store() const override { return "file"; }
};

// The refusal a control client gets instead of service: one error line, then end of file.
void expect_refused(RpcConnection& c, const std::string& why) {
  Json reply = c.read_reply();
  ASSERT_TRUE(reply.is_object()) << "no refusal";
  EXPECT_EQ(reason_of(reply), "internal") << reply;
  EXPECT_NE(reply["error"].value("message", "").find(why), std::string::npos) << reply;
  EXPECT_FALSE(c.read_line(milliseconds(2000))) << "the refused connection stayed open";
}

// A control connection that has been served a call, so that it counts against the limit. A
// client that has just closed (the readiness probe of st::Daemon, a one-shot rpc()) still
// counts until the daemon's thread for it has seen it go, so a refusal is tried again for a
// while; a connection that is never served comes back null.
std::unique_ptr<RpcConnection> served_connection(const std::string& socket) {
  const auto deadline = std::chrono::steady_clock::now() + seconds(10);
  do {
    auto c = std::make_unique<RpcConnection>(socket);
    if (c->send_raw(R"({"jsonrpc":"2.0","id":0,"method":"volume_list"})"
                    "\n") &&
        c->read_reply().contains("result")) {
      return c;
    }
    std::this_thread::sleep_for(milliseconds(20));
  } while (std::chrono::steady_clock::now() < deadline);
  return nullptr;
}

TEST_F(ControlLimitsTest, ClientsBeyondTheLimitAreRefusedAndLaterOnesServed) {
  start({"--max-control-connections", "4"});
  std::vector<std::unique_ptr<RpcConnection>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(served_connection(control_socket()));
    ASSERT_TRUE(held.back()) << "connection " << i << " of 4 was never served";
  }
  {
    RpcConnection fifth(control_socket());
    ASSERT_NO_FATAL_FAILURE(expect_refused(fifth, "too many control connections (4 at once)"));
  }
  // One client leaves: its place is free again once the daemon has seen it go.
  held.pop_back();
  bool served = false;
  for (int i = 0; i < 100 && !served; ++i) {
    // A refused connection may be closed before the request is even sent.
    RpcConnection next(control_socket());
    served = next.send_raw(R"({"jsonrpc":"2.0","id":1,"method":"volume_list"})"
                           "\n") &&
             next.read_reply().contains("result");
    if (!served) std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(served) << daemon_->log();
  for (auto& c : held) EXPECT_TRUE(c->call("volume_list", Json::object()).contains("result"));
}

// The CLI reports the daemon's refusal of its connection with the reason and status 1, as any
// refusal. It used to send its request after the daemon had closed the connection, fail, and
// report status 3 ("cannot send to shareblkd"), as if no daemon were there.
TEST_F(ControlLimitsTest, TheCliReportsTheRefusalOfItsConnection) {
  start({"--max-control-connections", "2"});
  std::vector<std::unique_ptr<RpcConnection>> held;
  for (int i = 0; i < 2; ++i) {
    held.push_back(served_connection(control_socket()));
    ASSERT_TRUE(held.back()) << "connection " << i << " of 2 was never served";
  }
  for (int i = 0; i < 5; ++i) {
    const st::RunResult refused =
        st::run({SHAREBLK_CLI_PATH, "--socket", control_socket(), "volume-list"}, seconds(30));
    EXPECT_EQ(refused.status, 1) << refused.output;
    EXPECT_NE(refused.output.find("internal: too many control connections (2 at once)"),
              std::string::npos)
        << refused.output;
  }
}

// The daemon moved into a cgroup (v1 pids controller) whose limit it can be held at, so that
// starting a thread fails.
class PidsCgroup {
 public:
  explicit PidsCgroup(pid_t pid) : pid_(pid) {
    std::error_code ec;
    if (!fs::exists(root_ / "cgroup.procs", ec)) return;
    dir_ = root_ / ("shareblk-test-" + std::to_string(::getpid()));
    if (!fs::create_directory(dir_, ec) && ec) {
      dir_.clear();
      return;
    }
    ok_ = write(dir_ / "cgroup.procs", std::to_string(pid_));
  }
  ~PidsCgroup() {
    if (ok_) write(root_ / "cgroup.procs", std::to_string(pid_));
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  PidsCgroup(const PidsCgroup&) = delete;
  PidsCgroup& operator=(const PidsCgroup&) = delete;

  bool ok() const { return ok_; }
  // No task (thread) more than the daemon has now, or "max".
  bool hold() { return write(dir_ / "pids.max", st::read_file(dir_ / "pids.current", 0, 32)); }
  bool release() { return write(dir_ / "pids.max", "max"); }

 private:
  static bool write(const fs::path& file, const std::string& value) {
    FILE* f = std::fopen(file.c_str(), "w");
    if (f == nullptr) return false;
    const bool ok = std::fputs(value.c_str(), f) >= 0;
    return std::fclose(f) == 0 && ok;
  }
  const fs::path root_ = "/sys/fs/cgroup/pids";
  fs::path dir_;
  pid_t pid_;
  bool ok_ = false;
};

// Every control client and every NBD handshake runs on a thread of its own. When none can be
// started (a pids limit such as systemd's TasksMax, or no memory) the client is refused; the
// daemon used to abort (an uncaught std::system_error).
TEST_F(ControlLimitsTest, NoThreadForAClientRefusesItAndTheDaemonGoesOn) {
  const std::string vol = create_volume("v", kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  RpcConnection served(control_socket());
  ASSERT_TRUE(served.call("volume_list", Json::object()).contains("result"));

  PidsCgroup cgroup(daemon_->pid());
  SHAREBLK_REQUIRE(cgroup.ok(), "a writable cgroup v1 pids controller at /sys/fs/cgroup/pids");
  ASSERT_TRUE(cgroup.hold());
  for (int i = 0; i < 3; ++i) {
    RpcConnection refused(control_socket());
    ASSERT_NO_FATAL_FAILURE(expect_refused(refused, "cannot serve another control connection now"));
  }
  int errnum = 0;
  EXPECT_FALSE(nbd_open(uri_of(rw), &errnum)) << "an NBD handshake ran without a thread";

  // Alive and still serving what it served.
  EXPECT_TRUE(served.call("volume_list", Json::object()).contains("result")) << daemon_->log();
  ASSERT_TRUE(cgroup.release());
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["id"], vol);
  NbdHandle h = nbd_open(uri_of(rw));
  ASSERT_TRUE(h) << nbd_get_error();
  const std::string data = pattern(3, 4096);
  EXPECT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_read(h.get(), 0, data.size()), data);
}

TEST_F(ControlLimitsTest, DeeplyNestedRequestsAreRefusedAndTheDaemonGoesOn) {
  RpcConnection c(control_socket());
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string lines[] = {
      R"({"jsonrpc":"2.0","id":)" + deep + R"(,"method":"volume_list"})",
      R"({"jsonrpc":"2.0","id":1,"method":"volume_list","params":{"x":)" + deep + "}}",
      "[" + deep + "]",
  };
  for (const std::string& line : lines) {
    ASSERT_TRUE(c.send_raw(line + "\n"));
    Json reply = c.read_reply();
    ASSERT_TRUE(reply.is_object()) << "no reply; daemon log:\n" << daemon_->log();
    EXPECT_EQ(reply["error"]["code"], -32600) << reply;
    EXPECT_EQ(reason_of(reply), "invalid_params") << reply;
  }
  EXPECT_TRUE(c.call("volume_list", Json::object()).contains("result"));
}

// A revocation notice goes out from inside attachment_delete, under the volume's lock, which
// then waits for the subscriber to let go. A subscriber that takes no replies (here: a batch of
// 2,000 calls it never reads) used to hold the delete, and every other change to that volume,
// until it went away. It holds it at most the 10 s a subscriber has to let go (docs/api.md);
// then its link is cut, which a subscriber takes as a revocation.
TEST_F(ControlLimitsTest, ASubscriberThatDoesNotReadDoesNotHoldADelete) {
  const std::string vol = create_volume("v", kMiB, true)["id"];
  Json a = attach(vol, "writer", "rw");
  RpcConnection subscriber(control_socket());
  ASSERT_TRUE(
      subscriber.call("export_resolve", {{"export_name", export_of(a)}}).contains("result"));
  Json batch = Json::array();
  for (int i = 0; i < 2000; ++i) {
    batch.push_back({{"jsonrpc", "2.0"},
                     {"id", i},
                     {"method", "attachment_show"},
                     {"params", {{"attachment_id", a["id"]}}}});
  }
  ASSERT_TRUE(subscriber.send_raw(batch.dump() + "\n"));
  std::this_thread::sleep_for(milliseconds(500));  // its reply now fills the socket

  const auto start = std::chrono::steady_clock::now();
  ok("attachment_delete", {{"attachment_id", a["id"]}});
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(12));
  EXPECT_EQ(ok("volume_extend", {{"volume_id", vol}, {"size", "2M"}})["size"], 2 * kMiB);
  // The subscriber's link is closed: what was sent before the cut, then end of file.
  bool closed = false;
  for (int i = 0; i < 100000 && !closed; ++i) closed = !subscriber.read_line(seconds(5));
  EXPECT_TRUE(closed);
}

// Every nbdkit connection holds a control connection (its subscription) for its whole life.
// With one per NBD client through nbdkit, enough clients would take every control connection
// and lock the operators out; subscriptions are capped below the limit instead.
TEST_F(ControlLimitsTest, SubscribersLeaveControlConnectionsForOperators) {
  start({"--max-control-connections", "8"});  // 4 of them for subscribers at most
  const std::string vol = create_volume("v", kMiB, true)["id"];
  Json a = attach(vol, "writer", "rw");
  std::vector<std::unique_ptr<RpcConnection>> subscribers;
  for (int i = 0; i < 4; ++i) {
    subscribers.push_back(served_connection(control_socket()));
    ASSERT_TRUE(subscribers.back()) << "connection " << i << " was never served";
    Json reply = subscribers.back()->call("export_resolve", {{"export_name", export_of(a)}});
    ASSERT_TRUE(reply.contains("result")) << reply;
  }
  std::unique_ptr<RpcConnection> fifth = served_connection(control_socket());
  ASSERT_TRUE(fifth);
  Json refused = fifth->call("export_resolve", {{"export_name", export_of(a)}});
  EXPECT_EQ(reason_of(refused), "internal") << refused;
  // The remaining connections serve operators.
  std::vector<std::unique_ptr<RpcConnection>> operators;
  for (int i = 0; i < 3; ++i) {
    operators.push_back(served_connection(control_socket()));
    EXPECT_TRUE(operators.back()) << "operator " << i << " of 3 was never served";
  }
  // A subscriber that goes away makes room for another.
  subscribers.pop_back();
  bool resolved = false;
  for (int i = 0; i < 100 && !resolved; ++i) {
    resolved = fifth->call("export_resolve", {{"export_name", export_of(a)}}).contains("result");
    if (!resolved) std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(resolved);
}

}  // namespace
