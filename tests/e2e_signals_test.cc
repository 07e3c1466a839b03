// Signals an operator may send by mistake change nothing, SIGHUP reloads (with the same options:
// nothing changes either); SIGTERM still stops cleanly (docs/operations.md, "Signals").
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;

TEST(DaemonSignals, HupUsr1Usr2AndPipeAreLoggedAndChangeNothing) {
  st::TempDir dir;
  const std::string control = dir / "shareblk.sock";
  st::Daemon daemon(
      {"--state-dir", dir.path().string(), "--listen-unix", dir / "nbd.sock", "--workers", "1"},
      control);
  const std::string id =
      st::rpc_ok(control, "volume_create", {{"name", "v"}, {"size", "1M"}})["id"];
  for (int sig : {SIGHUP, SIGUSR1, SIGUSR2, SIGPIPE}) {
    ASSERT_EQ(::kill(daemon.pid(), sig), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(st::rpc_ok(control, "volume_show", {{"volume_id", id}})["id"], id)
        << "after signal " << sig << ":\n"
        << daemon.log();
  }
  const std::string log = daemon.log();
  for (int sig : {SIGUSR1, SIGUSR2}) {
    EXPECT_NE(log.find("signal " + std::to_string(sig) + " ("), std::string::npos) << log;
  }
  EXPECT_NE(log.find("SIGHUP: reloaded: log level info, policy unchanged"), std::string::npos)
      << log;
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// One daemon per state directory: a second one started on it exits at once, naming the first's
// pid, and the first keeps its sockets and goes on serving. Once the first is gone (even by
// kill -9), a new one starts there and replaces the stale sockets.
TEST(DaemonLock, ASecondDaemonOnTheSameStateDirectoryExitsAndTouchesNothing) {
  st::TempDir dir;
  const std::string control = dir / "shareblk.sock";
  const std::vector<std::string> args{"--state-dir",    dir.path().string(), "--listen-unix",
                                      dir / "nbd.sock", "--workers",         "1"};
  auto first = std::make_unique<st::Daemon>(args, control);
  const std::string id =
      st::rpc_ok(control, "volume_create", {{"name", "v"}, {"size", "1M"}})["id"];
  std::vector<std::string> second{st::Daemon::binary()};
  second.insert(second.end(), args.begin(), args.end());
  const st::RunResult r = st::run(second, std::chrono::seconds(10));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("another shareblkd (pid " + std::to_string(first->pid()) + ")"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(st::wait_for_socket(dir / "nbd.sock", std::chrono::milliseconds(100)));
  EXPECT_EQ(st::rpc_ok(control, "volume_show", {{"volume_id", id}})["id"], id);
  EXPECT_EQ(first->stop(SIGKILL), 128 + SIGKILL);
  first.reset();
  st::Daemon again(args, control);  // the lock went with the killed daemon
  EXPECT_EQ(st::rpc_ok(control, "volume_show", {{"volume_id", id}})["id"], id);
  EXPECT_EQ(again.stop(SIGTERM), 0) << again.log();
}

}  // namespace
