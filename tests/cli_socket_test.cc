// Which control socket `shareblk` calls when none is named: ./var/shareblk.sock (a `./dev run`
// daemon), else the packaged service's /run/shareblk/shareblk.sock; --socket and
// $SHAREBLK_SOCKET name the only one. Each test runs in a mount namespace of its own with a
// tmpfs on /run, so that a packaged daemon on this host is neither reached nor touched.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tests/control_client.h"
#include "tests/support.h"

namespace shareblk::testing {
namespace {

constexpr char kPackaged[] = "/run/shareblk/shareblk.sock";

class CliSocket : public ::testing::Test {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(is_root(), "needs root: a mount namespace with a tmpfs on /run");
    ASSERT_EQ(::unshare(CLONE_NEWNS), 0) << std::strerror(errno);
    ASSERT_EQ(::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr), 0)
        << std::strerror(errno);
    ASSERT_EQ(::mount("tmpfs", "/run", "tmpfs", 0, "size=4m,mode=0755"), 0) << std::strerror(errno);
    run_mounted_ = true;
    ASSERT_EQ(::mkdir("/run/shareblk", 0755), 0) << std::strerror(errno);
  }
  void TearDown() override {
    packaged_.reset();
    local_.reset();
    if (run_mounted_) ::umount2("/run", MNT_DETACH);
  }

  // The CLI run in `cwd`, with $SHAREBLK_SOCKET unset or, when given, set to `env_socket`.
  static RunResult cli(const std::string& cwd, const std::vector<std::string>& args,
                       const std::string& env_socket = "") {
    std::vector<std::string> argv{"env", "-u", "SHAREBLK_SOCKET", "-C", cwd};
    if (!env_socket.empty()) argv.push_back("SHAREBLK_SOCKET=" + env_socket);
    argv.emplace_back(SHAREBLK_CLI_PATH);
    argv.insert(argv.end(), args.begin(), args.end());
    return run(argv, std::chrono::seconds(30));
  }
  // A daemon whose control socket is `control`, its state in `state`.
  static std::unique_ptr<Daemon> daemon(const std::string& state, const std::string& control) {
    return std::make_unique<Daemon>(
        std::vector<std::string>{"--state-dir", state, "--control-socket", control, "--listen-unix",
                                 state + "/nbd.sock"},
        control);
  }

  TempDir dir_;
  bool run_mounted_ = false;
  std::unique_ptr<Daemon> packaged_;
  std::unique_ptr<Daemon> local_;
};

TEST_F(CliSocket, WithNoDaemonAnywhereTheMessageNamesEverySocketTried) {
  const RunResult r = cli(dir_.path(), {"volume-list"});
  EXPECT_EQ(r.status, 3) << r.output;
  EXPECT_NE(r.output.find("./var/shareblk.sock"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(kPackaged), std::string::npos) << r.output;
}

TEST_F(CliSocket, ThePackagedDaemonIsFoundWithoutConfiguration) {
  packaged_ = daemon(dir_ / "packaged", kPackaged);
  rpc_ok(kPackaged, "volume_create", {{"name", "in-run"}, {"size", "1M"}});
  const RunResult r = cli(dir_.path(), {"volume-list"});
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("in-run"), std::string::npos) << r.output;
}

TEST_F(CliSocket, ALocalVarSocketWinsOverThePackagedOne) {
  packaged_ = daemon(dir_ / "packaged", kPackaged);
  rpc_ok(kPackaged, "volume_create", {{"name", "in-run"}, {"size", "1M"}});
  const std::string project = dir_ / "project";
  local_ = daemon(project + "/var", project + "/var/shareblk.sock");
  rpc_ok(project + "/var/shareblk.sock", "volume_create", {{"name", "in-var"}, {"size", "1M"}});
  const RunResult r = cli(project, {"volume-list"});
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("in-var"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("in-run"), std::string::npos) << r.output;
}

TEST_F(CliSocket, ANamedSocketIsTheOnlyOneTried) {
  packaged_ = daemon(dir_ / "packaged", kPackaged);
  const std::string missing = dir_ / "missing.sock";
  for (const RunResult& r : {cli(dir_.path(), {"--socket", missing, "volume-list"}),
                             cli(dir_.path(), {"volume-list"}, missing)}) {
    EXPECT_EQ(r.status, 3) << r.output;
    EXPECT_NE(r.output.find(missing), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find(kPackaged), std::string::npos) << r.output;
  }
  // --socket wins over $SHAREBLK_SOCKET.
  const RunResult r = cli(dir_.path(), {"--socket", kPackaged, "volume-list"}, missing);
  EXPECT_EQ(r.status, 0) << r.output;
}

}  // namespace
}  // namespace shareblk::testing
