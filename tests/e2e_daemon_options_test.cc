// shareblkd's options as an operator meets them: a bad value is one clear line and exit 2, an
// old option name still works with a warning, SIGHUP reloads the config file without dropping
// a connection, the log file can be rotated, and connection_info names the address clients
// should use (docs/operations.md).
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
using Json = nlohmann::json;

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

// Waits up to 5 s for `needle` in the file.
bool wait_for_line(const std::string& path, const std::string& needle) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    if (slurp(path).find(needle) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

TEST(DaemonOptions, ABadValueIsOneLineNamingTheOptionAndExit2) {
  st::TempDir dir;
  write_file(dir / "bad.conf", "workers = -3\n");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--workers", "-1"}, "--workers must be a whole number from 0 to 256, not '-1'"},
      {{"--workers", "100000"}, "--workers must be a whole number from 0 to 256"},
      {{"--max-connections", "12x"}, "--max-connections must be a whole number"},
      {{"--send-timeout-ms", "-5"}, "--send-timeout-ms must be a whole number"},
      {{"--log-level", "loud"}, "--log-level must be trace, debug, info, warn, error"},
      {{"--tls", "maybe"}, "--tls must be off, on or require"},
      {{"--nbd-socket-mode", "999"}, "--nbd-socket-mode must be an octal mode"},
      {{"--no-such-option"}, "unrecognised option '--no-such-option'"},
      {{"--config", dir / "missing.conf"}, "cannot read config file"},
      {{"--config", dir / "bad.conf"}, "bad.conf: workers must be a whole number"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv{st::Daemon::binary(), "--state-dir", dir / "state"};
    argv.insert(argv.end(), args.begin(), args.end());
    const st::RunResult r = st::run(argv, std::chrono::seconds(10));
    EXPECT_EQ(r.status, 2) << args.front() << ": " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args.front() << ": " << r.output;
    EXPECT_LT(std::count(r.output.begin(), r.output.end(), '\n'), 3) << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "state/shareblk.sock"));
}

TEST(DaemonOptions, AnOldOptionNameStillWorksWithAWarning) {
  st::TempDir dir;
  const std::string control = dir / "shareblk.sock";
  st::Daemon daemon({"--state-dir", dir.path().string(), "--listen-unix", dir / "nbd.sock",
                     "--workers", "1", "--allow_multiattach", "false"},
                    control);
  EXPECT_EQ(st::rpc_reason(control, "volume_create",
                           {{"name", "v"}, {"size", "1M"}, {"multiattach", true}}),
            "policy_denied");
  EXPECT_NE(daemon.log().find("allow_multiattach is now allow-multiattach"), std::string::npos)
      << daemon.log();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// The operator edits the config file and sends SIGHUP: the new policy and log level hold for the
// calls that follow, an NBD client connected before goes on reading and writing, and the log
// file logrotate moved away is replaced by a new one.
TEST(DaemonReload, SighupTakesTheNewConfigAndReopensTheLogWithoutDroppingAConnection) {
  st::TempDir dir;
  const std::string control = dir / "shareblk.sock";
  const std::string config = dir / "shareblkd.conf";
  const std::string log = dir / "shareblkd.log";
  write_file(config, "allow-multiattach = true\nlog-level = info\n");
  st::Daemon daemon({"--state-dir", dir.path().string(), "--listen-unix", dir / "nbd.sock",
                     "--workers", "1", "--config", config, "--log-file", log},
                    control);
  const std::string volume = st::rpc_ok(
      control, "volume_create", {{"name", "v"}, {"size", "1M"}, {"multiattach", true}})["id"];
  const Json a = st::rpc_ok(control, "attachment_create",
                            {{"volume_id", volume},
                             {"instance_uuid", "i1"},
                             {"connector", {{"host", "h1"}, {"transport", "unix"}}}});
  auto nbd = st::nbd_connect(a["connection_info"]["data"]["uri"]);
  ASSERT_TRUE(nbd);
  const std::string before = st::pattern('a', 4096);
  ASSERT_EQ(nbd_pwrite(nbd.get(), before.data(), before.size(), 0, 0), 0) << nbd_get_error();
  ASSERT_TRUE(wait_for_line(log, "control socket"));

  write_file(config, "allow-multiattach = false\nlog-level = warn\n");
  std::filesystem::rename(log, log + ".1");  // what logrotate does
  ASSERT_EQ(::kill(daemon.pid(), SIGHUP), 0);
  ASSERT_TRUE(
      wait_for_line(log, "SIGHUP: reloaded: log level warn, policy allow-multiattach=false"))
      << slurp(log) << slurp(log + ".1");

  EXPECT_EQ(st::rpc_reason(control, "volume_create",
                           {{"name", "w"}, {"size", "1M"}, {"multiattach", true}}),
            "policy_denied");
  EXPECT_EQ(st::nbd_read(nbd.get(), 0, before.size()), before);
  const std::string after = st::pattern('b', 4096);
  EXPECT_EQ(nbd_pwrite(nbd.get(), after.data(), after.size(), 4096, 0), 0) << nbd_get_error();
  EXPECT_EQ(st::nbd_read(nbd.get(), 4096, after.size()), after);
  EXPECT_NE(slurp(log + ".1").find("control socket"), std::string::npos);
  EXPECT_EQ(slurp(log).find("volume_create"), std::string::npos)
      << "warn, the new level, leaves calls out:\n"
      << slurp(log);
  nbd.reset();
  EXPECT_EQ(daemon.stop(SIGTERM), 0);
}

TEST(DaemonReload, AConfigFileThatNoLongerParsesChangesNothing) {
  st::TempDir dir;
  const std::string control = dir / "shareblk.sock";
  const std::string config = dir / "shareblkd.conf";
  write_file(config, "allow-multiattach = false\n");
  st::Daemon daemon({"--state-dir", dir.path().string(), "--listen-unix", dir / "nbd.sock",
                     "--workers", "1", "--config", config},
                    control);
  write_file(config, "allow-multiattach = true\nmax-connections = lots\n");
  ASSERT_EQ(::kill(daemon.pid(), SIGHUP), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (daemon.log().find("options not reloaded") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(daemon.log().find("SIGHUP: options not reloaded, the old ones stay: config file"),
            std::string::npos)
      << daemon.log();
  EXPECT_EQ(st::rpc_reason(control, "volume_create",
                           {{"name", "v"}, {"size", "1M"}, {"multiattach", true}}),
            "policy_denied");
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

std::string tcp_uri(const std::string& control) {
  const std::string volume =
      st::rpc_ok(control, "volume_create", {{"name", "v"}, {"size", "1M"}})["id"];
  const Json a = st::rpc_ok(control, "attachment_create",
                            {{"volume_id", volume},
                             {"instance_uuid", "i1"},
                             {"connector", {{"host", "h1"}, {"transport", "tcp"}}}});
  return a["connection_info"]["data"]["uri"];
}

TEST(DaemonOptions, ConnectionInfoNamesTheAdvertisedAddress) {
  st::TempDir dir;
  const std::string control = dir / "shareblk.sock";
  {
    st::Daemon daemon({"--state-dir", dir / "a", "--control-socket", control, "--listen-tcp",
                       "127.0.0.1:0", "--workers", "1", "--advertise-address", "fd00::7"},
                      control);
    const int port = st::logged_tcp_port(daemon, "127.0.0.1");
    const std::string uri = tcp_uri(control);
    EXPECT_EQ(uri.rfind("nbd://[fd00::7]:" + std::to_string(port) + "/", 0), 0) << uri;
    EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
  }
  // A wildcard listener reaches no client as "0.0.0.0": the host's name instead, and a warning.
  st::Daemon daemon({"--state-dir", dir / "b", "--control-socket", control, "--listen-tcp",
                     "0.0.0.0:0", "--workers", "1"},
                    control);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const int port = st::logged_tcp_port(daemon, "0.0.0.0");
  const std::string uri = tcp_uri(control);
  EXPECT_EQ(uri.rfind("nbd://" + std::string(host) + ":" + std::to_string(port) + "/", 0), 0)
      << uri;
  EXPECT_NE(daemon.log().find("give --advertise-address"), std::string::npos) << daemon.log();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

}  // namespace
