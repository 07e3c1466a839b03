// Least authority at the control socket (issue 39): a caller that is not root gets the daemon
// to touch only what it could touch itself. Real daemon (as root), real unprivileged callers
// (setpriv), real files and FUSE mounts; the mount attacks run in a private mount namespace, so
// that a mount that went wrong could never reach the host's /etc.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/control_client.h"
#include "tests/managed_daemon.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
using Json = nlohmann::json;

constexpr uid_t kNobody = 65534;   // and gid 65534, Debian's nogroup
constexpr uid_t kStranger = 4242;  // a user in no group the daemon knows

class CallerRightsTest : public st::ManagedDaemonTest {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(st::is_root(), "needs root to run callers as other users");
    SHAREBLK_REQUIRE(st::have_program("setpriv"), "needs setpriv (util-linux)");
    SHAREBLK_REQUIRE(::access("/usr/bin/python3", X_OK) == 0, "needs /usr/bin/python3");
    // Other users reach the control socket through this directory; the socket's mode decides.
    ASSERT_EQ(::chmod(socket_dir_.path().c_str(), 0711), 0);
    control_socket_ = socket_dir_ / "control.sock";
  }

  // One JSON-RPC call as `uid` (gid `gid`, supplementary `groups`); the response object.
  Json call_as(uid_t uid, gid_t gid, const std::string& groups, const std::string& method,
               const Json& params) {
    const Json request = {{"jsonrpc", "2.0"}, {"id", 1}, {"method", method}, {"params", params}};
    std::vector<std::string> argv{"setpriv", "--reuid=" + std::to_string(uid),
                                  "--regid=" + std::to_string(gid)};
    argv.push_back(groups.empty() ? "--clear-groups" : "--groups=" + groups);
    argv.insert(argv.end(), {"/usr/bin/python3", "-c",
                             "import socket, sys\n"
                             "s = socket.socket(socket.AF_UNIX)\n"
                             "s.connect(sys.argv[1])\n"
                             "s.sendall(sys.argv[2].encode() + b'\\n')\n"
                             "print(s.makefile().readline(), end='')\n",
                             control(), request.dump()});
    const st::RunResult r = st::run(argv, std::chrono::seconds(60));
    EXPECT_EQ(r.status, 0) << r.output;
    try {
      return Json::parse(r.output);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a JSON-RPC response: " << r.output;
      return Json::object();
    }
  }
  Json as_nobody(const std::string& method, const Json& params) {
    return call_as(kNobody, kNobody, "", method, params);
  }
  static std::string reason_of(const Json& response) {
    if (!response.contains("error")) return "ok";
    return response["error"]["data"]["reason"].get<std::string>();
  }

  // A control socket that nobody's group may use in full.
  void start_for_nobody(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args{"--control-socket-mode", "0660", "--control-socket-group",
                                  std::to_string(kNobody)};
    args.insert(args.end(), extra.begin(), extra.end());
    start(args);
  }
};

struct Stat {
  uid_t uid;
  mode_t mode;
};
Stat stat_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return {st.st_uid, st.st_mode & 07777};
}

// Before: the daemon read any file as root for a caller who could not (a 0600 file of root's,
// /etc/shadow), and the caller read its bytes back over NBD.
TEST_F(CallerRightsTest, AnImageIsReadWithTheCallersRights) {
  start_for_nobody();
  st::TempDir images;
  ASSERT_EQ(::chmod(images.path().c_str(), 0755), 0);
  const std::string secret = images / "secret.img";
  const std::string open = images / "open.img";
  st::make_file(secret, 1 << 20, 0x5a);
  st::make_file(open, 1 << 20, 0x33);
  ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0644), 0);

  for (const std::string& path : {secret, std::string("/etc/shadow")}) {
    const Json r = as_nobody("volume_create", {{"name", "x"}, {"from_image", path}});
    EXPECT_EQ(reason_of(r), "forbidden") << r.dump();
    if (r.contains("error")) {
      EXPECT_NE(r["error"]["message"].get<std::string>().find("uid 65534 may not read " + path),
                std::string::npos)
          << r.dump();
    }
  }
  // A symlink the caller may make changes nothing: the target is opened with its rights.
  const std::string link = images / "link.img";
  ASSERT_EQ(::symlink(secret.c_str(), link.c_str()), 0);
  EXPECT_EQ(reason_of(as_nobody("volume_create", {{"name", "x"}, {"from_image", link}})),
            "forbidden");
  EXPECT_TRUE(st::rpc_ok(control(), "volume_list", Json::object()).empty());

  // What the caller may read, it may fill a volume from.
  const Json made = as_nobody("volume_create", {{"name", "ok"}, {"from_image", open}});
  ASSERT_EQ(reason_of(made), "ok") << made.dump();
  // Root may still name a root-only file.
  EXPECT_EQ(st::rpc_ok(control(), "volume_create", {{"name", "root"}, {"from_image", secret}})
                .value("status", ""),
            "creating");
}

// Before: state_backup created a root-owned file in any directory, a root-only one included.
TEST_F(CallerRightsTest, ABackupIsWrittenWithTheCallersRights) {
  start_for_nobody();
  st::TempDir out;
  const std::string closed = out / "closed";
  const std::string theirs = out / "theirs";
  ASSERT_EQ(::mkdir(closed.c_str(), 0700), 0);
  ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
  ASSERT_EQ(::chown(theirs.c_str(), kNobody, kNobody), 0);
  ASSERT_EQ(::chmod(out.path().c_str(), 0755), 0);

  const Json refused = as_nobody("state_backup", {{"path", closed + "/db"}});
  EXPECT_EQ(reason_of(refused), "forbidden") << refused.dump();
  EXPECT_TRUE(std::filesystem::is_empty(closed));

  const Json made = as_nobody("state_backup", {{"path", theirs + "/db"}});
  ASSERT_EQ(reason_of(made), "ok") << made.dump();
  const Stat backup = stat_of(theirs + "/db");
  EXPECT_EQ(backup.uid, kNobody);
  EXPECT_EQ(backup.mode, 0600u);
  // Never over a file, and never through a symlink the caller planted.
  ASSERT_EQ(::symlink("/etc/passwd-shareblk-test", (theirs + "/planted").c_str()), 0);
  EXPECT_EQ(reason_of(as_nobody("state_backup", {{"path", theirs + "/planted"}})),
            "invalid_params");
  EXPECT_FALSE(std::filesystem::exists("/etc/passwd-shareblk-test"));
  EXPECT_EQ(reason_of(as_nobody("state_backup", {{"path", theirs + "/db"}})), "invalid_params");
}

// Before: every caller that could connect could call every method.
TEST_F(CallerRightsTest, AReadOnlyRoleLooksAndSeesNoCredentials) {
  start({"--control-readonly-group", std::to_string(kNobody)});
  const std::string volume = create_volume("1M");
  const Json a = attach(volume, "i-1", {{"host", "a"}, {"transport", "unix"}});
  auto as_reader = [&](const std::string& method, const Json& params) {
    return call_as(kStranger, kStranger, std::to_string(kNobody), method, params);
  };
  EXPECT_EQ(reason_of(as_reader("volume_list", Json::object())), "ok");
  EXPECT_EQ(reason_of(as_reader("stats", Json::object())), "ok");
  const Json shown = as_reader("attachment_show", {{"attachment_id", a["id"]}});
  ASSERT_EQ(reason_of(shown), "ok") << shown.dump();
  EXPECT_TRUE(shown["result"]["connection_info"].is_null()) << shown.dump();
  const Json listed = as_reader("volume_show", {{"volume_id", volume}});
  EXPECT_EQ(listed.dump().find(a["connection_info"]["data"]["export_name"].get<std::string>()),
            std::string::npos);
  for (const auto& [method, params] : std::vector<std::pair<std::string, Json>>{
           {"volume_create", {{"name", "x"}, {"size", "1M"}}},
           {"volume_delete", {{"volume_id", volume}}},
           {"attachment_delete", {{"attachment_id", a["id"]}}},
           {"state_backup", {{"path", "/tmp/x"}}},
           {"export_resolve", {{"export_name", "x"}}}}) {
    EXPECT_EQ(reason_of(as_reader(method, params)), "forbidden") << method;
  }
  // A user in neither group is refused at connect, though the socket is open to all.
  EXPECT_EQ(reason_of(call_as(kStranger, kStranger, "", "volume_list", Json::object())),
            "forbidden");
  EXPECT_EQ(st::rpc_ok(control(), "attachment_show", {{"attachment_id", a["id"]}})["id"], a["id"]);
}

// FUSE mounts: the attack that gave a control-group user root (a mount over /etc/sudoers.d).
class FuseMountRootTest : public CallerRightsTest {
 protected:
  void SetUp() override {
    CallerRightsTest::SetUp();
    if (::testing::Test::IsSkipped()) return;
    SHAREBLK_REQUIRE(::access("/dev/fuse", R_OK | W_OK) == 0, "needs /dev/fuse");
    // This test process and the daemon it starts get a mount namespace of their own: nothing
    // mounted here, right or wrong, is seen by the host.
    ASSERT_EQ(::unshare(CLONE_NEWNS), 0) << std::strerror(errno);
    ASSERT_EQ(::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr), 0);
    root_ = mounts_ / "root";
    ASSERT_EQ(::mkdir(root_.c_str(), 0755), 0);
    ASSERT_EQ(::mkdir((root_ + "/ok").c_str(), 0755), 0);
    // A tmpfs stands in for /etc: the test attacks a copy, never the real one.
    etc_ = mounts_ / "etc";
    ASSERT_EQ(::mkdir(etc_.c_str(), 0755), 0);
    ASSERT_EQ(::mount("tmpfs", etc_.c_str(), "tmpfs", 0, "size=1m"), 0);
    ASSERT_EQ(::mkdir((etc_ + "/sudoers.d").c_str(), 0755), 0);
  }
  static std::string mount_options(const std::string& point) {
    std::ifstream in("/proc/self/mountinfo");
    for (std::string line; std::getline(in, line);) {
      std::istringstream fields(line);
      std::string id, parent, dev, root, where, options;
      fields >> id >> parent >> dev >> root >> where >> options;
      if (where == point) return options;
    }
    return "";
  }
  Json fuse_attach(const std::string& instance, const std::string& mountpoint) {
    return as_nobody(
        "attachment_create",
        {{"volume_id", volume_},
         {"instance_uuid", instance},
         {"connector", {{"host", instance}, {"transport", "fuse"}, {"mountpoint", mountpoint}}}});
  }

  st::TempDir mounts_;
  std::string root_;
  std::string etc_;
  std::string volume_;
};

TEST_F(FuseMountRootTest, AMountLandsOnlyBelowTheMountRoot) {
  start_for_nobody({"--fuse-mount-root", root_});
  volume_ = create_volume("4M");
  ASSERT_EQ(::symlink((etc_ + "/sudoers.d").c_str(), (root_ + "/escape").c_str()), 0);
  for (const std::string& where : {etc_ + "/sudoers.d", root_ + "/../etc/sudoers.d",
                                   root_ + "/escape", root_, std::string("/etc")}) {
    const Json r = fuse_attach("i-bad", where);
    EXPECT_EQ(reason_of(r), "forbidden") << where << ": " << r.dump();
    EXPECT_EQ(mount_options(where), "") << where;
  }
  EXPECT_TRUE(std::filesystem::is_empty(etc_ + "/sudoers.d"));
  EXPECT_EQ(mount_options("/etc"), mount_options("/etc"));  // (the host's, untouched)

  // Below the root it mounts, without set-uid files, device nodes or executables.
  const Json ok = fuse_attach("i-ok", root_ + "/ok");
  ASSERT_EQ(reason_of(ok), "ok") << ok.dump();
  const std::string options = mount_options(root_ + "/ok");
  for (const char* flag : {"nosuid", "nodev", "noexec"}) {
    EXPECT_NE(options.find(flag), std::string::npos) << options;
  }
  EXPECT_TRUE(std::filesystem::exists(root_ + "/ok/disk"));
}

}  // namespace
