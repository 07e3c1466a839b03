// FUSE local attach on real FUSE mounts, loop devices and ext4 (root).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/falloc.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "backend/backend.h"
#include "fuse/local_attach.h"
#include "tests/control_client.h"
#include "tests/support.h"

namespace shareblk::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

bool fuse_available(std::string& why) {
  if (!is_root()) {
    why = "FUSE local attach tests need root (mount, losetup)";
    return false;
  }
  if (::access("/dev/fuse", R_OK | W_OK) != 0) {
    why = "FUSE local attach tests need /dev/fuse";
    return false;
  }
  for (const char* tool : {"losetup", "mkfs.ext4", "mount", "umount"}) {
    if (!have_program(tool)) {
      why = std::string("FUSE local attach tests need ") + tool;
      return false;
    }
  }
  return true;
}

// A loop device on a file, detached at scope exit.
struct Loop {
  Loop(const std::string& file, bool read_only) {
    std::vector<std::string> argv{"losetup", "--find", "--show"};
    if (read_only) argv.push_back("-r");
    argv.push_back(file);
    RunResult r = run(argv);
    if (r.status == 0) device = r.output.substr(0, r.output.find('\n'));
    output = r.output;
  }
  ~Loop() {
    if (!device.empty()) run({"losetup", "-d", device});
  }
  std::string device;
  std::string output;
};

class FuseAttach : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    SHAREBLK_REQUIRE(fuse_available(why), why);
    make_file(dir_ / "volume.img", 64 * kMiB);
    std::error_code ec;
    volume_ = backend::Volume::open(dir_ / "volume.img", ec);
    ASSERT_TRUE(volume_) << ec.message();
    for (const char* d : {"rw", "ro", "fs-rw", "fs-ro"}) {
      ASSERT_EQ(::mkdir((dir_ / d).c_str(), 0755), 0);
    }
  }

  std::unique_ptr<fuse::LocalAttach> attach(const std::string& where, backend::AttachMode mode) {
    std::string error;
    auto a = fuse::LocalAttach::mount(dir_ / where, dir_.path().string(),
                                      backend::Handle(volume_, mode), error);
    EXPECT_TRUE(a) << error;
    return a;
  }

  TempDir dir_;
  std::shared_ptr<backend::Volume> volume_;
};

TEST_F(FuseAttach, DiskFileHasTheVolumesSizeAndModes) {
  auto rw = attach("rw", backend::AttachMode::ReadWrite);
  auto ro = attach("ro", backend::AttachMode::ReadOnly);
  ASSERT_TRUE(rw && ro);
  struct stat st {};
  ASSERT_EQ(::stat(rw->device_path().c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 64 * kMiB);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  ASSERT_EQ(::stat(ro->device_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0444u);
}

TEST_F(FuseAttach, Ext4OnALoopDeviceAndAReadOnlySecondAttachment) {
  auto rw = attach("rw", backend::AttachMode::ReadWrite);
  ASSERT_TRUE(rw);
  {
    Loop loop(rw->device_path(), false);
    ASSERT_FALSE(loop.device.empty()) << loop.output;
    RunResult mkfs = run({"mkfs.ext4", "-q", "-F", loop.device});
    ASSERT_EQ(mkfs.status, 0) << mkfs.output;
    RunResult m = run({"mount", loop.device, dir_ / "fs-rw"});
    ASSERT_EQ(m.status, 0) << m.output;
    {
      std::ofstream out(dir_ / "fs-rw/hello.txt");
      out << "written through FUSE, a loop device and ext4\n";
    }
    RunResult sync = run({"sync", "-f", dir_ / "fs-rw/hello.txt"});
    EXPECT_EQ(sync.status, 0) << sync.output;
    RunResult u = run({"umount", dir_ / "fs-rw"});  // the writer's flush: everything on disk
    ASSERT_EQ(u.status, 0) << u.output;
  }

  // A read-only attachment of the same volume on another mountpoint sees the file system.
  auto ro = attach("ro", backend::AttachMode::ReadOnly);
  ASSERT_TRUE(ro);
  Loop loop(ro->device_path(), true);
  ASSERT_FALSE(loop.device.empty()) << loop.output;
  RunResult m = run({"mount", "-o", "ro,noload", loop.device, dir_ / "fs-ro"});
  ASSERT_EQ(m.status, 0) << m.output;
  std::string line;
  {
    std::ifstream in(dir_ / "fs-ro/hello.txt");
    std::getline(in, line);
  }
  EXPECT_EQ(line, "written through FUSE, a loop device and ext4");
  RunResult u = run({"umount", dir_ / "fs-ro"});
  EXPECT_EQ(u.status, 0) << u.output;
}

TEST_F(FuseAttach, EveryWriteThroughAReadOnlyAttachmentIsRefused) {
  auto ro = attach("ro", backend::AttachMode::ReadOnly);
  ASSERT_TRUE(ro);
  const std::string before = read_file(dir_ / "volume.img", 0, kMiB);
  // Open for writing: refused (even for root, whom permission bits do not stop).
  int fd = ::open(ro->device_path().c_str(), O_RDWR);
  EXPECT_LT(fd, 0);
  EXPECT_TRUE(errno == EROFS || errno == EPERM || errno == EACCES) << std::strerror(errno);
  if (fd >= 0) ::close(fd);
  EXPECT_NE(::truncate(ro->device_path().c_str(), 0), 0);
  // A read-only descriptor can still ask for fallocate; the backend says no.
  fd = ::open(ro->device_path().c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  EXPECT_NE(::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
  ::close(fd);
  // A loop device on it is read-only whatever losetup is asked.
  Loop loop(ro->device_path(), false);
  if (!loop.device.empty()) {
    int dev = ::open(loop.device.c_str(), O_WRONLY);
    if (dev >= 0) {
      char block[4096] = {1};
      EXPECT_LT(::pwrite(dev, block, sizeof block, 0), 0);
      ::close(dev);
    }
  }
  EXPECT_EQ(read_file(dir_ / "volume.img", 0, kMiB), before);
}

TEST_F(FuseAttach, FsyncFlushesAndPunchHoleReadsZeroes) {
  auto rw = attach("rw", backend::AttachMode::ReadWrite);
  ASSERT_TRUE(rw);
  int fd = ::open(rw->device_path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  std::string data(8192, 'q');
  ASSERT_EQ(::pwrite(fd, data.data(), data.size(), 4096), 8192);
  EXPECT_EQ(::fsync(fd), 0);
  EXPECT_EQ(read_file(dir_ / "volume.img", 4096, 8192), data);
  ASSERT_EQ(::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 4096, 4096), 0);
  char back[4096];
  ASSERT_EQ(::pread(fd, back, sizeof back, 4096), 4096);
  EXPECT_EQ(std::string(back, sizeof back), std::string(4096, '\0'));
  // Past the end is the end of the file, as for a block device.
  EXPECT_EQ(::pread(fd, back, sizeof back, 64 * kMiB), 0);
  ::close(fd);
}

TEST_F(FuseAttach, UnmountWhileALoopDeviceHoldsItDetachesLazilyAndStopsIo) {
  auto rw = attach("rw", backend::AttachMode::ReadWrite);
  ASSERT_TRUE(rw);
  Loop loop(rw->device_path(), false);
  ASSERT_FALSE(loop.device.empty()) << loop.output;
  EXPECT_TRUE(rw->unmount()) << "a busy mount should be detached lazily";
  const std::string before = read_file(dir_ / "volume.img", 0, 4096);
  int dev = ::open(loop.device.c_str(), O_WRONLY | O_DIRECT);
  if (dev >= 0) {
    void* block = nullptr;
    ASSERT_EQ(::posix_memalign(&block, 4096, 4096), 0);
    std::memset(block, 7, 4096);
    EXPECT_LT(::pwrite(dev, block, 4096, 0), 0) << "no byte may move after detach";
    std::free(block);
    ::close(dev);
  }
  EXPECT_EQ(read_file(dir_ / "volume.img", 0, 4096), before);
}

TEST_F(FuseAttach, UnmountCutsOffABindMountOfTheSameFileSystem) {
  // umount of our mountpoint succeeds while a bind mount keeps the file system: detach must
  // still end the connection, or it would wait for a request and then serve it.
  auto rw = attach("rw", backend::AttachMode::ReadWrite);
  ASSERT_TRUE(rw);
  ASSERT_EQ(::mkdir((dir_ / "bound").c_str(), 0755), 0);
  ASSERT_EQ(::mount((dir_ / "rw").c_str(), (dir_ / "bound").c_str(), nullptr, MS_BIND, nullptr), 0)
      << std::strerror(errno);
  EXPECT_FALSE(rw->unmount());  // returns: the abort ended the loop
  const std::string before = read_file(dir_ / "volume.img", 0, 4096);
  int fd = ::open((dir_ / "bound/disk").c_str(), O_RDWR);
  if (fd >= 0) {
    char block[4096];
    std::memset(block, 7, sizeof block);
    EXPECT_LT(::pwrite(fd, block, sizeof block, 0), 0) << "no byte may move after detach";
    ::close(fd);
  }
  ::umount2((dir_ / "bound").c_str(), MNT_DETACH);
  EXPECT_EQ(read_file(dir_ / "volume.img", 0, 4096), before);
}

// Thread ids of this process.
std::set<std::string> thread_ids() {
  std::set<std::string> ids;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    ids.insert(task.path().filename().string());
  }
  return ids;
}

TEST_F(FuseAttach, TheLoopKeepsItsThreadsUnderLoad) {
  // A thread made and torn down per request cost 10-20x the listener's CPU per 4 KiB read.
  auto rw = attach("rw", backend::AttachMode::ReadWrite);
  ASSERT_TRUE(rw);
  std::atomic<bool> stop{false};
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&, t] {
      int fd = ::open(rw->device_path().c_str(), O_RDONLY);
      if (fd < 0) return;
      char block[4096];
      for (uint64_t i = 0; !stop; ++i) {
        if (::pread(fd, block, sizeof block, static_cast<off_t>(((i * 4 + t) % 1024) * 4096)) < 0) {
          break;
        }
      }
      ::close(fd);
    });
  }
  std::set<std::string> seen;
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (std::chrono::steady_clock::now() < end) {
    std::set<std::string> now = thread_ids();
    seen.insert(now.begin(), now.end());
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  stop = true;
  for (auto& t : readers) t.join();
  // This thread, 4 readers, the session's loop threads (at most 8 plus the one that started
  // them), and a little slack for the test runner's own.
  EXPECT_LE(seen.size(), 20u) << "the FUSE loop is creating a thread per request: " << seen.size()
                              << " threads";
}

// A log sink that keeps error messages.
class ErrorLog : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::vector<std::string> lines;

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    if (msg.level >= spdlog::level::err) lines.emplace_back(msg.payload.begin(), msg.payload.end());
  }
  void flush_() override {}
};

TEST_F(FuseAttach, ACleanUnmountLogsNoError) {
  auto sink = std::make_shared<ErrorLog>();
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("test", sink));
  auto rw = attach("rw", backend::AttachMode::ReadWrite);
  ASSERT_TRUE(rw);
  EXPECT_FALSE(rw->unmount());
  spdlog::set_default_logger(previous);
  EXPECT_TRUE(sink->lines.empty()) << sink->lines.front();
}

// The same frontend driven through the attachment API of a running daemon.
class FuseThroughDaemon : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    SHAREBLK_REQUIRE(fuse_available(why), why);
    for (const char* d : {"mnt-rw", "mnt-ro"}) ASSERT_EQ(::mkdir((dir_ / d).c_str(), 0755), 0);
    start();
    volume_ = rpc_ok(socket(), "volume_create",
                     {{"name", "local"}, {"size", "16M"}, {"multiattach", true}})["id"];
  }
  void start() {
    daemon_ = std::make_unique<Daemon>(
        std::vector<std::string>{"--state-dir", dir_ / "var", "--listen-unix", dir_ / "nbd.sock",
                                 "--workers", "1", "--fuse-mount-root", dir_.path().string()},
        socket());
  }
  std::string socket() const { return dir_ / "var/shareblk.sock"; }
  nlohmann::json attach(const std::string& instance, const std::string& mode,
                        const std::string& mountpoint) {
    return rpc_ok(
        socket(), "attachment_create",
        {{"volume_id", volume_},
         {"instance_uuid", instance},
         {"mode", mode},
         {"connector", {{"host", instance}, {"transport", "fuse"}, {"mountpoint", mountpoint}}}});
  }
  static bool mounted(const std::string& mountpoint) {
    std::ifstream in("/proc/self/mountinfo");
    std::string line;
    while (std::getline(in, line)) {
      if (line.find(" " + mountpoint + " ") != std::string::npos) return true;
    }
    return false;
  }

  TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
  std::string volume_;
};

TEST_F(FuseThroughDaemon, AttachMountsDetachUnmountsAndTheBytesAreTheVolumes) {
  nlohmann::json rw = attach("writer", "rw", dir_ / "mnt-rw");
  EXPECT_EQ(rw["connection_info"]["driver_volume_type"], "local");
  const std::string disk = rw["connection_info"]["data"]["device_path"];
  EXPECT_EQ(disk, dir_ / "mnt-rw/disk");
  EXPECT_EQ(rw["connection_info"]["data"]["access_mode"], "rw");
  EXPECT_EQ(rw["connection_info"]["data"]["shareable"], true);
  nlohmann::json ro = attach("reader", "ro", dir_ / "mnt-ro");
  const std::string ro_disk = ro["connection_info"]["data"]["device_path"];

  int fd = ::open(disk.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const std::string data(65536, 'L');
  ASSERT_EQ(::pwrite(fd, data.data(), data.size(), 8192), static_cast<ssize_t>(data.size()));
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
  EXPECT_EQ(read_file(ro_disk, 8192, data.size()), data);  // through the read-only attachment
  EXPECT_EQ(read_file(dir_ / ("var/volumes/" + volume_ + ".img"), 8192, data.size()), data);
  EXPECT_LT(::open(ro_disk.c_str(), O_WRONLY), 0);

  nlohmann::json gone = rpc_ok(socket(), "attachment_delete", {{"attachment_id", rw["id"]}});
  EXPECT_EQ(gone["attach_status"], "detached");
  EXPECT_FALSE(mounted(dir_ / "mnt-rw"));
  EXPECT_TRUE(mounted(dir_ / "mnt-ro"));
}

// The fence reaches FUSE attachments too: a standby's mount refuses writes until it takes
// over, then the old writer's does; a live demotion refuses on the mount it has.
TEST_F(FuseThroughDaemon, TakeoverAndModeChangeFenceTheMounts) {
  const std::string single = rpc_ok(
      socket(), "volume_create",
      {{"name", "pair"}, {"size", "4M"}, {"multiattach", true}, {"writer_policy", "single"}})["id"];
  auto attach_fuse = [&](const std::string& instance, const std::string& mountpoint) {
    return rpc_ok(
        socket(), "attachment_create",
        {{"volume_id", single},
         {"instance_uuid", instance},
         {"connector", {{"host", instance}, {"transport", "fuse"}, {"mountpoint", mountpoint}}}});
  };
  const nlohmann::json a = attach_fuse("node-a", dir_ / "mnt-rw");
  const nlohmann::json b = attach_fuse("node-b", dir_ / "mnt-ro");
  auto write_at = [](const std::string& disk, char byte, off_t offset) {
    int fd = ::open(disk.c_str(), O_RDWR);
    if (fd < 0) return errno;
    const std::string data(4096, byte);
    int err =
        ::pwrite(fd, data.data(), data.size(), offset) == 4096 && ::fsync(fd) == 0 ? 0 : errno;
    ::close(fd);
    return err;
  };
  const std::string disk_a = dir_ / "mnt-rw/disk", disk_b = dir_ / "mnt-ro/disk";
  EXPECT_EQ(write_at(disk_a, 'a', 0), 0);
  EXPECT_EQ(write_at(disk_b, 'b', 4096), EPERM) << "a standby wrote";
  rpc_ok(socket(), "volume_takeover", {{"volume_id", single}, {"attachment_id", b["id"]}});
  EXPECT_EQ(write_at(disk_a, 'A', 0), EPERM) << "the old writer wrote after the takeover";
  EXPECT_EQ(write_at(disk_b, 'B', 4096), 0);
  EXPECT_EQ(read_file(disk_b, 0, 4096), std::string(4096, 'a'));
  EXPECT_EQ(read_file(disk_a, 4096, 4096), std::string(4096, 'B'));
  rpc_ok(socket(), "attachment_update", {{"attachment_id", b["id"]}, {"mode", "ro"}});
  EXPECT_EQ(write_at(disk_b, 'x', 4096), EPERM) << "written after its demotion";
  EXPECT_EQ(read_file(disk_b, 4096, 4096), std::string(4096, 'B'));
}

TEST_F(FuseThroughDaemon, BusyMountIsDetachedLazilyAndSaysSo) {
  nlohmann::json rw = attach("writer", "rw", dir_ / "mnt-rw");
  int fd = ::open((dir_ / "mnt-rw/disk").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  nlohmann::json gone = rpc_ok(socket(), "attachment_delete", {{"attachment_id", rw["id"]}});
  EXPECT_EQ(gone.value("unmounted_lazily", false), true);
  char byte = 'x';
  EXPECT_LT(::pwrite(fd, &byte, 1, 0), 0) << "nothing may be written after detach";
  ::close(fd);
  EXPECT_FALSE(mounted(dir_ / "mnt-rw"));
}

TEST_F(FuseThroughDaemon, RestartAndKillMountTheLiveAttachmentsAgain) {
  attach("writer", "rw", dir_ / "mnt-rw");
  const std::string data(4096, 'K');
  {
    int fd = ::open((dir_ / "mnt-rw/disk").c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, data.data(), data.size(), 0), 4096);
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
  }
  daemon_->stop(SIGTERM);
  EXPECT_FALSE(mounted(dir_ / "mnt-rw")) << "a clean stop unmounts";
  start();
  EXPECT_TRUE(mounted(dir_ / "mnt-rw"));
  EXPECT_EQ(read_file(dir_ / "mnt-rw/disk", 0, 4096), data);

  daemon_->stop(SIGKILL);  // leaves a dead mount behind
  start();                 // which must not block the next start
  EXPECT_EQ(read_file(dir_ / "mnt-rw/disk", 0, 4096), data);
}

}  // namespace
}  // namespace shareblk::testing
