// What the end-to-end control plane suite (e2e_control_tests) shares: its fixture and clients.
//
// The control plane end to end: a real shareblkd in managed mode, driven through its control
// socket and the shareblk CLI, with real NBD clients (libnbd, qemu-io, nbdinfo) on the
// attachments' connection_info. The attachment contract (Stores/ControlE2eTest) is in
// tests/e2e_control_data_test.cc and tests/e2e_control_daemon_test.cc, the CLI in
// tests/e2e_control_cli_test.cc, and clients beyond what the daemon can serve in
// tests/e2e_control_overload_test.cc.
#pragma once

#include <gtest/gtest.h>
#include <libnbd.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#if SHAREBLK_TEST_CEPH
#include "tests/ceph_cluster.h"
#endif
#include "tests/control_client.h"
#include "tests/lvm_fixture.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace shareblk::testing::control_e2e {

namespace fs = std::filesystem;
namespace st = shareblk::testing;
using Json = nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

inline constexpr uint64_t kMiB = 1 << 20;
inline constexpr size_t k64K = 64 * 1024;

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
inline Json rpc(const std::string& socket, const std::string& method, const Json& params) {
  RpcConnection connection(socket);
  return connection.call(method, params);
}

inline std::string reason_of(const Json& response) {
  if (!response.is_object() || !response.contains("error")) return "(no error)";
  return response["error"]["data"].value("reason", "(no reason)");
}

using st::nbd_read;
using st::NbdHandle;
using st::new_handle;
using st::pattern;

inline NbdHandle nbd_open(const std::string& uri, int* errnum = nullptr) {
  return st::nbd_connect(uri, errnum);
}

// With libnbd's own checks off, so that every request reaches the server whatever the export
// advertises.
inline NbdHandle nbd_open_unchecked(const std::string& uri) {
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

}  // namespace shareblk::testing::control_e2e
