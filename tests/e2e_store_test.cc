// The file store's long operations end to end: volumes filled from raw and qcow2 images by
// qemu-img, read back through NBD; deletes that return at once; sparse volumes on a full file
// system, whose writes get ENOSPC on the wire while everything else goes on.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "tests/managed_daemon.h"

namespace shareblk::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

std::string pattern(size_t length, int seed) {
  std::string s(length, '\0');
  for (size_t i = 0; i < length; ++i) s[i] = static_cast<char>((i * 7 + seed) % 253);
  return s;
}

struct Nbd {
  explicit Nbd(const std::string& uri) : h(nbd_create()) {
    ok = h != nullptr && nbd_connect_uri(h, uri.c_str()) == 0;
  }
  ~Nbd() {
    if (h) nbd_close(h);
  }
  Nbd(const Nbd&) = delete;
  Nbd& operator=(const Nbd&) = delete;
  nbd_handle* h;
  bool ok = false;
};

class StoreTest : public ManagedDaemonTest {
 protected:
  std::string uri(const std::string& volume, const std::string& instance) {
    return attach(volume, instance,
                  {{"host", instance}, {"transport", "unix"}})["connection_info"]["data"]["uri"];
  }
  // volume_show until its status is no longer `busy` (at most 30 s); the last one.
  Json settle(const std::string& id, const std::string& busy) {
    Json v = rpc(control(), "volume_show", {{"volume_id", id}});
    for (int i = 0; i < 3000 && v.contains("result") && v["result"]["status"] == busy; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      v = rpc(control(), "volume_show", {{"volume_id", id}});
    }
    return v;
  }
  RunResult cli(std::vector<std::string> args) {
    std::vector<std::string> argv{SHAREBLK_CLI_PATH, "--socket", control()};
    argv.insert(argv.end(), args.begin(), args.end());
    return run(argv, std::chrono::seconds(60));
  }
};

TEST_F(StoreTest, VolumesFilledFromQcow2AndRawImagesReadBackThroughNbd) {
  SHAREBLK_REQUIRE(have_program("qemu-img"), "qemu-img is not installed");
  start();
  const std::string data = pattern(3 * kMiB + 4096, 1);
  const std::string raw = dir_ / "image.raw";
  { std::ofstream(raw, std::ios::binary) << data; }
  const std::string qcow2 = dir_ / "image.qcow2";
  RunResult made = run({"qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, qcow2});
  ASSERT_EQ(made.status, 0) << made.output;

  // qcow2, its size taken from the image: "creating" until qemu-img is done.
  Json created = rpc_ok(control(), "volume_create", {{"name", "q"}, {"from_image", qcow2}});
  EXPECT_EQ(created["status"], "creating") << created;
  EXPECT_EQ(created["size"], data.size());
  const std::string q = created["id"];
  Json filled = settle(q, "creating");
  ASSERT_EQ(filled["result"]["status"], "available") << filled;
  EXPECT_TRUE(filled["result"]["progress"].is_null()) << filled;
  {
    Nbd nbd(uri(q, "qa"));
    ASSERT_TRUE(nbd.ok) << nbd_get_error();
    EXPECT_EQ(nbd_get_size(nbd.h), static_cast<int64_t>(data.size()));
    std::string back(data.size(), '\0');
    ASSERT_EQ(nbd_pread(nbd.h, back.data(), back.size(), 0, 0), 0) << nbd_get_error();
    EXPECT_TRUE(back == data);
  }

  // raw into a bigger volume: the image, then zeroes. Through the CLI, which waits.
  RunResult cli_made = cli({"--json", "volume-create", "r", "5M", "--from-image", raw});
  ASSERT_EQ(cli_made.status, 0) << cli_made.output;
  const Json r = Json::parse(cli_made.output, nullptr, false);
  ASSERT_EQ(r["status"], "available") << cli_made.output;
  EXPECT_EQ(r["size"], 5 * kMiB);
  Nbd nbd(uri(r["id"], "ra"));
  ASSERT_TRUE(nbd.ok) << nbd_get_error();
  std::string back(5 * kMiB, 'x');
  ASSERT_EQ(nbd_pread(nbd.h, back.data(), back.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back.substr(0, data.size()) == data);
  EXPECT_EQ(back.substr(data.size()), std::string(back.size() - data.size(), '\0'));
}

TEST_F(StoreTest, ImagesThatCannotFillAVolumeAreRefusedWithTheirReason) {
  SHAREBLK_REQUIRE(have_program("qemu-img"), "qemu-img is not installed");
  start();
  const std::string base = dir_ / "base.qcow2";
  const std::string overlay = dir_ / "overlay.qcow2";
  ASSERT_EQ(run({"qemu-img", "create", "-f", "qcow2", base, "4M"}).status, 0);
  ASSERT_EQ(run({"qemu-img", "create", "-f", "qcow2", "-b", base, "-F", "qcow2", overlay}).status,
            0);
  auto refused = [&](const Json& params) {
    Json reply = rpc(control(), "volume_create", params);
    EXPECT_EQ(reply["error"]["data"]["reason"], "invalid_params") << reply;
    return reply["error"]["message"].is_string() ? reply["error"]["message"].get<std::string>()
                                                 : "";
  };
  EXPECT_NE(refused({{"name", "v"}, {"from_image", dir_ / "missing.qcow2"}}).find("No such file"),
            std::string::npos);
  EXPECT_NE(refused({{"name", "v"}, {"from_image", dir_.path().string()}}).find("not a file"),
            std::string::npos);
  EXPECT_NE(refused({{"name", "v"}, {"from_image", "relative.qcow2"}}).find("absolute"),
            std::string::npos);
  EXPECT_NE(refused({{"name", "v"}, {"size", "1M"}, {"from_image", base}}).find("smaller"),
            std::string::npos);
  EXPECT_NE(refused({{"name", "v"}, {"from_image", overlay}}).find("backing file"),
            std::string::npos);
  EXPECT_NE(refused({{"name", "v"}}).find("size"), std::string::npos);
  EXPECT_TRUE(rpc_ok(control(), "volume_list").empty());
}

// While qemu-img fills it (slowed down by the test hook), the volume is "creating": it cannot
// be attached, grown or deleted; other volumes are unaffected.
TEST_F(StoreTest, AVolumeBeingFilledRefusesAttachmentsUntilItIsDone) {
  SHAREBLK_REQUIRE_TEST_HOOKS();
  SHAREBLK_REQUIRE(have_program("qemu-img"), "qemu-img is not installed");
  const std::string raw = dir_ / "image.raw";
  { std::ofstream(raw, std::ios::binary) << pattern(kMiB, 3); }
  ::setenv("SHAREBLK_TEST_JOB_PAUSE_MS", "800", 1);
  start();
  ::unsetenv("SHAREBLK_TEST_JOB_PAUSE_MS");
  const std::string id =
      rpc_ok(control(), "volume_create", {{"name", "v"}, {"from_image", raw}})["id"];
  EXPECT_EQ(rpc_reason(control(), "attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}}),
            "volume_busy");
  EXPECT_EQ(rpc_reason(control(), "volume_extend", {{"volume_id", id}, {"size", "2M"}}),
            "volume_busy");
  EXPECT_EQ(rpc_reason(control(), "volume_delete", {{"volume_id", id}}), "volume_busy");
  const std::string other = create_volume("1M");
  Nbd nbd(uri(other, "o"));
  ASSERT_TRUE(nbd.ok) << nbd_get_error();
  EXPECT_EQ(rpc_ok(control(), "volume_show", {{"volume_id", id}})["status"], "creating");
  EXPECT_EQ(settle(id, "creating")["result"]["status"], "available");
  rpc_ok(control(), "attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}});
}

// A fill that a kill interrupts (here: once qemu-img is done, before the intent is dropped)
// cannot be trusted: the next start rolls the volume back, file and row.
TEST_F(StoreTest, AFillKilledHalfWayIsRolledBackByTheNextStart) {
  SHAREBLK_REQUIRE_TEST_HOOKS();
  SHAREBLK_REQUIRE(have_program("qemu-img"), "qemu-img is not installed");
  const std::string raw = dir_ / "image.raw";
  { std::ofstream(raw, std::ios::binary) << pattern(kMiB, 4); }
  start();
  const std::string kept = create_volume("1M");
  ::setenv("SHAREBLK_TEST_KILL_AT", "volume_create:filled", 1);
  start();
  ::unsetenv("SHAREBLK_TEST_KILL_AT");
  const std::string id =
      rpc_ok(control(), "volume_create", {{"name", "v"}, {"from_image", raw}})["id"];
  for (int i = 0; i < 1000 && ::kill(daemon_->pid(), 0) == 0 &&
                  daemon_->log().find("SHAREBLK_TEST_KILL_AT") == std::string::npos;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(daemon_->stop(SIGKILL), 128 + SIGKILL);
  EXPECT_TRUE(std::filesystem::exists(dir_ / ("volumes/" + id + ".img")));
  daemon_.reset();
  start();
  EXPECT_EQ(rpc_reason(control(), "volume_show", {{"volume_id", id}}), "not_found");
  EXPECT_FALSE(std::filesystem::exists(dir_ / ("volumes/" + id + ".img")));
  EXPECT_EQ(rpc_ok(control(), "volume_show", {{"volume_id", kept}})["status"], "available");
  EXPECT_NE(daemon_->log().find("rolled back"), std::string::npos) << daemon_->log();
}

TEST_F(StoreTest, VolumeDeleteReturnsAtOnceAndTheCliWaits) {
  start();
  const std::string a = create_volume("4M");
  Json started = rpc_ok(control(), "volume_delete", {{"volume_id", a}});
  EXPECT_EQ(started["id"], a);
  EXPECT_EQ(started["status"], "deleting");
  EXPECT_EQ(settle(a, "deleting")["error"]["data"]["reason"], "not_found");

  const std::string b = create_volume("4M");
  RunResult deleted = cli({"--json", "volume-delete", b});
  ASSERT_EQ(deleted.status, 0) << deleted.output;
  EXPECT_EQ(Json::parse(deleted.output, nullptr, false)["deleted"], true) << deleted.output;
  EXPECT_EQ(rpc_reason(control(), "volume_show", {{"volume_id", b}}), "not_found");
  const std::string c = create_volume("4M");
  RunResult at_once = cli({"--json", "volume-delete", c, "--no-wait"});
  ASSERT_EQ(at_once.status, 0) << at_once.output;
  EXPECT_EQ(Json::parse(at_once.output, nullptr, false)["status"], "deleting") << at_once.output;
}

// The file store on a small file system of its own (tmpfs, 8 MiB).
class SmallFileSystem : public StoreTest {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(is_root(), "mounting a tmpfs needs root");
    std::filesystem::create_directories(volumes_dir());
    mounted_ = ::mount("tmpfs", volumes_dir().c_str(), "tmpfs", 0, "size=8m") == 0;
    SHAREBLK_REQUIRE(mounted_, "cannot mount a tmpfs: " << std::strerror(errno));
  }
  void TearDown() override {
    StoreTest::TearDown();  // the daemon first: it holds the volumes open
    if (mounted_) ::umount2(volumes_dir().c_str(), MNT_DETACH);
  }
  std::string volumes_dir() const { return dir_ / "volumes"; }
  uint64_t allocated(const std::string& id) const {
    struct stat st {};
    ::stat((volumes_dir() + "/" + id + ".img").c_str(), &st);
    return static_cast<uint64_t>(st.st_blocks) * 512;
  }
  bool mounted_ = false;
};

TEST_F(SmallFileSystem, ASparseVolumeFullOfWritesGetsEnospcAndNothingElseBreaks) {
  start();
  // 32 MiB on 8 MiB: sparse, so it fits until written.
  const std::string big = create_volume("32M");
  EXPECT_LT(allocated(big), kMiB);
  const std::string small = create_volume("1M");
  Nbd other(uri(small, "other"));
  ASSERT_TRUE(other.ok) << nbd_get_error();
  const std::string mine = pattern(kMiB, 5);
  ASSERT_EQ(nbd_pwrite(other.h, mine.data(), mine.size(), 0, 0), 0) << nbd_get_error();

  Nbd nbd(uri(big, "filler"));
  ASSERT_TRUE(nbd.ok) << nbd_get_error();
  const std::string chunk = pattern(kMiB, 9);
  uint64_t written = 0;
  int err = 0;
  for (; written < 32 * kMiB; written += kMiB) {
    if (nbd_pwrite(nbd.h, chunk.data(), chunk.size(), written, 0) != 0) {
      err = nbd_get_errno();
      break;
    }
  }
  EXPECT_EQ(err, ENOSPC) << "after " << written << " bytes: " << nbd_get_error();
  EXPECT_LT(written, 8 * kMiB);
  // The same connection goes on: what was written reads back, a smaller write into blocks it
  // already has succeeds.
  std::string back(kMiB, '\0');
  ASSERT_EQ(nbd_pread(nbd.h, back.data(), back.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == chunk);
  ASSERT_EQ(nbd_pwrite(nbd.h, mine.data(), 4096, 0, 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_flush(nbd.h, 0), 0) << nbd_get_error();
  // So does the other volume, and the daemon.
  ASSERT_EQ(nbd_pread(other.h, back.data(), back.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == mine);
  ASSERT_EQ(nbd_pwrite(other.h, chunk.data(), chunk.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_EQ(rpc_ok(control(), "volume_list").size(), 2u);
  EXPECT_EQ(::kill(daemon_->pid(), 0), 0);

  // Preallocated, the same volume is refused at create instead.
  start({"--preallocate"});
  EXPECT_EQ(rpc_reason(control(), "volume_create", {{"name", "v"}, {"size", "32M"}}), "no_space");
  EXPECT_EQ(rpc_ok(control(), "volume_list").size(), 2u);
}

}  // namespace
}  // namespace shareblk::testing
