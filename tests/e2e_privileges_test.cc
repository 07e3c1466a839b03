// shareblkd --user and --group (docs/install.md, "Hardening"): started as root, the daemon binds
// and opens everything, gives its state to the user and drops root for good; it then serves
// the control socket and NBD, and reads only what that user may read. Also what a build without
// the test hooks does with SHAREBLK_TEST_KILL_AT.
#include <gtest/gtest.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
namespace fs = std::filesystem;
using Json = nlohmann::json;

// The fields of /proc/PID/status (or of one of its threads'), by name without the colon.
std::map<std::string, std::string> proc_status(const std::string& path) {
  std::map<std::string, std::string> fields;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string value = line.substr(colon + 1);
    value.erase(0, value.find_first_not_of(" \t"));
    value.erase(value.find_last_not_of(" \t") + 1);  // Groups: ends with a space
    fields[line.substr(0, colon)] = value;
  }
  return fields;
}

// Waits up to 10 s for `needle` in the daemon's log.
bool wait_for_log(const st::Daemon& daemon, const std::string& needle) {
  for (int i = 0; i < 200; ++i) {
    if (daemon.log().find(needle) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

uid_t owner(const fs::path& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 ? st.st_uid : static_cast<uid_t>(-1);
}

class PrivilegesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(st::is_root(), "needs root (the daemon drops it)");
    const passwd* pw = ::getpwnam("nobody");
    SHAREBLK_REQUIRE(pw != nullptr, "no user nobody");
    uid_ = pw->pw_uid;
    gid_ = pw->pw_gid;
    // Where the test's files live: a directory anyone may enter, as /tmp is.
    fs::permissions(files_.path(),
                    fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  }
  void TearDown() override {
    if (daemon_) {
      EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
    }
  }
  void start(const std::vector<std::string>& extra) {
    if (daemon_) {
      ASSERT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
    }
    std::vector<std::string> args{
        "--state-dir",  state_.path().string(), "--listen-unix", files_ / "nbd.sock",
        "--listen-tcp", "127.0.0.1:0",          "--workers",     "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    daemon_ = std::make_unique<st::Daemon>(args, control());
  }
  std::string control() const { return state_ / "shareblk.sock"; }

  st::TempDir state_;
  st::TempDir files_;
  std::unique_ptr<st::Daemon> daemon_;
  uid_t uid_ = 0;
  gid_t gid_ = 0;
};

TEST_F(PrivilegesTest, UserDropsRootAndStillServes) {
  start({"--user", "nobody"});
  ASSERT_TRUE(wait_for_log(*daemon_, "running as user nobody")) << daemon_->log();
  EXPECT_EQ(daemon_->log().find("running as root"), std::string::npos) << daemon_->log();

  // Every thread: nobody's ids (real, effective, saved, file system), no capability.
  const std::string ids = std::to_string(uid_) + "\t" + std::to_string(uid_) + "\t" +
                          std::to_string(uid_) + "\t" + std::to_string(uid_);
  const std::string gids = std::to_string(gid_) + "\t" + std::to_string(gid_) + "\t" +
                           std::to_string(gid_) + "\t" + std::to_string(gid_);
  const std::string proc = "/proc/" + std::to_string(daemon_->pid());
  int threads = 0;
  for (const auto& task : fs::directory_iterator(proc + "/task")) {
    auto status = proc_status(task.path() / "status");
    if (status.empty()) continue;  // ended meanwhile
    ++threads;
    EXPECT_EQ(status["Uid"], ids) << task.path();
    EXPECT_EQ(status["Gid"], gids) << task.path();
    for (const char* set : {"CapInh", "CapPrm", "CapEff", "CapAmb"}) {
      EXPECT_EQ(status[set], "0000000000000000") << task.path() << " " << set;
    }
  }
  EXPECT_GT(threads, 1) << "the daemon's workers are threads too";
  EXPECT_EQ(proc_status(proc + "/status")["Groups"], std::to_string(gid_));

  // Its state is nobody's now: the directory, the database, the lock, the control socket.
  for (const char* name : {"", "shareblk.db", "shareblkd.lock", "shareblk.sock"}) {
    EXPECT_EQ(owner(state_.path() / name), uid_) << name;
  }
  EXPECT_EQ(owner(files_ / "nbd.sock"), uid_);

  // It serves: a volume made (a file nobody creates), attached, written and read over NBD.
  const std::string volume = st::rpc_ok(
      control(), "volume_create", {{"name", "v"}, {"size", "4M"}, {"multiattach", true}})["id"];
  Json a = st::rpc_ok(control(), "attachment_create",
                      {{"volume_id", volume},
                       {"instance_uuid", "i-1"},
                       {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  const std::string uri = a["connection_info"]["data"]["uri"];
  {
    auto h = st::nbd_connect(uri);
    ASSERT_TRUE(h) << nbd_get_error();
    const std::string data = st::patterned(65536, 7);
    ASSERT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 4096, 0), 0) << nbd_get_error();
    ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
    EXPECT_EQ(st::nbd_read(h.get(), 4096, data.size()), data);
  }
  for (const auto& entry : fs::recursive_directory_iterator(state_.path())) {
    EXPECT_EQ(owner(entry.path()), uid_) << entry.path();
  }

  // A file only root may read stays unread: nobody cannot open it.
  const std::string secret = files_ / "secret.raw";
  st::make_file(secret, 1 << 20, 0x5a);
  ::chmod(secret.c_str(), 0600);
  Json refused = st::rpc(control(), "volume_create", {{"name", "s"}, {"from_image", secret}});
  ASSERT_TRUE(refused.contains("error")) << refused.dump();
  EXPECT_EQ(st::rpc_ok(control(), "volume_list").size(), 1U);

  // A restart with --user finds its state and the data, and drops again.
  start({"--user", "nobody"});
  ASSERT_TRUE(wait_for_log(*daemon_, "running as user nobody")) << daemon_->log();
  auto h = st::nbd_connect(uri);
  ASSERT_TRUE(h) << nbd_get_error();
  EXPECT_EQ(st::nbd_read(h.get(), 4096, 65536), st::patterned(65536, 7));
}

TEST_F(PrivilegesTest, RootWithoutUserSaysSo) {
  start({});
  ASSERT_TRUE(wait_for_log(*daemon_, "running as root; --user USER drops privileges after binding"))
      << daemon_->log();
  EXPECT_EQ(proc_status("/proc/" + std::to_string(daemon_->pid()) + "/status")["Uid"],
            "0\t0\t0\t0");
}

// Standalone mode: the exports are opened as root, then root goes; a root-only file stays
// served through the descriptor opened before.
TEST_F(PrivilegesTest, StandaloneExportOpensThenDrops) {
  const std::string image = files_ / "export.raw";
  st::make_file(image, 1 << 20, 0x3c);
  ::chmod(image.c_str(), 0600);
  const std::string socket = files_ / "export.sock";
  daemon_ = std::make_unique<st::Daemon>(
      std::vector<std::string>{"--export", "e=" + image, "--listen-unix", socket, "--workers", "1",
                               "--buffered", "--user", "nobody"},
      socket);
  ASSERT_TRUE(wait_for_log(*daemon_, "running as user nobody")) << daemon_->log();
  EXPECT_EQ(proc_status("/proc/" + std::to_string(daemon_->pid()) + "/status")["CapEff"],
            "0000000000000000");
  auto h = st::nbd_connect("nbd+unix:///e?socket=" + socket);
  ASSERT_TRUE(h) << nbd_get_error();
  EXPECT_EQ(st::nbd_read(h.get(), 0, 4096), st::pattern(0x3c, 4096));
  EXPECT_EQ(owner(socket), uid_);
}

TEST_F(PrivilegesTest, RefusedCombinations) {
  struct Case {
    std::vector<std::string> args;
    int status;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--user", "root"}, 2, "--user must name a user other than root"},
      {{"--user", "0"}, 2, "--user must name a user other than root"},
      {{"--user", "no-such-user-here"}, 2, "--user: no user 'no-such-user-here'"},
      {{"--user", "nobody", "--group", "no-such-group-here"},
       2,
       "--group: no group 'no-such-group-here'"},
      {{"--group", "nogroup"}, 2, "--group needs --user"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv{st::Daemon::binary(), "--state-dir", state_ / "s"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const st::RunResult r = st::run(argv, std::chrono::seconds(30));
    EXPECT_EQ(r.status, c.status) << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << r.output;
    // Refused before anything is made.
    EXPECT_FALSE(fs::exists(state_ / "s")) << r.output;
  }
}

// A build without SHAREBLK_TEST_HOOKS (a plain build, the package preset) has no crash point:
// the variable the crash tests set changes nothing. In a build with them, it kills the daemon.
TEST(TestHooks, KillAtIsATestBuildsAlone) {
  st::TempDir dir;
  const std::string control = dir / "shareblk.sock";
  st::Daemon daemon({"--state-dir", dir.path().string(), "--listen-unix", dir / "nbd.sock",
                     "--listen-tcp", "127.0.0.1:0", "--workers", "1"},
                    control, {"env", "SHAREBLK_TEST_KILL_AT=volume_create:intent"});
  Json reply;
  try {
    reply = st::rpc(control, "volume_create", {{"name", "v"}, {"size", "1M"}});
  } catch (const std::exception& e) {
    reply = {{"lost", e.what()}};
  }
#if SHAREBLK_TEST_HOOKS
  EXPECT_FALSE(reply.contains("result")) << reply.dump();
  EXPECT_EQ(daemon.stop(0), 128 + SIGKILL) << daemon.log();
#else
  EXPECT_TRUE(reply.contains("result")) << reply.dump() << daemon.log();
  EXPECT_EQ(daemon.log().find("SHAREBLK_TEST_KILL_AT"), std::string::npos) << daemon.log();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
#endif
}

}  // namespace
