// The RBD store on a real single-node Ceph cluster (ceph_cluster.h): each volume is an RBD
// image, served over NBD through librbd's asynchronous calls reaped on the worker's ring. The
// bytes are checked in the image itself, read back with the `rbd` tool.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "tests/ceph_fixture.h"
#include "tests/control_client.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace shareblk::testing {
namespace {

using Json = nlohmann::json;
constexpr uint64_t kMiB = 1 << 20;

// libnbd with its own checks off, so that every request reaches the server (a read-only
// export's writes included).
NbdHandle open_nbd(const std::string& uri, bool base_allocation = false) {
  return nbd_connect(uri, nullptr, NbdOptions{false, base_allocation});
}

class RbdStore : public CephSuite {
 protected:
  void SetUp() override {
    require_cluster();
    if (IsSkipped() || HasFatalFailure()) return;
    start();
  }
  // A clean exit: under the sanitizers a leak or an error makes it fail.
  void TearDown() override {
    if (!daemon_) return;
    EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  }

  void start(int ceph_timeout_s = 20) {
    daemon_.reset();
    daemon_ = std::make_unique<Daemon>(
        std::vector<std::string>{"--state-dir", dir_ / "var", "--store", "rbd:" + pool(),
                                 "--ceph-conf", ceph_->conf_path(), "--listen-unix",
                                 dir_ / "nbd.sock", "--workers", "2", "--ceph-timeout",
                                 std::to_string(ceph_timeout_s)},
        socket());
  }
  static const std::string& pool() { return ceph_->pool(); }
  std::string socket() const { return dir_ / "var/shareblk.sock"; }

  // The `rbd` tool against the test's cluster.
  RunResult rbd(std::vector<std::string> args) const {
    args.insert(args.begin(), {"rbd", "-c", ceph_->conf_path()});
    return run(args, std::chrono::seconds(60));
  }
  bool has_image(const std::string& id) const {
    return rbd({"ls", pool()}).output.find("volume-" + id) != std::string::npos;
  }
  // `length` bytes at `offset` of the volume's image, as the cluster has them.
  std::string image_bytes(const std::string& id, uint64_t offset, size_t length) const {
    const std::string out = dir_ / ("export-" + id);
    std::filesystem::remove(out);
    RunResult r = rbd({"export", pool() + "/volume-" + id, out});
    if (r.status != 0) return "rbd export failed: " + r.output;
    return read_file(out, offset, length);
  }

  std::string create(const std::string& size, bool multiattach = true) {
    return rpc_ok(socket(), "volume_create",
                  {{"name", "v"}, {"size", size}, {"multiattach", multiattach}})["id"];
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

  TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
};

// Writes through NBD land in the image at the offsets written, across RADOS object seams
// (4 MiB), and read back the same through NBD; FUA and FLUSH are answered.
TEST_F(RbdStore, AVolumeIsAnImageThatHoldsWhatNbdWrites) {
  const std::string id = create("64M");
  EXPECT_TRUE(has_image(id)) << rbd({"ls", pool()}).output;
  NbdHandle rw = open_nbd(attach(id, "host-a", "rw"));
  ASSERT_TRUE(rw) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(rw.get()), static_cast<int64_t>(64 * kMiB));
  const std::string a = patterned(1 * kMiB, 1);
  const std::string b = patterned(64 * 1024, 2);
  const uint64_t seam = 4 * kMiB - 512 * 1024;  // crosses the first object's end
  ASSERT_EQ(nbd_pwrite(rw.get(), a.data(), a.size(), seam, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_pwrite(rw.get(), b.data(), b.size(), 60 * kMiB, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  ASSERT_EQ(nbd_flush(rw.get(), 0), 0) << nbd_get_error();

  std::string back(a.size(), '\0');
  ASSERT_EQ(nbd_pread(rw.get(), back.data(), back.size(), seam, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == a);
  EXPECT_TRUE(image_bytes(id, seam, a.size()) == a);
  EXPECT_TRUE(image_bytes(id, 60 * kMiB, b.size()) == b);
  EXPECT_EQ(image_bytes(id, 0, 4096), std::string(4096, '\0'));
}

// Many requests in flight at once on two hosts' attachments (two connections on one worker,
// sharing the image): every one is answered, with its own bytes (completions are matched to
// their requests through librbd's completion argument).
TEST_F(RbdStore, ManyRequestsInFlightAreEachAnsweredWithTheirOwnBytes) {
  const std::string id = create("32M");
  NbdHandle one = open_nbd(attach(id, "host-a", "rw"));
  NbdHandle two = open_nbd(attach(id, "host-b", "rw"));
  ASSERT_TRUE(one && two) << nbd_get_error();
  constexpr int kBlocks = 256;
  constexpr size_t kBlock = 64 * 1024;
  std::vector<std::string> blocks;
  for (int i = 0; i < kBlocks; ++i) blocks.push_back(patterned(kBlock, i));
  for (int i = 0; i < kBlocks; ++i) {
    nbd_handle* h = (i % 2) ? two.get() : one.get();
    ASSERT_NE(nbd_aio_pwrite(h, blocks[i].data(), kBlock, i * kBlock, NBD_NULL_COMPLETION, 0), -1)
        << nbd_get_error();
  }
  for (nbd_handle* h : {one.get(), two.get()}) {
    while (nbd_aio_in_flight(h) > 0) ASSERT_NE(nbd_poll(h, -1), -1) << nbd_get_error();
  }
  std::vector<std::string> back(kBlocks, std::string(kBlock, '\0'));
  for (int i = 0; i < kBlocks; ++i) {
    nbd_handle* h = (i % 2) ? one.get() : two.get();  // read through the other connection
    ASSERT_NE(nbd_aio_pread(h, back[i].data(), kBlock, i * kBlock, NBD_NULL_COMPLETION, 0), -1)
        << nbd_get_error();
  }
  for (nbd_handle* h : {one.get(), two.get()}) {
    while (nbd_aio_in_flight(h) > 0) ASSERT_NE(nbd_poll(h, -1), -1) << nbd_get_error();
  }
  int wrong = 0;
  for (int i = 0; i < kBlocks; ++i) wrong += back[i] != blocks[i];
  EXPECT_EQ(wrong, 0);
}

// A read-only attachment of an RBD volume refuses every change with EPERM and changes nothing,
// while the read-write one writes.
TEST_F(RbdStore, AReadOnlyAttachmentChangesNothing) {
  const std::string id = create("16M");
  NbdHandle rw = open_nbd(attach(id, "host-a", "rw"));
  NbdHandle ro = open_nbd(attach(id, "host-b", "ro"));
  ASSERT_TRUE(rw && ro) << nbd_get_error();
  const std::string data = patterned(4096, 7);
  ASSERT_EQ(nbd_pwrite(rw.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(ro.get()), 1);
  const std::string other = patterned(4096, 8);
  EXPECT_EQ(nbd_pwrite(ro.get(), other.data(), other.size(), 0, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM);
  EXPECT_EQ(nbd_trim(ro.get(), 4096, 0, 0), -1);
  EXPECT_EQ(nbd_zero(ro.get(), 4096, 0, 0), -1);
  std::string back(4096, '\0');
  ASSERT_EQ(nbd_pread(ro.get(), back.data(), back.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == data);
  EXPECT_TRUE(image_bytes(id, 0, 4096) == data);
}

struct Extents {
  std::vector<std::pair<uint32_t, uint32_t>> list;  // (length, flags)
};
// libnbd 1.14 (Debian 12): `entries` holds `count` numbers, (length, flags) pairs.
int on_extents(void* data, const char* context, uint64_t, uint32_t* entries, size_t count, int*) {
  if (std::string(context) != LIBNBD_CONTEXT_BASE_ALLOCATION) return 0;
  auto* e = static_cast<Extents*>(data);
  for (size_t i = 0; i + 1 < count; i += 2) e->list.emplace_back(entries[i], entries[i + 1]);
  return 0;
}

// Write-zeroes and trim reach the image; block status says which objects hold data; CACHE
// is answered.
TEST_F(RbdStore, ZeroesTrimAndBlockStatusComeFromTheImage) {
  const std::string id = create("32M");
  NbdHandle client = open_nbd(attach(id, "host-a", "rw"), true);
  ASSERT_TRUE(client) << nbd_get_error();
  nbd_handle* h = client.get();
  const std::string data = patterned(8 * kMiB, 3);
  ASSERT_EQ(nbd_pwrite(h, data.data(), data.size(), 8 * kMiB, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_zero(h, 1 * kMiB, 9 * kMiB, 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_zero(h, 1 * kMiB, 10 * kMiB, LIBNBD_CMD_FLAG_FAST_ZERO), 0) << nbd_get_error();
  ASSERT_EQ(nbd_trim(h, 4 * kMiB, 12 * kMiB, 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_cache(h, 1 * kMiB, 0, 0), 0) << nbd_get_error();  // a hint: answered
  std::string back(1 * kMiB, 'x');
  ASSERT_EQ(nbd_pread(h, back.data(), back.size(), 9 * kMiB, 0), 0);
  EXPECT_EQ(back, std::string(1 * kMiB, '\0'));
  EXPECT_EQ(image_bytes(id, 9 * kMiB, 1 * kMiB), std::string(1 * kMiB, '\0'));

  Extents e;
  ASSERT_EQ(nbd_block_status(h, 32 * kMiB, 0, nbd_extent_callback{on_extents, &e, nullptr}, 0), 0)
      << nbd_get_error();
  ASSERT_FALSE(e.list.empty());
  // Never written: the first 8 MiB are a hole (two whole objects).
  EXPECT_EQ(e.list[0].first, 8 * kMiB);
  EXPECT_EQ(e.list[0].second & LIBNBD_STATE_HOLE, LIBNBD_STATE_HOLE);
  uint64_t covered = 0, data_bytes = 0;
  for (auto& [length, flags] : e.list) {
    if (!(flags & LIBNBD_STATE_HOLE)) data_bytes += length;
    covered += length;
  }
  EXPECT_GE(data_bytes, 4 * kMiB);  // at least the object not trimmed
  EXPECT_LE(covered, 32 * kMiB);
}

// volume_extend grows the image; a new connection sees the new size and writes at its end.
TEST_F(RbdStore, ExtendGrowsTheImage) {
  const std::string id = create("16M");
  rpc_ok(socket(), "volume_extend", {{"volume_id", id}, {"size", "24M"}});
  RunResult info = rbd({"info", pool() + "/volume-" + id});
  EXPECT_NE(info.output.find("24 MiB"), std::string::npos) << info.output;
  NbdHandle rw = open_nbd(attach(id, "host-a", "rw"));
  ASSERT_TRUE(rw) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(rw.get()), static_cast<int64_t>(24 * kMiB));
  const std::string data = patterned(4096, 9);
  ASSERT_EQ(nbd_pwrite(rw.get(), data.data(), data.size(), 24 * kMiB - 4096, 0), 0)
      << nbd_get_error();
  EXPECT_TRUE(image_bytes(id, 24 * kMiB - 4096, 4096) == data);
}

// Deleting a volume that was served removes its image (the worker lets go of its open image,
// which would otherwise hold a watch and make librbd refuse), and a restart serves the others.
TEST_F(RbdStore, DeleteRemovesTheImageAndARestartServesTheRest) {
  const std::string gone = create("8M", false);
  const std::string kept = create("8M", false);
  const std::string data = patterned(4096, 5);
  {
    NbdHandle rw = open_nbd(attach(gone, "host-a", "rw"));
    ASSERT_TRUE(rw) << nbd_get_error();
    ASSERT_EQ(nbd_pwrite(rw.get(), data.data(), data.size(), 0, 0), 0);
  }
  {
    NbdHandle rw = open_nbd(attach(kept, "host-b", "rw"));
    ASSERT_TRUE(rw) << nbd_get_error();
    ASSERT_EQ(nbd_pwrite(rw.get(), data.data(), data.size(), 4096, 0), 0);
  }
  rpc_ok(socket(), "volume_detach", {{"volume_id", gone}});
  rpc_ok(socket(), "volume_delete", {{"volume_id", gone}});
  for (int i = 0; i < 300 && has_image(gone); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_FALSE(has_image(gone)) << rbd({"ls", pool()}).output << daemon_->log();
  EXPECT_TRUE(has_image(kept));

  start();
  Json list = rpc_ok(socket(), "attachment_list", {{"volume_id", kept}});
  ASSERT_EQ(list.size(), 1u) << list.dump();
  NbdHandle again = open_nbd(list[0]["connection_info"]["data"]["uri"].get<std::string>());
  ASSERT_TRUE(again) << nbd_get_error();
  std::string back(4096, '\0');
  ASSERT_EQ(nbd_pread(again.get(), back.data(), back.size(), 4096, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == data);
}

// What the RBD store cannot do yet is refused with not_supported before anything is made:
// a fill from an image (qemu-img writes local files), and the nbdkit plugin's export_resolve.
TEST_F(RbdStore, FillsAndThePluginAreRefusedAsNotSupported) {
  const std::string id = create("8M");
  attach(id, "host-a", "rw");
  make_file(dir_ / "image.raw", 1 * kMiB, 0);
  EXPECT_EQ(
      rpc_reason(socket(), "volume_create", {{"name", "i"}, {"from_image", dir_ / "image.raw"}}),
      "not_supported");
  Json a = rpc_ok(socket(), "attachment_list", {{"volume_id", id}});
  ASSERT_EQ(a.size(), 1u);
  const std::string name = a[0]["connection_info"]["data"]["export_name"];
  Json r = rpc(socket(), "export_resolve", {{"export_name", name}});
  ASSERT_TRUE(r.contains("error")) << r.dump();
  EXPECT_EQ(r["error"]["code"], -32014) << r.dump();
  EXPECT_NE(r["error"]["message"].get<std::string>().find("rbd:" + pool()), std::string::npos);
  EXPECT_EQ(rpc_ok(socket(), "volume_list", Json::object()).size(), 1u);  // nothing was made
}

// `method` (volume_show or snapshot_show) until the status is no longer "creating" (30 s).
Json settle(const std::string& socket, const std::string& method, const std::string& key,
            const std::string& id) {
  Json v = rpc_ok(socket, method, {{key, id}});
  for (int i = 0; i < 3000 && v["status"] == "creating"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    v = rpc_ok(socket, method, {{key, id}});
  }
  return v;
}

// A snapshot of an RBD volume in use, a volume made from it and a clone of the volume are
// images of their own holding the bytes of their moment, sparse where the source was never
// written; deleting the snapshot removes its image.
TEST_F(RbdStore, SnapshotsAndClonesAreImagesOfTheirOwn) {
  const std::string id = create("32M");
  NbdHandle rw = open_nbd(attach(id, "host-a", "rw"));
  ASSERT_TRUE(rw) << nbd_get_error();
  const std::string a = patterned(64 * 1024, 31);
  ASSERT_EQ(nbd_pwrite(rw.get(), a.data(), a.size(), 20 * kMiB, 0), 0) << nbd_get_error();

  const std::string snap =
      rpc_ok(socket(), "snapshot_create", {{"volume_id", id}, {"name", "before"}})["id"];
  EXPECT_EQ(settle(socket(), "snapshot_show", "snapshot_id", snap)["status"], "available");
  EXPECT_TRUE(has_image(snap)) << rbd({"ls", pool()}).output;
  const std::string b = patterned(64 * 1024, 32);
  ASSERT_EQ(nbd_pwrite(rw.get(), b.data(), b.size(), 20 * kMiB, 0), 0) << nbd_get_error();

  const std::string restored =
      rpc_ok(socket(), "volume_create", {{"name", "r"}, {"from_snapshot", snap}})["id"];
  EXPECT_EQ(settle(socket(), "volume_show", "volume_id", restored)["status"], "available");
  EXPECT_TRUE(image_bytes(restored, 20 * kMiB, a.size()) == a);
  const std::string cloned = rpc_ok(socket(), "volume_create",
                                    {{"name", "c"}, {"from_volume", id}, {"size", "40M"}})["id"];
  EXPECT_EQ(settle(socket(), "volume_show", "volume_id", cloned)["status"], "available");
  EXPECT_TRUE(image_bytes(cloned, 20 * kMiB, b.size()) == b);
  // Sparse: only the object written was copied (rbd du counts what is allocated).
  RunResult du = rbd({"du", "--format", "json", pool() + "/volume-" + cloned});
  ASSERT_EQ(du.status, 0) << du.output;
  const uint64_t used = Json::parse(du.output)["images"][0]["used_size"];
  EXPECT_LE(used, 4 * kMiB) << du.output;
  NbdHandle c = open_nbd(attach(cloned, "host-b", "rw"));
  ASSERT_TRUE(c) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(c.get()), static_cast<int64_t>(40 * kMiB));

  rpc_ok(socket(), "snapshot_delete", {{"snapshot_id", snap}});
  for (int i = 0; i < 300 && has_image(snap); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_FALSE(has_image(snap));
}

// An image removed behind shareblk's back: after a restart the volume shows status error
// with the reason, refuses attachments, and can still be deleted.
TEST_F(RbdStore, AnImageRemovedBehindOurBackIsAVolumeInError) {
  const std::string id = create("8M");
  daemon_.reset();
  RunResult rm = rbd({"rm", pool() + "/volume-" + id});
  ASSERT_EQ(rm.status, 0) << rm.output;
  start();
  Json v = rpc_ok(socket(), "volume_show", {{"volume_id", id}});
  EXPECT_EQ(v["status"], "error") << v.dump();
  EXPECT_NE(v["status_reason"].dump().find("rbd:" + pool()), std::string::npos) << v.dump();
  EXPECT_EQ(rpc_reason(socket(), "attachment_create",
                       {{"volume_id", id},
                        {"instance_uuid", "i"},
                        {"connector", {{"host", "h"}, {"transport", "unix"}}}}),
            "volume_error");
  rpc_ok(socket(), "volume_delete", {{"volume_id", id}});
}

// The cluster stops answering while a volume is served (its OSD frozen): requests fail with
// EIO after --ceph-timeout rather than hanging, and once the OSD is back the same
// connection writes and reads again.
TEST_F(RbdStore, AClusterThatStopsAnsweringFailsRequestsWithEioThenRecovers) {
  start(3);
  const std::string id = create("8M");
  NbdHandle rw = open_nbd(attach(id, "host-a", "rw"));
  ASSERT_TRUE(rw) << nbd_get_error();
  const std::string before = patterned(4096, 11);
  ASSERT_EQ(nbd_pwrite(rw.get(), before.data(), before.size(), 0, 0), 0) << nbd_get_error();

  std::string back(4096, '\0');
  {
    const CephCluster::Frozen osd = ceph_->freeze_osd();
    const std::string during = patterned(4096, 12);
    const auto begin = std::chrono::steady_clock::now();
    EXPECT_EQ(nbd_pwrite(rw.get(), during.data(), during.size(), 4096, LIBNBD_CMD_FLAG_FUA), -1);
    EXPECT_EQ(nbd_get_errno(), EIO) << nbd_get_error();
    EXPECT_EQ(nbd_pread(rw.get(), back.data(), back.size(), 0, 0), -1);
    EXPECT_EQ(nbd_get_errno(), EIO) << nbd_get_error();
    const auto failed_after = std::chrono::steady_clock::now() - begin;
    EXPECT_LT(failed_after, std::chrono::seconds(20));  // two requests, 3 s each, and slack
  }                                                     // the OSD goes on

  // Back: the next requests on the same connection go through (librbd may take a moment to
  // find its OSD again).
  const std::string after = patterned(4096, 13);
  int rc = -1;
  for (int i = 0; i < 30 && rc != 0; ++i) {
    rc = nbd_pwrite(rw.get(), after.data(), after.size(), 8192, LIBNBD_CMD_FLAG_FUA);
    if (rc != 0) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  ASSERT_EQ(rc, 0) << nbd_get_error();
  ASSERT_EQ(nbd_pread(rw.get(), back.data(), back.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == before);
  ASSERT_EQ(nbd_pread(rw.get(), back.data(), back.size(), 8192, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == after);
  EXPECT_TRUE(image_bytes(id, 8192, 4096) == after);
}

// A cluster that stops answering holds only the calls that need it: while an
// attachment_create waits for the frozen OSD (up to --ceph-timeout), calls that read only
// this gateway's own state answer at once, and the create fails with a clear error.
TEST_F(RbdStore, ACallWaitingForTheClusterHoldsNoOtherCall) {
  start(4);
  const std::string id = create("8M");
  Json created;
  std::chrono::steady_clock::duration listed_after{};
  {
    const CephCluster::Frozen osd = ceph_->freeze_osd();
    std::thread waiting([&] {
      created = rpc(socket(), "attachment_create",
                    {{"volume_id", id},
                     {"instance_uuid", "vm-1"},
                     {"connector", {{"host", "vm-1"}, {"transport", "unix"}}}});
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const auto begin = std::chrono::steady_clock::now();
    const Json volumes = rpc_ok(socket(), "volume_list", Json::object());
    rpc_ok(socket(), "attachment_list", Json::object());
    listed_after = std::chrono::steady_clock::now() - begin;
    EXPECT_EQ(volumes.size(), 1U) << volumes.dump();
    waiting.join();
  }
  EXPECT_LT(listed_after, std::chrono::seconds(2));
  ASSERT_TRUE(created.contains("error")) << created.dump();
  EXPECT_EQ(created["error"]["data"]["reason"], "internal") << created.dump();
  // Back: the volume attaches, and nothing of the failed create is left.
  Json again;
  for (int i = 0; i < 30; ++i) {  // librbd may take a moment to find its OSD again
    again = rpc(socket(), "attachment_create",
                {{"volume_id", id},
                 {"instance_uuid", "vm-1"},
                 {"connector", {{"host", "vm-1"}, {"transport", "unix"}}}});
    if (again.contains("result")) break;
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  ASSERT_TRUE(again.contains("result")) << again.dump();
  EXPECT_EQ(rpc_ok(socket(), "attachment_list", {{"volume_id", id}}).size(), 1U);
}

// The monitor stops answering (frozen) while a volume is served: I/O goes on, and so do the
// calls that make and grow images, which talk to the OSDs alone once the daemon has the
// cluster's maps. (Removing one waited 60 s for the monitor, then went through: it is left
// until the monitor is back here. A daemon starting then could not connect: see the startup
// test.)
TEST_F(RbdStore, WithTheMonitorDownIoAndImageCallsGoOn) {
  start(3);
  const std::string id = create("8M");
  NbdHandle rw = open_nbd(attach(id, "host-a", "rw"));
  ASSERT_TRUE(rw) << nbd_get_error();
  const std::string data = patterned(4096, 21);
  ASSERT_EQ(nbd_pwrite(rw.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();

  const std::string more = patterned(4096, 22);
  std::string back(4096, '\0');
  std::string other;
  {
    const CephCluster::Frozen monitor = ceph_->freeze_monitor();
    EXPECT_EQ(nbd_pwrite(rw.get(), more.data(), more.size(), 4096, LIBNBD_CMD_FLAG_FUA), 0)
        << nbd_get_error();
    EXPECT_EQ(nbd_pread(rw.get(), back.data(), back.size(), 0, 0), 0) << nbd_get_error();
    EXPECT_TRUE(back == data);
    other = create("8M", false);
    rpc_ok(socket(), "volume_extend", {{"volume_id", other}, {"size", "16M"}});
  }                                                           // the monitor goes on
  rpc_ok(socket(), "volume_delete", {{"volume_id", other}});  // removed on a job
  for (int i = 0; i < 300 && has_image(other); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_FALSE(has_image(other));
  ASSERT_EQ(nbd_pread(rw.get(), back.data(), back.size(), 4096, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == more);
}

// An image shrunk behind shareblk's back is not served at its old size: a new attachment is
// refused with the sizes named.
TEST_F(RbdStore, AnImageShrunkBehindOurBackIsRefused) {
  const std::string id = create("16M");
  daemon_.reset();
  RunResult shrink = rbd({"resize", "--allow-shrink", "--size", "8M", pool() + "/volume-" + id});
  ASSERT_EQ(shrink.status, 0) << shrink.output;
  start();
  Json r = rpc(socket(), "attachment_create",
               {{"volume_id", id},
                {"instance_uuid", "i"},
                {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  ASSERT_TRUE(r.contains("error")) << r.dump();
  EXPECT_NE(r["error"]["message"].get<std::string>().find("resized outside shareblk"),
            std::string::npos)
      << r.dump();
}

// A cluster that does not answer: the daemon, whose only store it is, refuses to start within
// its --ceph-timeout and says which monitors it tried.
TEST(RbdStoreStartup, AClusterOutOfReachIsAClearErrorNamingTheMonitors) {
  TempDir dir;
  {
    std::ofstream conf(dir / "ceph.conf");
    conf << "[global]\nmon host = 127.0.0.1:9\nauth cluster required = none\n"
            "auth service required = none\nauth client required = none\n";
  }
  const auto begin = std::chrono::steady_clock::now();
  RunResult r =
      run({Daemon::binary(), "--state-dir", dir / "var", "--store", "rbd:rbd", "--ceph-conf",
           dir / "ceph.conf", "--ceph-timeout", "3", "--listen-unix", dir / "nbd.sock"},
          std::chrono::seconds(60));
  const auto took = std::chrono::steady_clock::now() - begin;
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("127.0.0.1:9"), std::string::npos) << r.output;
  EXPECT_LT(took, std::chrono::seconds(30));
}

}  // namespace
}  // namespace shareblk::testing
