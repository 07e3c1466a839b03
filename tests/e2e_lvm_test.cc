// The LVM store on real lvm2, on a loop device, without device-mapper: the daemon maps each
// logical volume's extents itself, so these tests check the bytes where lvm2 says they are.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>

#include "tests/control_client.h"
#include "tests/lvm_fixture.h"
#include "tests/support.h"

namespace shareblk::testing {
namespace {

using Json = nlohmann::json;
constexpr uint64_t kMiB = 1 << 20;

struct NbdHandle {
  explicit NbdHandle(const std::string& uri) : h(nbd_create()) {
    ok = h != nullptr && nbd_set_strict_mode(h, 0) == 0 && nbd_connect_uri(h, uri.c_str()) == 0;
  }
  ~NbdHandle() {
    if (h) nbd_close(h);
  }
  nbd_handle* h;
  bool ok = false;
};

class LvmStore : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    SHAREBLK_REQUIRE(lvm_available(why), why);
    vg_name_ = "sbt" + std::to_string(::getpid()) + "x" +
               std::to_string(reinterpret_cast<uintptr_t>(this) % 100000);
    vg_ = std::make_unique<LoopVolumeGroup>(dir_, vg_name_, 128 * kMiB);
    ASSERT_TRUE(vg_->ok()) << vg_->why();
    start();
  }
  void TearDown() override {
    daemon_.reset();  // before the VG goes
    vg_.reset();
  }

  // `env`: NAME=VALUE settings for the daemon (the tests' hooks).
  void start(const std::vector<std::string>& env = {}) {
    std::vector<std::string> launcher;
    if (!env.empty()) launcher.emplace_back("env");
    launcher.insert(launcher.end(), env.begin(), env.end());
    daemon_ = std::make_unique<Daemon>(
        std::vector<std::string>{"--state-dir", dir_ / "var", "--store", "lvm:" + vg_name_,
                                 "--lvm-config", vg_->daemon_config(), "--listen-unix",
                                 dir_ / "nbd.sock", "--workers", "2"},
        socket(), launcher);
  }
  // volume_show until the volume is gone (at most 30 s); its last status otherwise.
  std::string wait_gone(const std::string& id) {
    for (int i = 0; i < 3000; ++i) {
      Json v = rpc(socket(), "volume_show", {{"volume_id", id}});
      if (v.contains("error") && v["error"]["data"]["reason"] == "not_found") return "gone";
      if (v["result"]["status"] != "deleting") return v.dump();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return "still deleting";
  }
  bool has_lv(const std::string& id) {
    RunResult lvs = vg_->lvm({"lvs", "--noheadings", "-o", "lv_name", vg_name_});
    return lvs.output.find("volume-" + id) != std::string::npos;
  }
  std::string socket() const { return dir_ / "var/shareblk.sock"; }

  Json create(const std::string& name, const std::string& size, bool multiattach = false) {
    return rpc_ok(socket(), "volume_create",
                  {{"name", name}, {"size", size}, {"multiattach", multiattach}});
  }
  std::string attach(const std::string& volume, const std::string& instance,
                     const std::string& mode) {
    Json a = rpc_ok(socket(), "attachment_create",
                    {{"volume_id", volume},
                     {"instance_uuid", instance},
                     {"mode", mode},
                     {"connector", {{"host", instance}, {"transport", "unix"}}}});
    return a["connection_info"]["data"]["uri"].get<std::string>();
  }

  std::vector<LoopVolumeGroup::Range> ranges(const std::string& id) {
    return vg_->ranges("volume-" + id);
  }
  // The PV's bytes behind the LV's [logical, logical+length), as lvm2 maps them.
  std::string physical_bytes(const std::string& id, uint64_t logical, size_t length) {
    return vg_->read("volume-" + id, logical, length);
  }
  // A detached 96 MiB volume with `secret` written and flushed at 80 MiB, what a delete must
  // zero: its id, and its extents in `map`.
  void detached_volume_with(const std::string& secret, std::string& id,
                            std::vector<LoopVolumeGroup::Range>& map) {
    id = create("big", "96M")["id"];
    {
      NbdHandle rw(attach(id, "host", "rw"));
      ASSERT_TRUE(rw.ok) << nbd_get_error();
      ASSERT_EQ(nbd_pwrite(rw.h, secret.data(), secret.size(), 80 * kMiB, 0), 0);
      ASSERT_EQ(nbd_flush(rw.h, 0), 0);
    }
    map = ranges(id);
    rpc_ok(socket(), "volume_detach", {{"volume_id", id}});
  }

  TempDir dir_;
  std::string vg_name_;
  std::unique_ptr<LoopVolumeGroup> vg_;
  std::unique_ptr<Daemon> daemon_;
};

std::string pattern(size_t length, int seed) {
  std::string s(length, '\0');
  for (size_t i = 0; i < length; ++i) s[i] = static_cast<char>((i * 31 + seed) % 251);
  return s;
}

TEST_F(LvmStore, WritesLandAtTheMappedOffsetsOfThePhysicalVolume) {
  Json v = create("data", "8M", true);
  const std::string id = v["id"];
  NbdHandle rw(attach(id, "writer", "rw"));
  ASSERT_TRUE(rw.ok) << nbd_get_error();
  const std::string data = pattern(8 * kMiB, 7);
  ASSERT_EQ(nbd_pwrite(rw.h, data.data(), data.size(), 0, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_flush(rw.h, 0), 0);
  EXPECT_TRUE(physical_bytes(id, 0, data.size()) == data);

  // A read-only attachment of the same volume sees it, and cannot change it.
  NbdHandle ro(attach(id, "reader", "ro"));
  ASSERT_TRUE(ro.ok) << nbd_get_error();
  std::string back(4096, '\0');
  ASSERT_EQ(nbd_pread(ro.h, back.data(), back.size(), 4 * kMiB, 0), 0);
  EXPECT_TRUE(back == data.substr(4 * kMiB, 4096));
  std::string junk(4096, 'x');
  EXPECT_EQ(nbd_pwrite(ro.h, junk.data(), junk.size(), 0, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM);
  EXPECT_EQ(nbd_zero(ro.h, kMiB, 0, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM);
  EXPECT_TRUE(physical_bytes(id, 0, data.size()) == data);
}

TEST_F(LvmStore, ExtendedVolumeServesIoAcrossANonContiguousSeam) {
  Json v = create("grows", "4M");
  const std::string id = v["id"];
  create("neighbour", "4M");  // takes the extents right after the first volume's
  rpc_ok(socket(), "volume_extend", {{"volume_id", id}, {"size", "12M"}});
  std::vector<LoopVolumeGroup::Range> map = ranges(id);
  ASSERT_GE(map.size(), 2u);
  ASSERT_NE(map[0].physical + map[0].length, map[1].physical) << "the seam should be a gap";

  NbdHandle rw(attach(id, "host", "rw"));
  ASSERT_TRUE(rw.ok) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(rw.h), static_cast<int64_t>(12 * kMiB));
  const uint64_t seam = map[1].logical;
  const std::string data = pattern(2 * kMiB + 123, 3);
  const uint64_t at = seam - kMiB - 17;  // unaligned, across the seam
  ASSERT_EQ(nbd_pwrite(rw.h, data.data(), data.size(), at, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_flush(rw.h, 0), 0);
  std::string back(data.size(), '\0');
  ASSERT_EQ(nbd_pread(rw.h, back.data(), back.size(), at, 0), 0);
  EXPECT_TRUE(back == data);
  EXPECT_TRUE(physical_bytes(id, at, data.size()) == data);
  // Nothing leaked into the neighbour's extents in the gap.
  EXPECT_EQ(read_file(vg_->device(), map[0].physical + map[0].length, 4096),
            std::string(4096, '\0'));

  // Growing while attached: the live connection keeps serving; a new one sees the new size.
  rpc_ok(socket(), "volume_extend", {{"volume_id", id}, {"size", "16M"}});
  ASSERT_EQ(nbd_pread(rw.h, back.data(), 4096, at, 0), 0);
  Json a = rpc_ok(socket(), "attachment_list", {{"volume_id", id}})[0];
  NbdHandle again(a["connection_info"]["data"]["uri"].get<std::string>());
  ASSERT_TRUE(again.ok) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(again.h), static_cast<int64_t>(16 * kMiB));
  std::string tail = pattern(4096, 9);
  ASSERT_EQ(nbd_pwrite(again.h, tail.data(), tail.size(), 16 * kMiB - 4096, 0), 0);
  EXPECT_TRUE(physical_bytes(id, 16 * kMiB - 4096, 4096) == tail);
}

TEST_F(LvmStore, DeletedVolumeLeavesNoDataOnItsExtents) {
  Json v = create("secret", "8M");
  const std::string id = v["id"];
  {
    NbdHandle rw(attach(id, "host", "rw"));
    ASSERT_TRUE(rw.ok) << nbd_get_error();
    const std::string data(8 * kMiB, 's');
    ASSERT_EQ(nbd_pwrite(rw.h, data.data(), data.size(), 0, 0), 0);
    ASSERT_EQ(nbd_flush(rw.h, 0), 0);
  }
  std::vector<LoopVolumeGroup::Range> map = ranges(id);
  rpc_ok(socket(), "volume_detach", {{"volume_id", id}});
  rpc_ok(socket(), "volume_delete", {{"volume_id", id}, {"wait", true}});
  for (const auto& r : map) {
    EXPECT_EQ(read_file(vg_->device(), r.physical, r.length), std::string(r.length, '\0'));
  }
  RunResult lvs = vg_->lvm({"lvs", "--noheadings", "-o", "lv_name", vg_name_});
  EXPECT_EQ(lvs.output.find("volume-" + id), std::string::npos) << lvs.output;

  // A new volume on the same extents reads zeroes.
  Json fresh = create("fresh", "8M");
  NbdHandle rw(attach(fresh["id"], "host", "rw"));
  ASSERT_TRUE(rw.ok) << nbd_get_error();
  std::string back(kMiB, 'x');
  ASSERT_EQ(nbd_pread(rw.h, back.data(), back.size(), 0, 0), 0);
  EXPECT_EQ(back, std::string(kMiB, '\0'));
}

TEST_F(LvmStore, RestartAfterKillServesTheSameExportsAndReportsMissingVolumes) {
  Json v = create("kept", "8M");
  Json gone = create("gone", "4M");
  const std::string uri = attach(v["id"], "host", "rw");
  const std::string data = pattern(kMiB, 5);
  {
    NbdHandle rw(uri);
    ASSERT_TRUE(rw.ok) << nbd_get_error();
    ASSERT_EQ(nbd_pwrite(rw.h, data.data(), data.size(), kMiB, 0), 0);
    ASSERT_EQ(nbd_flush(rw.h, 0), 0);
  }
  daemon_->stop(SIGKILL);
  // An LV removed behind the daemon's back is reported at start-up, not silently forgotten.
  RunResult rm =
      vg_->lvm({"lvremove", "-y", vg_name_ + "/volume-" + gone["id"].get<std::string>()});
  ASSERT_EQ(rm.status, 0) << rm.output;
  start();
  EXPECT_NE(daemon_->log().find("has no backing"), std::string::npos) << daemon_->log();
  NbdHandle rw(uri);
  ASSERT_TRUE(rw.ok) << nbd_get_error();
  std::string back(data.size(), '\0');
  ASSERT_EQ(nbd_pread(rw.h, back.data(), back.size(), kMiB, 0), 0);
  EXPECT_TRUE(back == data);
  EXPECT_EQ(rpc_ok(socket(), "volume_list").size(), 2u);  // metadata is the database's
  // The volume whose LV is gone can still be deleted: removing absent backing is a no-op.
  rpc_ok(socket(), "volume_delete", {{"volume_id", gone["id"]}, {"wait", true}});
  EXPECT_EQ(rpc_ok(socket(), "volume_list").size(), 1u);
}

TEST_F(LvmStore, FullVolumeGroupIsNoSpaceAndLeavesNothingBehind) {
  EXPECT_EQ(rpc_reason(socket(), "volume_create", {{"name", "big"}, {"size", "1G"}}), "no_space");
  RunResult lvs = vg_->lvm({"lvs", "--noheadings", "-o", "lv_name", vg_name_});
  EXPECT_EQ(lvs.output.find("volume-"), std::string::npos) << lvs.output;
  EXPECT_EQ(rpc_ok(socket(), "volume_list").size(), 0u);
  // Growing past the free space is refused the same way, and the volume keeps its size.
  Json v = create("small", "8M");
  EXPECT_EQ(rpc_reason(socket(), "volume_extend", {{"volume_id", v["id"]}, {"size", "1G"}}),
            "no_space");
  EXPECT_EQ(rpc_ok(socket(), "volume_show", {{"volume_id", v["id"]}})["size"], 8 * kMiB);
}

TEST_F(LvmStore, ForeignLogicalVolumeWithOurNameIsRefused) {
  const std::string id = "00000000-0000-4000-8000-000000000001";
  RunResult r =
      vg_->lvm({"lvcreate", "-y", "-Zn", "-an", "-n", "volume-" + id, "-L", "4M", vg_name_});
  ASSERT_EQ(r.status, 0) << r.output;
  // The daemon never adopts it: it says so, and no volume appears.
  daemon_.reset();
  start();
  EXPECT_NE(daemon_->log().find("lacks the 'shareblk' tag"), std::string::npos) << daemon_->log();
  EXPECT_EQ(rpc_ok(socket(), "volume_list").size(), 0u);
}

TEST(LvmStoreStartup, MissingVolumeGroupIsAClearError) {
  std::string why;
  SHAREBLK_REQUIRE(lvm_available(why), why);
  TempDir dir;
  RunResult r = run({Daemon::binary(), "--state-dir", dir / "var", "--store",
                     "lvm:shareblk_no_such_vg", "--listen-unix", dir / "nbd.sock"},
                    std::chrono::seconds(60));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("not found"), std::string::npos) << r.output;
}

// A delete's zeroing (slowed down by the test hook: 96 MiB in two pieces, a pause before each)
// runs in the background: the call returns at once, the volume shows "deleting" and how far it
// has come, refuses attachments, and another volume is created and used meanwhile.
TEST_F(LvmStore, DeleteZeroesInTheBackgroundWhileOtherVolumesGoOn) {
  SHAREBLK_REQUIRE_TEST_HOOKS();
  daemon_.reset();
  start({"SHAREBLK_TEST_JOB_PAUSE_MS=1000"});
  const std::string secret = pattern(kMiB, 11);
  std::string id;
  std::vector<LoopVolumeGroup::Range> map;
  ASSERT_NO_FATAL_FAILURE(detached_volume_with(secret, id, map));

  const auto before = std::chrono::steady_clock::now();
  Json started = rpc_ok(socket(), "volume_delete", {{"volume_id", id}});
  EXPECT_LT(std::chrono::steady_clock::now() - before, std::chrono::milliseconds(900));
  EXPECT_EQ(started["status"], "deleting") << started;
  Json shown = rpc_ok(socket(), "volume_show", {{"volume_id", id}});
  EXPECT_EQ(shown["status"], "deleting") << shown;
  EXPECT_TRUE(shown["progress"].is_number_integer()) << shown;
  EXPECT_EQ(rpc_reason(socket(), "attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}}),
            "volume_busy");
  // Deleting again while it runs is the same delete.
  EXPECT_EQ(rpc_ok(socket(), "volume_delete", {{"volume_id", id}})["status"], "deleting");

  Json other = create("other", "8M");
  EXPECT_EQ(rpc_ok(socket(), "volume_show", {{"volume_id", id}})["status"], "deleting")
      << "the create should have completed while the delete was still zeroing";
  {
    NbdHandle rw(attach(other["id"], "host", "rw"));
    ASSERT_TRUE(rw.ok) << nbd_get_error();
    const std::string data = pattern(kMiB, 2);
    ASSERT_EQ(nbd_pwrite(rw.h, data.data(), data.size(), 0, 0), 0);
    std::string back(kMiB, '\0');
    ASSERT_EQ(nbd_pread(rw.h, back.data(), back.size(), 0, 0), 0);
    EXPECT_TRUE(back == data);
  }

  EXPECT_EQ(wait_gone(id), "gone");
  EXPECT_FALSE(has_lv(id));
  for (const auto& r : map) {
    EXPECT_EQ(read_file(vg_->device(), r.physical, r.length), std::string(r.length, '\0'));
  }
}

// A volume filled from an image by qemu-img, straight onto the physical volume where lvm2 put
// the LV (no device-mapper here), read back through NBD.
TEST_F(LvmStore, VolumeFilledFromAnImageHoldsItsBytesOnTheMappedExtents) {
  SHAREBLK_REQUIRE(have_program("qemu-img"), "qemu-img is not installed");
  const std::string data = pattern(6 * kMiB, 17);
  const std::string raw = dir_ / "image.raw";
  const std::string qcow2 = dir_ / "image.qcow2";
  { std::ofstream(raw, std::ios::binary) << data; }
  RunResult made = run({"qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, qcow2});
  ASSERT_EQ(made.status, 0) << made.output;
  create("before", "4M");  // so that the new LV does not start at the first extent
  Json v =
      rpc_ok(socket(), "volume_create", {{"name", "img"}, {"size", "8M"}, {"from_image", qcow2}});
  const std::string id = v["id"];
  for (int i = 0; i < 3000 && v["status"] == "creating"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    v = rpc_ok(socket(), "volume_show", {{"volume_id", id}});
  }
  ASSERT_EQ(v["status"], "available") << v;
  EXPECT_TRUE(physical_bytes(id, 0, data.size()) == data);
  NbdHandle rw(attach(id, "host", "rw"));
  ASSERT_TRUE(rw.ok) << nbd_get_error();
  std::string back(8 * kMiB, 'x');
  ASSERT_EQ(nbd_pread(rw.h, back.data(), back.size(), 0, 0), 0);
  EXPECT_TRUE(back.substr(0, data.size()) == data);
  EXPECT_EQ(back.substr(data.size()), std::string(2 * kMiB, '\0'));
}

// On LVM a snapshot is a new LV and a copy onto its extents (no device-mapper snapshots here);
// a volume made from it reads the bytes of the moment, and the source LV goes on alone.
TEST_F(LvmStore, ASnapshotIsACopyIntoANewLogicalVolume) {
  const std::string data = pattern(3 * kMiB, 23);
  const std::string id = create("src", "8M")["id"];
  {
    NbdHandle rw(attach(id, "host", "rw"));
    ASSERT_TRUE(rw.ok) << nbd_get_error();
    ASSERT_EQ(nbd_pwrite(rw.h, data.data(), data.size(), kMiB, 0), 0) << nbd_get_error();
    Json s = rpc_ok(socket(), "snapshot_create", {{"volume_id", id}, {"name", "s"}});
    const std::string snap = s["id"];
    for (int i = 0; i < 3000 && s["status"] == "creating"; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      s = rpc_ok(socket(), "snapshot_show", {{"snapshot_id", snap}});
    }
    ASSERT_EQ(s["status"], "available") << s;
    EXPECT_TRUE(physical_bytes(snap, kMiB, data.size()) == data);
    const std::string later(kMiB, 'L');
    ASSERT_EQ(nbd_pwrite(rw.h, later.data(), later.size(), kMiB, 0), 0) << nbd_get_error();
    Json v = rpc_ok(socket(), "volume_create", {{"name", "copy"}, {"from_snapshot", snap}});
    const std::string copy = v["id"];
    for (int i = 0; i < 3000 && v["status"] == "creating"; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      v = rpc_ok(socket(), "volume_show", {{"volume_id", copy}});
    }
    ASSERT_EQ(v["status"], "available") << v;
    NbdHandle back(attach(copy, "other", "ro"));
    ASSERT_TRUE(back.ok) << nbd_get_error();
    std::string bytes(data.size(), 'x');
    ASSERT_EQ(nbd_pread(back.h, bytes.data(), bytes.size(), kMiB, 0), 0);
    EXPECT_TRUE(bytes == data) << "the copy must hold the snapshot's bytes, not the later ones";
  }
  const RunResult lvs = vg_->lvm({"lvs", "--noheadings", "-o", "lv_name", vg_name_});
  EXPECT_NE(lvs.output.find("volume-" + id), std::string::npos) << lvs.output;
}

// kill -9 in the middle of the zeroing (after the first piece): the LV is half zeroed and
// still there; the next start finishes the delete by itself.
TEST_F(LvmStore, DeleteKilledMidZeroingIsFinishedByTheNextStart) {
  SHAREBLK_REQUIRE_TEST_HOOKS();
  daemon_.reset();
  start({"SHAREBLK_TEST_KILL_AT=volume_delete:zeroing"});
  const std::string secret = pattern(kMiB, 13);
  std::string id;
  std::vector<LoopVolumeGroup::Range> map;
  ASSERT_NO_FATAL_FAILURE(detached_volume_with(secret, id, map));
  try {  // the daemon may die before it answers
    rpc(socket(), "volume_delete", {{"volume_id", id}});
  } catch (const std::exception&) {
  }
  const std::string hook = "SHAREBLK_TEST_KILL_AT=volume_delete:zeroing";
  for (int i = 0; i < 1000 && daemon_->log().find(hook) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_NE(daemon_->log().find(hook), std::string::npos) << daemon_->log();
  EXPECT_EQ(daemon_->stop(SIGKILL), 128 + SIGKILL);
  EXPECT_TRUE(has_lv(id));
  EXPECT_TRUE(physical_bytes(id, 80 * kMiB, kMiB) == secret) << "killed after the first piece";

  start();
  EXPECT_EQ(wait_gone(id), "gone") << daemon_->log();
  EXPECT_FALSE(has_lv(id));
  for (const auto& r : map) {
    EXPECT_EQ(read_file(vg_->device(), r.physical, r.length), std::string(r.length, '\0'));
  }
  EXPECT_NE(daemon_->log().find("being finished"), std::string::npos) << daemon_->log();
  EXPECT_EQ(daemon_->log().find("has no backing"), std::string::npos) << daemon_->log();
}

// kill -9 after lvremove, before the row went: the next start finds the LV gone, which is
// what the delete it finishes wants; it says nothing about missing backing or status error,
// which the API never shows.
TEST_F(LvmStore, DeleteKilledAfterLvremoveIsFinishedWithoutAFalseError) {
  SHAREBLK_REQUIRE_TEST_HOOKS();
  daemon_.reset();
  start({"SHAREBLK_TEST_KILL_AT=volume_delete:removed"});
  const std::string id = create("doomed", "8M")["id"];
  try {  // the daemon may die before it answers
    rpc(socket(), "volume_delete", {{"volume_id", id}});
  } catch (const std::exception&) {
  }
  const std::string hook = "SHAREBLK_TEST_KILL_AT=volume_delete:removed";
  for (int i = 0; i < 1000 && daemon_->log().find(hook) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_NE(daemon_->log().find(hook), std::string::npos) << daemon_->log();
  EXPECT_EQ(daemon_->stop(SIGKILL), 128 + SIGKILL);
  EXPECT_FALSE(has_lv(id));

  start();
  EXPECT_EQ(wait_gone(id), "gone") << daemon_->log();
  const std::string log = daemon_->log();
  EXPECT_NE(log.find("being finished"), std::string::npos) << log;
  EXPECT_NE(log.find("deleted " + id), std::string::npos) << log;
  EXPECT_EQ(log.find("has no backing"), std::string::npos) << log;
  EXPECT_EQ(log.find("[error]"), std::string::npos) << log;
}

// /dev as installing lvm2 leaves it on a kernel without device-mapper: vgcfgbackup in its
// postinst makes /dev/mapper/control, and no driver answers behind it. The store must ask
// the kernel, not the file system, and serve through the segment maps as it does without
// the node. The node is 10:236, device-mapper's, when the kernel has no device-mapper (the
// case as it happens), else /dev/null's numbers: a node that is not device-mapper's on any
// kernel.
class LvmStoreWithStaleMapperNode : public LvmStore {
 protected:
  void SetUp() override {
    std::string why;
    SHAREBLK_REQUIRE(lvm_available(why), why);
    // This process and the daemon it starts get a mount namespace of their own, where /dev is
    // an overlay whose changes land in a tmpfs: the host's /dev is never written.
    ASSERT_EQ(::unshare(CLONE_NEWNS), 0) << std::strerror(errno);
    ASSERT_EQ(::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr), 0)
        << std::strerror(errno);
    ASSERT_EQ(::mount("tmpfs", layers_.path().c_str(), "tmpfs", 0, "size=1m"), 0)
        << std::strerror(errno);
    const std::string upper = layers_ / "upper";
    const std::string work = layers_ / "work";
    ASSERT_EQ(::mkdir(upper.c_str(), 0755), 0);
    ASSERT_EQ(::mkdir(work.c_str(), 0755), 0);
    const std::string layers = "lowerdir=/dev,upperdir=" + upper + ",workdir=" + work;
    ASSERT_EQ(::mount("overlay", "/dev", "overlay", 0, layers.c_str()), 0) << std::strerror(errno);
    dev_mounted_ = true;
    ASSERT_TRUE(::mkdir("/dev/mapper", 0755) == 0 || errno == EEXIST) << std::strerror(errno);
    ASSERT_EQ(::mount("tmpfs", "/dev/mapper", "tmpfs", 0, "size=1m"), 0) << std::strerror(errno);
    mapper_mounted_ = true;
    const dev_t node = kernel_has_device_mapper() ? ::makedev(1, 3) : ::makedev(10, 236);
    ASSERT_EQ(::mknod("/dev/mapper/control", S_IFCHR | 0600, node), 0) << std::strerror(errno);
    LvmStore::SetUp();
  }
  void TearDown() override {
    LvmStore::TearDown();
    if (mapper_mounted_) ::umount2("/dev/mapper", MNT_DETACH);
    if (dev_mounted_) ::umount2("/dev", MNT_DETACH);
    ::umount2(layers_.path().c_str(), MNT_DETACH);
  }
  static bool kernel_has_device_mapper() {
    std::ifstream misc("/proc/misc");
    for (std::string line; std::getline(misc, line);) {
      if (line.ends_with(" device-mapper")) return true;
    }
    return false;
  }

  TempDir layers_;
  bool dev_mounted_ = false;
  bool mapper_mounted_ = false;
};

TEST_F(LvmStoreWithStaleMapperNode, VolumesAreMadeServedGrownAndDeleted) {
  const std::string id = create("data", "4M")["id"];
  rpc_ok(socket(), "volume_extend", {{"volume_id", id}, {"size", "8M"}});
  {
    NbdHandle rw(attach(id, "host", "rw"));
    ASSERT_TRUE(rw.ok) << nbd_get_error();
    const std::string data = pattern(8 * kMiB, 29);
    ASSERT_EQ(nbd_pwrite(rw.h, data.data(), data.size(), 0, 0), 0) << nbd_get_error();
    ASSERT_EQ(nbd_flush(rw.h, 0), 0);
    EXPECT_TRUE(physical_bytes(id, 0, data.size()) == data);
  }
  rpc_ok(socket(), "volume_detach", {{"volume_id", id}});
  rpc_ok(socket(), "volume_delete", {{"volume_id", id}, {"wait", true}});
  EXPECT_FALSE(has_lv(id));
}

}  // namespace
}  // namespace shareblk::testing
