// Signals an operator may send by mistake change nothing; SIGTERM still stops cleanly
// (README, "Signals").
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <string>
#include <thread>

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
  for (int sig : {SIGHUP, SIGUSR1, SIGUSR2}) {
    EXPECT_NE(log.find("signal " + std::to_string(sig) + " ("), std::string::npos) << log;
  }
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

}  // namespace
