// Revocation never waits for the disk (issue 19): with the state directory's file system
// full, attachment_delete still cuts the attachment's clients off and refuses its name, says
// no_space, and a restart (even after kill -9) finds the attachment detached.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>

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
  void start() {
    daemon_ = std::make_unique<st::Daemon>(
        std::vector<std::string>{"--state-dir", state(), "--listen-unix", dir_ / "nbd.sock",
                                 "--workers", "1"},
        control());
  }
  void fill() {
    std::ofstream filler(state() + "/filler", std::ios::binary);
    const std::string block(64 * 1024, 'x');
    while (filler.write(block.data(), block.size())) {
    }
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

  fill();
  Json refused;
  for (int i = 0; i < 100; ++i) {  // the database's free pages run out first
    refused = st::rpc(control(), "volume_create", {{"name", std::string(200, 'n')}, {"size", 512}});
    if (refused.contains("error")) break;
  }
  ASSERT_EQ(refused["error"]["data"]["reason"], "no_space") << refused;

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

}  // namespace
