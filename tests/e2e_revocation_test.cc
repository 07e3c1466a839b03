// Revocation never waits for the disk (issue 19): with the state directory's file system
// full, attachment_delete still cuts the attachment's clients off and refuses its name, says
// no_space, and a restart (even after kill -9) finds the attachment detached. A takeover on a
// full disk, or whose flush fails, never leaves a writer the API misreports (issue 40).
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/control_client.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace fs = std::filesystem;
namespace st = shareblk::testing;
using Json = nlohmann::json;

class FullDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(st::is_root(), "needs root to mount a small tmpfs as the state directory");
    fs::create_directory(state());
    ASSERT_EQ(st::run({"mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", state()}).status, 0);
    mounted_ = true;
  }
  void TearDown() override {
    if (daemon_) daemon_->stop(SIGTERM);
    daemon_.reset();
    if (mounted_) st::run({"umount", state()});
  }
  std::string state() const { return dir_ / "state"; }
  std::string control() const { return state() + "/shareblk.sock"; }
  void start(const std::vector<std::string>& env = {}) {
    std::vector<std::string> launcher;
    if (!env.empty()) launcher.emplace_back("env");
    launcher.insert(launcher.end(), env.begin(), env.end());
    daemon_ = std::make_unique<st::Daemon>(
        std::vector<std::string>{"--state-dir", state(), "--listen-unix", dir_ / "nbd.sock",
                                 "--workers", "1"},
        control(), launcher);
  }
  void fill() {
    std::ofstream filler(state() + "/filler", std::ios::binary);
    const std::string block(64 * 1024, 'x');
    while (filler.write(block.data(), block.size())) {
    }
  }
  // Fills the file system, then uses up the database's free pages: its next change fails.
  void fill_database() {
    fill();
    Json refused;
    for (int i = 0; i < 100; ++i) {
      refused =
          st::rpc(control(), "volume_create", {{"name", std::string(200, 'n')}, {"size", 512}});
      if (refused.contains("error")) break;
    }
    ASSERT_EQ(refused["error"]["data"]["reason"], "no_space") << refused;
  }

  st::TempDir dir_;
  bool mounted_ = false;
  std::unique_ptr<st::Daemon> daemon_;
};

TEST_F(FullDiskTest, DetachRevokesAtOnceAndAStartAfterKillFindsItDetached) {
  start();
  const std::string volume =
      st::rpc_ok(control(), "volume_create", {{"name", "v"}, {"size", "1M"}})["id"];
  Json a = st::rpc_ok(control(), "attachment_create",
                      {{"volume_id", volume},
                       {"instance_uuid", "i"},
                       {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  const std::string id = a["id"];
  const std::string uri = a["connection_info"]["data"]["uri"];
  st::rpc_ok(control(), "attachment_complete", {{"attachment_id", id}});
  int err = 0;
  st::NbdHandle client = st::nbd_connect(uri, &err);
  ASSERT_TRUE(client) << err;
  const std::string before(4096, 'a');
  ASSERT_EQ(nbd_pwrite(client.get(), before.data(), before.size(), 0, 0), 0) << nbd_get_error();

  fill_database();

  Json detach = st::rpc(control(), "attachment_delete", {{"attachment_id", id}});
  EXPECT_EQ(detach["error"]["data"]["reason"], "no_space") << detach;
  EXPECT_NE(detach["error"].value("message", "").find("is revoked"), std::string::npos) << detach;
  // Fenced all the same: the client's connection is gone and its name admits no one.
  const std::string after(4096, 'b');
  EXPECT_NE(nbd_pwrite(client.get(), after.data(), after.size(), 0, 0), 0);
  EXPECT_FALSE(st::nbd_connect(uri, &err));
  EXPECT_EQ(err, ENOENT);

  // A crash now, and a start with room again: the attachment is detached, never live again.
  daemon_->stop(SIGKILL);
  fs::remove(state() + "/filler");
  start();
  Json shown = st::rpc_ok(control(), "attachment_show", {{"attachment_id", id}});
  EXPECT_EQ(shown["attach_status"], "detached") << shown;
  EXPECT_FALSE(st::nbd_connect(uri, &err));
  EXPECT_EQ(err, ENOENT);
  // What the client had written and flushed before is there; nothing after.
  Json b = st::rpc_ok(control(), "attachment_create",
                      {{"volume_id", volume},
                       {"instance_uuid", "j"},
                       {"connector", {{"host", "h2"}, {"transport", "unix"}}}});
  st::NbdHandle reader = st::nbd_connect(b["connection_info"]["data"]["uri"], &err);
  ASSERT_TRUE(reader) << err;
  EXPECT_EQ(st::nbd_read(reader.get(), 0, before.size()), before);
}

// A single-writer volume with two attachments, A the writer and B a standby, each with an
// NBD client; each has written (or been refused) once, so that a later write of either lands
// on a block the file system already holds, even when it is full.
class TakeoverFaultTest : public FullDiskTest {
 protected:
  struct Side {
    std::string id;
    std::string uri;
    st::NbdHandle nbd{nullptr, nbd_close};
    uint64_t offset = 0;
  };

  void make_volume() {
    volume_ = st::rpc_ok(
        control(), "volume_create",
        {{"name", "v"}, {"size", "1M"}, {"multiattach", true}, {"writer_policy", "single"}})["id"];
    for (size_t i = 0; i < 2; ++i) {
      Json a = st::rpc_ok(control(), "attachment_create",
                          {{"volume_id", volume_},
                           {"instance_uuid", i == 0 ? "node-a" : "node-b"},
                           {"connector", {{"host", "h"}, {"transport", "unix"}}}});
      st::rpc_ok(control(), "attachment_complete", {{"attachment_id", a["id"]}});
      sides_[i].id = a["id"];
      sides_[i].uri = a["connection_info"]["data"]["uri"];
      sides_[i].offset = i * 4096;
    }
    connect();
    // A writes both blocks now; B's turn comes with its takeovers.
    for (const Side& s : sides_) {
      const std::string data(4096, 'w');
      ASSERT_EQ(nbd_pwrite(sides_[0].nbd.get(), data.data(), data.size(), s.offset, 0), 0)
          << nbd_get_error();
    }
    ASSERT_EQ(writer(), sides_[0].id);
  }
  void connect() {
    for (Side& s : sides_) {
      int err = 0;
      s.nbd = st::nbd_connect(s.uri, &err);
      EXPECT_TRUE(s.nbd) << s.id << ": " << std::strerror(err);
    }
  }
  std::string writer() {
    const Json v = st::rpc_ok(control(), "volume_show", {{"volume_id", volume_}});
    return v["writer"].is_null() ? "" : v["writer"].get<std::string>();
  }
  // volume_show's writer, after checking that each attachment's write_access is what its NBD
  // client finds when it writes (and that the writer is the one that writes).
  std::string writer_as_io_finds() {
    const Json v = st::rpc_ok(control(), "volume_show", {{"volume_id", volume_}});
    const std::string shown = v["writer"].is_null() ? "" : v["writer"].get<std::string>();
    for (const Side& s : sides_) {
      bool access = false;
      for (const Json& a : v["attachments"]) {
        if (a["id"] == s.id) access = a["write_access"];
      }
      const std::string data(4096, s.id == sides_[0].id ? 'a' : 'b');
      const bool wrote =
          s.nbd && nbd_pwrite(s.nbd.get(), data.data(), data.size(), s.offset, 0) == 0;
      EXPECT_EQ(wrote, access) << s.id << ": write_access " << access << ", its write "
                               << (wrote   ? "landed"
                                   : s.nbd ? nbd_get_error()
                                           : "(no connection)")
                               << "\n"
                               << v;
      EXPECT_EQ(wrote, s.id == shown) << s.id << " vs writer " << shown;
    }
    return shown;
  }
  // The writer a volume_takeover's answer names: its result's, or its error's data.writer.
  static std::string reported_writer(const Json& reply) {
    const Json& named =
        reply.contains("error") ? reply["error"]["data"]["writer"] : reply["result"]["writer"];
    return named.is_string() ? named.get<std::string>() : "";
  }
  Json takeover(const Side& to) {
    return st::rpc(control(), "volume_takeover",
                   {{"volume_id", volume_}, {"attachment_id", to.id}});
  }
  void restart(const std::vector<std::string>& env = {}) {
    daemon_->stop(SIGKILL);
    for (Side& s : sides_) s.nbd.reset();
    start(env);
    connect();
  }

  std::string volume_;
  std::array<Side, 2> sides_;
};

// With the state directory full, a takeover completes all the same: the revocation journal
// records the new writer where the database cannot. Every answer agrees with what the clients
// can do, a restart (kill -9) keeps the writer last reported, and takeovers both ways work
// once there is room again.
TEST_F(TakeoverFaultTest, OnAFullDiskATakeoverCompletesAndARestartKeepsIt) {
  start();
  ASSERT_NO_FATAL_FAILURE(make_volume());
  Side& a = sides_[0];
  Side& b = sides_[1];
  ASSERT_NO_FATAL_FAILURE(fill_database());

  const Json to_b = takeover(b);
  EXPECT_FALSE(to_b.contains("error")) << to_b;
  EXPECT_EQ(reported_writer(to_b), b.id) << to_b;
  EXPECT_EQ(writer_as_io_finds(), b.id);
  EXPECT_NE(daemon_->log().find("the revocation journal holds it"), std::string::npos);

  restart();  // the disk still full
  EXPECT_EQ(writer_as_io_finds(), b.id);
  EXPECT_NE(daemon_->log().find("the database cannot record it yet"), std::string::npos);

  fs::remove(state() + "/filler");
  const Json to_a = takeover(a);
  EXPECT_EQ(reported_writer(to_a), a.id) << to_a;
  EXPECT_EQ(writer_as_io_finds(), a.id);
  const Json back = takeover(b);
  EXPECT_EQ(reported_writer(back), b.id) << back;
  EXPECT_EQ(writer_as_io_finds(), b.id);
  restart();
  EXPECT_EQ(writer_as_io_finds(), b.id);
}

// Without a revocation journal (it could not be made at start) a takeover that the database
// cannot record changes nothing: the old writer writes on, and the error says so.
TEST_F(TakeoverFaultTest, OnAFullDiskWithoutAJournalATakeoverChangesNothing) {
  fs::create_directory(state() + "/revocations");  // where the journal's file would be
  start();
  ASSERT_NO_FATAL_FAILURE(make_volume());
  Side& a = sides_[0];
  Side& b = sides_[1];
  ASSERT_NO_FATAL_FAILURE(fill_database());

  const Json to_b = takeover(b);
  EXPECT_EQ(to_b["error"]["data"]["reason"], "no_space") << to_b;
  EXPECT_EQ(reported_writer(to_b), a.id) << to_b;
  EXPECT_EQ(writer_as_io_finds(), a.id);
  restart();
  EXPECT_EQ(writer_as_io_finds(), a.id);

  fs::remove(state() + "/filler");
  EXPECT_EQ(reported_writer(takeover(b)), b.id);
  EXPECT_EQ(writer_as_io_finds(), b.id);
}

// A flush that fails (EIO, injected: SHAREBLK_TEST_FAIL_FLUSH) does not hold the fence: the
// takeover completes and says, as internal with data.writer, that the flush failed and who
// writes. A restart (kill -9) keeps the writer last reported, the same holds back the other way
// while the fault lasts, and takeovers work normally once it is gone.
TEST_F(TakeoverFaultTest, AFailedFlushStillMovesTheWriterAndSaysWho) {
  SHAREBLK_REQUIRE_TEST_HOOKS();
  const std::vector<std::string> env{"SHAREBLK_TEST_FAIL_FLUSH=" + (dir_ / "flush-fails")};
  start(env);
  ASSERT_NO_FATAL_FAILURE(make_volume());
  Side& a = sides_[0];
  Side& b = sides_[1];
  std::ofstream(dir_ / "flush-fails").put('x');

  const Json to_b = takeover(b);
  EXPECT_EQ(to_b["error"]["data"]["reason"], "internal") << to_b;
  EXPECT_EQ(reported_writer(to_b), b.id) << to_b;
  EXPECT_EQ(writer_as_io_finds(), b.id);
  restart(env);
  EXPECT_EQ(writer_as_io_finds(), b.id);

  const Json to_a = takeover(a);
  EXPECT_EQ(to_a["error"]["data"]["reason"], "internal") << to_a;
  EXPECT_EQ(reported_writer(to_a), a.id) << to_a;
  EXPECT_EQ(writer_as_io_finds(), a.id);

  fs::remove(dir_ / "flush-fails");
  const Json again = takeover(b);
  EXPECT_FALSE(again.contains("error")) << again;
  EXPECT_EQ(writer_as_io_finds(), b.id);
  const Json back = takeover(a);
  EXPECT_FALSE(back.contains("error")) << back;
  EXPECT_EQ(writer_as_io_finds(), a.id);
}

}  // namespace
