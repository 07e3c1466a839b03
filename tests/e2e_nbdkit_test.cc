// The nbdkit plugin end to end: a real shareblkd in managed mode, a real nbdkit serving its
// attachments through nbdkit-shareblk-plugin.so, and real clients (libnbd, qemu-io) on
// nbdkit's socket. The same checks as for shareblkd's own listener, plus what only the plugin
// has: revocation by notification, a daemon that goes away, and nbdkit's own TLS.
//
// One test loads the plugin into this process instead, to call the callbacks nbdkit itself
// never calls for a read-only export (its write callbacks), with a stand-in for nbdkit's API.
#define NBDKIT_API_VERSION 2
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <libnbd.h>
#include <nbdkit-plugin.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"
#include "tests/nbd_client.h"
#include "tests/nbdkit_child.h"
#include "tests/support.h"
#include "tests/takeover_writer.h"

namespace {

namespace st = shareblk::testing;
using Json = nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr uint64_t kMiB = 1 << 20;
constexpr size_t k64K = 64 * 1024;

// --- libnbd ---

using st::nbd_read;
using st::NbdHandle;
using st::new_handle;
using st::pattern;

// Asking for base:allocation. `strict` false turns libnbd's own checks off, so every request
// reaches the server whatever the export advertises.
NbdHandle nbd_open(const std::string& uri, int* errnum = nullptr, bool strict = true) {
  return st::nbd_connect(uri, errnum, {.strict = strict, .base_allocation = true});
}

// errno of one read that must fail (0 if it succeeded).
int read_errno(nbd_handle* h) {
  std::string data(4096, '\0');
  return nbd_pread(h, data.data(), data.size(), 0, 0) == -1 ? nbd_get_errno() : 0;
}

// base:allocation of the extent at `offset`: NBD_STATE_HOLE | NBD_STATE_ZERO bits, or -1.
int64_t block_status_at(nbd_handle* h, uint64_t offset, uint64_t length) {
  struct Found {
    int64_t flags = -1;
  } found;
  nbd_extent_callback callback{
      [](void* user, const char* context, uint64_t, uint32_t* entries, size_t count, int*) {
        auto* f = static_cast<Found*>(user);
        if (std::strcmp(context, LIBNBD_CONTEXT_BASE_ALLOCATION) == 0 && count >= 2) {
          f->flags = entries[1];
        }
        return 0;
      },
      &found, nullptr};
  if (nbd_block_status(h, length, offset, callback, LIBNBD_CMD_FLAG_REQ_ONE) == -1) {
    ADD_FAILURE() << "nbd_block_status: " << nbd_get_error();
  }
  return found.flags;
}

// --- nbdkit ---

using st::Nbdkit;
using st::nbdkit_environment;

// Random bytes as hex: a PSK key, or nothing anyone could guess.
std::string random_hex(size_t bytes) {
  std::random_device source;
  std::string out;
  for (size_t i = 0; i < bytes; ++i) {
    char two[3];
    std::snprintf(two, sizeof two, "%02x", source() & 0xff);
    out += two;
  }
  return out;
}

class NbdkitE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(st::have_program("nbdkit"), "nbdkit is not installed");
    start_daemon();
  }

  // Clean shutdowns are part of every test: under the sanitizers a leak or a runtime error in
  // the plugin or the daemon shows up only here.
  void TearDown() override {
    if (nbdkit_) {
      const int status = nbdkit_->stop(SIGTERM);
      const std::string log = nbdkit_->log();
      EXPECT_EQ(status, 0) << log;
      EXPECT_EQ(log.find("Sanitizer"), std::string::npos) << log;
      EXPECT_EQ(log.find("runtime error"), std::string::npos) << log;
    }
    if (daemon_) {
      const int status = daemon_->stop(SIGTERM);
      const std::string log = daemon_->log();
      EXPECT_EQ(status, 0) << log;
      EXPECT_EQ(log.find("Sanitizer"), std::string::npos) << log;
      EXPECT_EQ(log.find("runtime error"), std::string::npos) << log;
    }
  }

  void start_daemon() {
    daemon_.reset();
    daemon_ = std::make_unique<st::Daemon>(
        std::vector<std::string>{"--state-dir", state_dir(), "--listen-unix", nbd_socket(),
                                 "--workers", "2"},
        control_socket());
  }

  // nbdkit with the plugin on kit.sock; `options` go before the plugin, `control` after it.
  void start_nbdkit(const std::vector<std::string>& options = {}, std::string control = "") {
    nbdkit_.reset();
    if (control.empty()) control = control_socket();
    std::vector<std::string> args{"--unix", kit_socket()};
    args.insert(args.end(), options.begin(), options.end());
    args.push_back(NBDKIT_PLUGIN_PATH);
    args.push_back("control=" + control);
    nbdkit_ = std::make_unique<Nbdkit>(args, dir_ / "kit.pid", dir_ / "kit.log");
  }

  std::string state_dir() const { return dir_ / "var"; }
  std::string control_socket() const { return dir_ / "var/shareblk.sock"; }
  std::string nbd_socket() const { return dir_ / "nbd.sock"; }
  std::string kit_socket() const { return dir_ / "kit.sock"; }
  std::string backing(const std::string& volume_id) const {
    return dir_ / ("var/volumes/" + volume_id + ".img");
  }
  // An export name through nbdkit.
  std::string kit_uri(const std::string& export_name) const {
    return "nbd+unix:///" + export_name + "?socket=" + kit_socket();
  }

  Json ok(const std::string& method, const Json& params) {
    return st::rpc_ok(control_socket(), method, params);
  }

  std::string create_volume(const std::string& name, uint64_t size, bool multiattach = true) {
    return ok("volume_create",
              {{"name", name}, {"size", size}, {"multiattach", multiattach}})["id"];
  }

  // An attachment through to attached, on the Unix transport (so connection_info has its
  // export name).
  Json attach(const std::string& volume_id, const std::string& instance, const std::string& mode) {
    Json a = ok("attachment_create",
                {{"volume_id", volume_id},
                 {"instance_uuid", instance},
                 {"mode", mode},
                 {"connector", {{"host", "host-" + instance}, {"transport", "unix"}}}});
    return ok("attachment_complete", {{"attachment_id", a["id"]}});
  }

  static std::string export_of(const Json& attachment) {
    return attachment["connection_info"]["data"]["export_name"];
  }
  // The same attachment on shareblkd's own listener.
  static std::string shareblkd_uri(const Json& attachment) {
    return attachment["connection_info"]["data"]["uri"];
  }

  st::TempDir dir_;
  std::unique_ptr<st::Daemon> daemon_;
  std::unique_ptr<Nbdkit> nbdkit_;
};

// --- Data paths ---

TEST_F(NbdkitE2eTest, DataWrittenThroughRwIsReadThroughRo) {
  const std::string vol = create_volume("shared", 4 * kMiB);
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  start_nbdkit();

  NbdHandle writer = nbd_open(kit_uri(export_of(rw)));
  ASSERT_TRUE(writer) << nbd_get_error() << nbdkit_->log();
  NbdHandle reader = nbd_open(kit_uri(export_of(ro)));
  ASSERT_TRUE(reader) << nbd_get_error();
  st::expect_reader_sees_writer(writer.get(), reader.get());
  if (::testing::Test::HasFatalFailure()) return;
  const std::string first = pattern('\xab', k64K);
  const std::string second = pattern('\xcd', 4096);
  // The bytes are the volume's own, and shareblkd's listener serves the same ones: both
  // frontends go through one backend.
  EXPECT_EQ(st::read_file(backing(vol), 0, k64K), first);
  NbdHandle direct = nbd_open(shareblkd_uri(ro));
  ASSERT_TRUE(direct) << nbd_get_error();
  EXPECT_EQ(nbd_read(direct.get(), 3 * kMiB + 512, 4096), second);

  // Several connections per attachment (multi-conn), each writing its own range at once; one
  // flush, and the reader sees all of it.
  constexpr int kWriters = 4;
  std::vector<std::thread> threads;
  for (int i = 0; i < kWriters; ++i) {
    threads.emplace_back([&, i] {
      NbdHandle h = nbd_open(kit_uri(export_of(rw)));
      ASSERT_TRUE(h) << nbd_get_error();
      const std::string data = pattern(static_cast<char>('0' + i), k64K);
      for (uint64_t at = kMiB + i * 4 * k64K; at < kMiB + (i + 1) * 4 * k64K; at += k64K) {
        ASSERT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), at, 0), 0) << nbd_get_error();
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(nbd_flush(writer.get(), 0), 0) << nbd_get_error();
  for (int i = 0; i < kWriters; ++i) {
    EXPECT_EQ(nbd_read(reader.get(), kMiB + i * 4 * k64K, 4 * k64K),
              pattern(static_cast<char>('0' + i), 4 * k64K))
        << "writer " << i;
  }
}

TEST_F(NbdkitE2eTest, CapabilitiesAreTruthful) {
  const std::string vol = create_volume("caps", 4 * kMiB);
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  start_nbdkit();

  NbdHandle writer = nbd_open(kit_uri(export_of(rw)));
  ASSERT_TRUE(writer) << nbd_get_error();
  EXPECT_EQ(nbd_can_multi_conn(writer.get()), 1);
  EXPECT_EQ(nbd_can_fua(writer.get()), 1);
  EXPECT_EQ(nbd_can_trim(writer.get()), 1);
  EXPECT_EQ(nbd_can_zero(writer.get()), 1);
  EXPECT_EQ(nbd_can_fast_zero(writer.get()), 1);
  EXPECT_EQ(nbd_can_flush(writer.get()), 1);
  EXPECT_EQ(nbd_can_meta_context(writer.get(), LIBNBD_CONTEXT_BASE_ALLOCATION), 1);
  NbdHandle reader = nbd_open(kit_uri(export_of(ro)));
  ASSERT_TRUE(reader) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(reader.get()), 1);
  EXPECT_EQ(nbd_can_multi_conn(reader.get()), 1);

  // What they advertise works, FUA included, and extents tell data from holes.
  const std::string data = pattern('\x3c', k64K);
  ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), 0, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), kMiB, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), 2 * kMiB, 0), 0);
  EXPECT_EQ(st::read_file(backing(vol), 0, k64K), data);
  EXPECT_EQ(block_status_at(reader.get(), 0, k64K), 0) << "data";
  EXPECT_EQ(block_status_at(reader.get(), 3 * kMiB, k64K), LIBNBD_STATE_HOLE | LIBNBD_STATE_ZERO);

  ASSERT_EQ(nbd_trim(writer.get(), k64K, kMiB, LIBNBD_CMD_FLAG_FUA), 0) << nbd_get_error();
  EXPECT_EQ(block_status_at(reader.get(), kMiB, k64K), LIBNBD_STATE_HOLE | LIBNBD_STATE_ZERO);
  EXPECT_EQ(nbd_read(reader.get(), kMiB, k64K), pattern('\0', k64K));
  // Zeroes, fast or allocated. (How an allocated zero range looks to SEEK_HOLE is the file
  // system's business: ext4 may call its unwritten extents holes.)
  ASSERT_EQ(nbd_zero(writer.get(), k64K, 2 * kMiB, LIBNBD_CMD_FLAG_FAST_ZERO), 0)
      << nbd_get_error();
  EXPECT_EQ(nbd_read(reader.get(), 2 * kMiB, k64K), pattern('\0', k64K));
  ASSERT_EQ(nbd_zero(writer.get(), 4096, 0, LIBNBD_CMD_FLAG_NO_HOLE | LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  EXPECT_EQ(nbd_read(reader.get(), 0, 8192), pattern('\0', 4096) + pattern('\x3c', 4096));

  // Ranges past the end are refused as shareblkd refuses them.
  EXPECT_EQ(nbd_pwrite(writer.get(), data.data(), 4096, 4 * kMiB - 512, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ENOSPC) << nbd_get_error();

  // An extended volume is seen at its new size by new connections.
  ok("volume_extend", {{"volume_id", vol}, {"size", 8 * kMiB}});
  NbdHandle grown = nbd_open(kit_uri(export_of(rw)));
  ASSERT_TRUE(grown) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(grown.get()), static_cast<int64_t>(8 * kMiB));
}

TEST_F(NbdkitE2eTest, ReadOnlyAttachmentRefusesEveryWrite) {
  const std::string vol = create_volume("guarded", 2 * kMiB);
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  start_nbdkit();
  {
    NbdHandle writer = nbd_open(kit_uri(export_of(rw)));
    ASSERT_TRUE(writer) << nbd_get_error();
    const std::string data = pattern('\x77', 2 * kMiB);
    ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
    ASSERT_EQ(nbd_flush(writer.get(), 0), 0) << nbd_get_error();
  }
  const std::string before = st::read_file(backing(vol), 0, 2 * kMiB);
  ASSERT_EQ(before, pattern('\x77', 2 * kMiB));

  NbdHandle reader = nbd_open(kit_uri(export_of(ro)), nullptr, /*strict=*/false);
  ASSERT_TRUE(reader) << nbd_get_error();
  ASSERT_EQ(nbd_is_read_only(reader.get()), 1);
  st::expect_every_write_refused(reader.get(), {{0, 512},
                                                {0, k64K},
                                                {kMiB + 4096, 4096},
                                                {123, 1000},
                                                {2 * kMiB - 512, 512},
                                                {2 * kMiB, 512}});
  // The connection survives the refusals and still reads; flush is harmless.
  EXPECT_EQ(nbd_flush(reader.get(), 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_read(reader.get(), 0, k64K), pattern('\x77', k64K));
  reader.reset();
  EXPECT_EQ(st::read_file(backing(vol), 0, 2 * kMiB), before) << "a read-only write got through";
}

TEST_F(NbdkitE2eTest, QemuIoReadsThroughReadOnlyAttachment) {
  SHAREBLK_REQUIRE(st::have_program("qemu-io"), "qemu-io is not installed");
  const std::string vol = create_volume("qemu", 2 * kMiB);
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  start_nbdkit();

  st::RunResult write =
      st::run({"qemu-io", "-f", "raw", kit_uri(export_of(rw)), "-c", "write -P 0x5a 0 64k"});
  ASSERT_EQ(write.status, 0) << write.output;
  ASSERT_NE(write.output.find("wrote 65536/65536 bytes"), std::string::npos) << write.output;

  st::RunResult read =
      st::run({"qemu-io", "-f", "raw", "-r", kit_uri(export_of(ro)), "-c", "read -P 0x5a 0 64k"});
  EXPECT_EQ(read.status, 0) << read.output;
  EXPECT_NE(read.output.find("read 65536/65536 bytes"), std::string::npos) << read.output;
  EXPECT_EQ(read.output.find("Pattern verification failed"), std::string::npos) << read.output;
  // The check above can fail: the wrong pattern is noticed.
  st::RunResult wrong =
      st::run({"qemu-io", "-f", "raw", "-r", kit_uri(export_of(ro)), "-c", "read -P 0x00 0 64k"});
  EXPECT_NE(wrong.output.find("Pattern verification failed"), std::string::npos) << wrong.output;

  // qemu cannot write through the read-only attachment either.
  const std::string before = st::read_file(backing(vol), 0, 2 * kMiB);
  st::RunResult refused =
      st::run({"qemu-io", "-f", "raw", kit_uri(export_of(ro)), "-c", "write -P 0x11 0 64k"});
  EXPECT_EQ(refused.output.find("wrote 65536/65536"), std::string::npos) << refused.output;
  EXPECT_EQ(st::read_file(backing(vol), 0, 2 * kMiB), before);
}

// --- Revocation ---

// attachment_delete does not wait for nbdkit: it tells the plugin, which refuses the
// attachment's connections from their next request on, and new connections by that name.
TEST_F(NbdkitE2eTest, DeleteRefusesConnectedHandlesFromTheNextRequest) {
  const std::string vol = create_volume("revoke", 2 * kMiB);
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  start_nbdkit();
  NbdHandle writer = nbd_open(kit_uri(export_of(rw)));
  NbdHandle second = nbd_open(kit_uri(export_of(rw)));
  NbdHandle reader = nbd_open(kit_uri(export_of(ro)));
  ASSERT_TRUE(writer && second && reader) << nbd_get_error();
  const std::string data = pattern('\x42', 4096);
  ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), 0, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  ASSERT_EQ(read_errno(second.get()), 0);

  const auto started = std::chrono::steady_clock::now();
  Json deleted = ok("attachment_delete", {{"attachment_id", rw["id"]}});
  EXPECT_EQ(deleted["attach_status"], "detached");
  EXPECT_LT(std::chrono::steady_clock::now() - started, seconds(5))
      << "attachment_delete waited for nbdkit's connections";

  // No retry, no wait: the very next request of each connection is refused.
  EXPECT_EQ(read_errno(writer.get()), ESHUTDOWN) << nbd_get_error();
  EXPECT_EQ(read_errno(second.get()), ESHUTDOWN) << nbd_get_error();
  const std::string late = pattern('\x99', 4096);
  EXPECT_EQ(nbd_pwrite(second.get(), late.data(), late.size(), 8192, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ESHUTDOWN) << nbd_get_error();
  EXPECT_EQ(nbd_flush(writer.get(), 0), -1);
  EXPECT_EQ(nbd_zero(writer.get(), 4096, 0, 0), -1);
  EXPECT_EQ(st::read_file(backing(vol), 0, 4096), data);
  EXPECT_EQ(st::read_file(backing(vol), 8192, 4096), pattern('\0', 4096));
  // And stays refused.
  EXPECT_EQ(read_errno(writer.get()), ESHUTDOWN);

  // The name is dead for new connections; the other attachment is untouched.
  int err = 0;
  EXPECT_FALSE(nbd_open(kit_uri(export_of(rw)), &err));
  EXPECT_EQ(err, ENOENT);
  EXPECT_EQ(nbd_read(reader.get(), 0, 4096), data);
  EXPECT_TRUE(nbdkit_->running());
}

// The plugin serves a single-writer volume's standby read-only; at a takeover both attachments'
// connections are told to let go (ESHUTDOWN from their next request), and clients that
// connect again get the new roles: the new writer writes, the old one is read-only.
TEST_F(NbdkitE2eTest, TakeoverMakesThePluginsClientsConnectAgainInTheirNewRoles) {
  const std::string vol = ok("volume_create", {{"name", "pair"},
                                               {"size", 2 * kMiB},
                                               {"multiattach", true},
                                               {"writer_policy", "single"}})["id"];
  Json a = attach(vol, "node-a", "rw");
  Json b = attach(vol, "node-b", "rw");
  start_nbdkit();
  NbdHandle ha = nbd_open(kit_uri(export_of(a)));
  NbdHandle hb = nbd_open(kit_uri(export_of(b)));
  ASSERT_TRUE(ha && hb) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(ha.get()), 0);
  EXPECT_EQ(nbd_is_read_only(hb.get()), 1) << "a standby through nbdkit is read-only";
  const std::string data = pattern('\x61', 4096);
  ASSERT_EQ(nbd_pwrite(ha.get(), data.data(), data.size(), 0, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();

  ok("volume_takeover", {{"volume_id", vol}, {"attachment_id", b["id"]}});
  EXPECT_EQ(read_errno(ha.get()), ESHUTDOWN) << nbd_get_error();
  EXPECT_EQ(read_errno(hb.get()), ESHUTDOWN) << nbd_get_error();
  const std::string late = pattern('\x7a', 4096);
  EXPECT_EQ(nbd_pwrite(ha.get(), late.data(), late.size(), 0, 0), -1);
  EXPECT_EQ(st::read_file(backing(vol), 0, 4096), data);

  ha = nbd_open(kit_uri(export_of(a)));
  hb = nbd_open(kit_uri(export_of(b)));
  ASSERT_TRUE(ha && hb) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(ha.get()), 1);
  EXPECT_EQ(nbd_is_read_only(hb.get()), 0);
  const std::string mine = pattern('\x62', 4096);
  EXPECT_EQ(nbd_pwrite(hb.get(), mine.data(), mine.size(), 4096, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  EXPECT_EQ(st::read_file(backing(vol), 4096, 4096), mine);
  EXPECT_EQ(nbd_read(ha.get(), 4096, 4096), mine);
}

// The same through nbdkit and the plugin: the old writer's nbdkit connection is told to let
// go, and the takeover returns only once its writes in flight are done; from then on it gets
// ESHUTDOWN (EPERM for a write that had passed the plugin's check as its gate closed). Each run the
// writer connects afresh (its old connection is refused for good).
TEST_F(NbdkitE2eTest, ATakeoverFencesAWriterThroughThePlugin) {
  const std::string vol = ok("volume_create", {{"name", "pair"},
                                               {"size", 4 * kMiB},
                                               {"multiattach", true},
                                               {"writer_policy", "single"}})["id"];
  const Json a = attach(vol, "node-a", "rw");
  const Json b = attach(vol, "node-b", "rw");
  start_nbdkit();
  auto through_kit = [&](const Json& att) { return nbd_open(kit_uri(export_of(att))); };
  // The new writer's own connections, on shareblkd's listener.
  NbdHandle direct_a = nbd_open(shareblkd_uri(a)), direct_b = nbd_open(shareblkd_uri(b));
  ASSERT_TRUE(direct_a && direct_b);
  std::mt19937 random(20261126);
  st::TakeoverFigures f;
  for (int run = 1; run <= 50; ++run) {
    const bool a_writes = run % 2 == 1;
    NbdHandle writer = through_kit(a_writes ? a : b);
    ASSERT_TRUE(writer) << nbd_get_error();
    ASSERT_EQ(nbd_is_read_only(writer.get()), 0) << "run " << run;
    st::takeover_run(control_socket(), vol, (a_writes ? b : a)["id"], writer.get(),
                     a_writes ? direct_b.get() : direct_a.get(), run, ESHUTDOWN, random, f);
  }
  f.print("takeover under a QD32 writer (nbdkit plugin)");
  EXPECT_EQ(f.violations, 0u);
  EXPECT_GT(f.refused, 0u);
}

// A daemon that goes away is an error for the plugin's clients, never a crash of nbdkit: the
// plugin can no longer learn of revocations, so it refuses, and serves again once the daemon
// is back.
TEST_F(NbdkitE2eTest, DaemonGoingAwayIsAnErrorNotACrash) {
  const std::string vol = create_volume("restart", kMiB);
  Json rw = attach(vol, "writer", "rw");
  start_nbdkit();
  NbdHandle h = nbd_open(kit_uri(export_of(rw)));
  ASSERT_TRUE(h) << nbd_get_error();
  const std::string data = pattern('\x24', 4096);
  ASSERT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 0, LIBNBD_CMD_FLAG_FUA), 0);

  ASSERT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  daemon_.reset();
  EXPECT_EQ(read_errno(h.get()), ESHUTDOWN) << nbd_get_error();
  EXPECT_FALSE(nbd_open(kit_uri(export_of(rw))));
  EXPECT_TRUE(nbdkit_->running()) << nbdkit_->log();

  // The attachments survive the restart, and nbdkit resolves them again.
  start_daemon();
  EXPECT_EQ(read_errno(h.get()), ESHUTDOWN) << "a connection resolved by the old daemon";
  NbdHandle again = nbd_open(kit_uri(export_of(rw)));
  ASSERT_TRUE(again) << nbd_get_error() << nbdkit_->log();
  EXPECT_EQ(nbd_read(again.get(), 0, 4096), data);
}

TEST_F(NbdkitE2eTest, BadControlPathRefusesClientsAndBadConfigStopsNbdkit) {
  const std::string vol = create_volume("bad", kMiB);
  Json rw = attach(vol, "writer", "rw");
  start_nbdkit({}, dir_ / "no-such.sock");
  int err = 0;
  EXPECT_FALSE(nbd_open(kit_uri(export_of(rw)), &err));
  EXPECT_TRUE(nbdkit_->running());
  EXPECT_NE(nbdkit_->log().find("cannot connect to shareblkd's control socket"), std::string::npos)
      << nbdkit_->log();

  // Configuration mistakes stop nbdkit at start, with the reason.
  const std::vector<std::string> base{"nbdkit", "--foreground", "--unix", dir_ / "other.sock",
                                      NBDKIT_PLUGIN_PATH};
  auto run_nbdkit = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    const std::vector<std::string> environment = nbdkit_environment();
    if (!environment.empty()) {
      argv.insert(argv.begin(), environment.begin(), environment.end());
      argv.insert(argv.begin(), "env");
    }
    return st::run(argv, seconds(30));
  };
  st::RunResult missing = run_nbdkit({});
  EXPECT_NE(missing.status, 0);
  EXPECT_NE(missing.output.find("control=PATH"), std::string::npos) << missing.output;
  st::RunResult unknown = run_nbdkit({"control=" + control_socket(), "colour=blue"});
  EXPECT_NE(unknown.status, 0);
  EXPECT_NE(unknown.output.find("colour"), std::string::npos) << unknown.output;
  st::RunResult too_long = run_nbdkit({"control=/" + std::string(200, 'x')});
  EXPECT_NE(too_long.status, 0);
  EXPECT_NE(too_long.output.find("too long"), std::string::npos) << too_long.output;
}

// --- TLS ---

// nbdkit's own TLS in front of the plugin: a PSK client reads and writes, a client without TLS
// or with the wrong key is refused.
TEST_F(NbdkitE2eTest, TlsPskThroughNbdkit) {
  const std::string vol = create_volume("tls", 2 * kMiB);
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  const std::string psk_dir = dir_ / "psk";
  std::filesystem::create_directory(psk_dir);
  const std::string psk = psk_dir + "/keys.psk";  // the name qemu's tls-creds-psk looks for
  {
    std::ofstream out(psk);
    out << "alice:" << random_hex(32) << "\n";
  }
  ::chmod(psk.c_str(), 0600);
  start_nbdkit({"--tls=require", "--tls-psk=" + psk});

  auto tls_open = [&](const std::string& export_name, const std::string& key_file,
                      int tls) -> NbdHandle {
    NbdHandle h = new_handle();
    if (nbd_set_tls(h.get(), tls) == -1 || nbd_set_export_name(h.get(), export_name.c_str()) == -1)
      return NbdHandle(nullptr, &nbd_close);
    if (tls != LIBNBD_TLS_DISABLE && (nbd_set_tls_psk_file(h.get(), key_file.c_str()) == -1 ||
                                      nbd_set_tls_username(h.get(), "alice") == -1)) {
      return NbdHandle(nullptr, &nbd_close);
    }
    if (nbd_connect_unix(h.get(), kit_socket().c_str()) == -1)
      return NbdHandle(nullptr, &nbd_close);
    return h;
  };

  NbdHandle writer = tls_open(export_of(rw), psk, LIBNBD_TLS_REQUIRE);
  ASSERT_TRUE(writer) << nbd_get_error() << nbdkit_->log();
  EXPECT_EQ(nbd_get_tls_negotiated(writer.get()), 1);
  const std::string data = pattern('\x6e', k64K);
  ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_flush(writer.get(), 0), 0) << nbd_get_error();
  NbdHandle reader = tls_open(export_of(ro), psk, LIBNBD_TLS_REQUIRE);
  ASSERT_TRUE(reader) << nbd_get_error();
  EXPECT_EQ(nbd_read(reader.get(), 0, k64K), data);
  EXPECT_EQ(nbd_pwrite(reader.get(), data.data(), 4096, 0, 0), -1) << "read-only under TLS too";

  // No TLS, or the wrong key: refused.
  EXPECT_FALSE(tls_open(export_of(rw), psk, LIBNBD_TLS_DISABLE)) << "a client without TLS";
  EXPECT_FALSE(nbd_open(kit_uri(export_of(rw))));
  const std::string wrong = dir_ / "wrong.psk";
  {
    std::ofstream out(wrong);
    out << "alice:" << random_hex(32) << "\n";
  }
  EXPECT_FALSE(tls_open(export_of(rw), wrong, LIBNBD_TLS_REQUIRE)) << "a client with another key";

  // qemu's PSK client too.
  if (st::have_program("qemu-io")) {
    const std::string image = "driver=nbd,server.type=unix,server.path=" + kit_socket() +
                              ",export=" + export_of(ro) + ",tls-creds=tls0";
    st::RunResult read =
        st::run({"qemu-io", "--object",
                 "tls-creds-psk,id=tls0,endpoint=client,username=alice,dir=" + psk_dir, "-r",
                 "--image-opts", image, "-c", "read -P 0x6e 0 64k"});
    EXPECT_EQ(read.status, 0) << read.output;
    EXPECT_NE(read.output.find("read 65536/65536 bytes"), std::string::npos) << read.output;
    EXPECT_EQ(read.output.find("Pattern verification failed"), std::string::npos) << read.output;
  }
}

}  // namespace

// --- The plugin in this process ---

// nbdkit's API as far as the plugin uses it, so that its callbacks can be called directly,
// the ones nbdkit never calls for a read-only export included. The test binary exports these
// (ENABLE_EXPORTS), as nbdkit's binary does.
namespace plugin_host {
std::string export_name;
thread_local int last_error = 0;
}  // namespace plugin_host

extern "C" {
const char* nbdkit_export_name(void) {
  return plugin_host::export_name.c_str();
}
void nbdkit_set_error(int err) {
  plugin_host::last_error = err;
}
void nbdkit_error(const char* fs, ...) {
  va_list args;
  va_start(args, fs);
  std::vfprintf(stderr, fs, args);
  va_end(args);
  std::fputc('\n', stderr);
}
void nbdkit_debug(const char*, ...) {}
char* nbdkit_absolute_path(const char* path) {
  return ::strdup(path);
}
int nbdkit_add_extent(nbdkit_extents*, uint64_t, uint64_t, uint32_t) {
  return 0;
}
}

namespace {

class PluginInProcessTest : public NbdkitE2eTest {
 protected:
  void SetUp() override {
    NbdkitE2eTest::SetUp();
    library_ = ::dlopen(NBDKIT_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(library_, nullptr) << ::dlerror();
    auto init = reinterpret_cast<nbdkit_plugin* (*)()>(::dlsym(library_, "plugin_init"));
    ASSERT_NE(init, nullptr) << ::dlerror();
    plugin_ = init();
    ASSERT_STREQ(plugin_->name, "shareblk");
    ASSERT_EQ(plugin_->config("control", control_socket().c_str()), 0);
    ASSERT_EQ(plugin_->config_complete(), 0);
  }
  void TearDown() override {
    if (library_ != nullptr) ::dlclose(library_);
    NbdkitE2eTest::TearDown();
  }

  void* open(const std::string& export_name) {
    plugin_host::export_name = export_name;
    return plugin_->open(0);
  }

  void* library_ = nullptr;
  nbdkit_plugin* plugin_ = nullptr;
};

// nbdkit refuses writes to an export whose can_write is false before the plugin sees them;
// the plugin's own write callbacks refuse them too, in the backend.
TEST_F(PluginInProcessTest, ReadOnlyHandleRefusesWritesEvenWhenAsked) {
  const std::string vol = create_volume("inproc", kMiB);
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  void* writer = open(export_of(rw));
  void* reader = open(export_of(ro));
  ASSERT_NE(writer, nullptr);
  ASSERT_NE(reader, nullptr);
  EXPECT_EQ(plugin_->can_write(writer), 1);
  EXPECT_EQ(plugin_->can_write(reader), 0);
  EXPECT_EQ(plugin_->get_size(reader), static_cast<int64_t>(kMiB));
  plugin_host::export_name.clear();
  EXPECT_EQ(plugin_->open(1), nullptr) << "the empty export name";

  const std::string data = pattern('\x51', 4096);
  ASSERT_EQ(plugin_->pwrite(writer, data.data(), 4096, 0, NBDKIT_FLAG_FUA), 0);
  const std::string junk = pattern('\x01', 4096);
  plugin_host::last_error = 0;
  EXPECT_EQ(plugin_->pwrite(reader, junk.data(), 4096, 0, 0), -1);
  EXPECT_EQ(plugin_host::last_error, EPERM);
  plugin_host::last_error = 0;
  EXPECT_EQ(plugin_->trim(reader, 4096, 0, NBDKIT_FLAG_FUA), -1);
  EXPECT_EQ(plugin_host::last_error, EPERM);
  for (uint32_t flags : {0u, unsigned{NBDKIT_FLAG_MAY_TRIM}, unsigned{NBDKIT_FLAG_FAST_ZERO}}) {
    plugin_host::last_error = 0;
    EXPECT_EQ(plugin_->zero(reader, 4096, 0, flags), -1);
    EXPECT_EQ(plugin_host::last_error, EPERM) << flags;
  }
  EXPECT_EQ(st::read_file(backing(vol), 0, 4096), data);
  std::string buf(4096, '\0');
  EXPECT_EQ(plugin_->pread(reader, buf.data(), 4096, 0, 0), 0);
  EXPECT_EQ(buf, data);

  // Revocation is exact: the request right after attachment_delete returns is refused.
  ok("attachment_delete", {{"attachment_id", rw["id"]}});
  plugin_host::last_error = 0;
  EXPECT_EQ(plugin_->pread(writer, buf.data(), 4096, 0, 0), -1);
  EXPECT_EQ(plugin_host::last_error, ESHUTDOWN);
  EXPECT_EQ(plugin_->pread(reader, buf.data(), 4096, 0, 0), 0);
  plugin_->close(writer);
  plugin_->close(reader);
}

}  // namespace
