// One capability rule for every frontend. For a read-write and a read-only attachment of one
// volume, end to end with the real daemon: what shareblkd's NBD listener advertises, what
// nbdkit with the plugin advertises, and what the FUSE file allows all equal
// backend::capabilities() for that attachment, and each frontend enforces it (a write through
// the read-only attachment fails on all three and changes nothing).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <libnbd.h>
#include <linux/falloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "tests/control_client.h"
#include "tests/nbd_client.h"
#include "tests/nbdkit_child.h"
#include "tests/support.h"

namespace shareblk::testing {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMiB = 1 << 20;

// What a frontend says an attachment may do, in backend::Capabilities' terms.
struct Advertised {
  bool read_only, trim, zero, fast_zero, flush, fua, multi_conn, block_status, cache;
  bool operator==(const Advertised&) const = default;
};

std::ostream& operator<<(std::ostream& out, const Advertised& a) {
  return out << "{read_only " << a.read_only << ", trim " << a.trim << ", zero " << a.zero
             << ", fast_zero " << a.fast_zero << ", flush " << a.flush << ", fua " << a.fua
             << ", multi_conn " << a.multi_conn << ", block_status " << a.block_status << ", cache "
             << a.cache << "}";
}

Advertised from_backend(const backend::Capabilities& c) {
  return {c.read_only, c.trim,       c.zero,         c.fast_zero, c.flush,
          c.fua,       c.multi_conn, c.block_status, c.cache};
}

// The transmission flags and metadata contexts an NBD server gave `h`.
Advertised from_nbd(nbd_handle* h) {
  return {nbd_is_read_only(h) == 1,   nbd_can_trim(h) == 1,
          nbd_can_zero(h) == 1,       nbd_can_fast_zero(h) == 1,
          nbd_can_flush(h) == 1,      nbd_can_fua(h) == 1,
          nbd_can_multi_conn(h) == 1, nbd_can_meta_context(h, LIBNBD_CONTEXT_BASE_ALLOCATION) == 1,
          nbd_can_cache(h) == 1};
}

// 0 or the errno of a request that failed.
int nbd_errno(int rc) {
  return rc == -1 ? nbd_get_errno() : 0;
}

// Every request an NBD server may be sent, through `h` (libnbd's own checks off, so that each
// reaches the server): each succeeds where `can` allows it, and the changes fail with EPERM
// where the attachment is read-only.
void expect_nbd_enforces(nbd_handle* h, const backend::Capabilities& can) {
  const std::string data(4096, '\x5e');
  const int change = can.read_only ? EPERM : 0;
  EXPECT_EQ(nbd_errno(nbd_pwrite(h, data.data(), data.size(), 0, 0)), change) << "write";
  if (can.fua && !can.read_only) {
    EXPECT_EQ(nbd_errno(nbd_pwrite(h, data.data(), data.size(), 4096, LIBNBD_CMD_FLAG_FUA)), 0)
        << "FUA write";
  }
  EXPECT_EQ(nbd_errno(nbd_trim(h, 4096, 8192, 0)), can.trim ? 0 : EPERM) << "trim";
  EXPECT_EQ(nbd_errno(nbd_zero(h, 4096, 12288, 0)), can.zero ? 0 : EPERM) << "zero";
  EXPECT_EQ(nbd_errno(nbd_zero(h, 4096, 16384, LIBNBD_CMD_FLAG_FAST_ZERO)),
            can.fast_zero ? 0 : EPERM)
      << "fast zero";
  if (can.flush) {
    EXPECT_EQ(nbd_errno(nbd_flush(h, 0)), 0) << "flush";
  }
  if (can.cache) {
    EXPECT_EQ(nbd_errno(nbd_cache(h, 4096, 0, 0)), 0) << "cache";
  }
  if (can.block_status) {
    nbd_extent_callback ignore{
        [](void*, const char*, uint64_t, uint32_t*, size_t, int*) { return 0; }, nullptr, nullptr};
    EXPECT_EQ(nbd_errno(nbd_block_status(h, 4096, 0, ignore, 0)), 0) << "block status";
  }
  std::string back(4096, '\0');
  EXPECT_EQ(nbd_errno(nbd_pread(h, back.data(), back.size(), 0, 0)), 0) << "read";
}

class CapabilityTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<Daemon>(
        std::vector<std::string>{"--state-dir", dir_ / "var", "--listen-unix", dir_ / "nbd.sock",
                                 "--workers", "1", "--fuse-mount-root", dir_.path().string()},
        control_socket());
    volume_ = rpc_ok(control_socket(), "volume_create",
                     {{"name", "caps"}, {"size", 4 * kMiB}, {"multiattach", true}})["id"];
    make_file(scratch(), 4 * kMiB, 0x11);  // known bytes, written through no frontend
    std::error_code ec;
    auto writer = backend::Volume::open(backing(), ec);
    ASSERT_TRUE(writer) << ec.message();
    const std::string fill = read_file(scratch(), 0, 4 * kMiB);
    ASSERT_EQ(backend::Handle(writer, backend::AttachMode::ReadWrite)
                  .write(fill.data(), fill.size(), 0, backend::kFua),
              0);
  }

  void TearDown() override {
    if (nbdkit_) {
      const int status = nbdkit_->stop(SIGTERM);
      EXPECT_EQ(status, 0) << nbdkit_->log();
    }
    if (daemon_) {
      EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
    }
  }

  std::string control_socket() const { return dir_ / "var/shareblk.sock"; }
  std::string backing() const { return dir_ / ("var/volumes/" + volume_ + ".img"); }
  std::string scratch() const { return dir_ / "scratch.img"; }
  std::string mode() const { return GetParam(); }
  backend::AttachMode attach_mode() const {
    return mode() == "rw" ? backend::AttachMode::ReadWrite : backend::AttachMode::ReadOnly;
  }

  // What the backend says this test's attachment may do: the rule under test.
  backend::Capabilities expected() {
    std::error_code ec;
    auto volume = backend::Volume::open(backing(), ec);
    EXPECT_TRUE(volume) << ec.message();
    return volume ? backend::capabilities(*volume, attach_mode()) : backend::Capabilities{};
  }

  // An attachment in this test's mode through to attached, on `connector`.
  Json attach(const std::string& instance, const Json& connector) {
    Json a = rpc_ok(control_socket(), "attachment_create",
                    {{"volume_id", volume_},
                     {"instance_uuid", instance},
                     {"mode", mode()},
                     {"connector", connector}});
    return rpc_ok(control_socket(), "attachment_complete", {{"attachment_id", a["id"]}});
  }
  // With multi_conn, so that the listener may advertise every backend capability (without it
  // an attachment takes one connection at a time and does not advertise CAN_MULTI_CONN).
  Json attach_nbd() {
    return attach("nbd-" + mode(), {{"host", "h"}, {"transport", "unix"}, {"multi_conn", true}});
  }

  // The bytes a read-only attachment must leave alone.
  void expect_unchanged_if_read_only() {
    if (mode() == "ro") {
      EXPECT_TRUE(read_file(backing(), 0, 4 * kMiB) == read_file(scratch(), 0, 4 * kMiB))
          << "a read-only attachment changed the volume";
    }
  }

  TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Nbdkit> nbdkit_;
  std::string volume_;
};

// (a) shareblkd's own NBD listener: the handshake's transmission flags and meta contexts.
TEST_P(CapabilityTest, NbdListenerAdvertisesAndEnforcesTheBackendsCapabilities) {
  const backend::Capabilities can = expected();
  const Json a = attach_nbd();
  const std::string uri = a["connection_info"]["data"]["uri"];
  NbdHandle h = nbd_connect(uri, nullptr, {.strict = false, .base_allocation = true});
  ASSERT_TRUE(h) << nbd_get_error();
  EXPECT_EQ(from_nbd(h.get()), from_backend(can));
  expect_nbd_enforces(h.get(), can);
  expect_unchanged_if_read_only();
}

// (b) nbdkit with the plugin: its can_* callbacks.
TEST_P(CapabilityTest, NbdkitPluginAdvertisesAndEnforcesTheBackendsCapabilities) {
  SHAREBLK_REQUIRE(have_program("nbdkit"), "nbdkit is not installed");
  const backend::Capabilities can = expected();
  const Json a = attach_nbd();
  const std::string kit_socket = dir_ / "kit.sock";
  nbdkit_ =
      std::make_unique<Nbdkit>(std::vector<std::string>{"--unix", kit_socket, NBDKIT_PLUGIN_PATH,
                                                        "control=" + control_socket()},
                               dir_ / "kit.pid", dir_ / "kit.log");
  const std::string uri = "nbd+unix:///" +
                          a["connection_info"]["data"]["export_name"].get<std::string>() +
                          "?socket=" + kit_socket;
  NbdHandle h = nbd_connect(uri, nullptr, {.strict = false, .base_allocation = true});
  ASSERT_TRUE(h) << nbd_get_error() << nbdkit_->log();
  Advertised want = from_backend(can);
  // Two answers are nbdkit's own, not the plugin's: its server asks can_fua only of a writable
  // export (FUA changes nothing on one that takes no writes), and the plugin has no cache
  // callback, so nbdkit does not offer NBD_CMD_CACHE.
  want.fua = can.fua && !can.read_only;
  want.cache = false;
  EXPECT_EQ(from_nbd(h.get()), want);
  backend::Capabilities enforced = can;
  enforced.cache = false;
  expect_nbd_enforces(h.get(), enforced);
  expect_unchanged_if_read_only();
}

// (c) FUSE: the file's mode, and which of open for writing, write, fallocate (punch, zero) and
// fsync succeed.
TEST_P(CapabilityTest, FuseFileAllowsExactlyTheBackendsCapabilities) {
  SHAREBLK_REQUIRE(is_root() && ::access("/dev/fuse", R_OK | W_OK) == 0,
                   "FUSE local attach needs root and /dev/fuse");
  const backend::Capabilities can = expected();
  const std::string mountpoint = dir_ / "mnt";
  ASSERT_EQ(::mkdir(mountpoint.c_str(), 0755), 0);
  const Json a =
      attach("fuse-" + mode(), {{"host", "h"}, {"transport", "fuse"}, {"mountpoint", mountpoint}});
  const std::string disk = a["connection_info"]["data"]["device_path"];

  struct stat st {};
  ASSERT_EQ(::stat(disk.c_str(), &st), 0) << std::strerror(errno);
  EXPECT_EQ(st.st_mode & 0777, can.read_only ? 0444u : 0644u);

  int fd = ::open(disk.c_str(), O_RDWR);
  const int open_errno = fd < 0 ? errno : 0;
  EXPECT_EQ(open_errno, can.read_only ? EROFS : 0) << "open for writing";
  if (fd < 0) fd = ::open(disk.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0) << std::strerror(errno);

  auto result = [](long rc) { return rc < 0 ? errno : 0; };
  const std::string data(4096, '\x5e');
  const int write_errno = result(::pwrite(fd, data.data(), data.size(), 0));
  EXPECT_EQ(write_errno == 0, !can.read_only) << "write: " << std::strerror(write_errno);
  const int punch_errno =
      result(::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 4096, 4096));
  EXPECT_EQ(punch_errno == 0, can.trim) << "punch: " << std::strerror(punch_errno);
  const int zero_errno = result(::fallocate(fd, FALLOC_FL_ZERO_RANGE, 8192, 4096));
  EXPECT_EQ(zero_errno == 0, can.zero) << "zero range: " << std::strerror(zero_errno);
  const int fsync_errno = result(::fsync(fd));
  EXPECT_EQ(fsync_errno == 0, can.flush) << "fsync: " << std::strerror(fsync_errno);
  std::string back(4096, '\0');
  EXPECT_EQ(::pread(fd, back.data(), back.size(), 0), 4096);
  ::close(fd);
  expect_unchanged_if_read_only();
}

INSTANTIATE_TEST_SUITE_P(Modes, CapabilityTest, ::testing::Values("rw", "ro"),
                         [](const ::testing::TestParamInfo<const char*>& mode) {
                           return std::string(mode.param);
                         });

}  // namespace
}  // namespace shareblk::testing
