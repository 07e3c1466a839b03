// Access control end to end (issue 18): an attachment is served only on its connector's
// transport, and a unix attachment that names a uid only to that local user. Real daemon,
// real libnbd and nbdinfo clients, a real unprivileged user.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>
#include <sys/stat.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/control_client.h"
#include "tests/managed_daemon.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
using Json = nlohmann::json;

constexpr uid_t kNobody = 65534;

class AccessTest : public st::ManagedDaemonTest {
 protected:
  std::string create_volume() { return ManagedDaemonTest::create_volume("1M"); }
  static std::string name_of(const Json& a) { return a["connection_info"]["data"]["export_name"]; }
  static std::string uri_of(const Json& a) { return a["connection_info"]["data"]["uri"]; }

  // libnbd's errno of a connection that failed, 0 when it succeeded.
  static int connect_errno(const std::string& uri) {
    int err = 0;
    st::NbdHandle h = st::nbd_connect(uri, &err);
    return h ? 0 : err;
  }
};

TEST_F(AccessTest, AnAttachmentIsServedOnlyOnItsConnectorsTransport) {
  start();
  const std::string volume = create_volume();
  const Json on_unix = attach(volume, "i-unix", {{"host", "a"}, {"transport", "unix"}});
  const Json on_tcp = attach(volume, "i-tcp", {{"host", "b"}, {"transport", "tcp"}});
  const std::string tcp_uri = uri_of(on_tcp);
  const std::string tcp_base = tcp_uri.substr(0, tcp_uri.rfind('/') + 1);  // nbd://HOST:PORT/

  // Each on its own listener...
  EXPECT_EQ(connect_errno(uri_of(on_unix)), 0);
  EXPECT_EQ(connect_errno(tcp_uri), 0);
  // ...and on the other exactly as a name that does not exist (NBD_REP_ERR_UNKNOWN: ENOENT).
  EXPECT_EQ(connect_errno(tcp_base + name_of(on_unix)), ENOENT);
  EXPECT_EQ(connect_errno("nbd+unix:///" + name_of(on_tcp) + "?socket=" + nbd_socket()), ENOENT);
  EXPECT_EQ(connect_errno(tcp_base + std::string(32, 'f')), ENOENT);

  // Logged by attachment id and peer, never by the name.
  const std::string log = daemon_->log();
  EXPECT_NE(log.find("refused tcp 127.0.0.1 the export of attachment " +
                     on_unix["id"].get<std::string>() + ": not served on this transport"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("the export of attachment " + on_tcp["id"].get<std::string>() +
                     ": not served on this transport"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("admitted unix pid"), std::string::npos) << log;
  EXPECT_NE(log.find("refused tcp 127.0.0.1: no live export of that name"), std::string::npos);
  for (const Json* a : {&on_unix, &on_tcp}) {
    EXPECT_EQ(log.find(name_of(*a)), std::string::npos) << "an export name was logged";
  }

  // Revocation is logged too, with what it cut.
  int err = 0;
  st::NbdHandle held = st::nbd_connect(uri_of(on_unix), &err);
  ASSERT_TRUE(held) << err;
  // Counted by the server, or the delete may find none to close.
  ASSERT_TRUE(st::wait_connections(control(), on_unix["id"], 1))
      << "the server never counted the connection";
  st::rpc_ok(control(), "attachment_delete", {{"attachment_id", on_unix["id"]}});
  EXPECT_NE(daemon_->log().find("revoked attachment " + on_unix["id"].get<std::string>() +
                                ": 0 nbdkit connection(s) told, 1 NBD connection(s) closed"),
            std::string::npos)
      << daemon_->log();
}

TEST_F(AccessTest, AConnectorUidIsCheckedAndOnlyForUnix) {
  start();
  const std::string volume = create_volume();
  for (const Json& uid : {Json("1000"), Json(-1), Json(1.5), Json(4294967295u)}) {
    EXPECT_EQ(st::rpc_reason(control(), "attachment_create",
                             {{"volume_id", volume},
                              {"instance_uuid", "i"},
                              {"connector", {{"host", "a"}, {"transport", "unix"}, {"uid", uid}}}}),
              "invalid_params")
        << uid;
  }
  EXPECT_EQ(st::rpc_reason(control(), "attachment_create",
                           {{"volume_id", volume},
                            {"instance_uuid", "i"},
                            {"connector", {{"host", "a"}, {"transport", "tcp"}, {"uid", 0}}}}),
            "invalid_params");
}

// The local user a unix attachment names gets it; another user, and root, do not, unless the
// daemon runs with --nbd-allow-root.
TEST_F(AccessTest, AUnixAttachmentBoundToAUidAdmitsThatUserOnly) {
  SHAREBLK_REQUIRE(st::is_root(), "needs root to run a client as another user");
  SHAREBLK_REQUIRE(st::have_program("setpriv") && st::have_program("nbdinfo"),
                   "needs setpriv (util-linux) and nbdinfo (libnbd-bin)");
  // The operator opens the socket to every local user: the uid binding is the gate.
  ASSERT_EQ(::chmod(socket_dir_.path().c_str(), 0711), 0);
  start({"--nbd-socket-mode", "0666"});
  const std::string volume = create_volume();
  const Json mine = attach(volume, "i-1", {{"host", "a"}, {"transport", "unix"}, {"uid", kNobody}});
  const Json theirs = attach(volume, "i-2", {{"host", "a2"}, {"transport", "unix"}, {"uid", 1000}});
  auto as_nobody = [&](const std::string& uri) {
    return st::run({"setpriv", "--reuid=" + std::to_string(kNobody),
                    "--regid=" + std::to_string(kNobody), "--clear-groups", "nbdinfo", "--size",
                    uri})
        .status;
  };
  EXPECT_EQ(as_nobody(uri_of(mine)), 0);
  EXPECT_NE(as_nobody(uri_of(theirs)), 0);
  EXPECT_EQ(connect_errno(uri_of(mine)), ENOENT);  // this test runs as root
  const std::string log = daemon_->log();
  EXPECT_NE(log.find("admitted unix pid"), std::string::npos) << log;
  EXPECT_NE(log.find(" uid 65534 to attachment " + mine["id"].get<std::string>()),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("uid 0 the export of attachment " + mine["id"].get<std::string>() +
                     ": not the connector's uid"),
            std::string::npos)
      << log;

  start({"--nbd-socket-mode", "0666", "--nbd-allow-root"});
  EXPECT_EQ(connect_errno(uri_of(mine)), 0);
  EXPECT_EQ(as_nobody(uri_of(theirs)), 1);
}

mode_t mode_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}
gid_t group_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_gid;
}

// The state directory and the database hold export names, which admit clients: the daemon's
// user alone reads them. The sockets' modes and groups are the operator's to set.
TEST_F(AccessTest, StateIsPrivateAndSocketsTakeTheirModeAndGroup) {
  start();
  EXPECT_EQ(mode_of(dir_.path().string()), 0700u);
  EXPECT_EQ(mode_of(dir_ / "shareblk.db"), 0600u);
  EXPECT_EQ(mode_of(control()), 0600u);
  EXPECT_EQ(mode_of(nbd_socket()), 0660u);
  EXPECT_EQ(group_of(nbd_socket()), ::getgid());

  start({"--nbd-socket-mode", "0666", "--nbd-socket-group", "65534", "--control-socket-mode",
         "0660", "--control-socket-group", "65534"});
  EXPECT_EQ(mode_of(nbd_socket()), 0666u);
  EXPECT_EQ(group_of(nbd_socket()), 65534u);
  EXPECT_EQ(mode_of(control()), 0660u);
  EXPECT_EQ(group_of(control()), 65534u);
  st::rpc_ok(control(), "volume_list");  // still served
  daemon_->stop(SIGTERM);
  daemon_.reset();

  // A mode or group that cannot be used is a clear error, not a default.
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--nbd-socket-mode", "0999"},
        std::vector<std::string>{"--control-socket-mode", "01777"},
        std::vector<std::string>{"--control-socket-mode", "rw"},
        std::vector<std::string>{"--nbd-socket-group", "no-such-group-here"}}) {
    std::vector<std::string> argv{st::Daemon::binary(), "--state-dir", dir_.path().string()};
    argv.insert(argv.end(), bad.begin(), bad.end());
    st::RunResult r = st::run(argv, std::chrono::seconds(20));
    EXPECT_EQ(r.status, 2) << bad[0] << " " << bad[1] << ": " << r.output;
    EXPECT_NE(r.output.find(bad[0]), std::string::npos) << r.output;
  }
}

}  // namespace
