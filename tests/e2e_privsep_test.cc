// The privileged helper (privsep/privsep.h, docs/security.md "The privileged helper"): what it
// refuses whoever asks, who may reach its socket, and that a daemon without root serves the LVM
// store and FUSE attachments through it.
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "privsep/privsep.h"
#include "tests/control_client.h"
#include "tests/lvm_fixture.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

extern char** environ;

namespace {

namespace st = shareblk::testing;
namespace fs = std::filesystem;
using Json = nlohmann::json;
using shareblk::privsep::Helper;
using shareblk::privsep::HelperConfig;
constexpr uint64_t kMiB = 1 << 20;
constexpr char kUuid[] = "0b6c1a2e-3f4d-4e5f-8a9b-0c1d2e3f4a5b";

// The mount options of what is mounted at `point` in this mount namespace; "" when nothing.
std::string mount_options(const std::string& point) {
  std::ifstream in("/proc/self/mountinfo");
  std::string found;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string id, parent, dev, root, where, options;
    fields >> id >> parent >> dev >> root >> where >> options;
    if (where == point) found = options;
  }
  return found;
}

// The test's files, in a directory the daemon's user may enter (as /tmp is).
void let_anyone_enter(const st::TempDir& dir) {
  fs::permissions(dir.path(),
                  fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
}

// This test process, and every daemon and helper it starts from now on, get a mount namespace
// of their own: a mount the helper wrongly made (on /etc, say) would never reach the host.
void enter_private_mount_namespace() {
  ASSERT_EQ(::unshare(CLONE_NEWNS), 0) << std::strerror(errno);
  ASSERT_EQ(::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr), 0);
}

class PrivilegedHelper : public ::testing::Test {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(st::is_root(), "needs root (the helper is root's)");
    std::string why;
    SHAREBLK_REQUIRE(st::lvm_available(why), why);
    enter_private_mount_namespace();  // before the helper starts: it is asked to mount on /etc
    if (HasFatalFailure()) return;
    vg_name_ = "sbh" + std::to_string(::getpid());
    vg_ = std::make_unique<st::LoopVolumeGroup>(dir_, vg_name_, 64 * kMiB);
    ASSERT_TRUE(vg_->ok()) << vg_->why();
    ASSERT_EQ(::mkdir((dir_ / "mounts").c_str(), 0755), 0);
    HelperConfig config;
    config.vg = vg_name_;
    config.lvm_config = vg_->daemon_config();
    config.fuse_mount_root = dir_ / "mounts";
    std::string error;
    helper_ = Helper::start(st::Daemon::helper_binary(), config, 0, 0, error);
    ASSERT_TRUE(helper_) << error;
  }
  void TearDown() override {
    helper_.reset();  // the helper exits when its socket closes
    vg_.reset();
  }
  int lvm(const std::vector<std::string>& argv, std::string& error) {
    shareblk::store::CommandResult result;
    const int err = helper_->run_lvm(argv, result, error);
    if (err == 0 && result.status != 0) error = result.err;
    return err != 0 ? err : result.status;
  }

  st::TempDir dir_;
  std::string vg_name_;
  std::unique_ptr<st::LoopVolumeGroup> vg_;
  std::shared_ptr<Helper> helper_;
};

TEST_F(PrivilegedHelper, RunsOnlyTheStoresCommandsOnItsVolumeGroup) {
  const std::string lv = std::string("volume-") + kUuid;
  const std::string vg = vg_name_;
  const std::vector<std::vector<std::string>> refused = {
      {"lvremove", "-y", vg},                                       // every LV of the group
      {"vgremove", "-y", vg},                                       // not a command of the store's
      {"lvs", "--reportformat", "json", "-o", "lv_name", "other"},  // another group
      {"lvs", "--config", "devices{filter=[\"a|.*|\"]}", vg},  // the operator's config is its own
      {"lvcreate", "-y", "-n", lv, "-L", "1048576b", "--addtag", "other", vg},  // not our tag
      {"lvcreate", "-y", "-n", "root", "-L", "1048576b", "--addtag", "shareblk", vg},
      {"lvextend", "-L", "1048576b", vg + "/root"},
      {"lvremove", "-y", vg + "/" + lv + "/../x"},
      {"lvs", "-o", "lv_name;touch /tmp/x", vg},
      {"pvs", "--reportformat", "json", "-o", "pv_name"},  // every PV of the host
      {}};
  for (const auto& argv : refused) {
    std::string error;
    EXPECT_EQ(lvm(argv, error), EPERM) << ::testing::PrintToString(argv) << ": " << error;
    EXPECT_FALSE(error.empty());
  }
  // The group is as it was; the store's own commands run.
  std::string error;
  EXPECT_EQ(
      lvm({"lvcreate", "-y", "-Zn", "-an", "--addtag", "shareblk", "-n", lv, "-L", "4194304b", vg},
          error),
      0)
      << error;
  EXPECT_EQ(lvm({"lvs", "--reportformat", "json", "-o", "lv_name,lv_tags", vg}, error), 0) << error;
  EXPECT_NE(vg_->lvm({"lvs", "--noheadings", "-o", "lv_name", vg}).output.find(lv),
            std::string::npos);
  EXPECT_EQ(lvm({"lvremove", "-y", vg + "/" + lv}, error), 0) << error;
}

TEST_F(PrivilegedHelper, OpensOnlyTheGroupsDevices) {
  std::string error;
  int fd = -1;
  for (const std::string& path :
       {std::string("/etc/shadow"), std::string("/dev/") + vg_name_ + "/../../etc/shadow",
        std::string("/dev/") + vg_name_ + "/root", std::string("/dev/null"),
        (dir_ / "backing.img")}) {
    EXPECT_EQ(helper_->open_device(path, O_RDONLY, fd, error), EPERM) << path;
    EXPECT_EQ(fd, -1);
  }
  // The store's flags only: never a create, a truncate or a path it could follow elsewhere.
  EXPECT_EQ(helper_->open_device(vg_->device(), O_RDWR | O_CREAT | O_TRUNC, fd, error), EPERM);
  ASSERT_EQ(helper_->open_device(vg_->device(), O_RDWR | O_DIRECT, fd, error), 0) << error;
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  EXPECT_TRUE(S_ISBLK(st.st_mode));
  ::close(fd);
}

TEST_F(PrivilegedHelper, MountsOnlyBelowItsMountRoot) {
  int fd = -1;
  std::string resolved;
  std::string error;
  ASSERT_EQ(::symlink("/etc", (dir_ / "mounts/escape").c_str()), 0);
  for (const std::string& where :
       {std::string("/etc"), dir_ / "mounts/../", dir_ / "mounts/escape", dir_ / "mounts"}) {
    EXPECT_EQ(helper_->mount(where, fd, resolved, error), EACCES) << where << ": " << error;
    bool lazily = false;
    EXPECT_NE(helper_->unmount(where, lazily, error), 0) << where;
  }
  EXPECT_EQ(mount_options("/etc"), mount_options("/etc"));
}

// A child that becomes `uid`, connects to the helper at `path` and asks hello: 0 when answered.
int hello_as(uid_t uid, gid_t gid, const std::string& path) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0 ||
        ::setresuid(uid, uid, uid) != 0) {
      ::_exit(3);
    }
    std::string error;
    auto helper = Helper::connect(path, error);
    if (!helper) ::_exit(4);
    std::string vg;
    bool dm = false;
    ::_exit(helper->hello(vg, dm, error) == 0 ? 0 : 5);
  }
  return st::wait_exit(pid, std::chrono::seconds(30));
}

// shareblk-helper --listen PATH --daemon-user USER, its output in `log`: its pid, or -1.
pid_t start_listening_helper(const std::string& path, const std::string& user,
                             const std::string& mount_root, const std::string& log) {
  const int out = ::open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND | O_CLOEXEC, 0600);
  if (out < 0) return -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out, 1);
  posix_spawn_file_actions_adddup2(&actions, out, 2);
  std::vector<std::string> args = {
      st::Daemon::helper_binary(), "--listen", path, "--daemon-user", user,
      "--fuse-mount-root",         mount_root};
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  ::close(out);
  return pid;
}

TEST(PrivilegedHelperSocket, AnswersTheDaemonsUserAlone) {
  SHAREBLK_REQUIRE(st::is_root(), "needs root");
  const passwd* pw = ::getpwnam("nobody");
  SHAREBLK_REQUIRE(pw != nullptr, "no user nobody");
  const uid_t nobody = pw->pw_uid;
  const gid_t nogroup = pw->pw_gid;
  st::TempDir dir;
  let_anyone_enter(dir);
  const std::string path = dir / "helper.sock";
  const std::string log = dir / "helper.log";
  const pid_t pid = start_listening_helper(path, "nobody", dir.path().string(), log);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(st::wait_for_socket(path, std::chrono::seconds(10)));

  struct stat sock {};
  ASSERT_EQ(::stat(path.c_str(), &sock), 0);
  EXPECT_EQ(sock.st_mode & 0777, 0600u);
  EXPECT_EQ(sock.st_uid, nobody);
  EXPECT_EQ(hello_as(nobody, nogroup, path), 0);
  // Root reaches the socket file (it may open anything) but the helper does not answer it; any
  // other user cannot even connect.
  EXPECT_EQ(hello_as(0, 0, path), 5);
  EXPECT_EQ(hello_as(1, 1, path), 4);  // daemon (uid 1): EACCES on the socket

  ::kill(pid, SIGTERM);
  st::wait_exit(pid, std::chrono::seconds(10));
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("refused a connection from uid 0"), std::string::npos) << text;
  EXPECT_NE(text.find("\"op\":\"hello\""), std::string::npos) << text;
}

// The helper's service restarts (its unit has Restart=on-failure): the daemon's next request
// reaches the new one, without a restart of the daemon.
TEST(PrivilegedHelperSocket, ADaemonReachesAHelperThatWasStartedAgain) {
  SHAREBLK_REQUIRE(st::is_root(), "needs root");
  st::TempDir dir;
  const std::string path = dir / "helper.sock";
  const std::string log = dir / "helper.log";
  pid_t pid = start_listening_helper(path, "root", dir.path().string(), log);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(st::wait_for_socket(path, std::chrono::seconds(10)));
  std::string error;
  auto helper = Helper::connect(path, error);
  ASSERT_TRUE(helper) << error;
  std::string vg;
  bool dm = false;
  ASSERT_EQ(helper->hello(vg, dm, error), 0) << error;
  ::kill(pid, SIGKILL);
  st::wait_exit(pid, std::chrono::seconds(10));
  EXPECT_EQ(helper->hello(vg, dm, error), EPIPE);  // no helper: a clear error, not a hang
  pid = start_listening_helper(path, "root", dir.path().string(), log);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(st::wait_for_socket(path, std::chrono::seconds(10)));
  EXPECT_EQ(helper->hello(vg, dm, error), 0) << error;
  ::kill(pid, SIGTERM);
  st::wait_exit(pid, std::chrono::seconds(10));
}

// shareblkd started as root with --user: it drops root and keeps a helper for what needs it.
class DaemonWithoutRoot : public ::testing::Test {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(st::is_root(), "needs root (the daemon drops it)");
    SHAREBLK_REQUIRE(::getpwnam("nobody") != nullptr, "no user nobody");
    let_anyone_enter(files_);
  }
  void TearDown() override {
    if (daemon_) {
      EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
    }
  }
  void start(const std::vector<std::string>& extra) {
    std::vector<std::string> args{"--state-dir",   state_.path().string(),
                                  "--listen-unix", files_ / "nbd.sock",
                                  "--workers",     "1",
                                  "--user",        "nobody"};
    args.insert(args.end(), extra.begin(), extra.end());
    daemon_ = std::make_unique<st::Daemon>(args, control());
  }
  std::string control() const { return state_ / "shareblk.sock"; }
  // In a mount namespace of its own, a daemon whose FUSE mount root holds the directory `a`:
  // that root.
  std::string start_with_fuse_root() {
    enter_private_mount_namespace();
    const std::string root = files_ / "mounts";
    if (HasFatalFailure()) return root;
    EXPECT_EQ(::mkdir(root.c_str(), 0755), 0);
    EXPECT_EQ(::mkdir((root + "/a").c_str(), 0755), 0);
    start({"--fuse-mount-root", root});
    return root;
  }
  // /proc's "Uid:" fields (real, effective, saved, file system) of nobody.
  static std::string nobody() {
    const std::string id = std::to_string(::getpwnam("nobody")->pw_uid);
    return "\t" + id + "\t" + id + "\t" + id + "\t" + id;
  }
  std::string daemon_uid() const {
    std::ifstream in("/proc/" + std::to_string(daemon_->pid()) + "/status");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("Uid:", 0) == 0) return line.substr(4);
    }
    return "";
  }
  std::string attach_unix(const std::string& volume) {
    const Json a = st::rpc_ok(control(), "attachment_create",
                              {{"volume_id", volume},
                               {"instance_uuid", "i-1"},
                               {"mode", "rw"},
                               {"connector", {{"host", "h"}, {"transport", "unix"}}}});
    return a["connection_info"]["data"]["uri"].get<std::string>();
  }

  st::TempDir state_;
  st::TempDir files_;
  std::unique_ptr<st::Daemon> daemon_;
};

TEST_F(DaemonWithoutRoot, ServesTheLvmStoreThroughItsHelper) {
  std::string why;
  SHAREBLK_REQUIRE(st::lvm_available(why), why);
  const std::string vg = "sbu" + std::to_string(::getpid());
  st::LoopVolumeGroup group(files_, vg, 128 * kMiB);
  ASSERT_TRUE(group.ok()) << group.why();
  start({"--store", "lvm:" + vg, "--lvm-config", group.daemon_config()});
  st::rpc_ok(control(), "volume_list", Json::object());
  EXPECT_EQ(daemon_uid(), nobody());
  const std::string id = std::to_string(::getpwnam("nobody")->pw_uid);

  const std::string volume =
      st::rpc_ok(control(), "volume_create", {{"name", "v"}, {"size", "8M"}})["id"];
  const std::string data = st::patterned(64 << 10, 7);
  {
    auto h = st::nbd_connect(attach_unix(volume));
    ASSERT_TRUE(h) << nbd_get_error();
    ASSERT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 5 * kMiB, 0), 0) << nbd_get_error();
    ASSERT_EQ(nbd_flush(h.get(), 0), 0);
    EXPECT_EQ(st::nbd_read(h.get(), 5 * kMiB, data.size()), data);
  }
  // The bytes are where lvm2 says the LV's extents are.
  EXPECT_EQ(group.read("volume-" + volume, 5 * kMiB, data.size()), data);
  st::rpc_ok(control(), "volume_extend", {{"volume_id", volume}, {"size", "16M"}});
  EXPECT_GE(group.size("volume-" + volume), 16 * kMiB);
  const auto extents = group.ranges("volume-" + volume);
  st::rpc_ok(control(), "volume_detach", {{"volume_id", volume}});
  st::rpc_ok(control(), "volume_delete", {{"volume_id", volume}, {"wait", true}});
  EXPECT_EQ(group.lvm({"lvs", "--noheadings", "-o", "lv_name", vg}).output.find(volume),
            std::string::npos);
  // Deleting zeroed the extents before lvremove, through the helper's descriptors.
  for (const auto& r : extents) {
    EXPECT_EQ(st::read_file(group.device(), r.physical, r.length), std::string(r.length, '\0'));
  }

  // Every root step went through the helper, which logged it.
  const std::string log = daemon_->log();
  EXPECT_NE(log.find("privileged helper: started (volume group " + vg + ")"), std::string::npos)
      << log;
  EXPECT_NE(log.find("helper: uid " + id + ": {\"argv\":[\"lvcreate\""), std::string::npos) << log;
  EXPECT_NE(log.find("helper: uid " + id + ": {\"flags\":"), std::string::npos) << log;
}

// The helper a daemon started dies: a FUSE detach and the daemon's stop still end (the mount
// stays until the daemon exits), rather than wait for a connection nobody can end.
// Root is gone before the first call is taken: a daemon that listened first and dropped root
// after served whoever called in between with root's authority (seen once in CI).
TEST_F(DaemonWithoutRoot, AnswersItsFirstCallAlreadyWithoutRoot) {
  // Many files for --user to hand over: a while between listening and dropping root.
  const auto many = state_.path() / "many";
  std::filesystem::create_directory(many);
  for (int i = 0; i < 20000; ++i) std::ofstream(many / std::to_string(i));
  for (int round = 0; round < 5; ++round) {
    daemon_.reset();
    start({});
    st::rpc_ok(control(), "volume_list", Json::object());
    ASSERT_EQ(daemon_uid(), nobody()) << "round " << round;
    EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
    daemon_.reset();
  }
}

TEST_F(DaemonWithoutRoot, AFuseDetachEndsWhenItsHelperIsGone) {
  SHAREBLK_REQUIRE(::access("/dev/fuse", R_OK | W_OK) == 0, "needs /dev/fuse");
  const std::string root = start_with_fuse_root();
  ASSERT_FALSE(HasFatalFailure());
  const std::string volume =
      st::rpc_ok(control(), "volume_create", {{"name", "v"}, {"size", "4M"}})["id"];
  const Json a = st::rpc_ok(
      control(), "attachment_create",
      {{"volume_id", volume},
       {"instance_uuid", "i-1"},
       {"mode", "rw"},
       {"connector", {{"host", "h"}, {"transport", "fuse"}, {"mountpoint", root + "/a"}}}});
  ASSERT_NE(mount_options(root + "/a"), "");
  // The helper is the daemon's child.
  std::ifstream children("/proc/" + std::to_string(daemon_->pid()) + "/task/" +
                         std::to_string(daemon_->pid()) + "/children");
  pid_t helper = 0;
  ASSERT_TRUE(children >> helper) << "the daemon has no child";
  ASSERT_EQ(::kill(helper, SIGKILL), 0);
  const auto start_time = std::chrono::steady_clock::now();
  st::rpc(control(), "attachment_delete", {{"attachment_id", a["id"]}});
  EXPECT_LT(std::chrono::steady_clock::now() - start_time, std::chrono::seconds(15));
  EXPECT_NE(daemon_->log().find("it stays until shareblkd exits"), std::string::npos)
      << daemon_->log();
  // TearDown: SIGTERM stops the daemon, status 0.
}

TEST_F(DaemonWithoutRoot, AnLvmStoreWithoutRootOrHelperIsRefusedAtStart) {
  SHAREBLK_REQUIRE(st::have_program("setpriv"), "needs setpriv");
  const st::RunResult r =
      st::run({"setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
               st::Daemon::binary(), "--state-dir", files_ / "s", "--store", "lvm:vg0"},
              std::chrono::seconds(30));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("give --privileged-helper SOCKET"), std::string::npos) << r.output;
}

TEST_F(DaemonWithoutRoot, MountsAndUnmountsFuseThroughItsHelper) {
  SHAREBLK_REQUIRE(::access("/dev/fuse", R_OK | W_OK) == 0, "needs /dev/fuse");
  const std::string root = start_with_fuse_root();
  ASSERT_FALSE(HasFatalFailure());
  const std::string volume =
      st::rpc_ok(control(), "volume_create", {{"name", "v"}, {"size", "4M"}})["id"];
  const Json connector = {{"host", "h"}, {"transport", "fuse"}, {"mountpoint", root + "/a"}};
  const std::string data = st::patterned(4096, 3);
  for (int round = 0; round < 2; ++round) {
    const Json a = st::rpc_ok(control(), "attachment_create",
                              {{"volume_id", volume},
                               {"instance_uuid", "i-" + std::to_string(round)},
                               {"mode", "rw"},
                               {"connector", connector}});
    const std::string options = mount_options(root + "/a");
    for (const char* flag : {"nosuid", "nodev", "noexec"}) {
      EXPECT_NE(options.find(flag), std::string::npos) << options;
    }
    const std::string disk = root + "/a/disk";
    if (round == 0) {
      const int fd = ::open(disk.c_str(), O_WRONLY);
      ASSERT_GE(fd, 0) << std::strerror(errno);
      ASSERT_EQ(::pwrite(fd, data.data(), data.size(), 8192), static_cast<ssize_t>(data.size()));
      ASSERT_EQ(::fsync(fd), 0);
      ::close(fd);
    } else {
      EXPECT_EQ(st::read_file(disk, 8192, data.size()), data);
    }
    st::rpc_ok(control(), "attachment_delete", {{"attachment_id", a["id"]}});
    // Unmounted by the helper: a daemon without root could not.
    EXPECT_EQ(mount_options(root + "/a"), "") << daemon_->log();
  }
  EXPECT_NE(daemon_->log().find("\"op\":\"unmount\""), std::string::npos) << daemon_->log();
}

}  // namespace
