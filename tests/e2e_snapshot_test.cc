// Snapshots and clones end to end (docs/snapshots.md): what a snapshot holds, the volumes made
// from snapshots and volumes, the refusals that keep them whole, crash consistency under a
// writer, a crash half way, and reflinks on XFS.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/managed_daemon.h"
#include "tests/nbd_client.h"

namespace shareblk::testing {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kBlock = 4096;

// Whether every byte of `s` is `c` (a mismatch's bytes would flood the log).
bool all(const std::string& s, char c) {
  return s.find_first_not_of(c) == std::string::npos;
}

// Through libnbd (tests/nbd_client.h), in pieces of 4 MiB: a request carries 32 MiB at most.
constexpr uint64_t kPiece = 4 << 20;

std::string read_bytes(nbd_handle* h, uint64_t length, uint64_t offset) {
  std::string out;
  for (uint64_t done = 0; done < length; done += kPiece) {
    out += nbd_read(h, offset + done, std::min(kPiece, length - done));
  }
  return out;
}

void write_bytes(nbd_handle* h, const std::string& data, uint64_t offset) {
  for (uint64_t done = 0; done < data.size(); done += kPiece) {
    const uint64_t n = std::min<uint64_t>(kPiece, data.size() - done);
    ASSERT_EQ(nbd_pwrite(h, data.data() + done, n, offset + done, 0), 0) << nbd_get_error();
  }
}

class SnapshotTest : public ManagedDaemonTest {
 protected:
  std::string uri(const std::string& volume, const std::string& instance) {
    return attach(volume, instance,
                  {{"host", instance}, {"transport", "unix"}})["connection_info"]["data"]["uri"];
  }
  // `method` (volume_show or snapshot_show) until the status is no longer "creating" (30 s).
  Json settle(const std::string& method, const std::string& key, const std::string& id) {
    Json v = rpc_ok(control(), method, {{key, id}});
    for (int i = 0; i < 3000 && v["status"] == "creating"; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      v = rpc_ok(control(), method, {{key, id}});
    }
    return v;
  }
  Json snapshot(const std::string& volume, const std::string& name = "s") {
    return rpc_ok(control(), "snapshot_create", {{"volume_id", volume}, {"name", name}});
  }
  uint64_t allocated(const std::string& id) {
    struct stat st {};
    EXPECT_EQ(::stat((dir_.path() / "volumes" / (id + ".img")).c_str(), &st), 0);
    return static_cast<uint64_t>(st.st_blocks) * 512;
  }
};

TEST_F(SnapshotTest, ASnapshotKeepsTheVolumeAsItWasAndNewVolumesCopyIt) {
  start();
  const std::string vol = create_volume("64M");
  NbdHandle client = nbd_connect(uri(vol, "a"));
  ASSERT_TRUE(client) << nbd_get_error();
  write_bytes(client.get(), std::string(64 * 1024, 'A'), 8 * kMiB);

  const Json taken = snapshot(vol, "before");
  EXPECT_EQ(taken["volume_id"], vol);
  EXPECT_EQ(taken["size"], 64 * kMiB);
  const std::string snap = taken["id"];
  EXPECT_EQ(settle("snapshot_show", "snapshot_id", snap)["status"], "available");
  write_bytes(client.get(), std::string(64 * 1024, 'B'), 8 * kMiB);

  // From the snapshot: the bytes as they were, at the snapshot's size; sparse as the source.
  const Json from_snap =
      rpc_ok(control(), "volume_create", {{"name", "restored"}, {"from_snapshot", snap}});
  EXPECT_EQ(from_snap["size"], 64 * kMiB);
  const std::string restored = from_snap["id"];
  EXPECT_EQ(settle("volume_show", "volume_id", restored)["status"], "available");
  EXPECT_LE(allocated(restored), 1 * kMiB) << "a copy of 64 KiB of data must stay sparse";
  {
    NbdHandle r = nbd_connect(uri(restored, "b"));
    ASSERT_TRUE(r) << nbd_get_error();
    EXPECT_TRUE(all(read_bytes(r.get(), 64 * 1024, 8 * kMiB), 'A'));
    EXPECT_TRUE(all(read_bytes(r.get(), 4096, 0), '\0'));
  }
  // From the volume, larger: its bytes now, zeroes past them.
  const std::string cloned = rpc_ok(
      control(), "volume_create", {{"name", "clone"}, {"from_volume", vol}, {"size", "96M"}})["id"];
  const Json clone = settle("volume_show", "volume_id", cloned);
  EXPECT_EQ(clone["status"], "available") << clone;
  EXPECT_EQ(clone["size"], 96 * kMiB);
  {
    NbdHandle c = nbd_connect(uri(cloned, "c"));
    ASSERT_TRUE(c) << nbd_get_error();
    EXPECT_TRUE(all(read_bytes(c.get(), 64 * 1024, 8 * kMiB), 'B'));
    EXPECT_TRUE(all(read_bytes(c.get(), 4096, 80 * kMiB), '\0'));
  }

  const Json listed = rpc_ok(control(), "snapshot_list", {{"volume_id", vol}});
  ASSERT_EQ(listed.size(), 1u) << listed;
  EXPECT_EQ(listed[0]["name"], "before");
  EXPECT_EQ(rpc_ok(control(), "snapshot_list", {{"volume_id", cloned}}).size(), 0u);
  EXPECT_EQ(rpc_reason(control(), "snapshot_list", {{"volume_id", "nope"}}), "not_found");
  EXPECT_EQ(rpc_reason(control(), "snapshot_show", {{"snapshot_id", "nope"}}), "not_found");
  EXPECT_EQ(rpc_reason(control(), "volume_create", {{"name", "x"}, {"from_snapshot", "nope"}}),
            "not_found");
  EXPECT_EQ(rpc_reason(control(), "volume_create",
                       {{"name", "x"}, {"from_snapshot", snap}, {"size", "1M"}}),
            "invalid_params");
  EXPECT_EQ(rpc_reason(control(), "volume_create",
                       {{"name", "x"}, {"from_snapshot", snap}, {"from_volume", vol}}),
            "invalid_params");

  // The volume keeps its snapshots: it cannot be deleted before them.
  rpc_ok(control(), "volume_detach", {{"volume_id", vol}});
  EXPECT_EQ(rpc_reason(control(), "volume_delete", {{"volume_id", vol}}), "volume_has_snapshots");
  EXPECT_EQ(rpc_ok(control(), "snapshot_delete", {{"snapshot_id", snap}, {"wait", true}}),
            (Json{{"id", snap}, {"deleted", true}}));
  EXPECT_FALSE(fs::exists(dir_.path() / "volumes" / (snap + ".img")));
  EXPECT_EQ(rpc_reason(control(), "snapshot_show", {{"snapshot_id", snap}}), "not_found");
  rpc_ok(control(), "volume_delete", {{"volume_id", vol}, {"wait", true}});

  // The restored volume outlives both.
  start();
  EXPECT_EQ(rpc_ok(control(), "volume_show", {{"volume_id", restored}})["status"], "attaching");
}

// A client writes sequence numbers into consecutive blocks, one at a time, each acknowledged
// before the next: the volume at any instant is a prefix 1..k. The copy is slowed down (the
// test hook pauses at each MiB) so that, were the writes not held, the writer would run far
// past the copy's position. The snapshot must be exactly such a prefix, the writer must never
// see an error, and it goes on once the snapshot is done.
TEST_F(SnapshotTest, ASnapshotTakenUnderWritesIsAPointInTime) {
  SHAREBLK_REQUIRE_TEST_HOOKS();
  ::setenv("SHAREBLK_TEST_JOB_PAUSE_MS", "10", 1);
  start();
  ::unsetenv("SHAREBLK_TEST_JOB_PAUSE_MS");
  const uint64_t blocks = 64 * kMiB / kBlock;
  const std::string vol = create_volume("64M");
  const std::string writer_uri = uri(vol, "writer");
  {
    // Every block allocated, and not zero (a copy skips holes and zeroes at once), with 0 for
    // its sequence number.
    NbdHandle fill = nbd_connect(writer_uri);
    ASSERT_TRUE(fill) << nbd_get_error();
    std::string blocks_of_x(4 * kMiB, 'x');
    for (uint64_t b = 0; b < 4 * kMiB / kBlock; ++b) std::memset(&blocks_of_x[b * kBlock], 0, 8);
    for (uint64_t at = 0; at < 64 * kMiB; at += blocks_of_x.size())
      write_bytes(fill.get(), blocks_of_x, at);
  }
  std::atomic<uint64_t> written{0};
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::thread writer([&] {
    NbdHandle w = nbd_connect(writer_uri);
    if (!w) {
      failures++;
      return;
    }
    std::string block(kBlock, 'x');
    for (uint64_t i = 0; i < blocks && !stop; ++i) {
      const uint64_t value = i + 1;
      std::memcpy(block.data(), &value, sizeof value);
      if (nbd_pwrite(w.get(), block.data(), kBlock, i * kBlock, 0) != 0) {
        failures++;
        return;
      }
      written = value;
    }
  });
  while (written < 200 && failures == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const std::string snap = snapshot(vol)["id"];
  const uint64_t at_snapshot = written;
  // The last count seen while the snapshot was still being copied (64 pauses of 10 ms). Writes
  // go on as soon as the last byte is copied, while the status still says "creating" until the
  // job is recorded as done; so a count is kept only when a later show says the copy had not
  // reached its end (progress < 100), which proves the writes were still held when it was read.
  uint64_t during_copy = at_snapshot;
  int seen_during_copy = 0;
  Json done = rpc_ok(control(), "snapshot_show", {{"snapshot_id", snap}});
  for (int i = 0; i < 3000 && done["status"] == "creating"; ++i) {
    const uint64_t seen = written;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    done = rpc_ok(control(), "snapshot_show", {{"snapshot_id", snap}});
    if (done["status"] == "creating" && done["progress"].get<int>() < 100) {
      during_copy = seen;
      ++seen_during_copy;
    }
  }
  EXPECT_EQ(done["status"], "available") << done;
  ASSERT_GT(seen_during_copy, 0) << "the copy must be slow enough to be watched";
  // Held while the copy ran: at most the write in flight when the snapshot began went on.
  EXPECT_LE(during_copy, at_snapshot + 1);
  for (int i = 0; i < 1000 && written <= during_copy && failures == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(written.load(), during_copy) << "the writer must go on after the snapshot";
  stop = true;
  writer.join();
  EXPECT_EQ(failures, 0) << "a held write must wait, never fail";

  const std::string copy =
      rpc_ok(control(), "volume_create", {{"name", "c"}, {"from_snapshot", snap}})["id"];
  ASSERT_EQ(settle("volume_show", "volume_id", copy)["status"], "available");
  NbdHandle r = nbd_connect(uri(copy, "reader"));
  ASSERT_TRUE(r) << nbd_get_error();
  const std::string bytes = read_bytes(r.get(), 64 * kMiB, 0);
  uint64_t prefix = 0;
  while (prefix < blocks) {
    uint64_t value = 0;
    std::memcpy(&value, bytes.data() + prefix * kBlock, sizeof value);
    if (value != prefix + 1) break;
    ++prefix;
  }
  EXPECT_GE(prefix, at_snapshot - 1);
  EXPECT_LE(prefix, during_copy + 1);
  for (uint64_t i = prefix; i < blocks; ++i) {
    uint64_t value = 0;
    std::memcpy(&value, bytes.data() + i * kBlock, sizeof value);
    if (value != 0) {
      ADD_FAILURE() << "block " << i << " was written after block " << prefix
                    << ", which the snapshot lacks: not a point in time";
      break;
    }
  }
}

TEST_F(SnapshotTest, ASnapshotBeingCopiedCannotBeUsedOrDeletedAndACrashRollsItBack) {
  SHAREBLK_REQUIRE_TEST_HOOKS();
  // Long enough for the calls below to find the copy still running on a slow machine: the
  // daemon is killed half way, so the pause costs the test nothing.
  ::setenv("SHAREBLK_TEST_JOB_PAUSE_MS", "5000", 1);
  start();
  ::unsetenv("SHAREBLK_TEST_JOB_PAUSE_MS");
  const std::string vol = create_volume("8M");
  {
    NbdHandle w = nbd_connect(uri(vol, "a"));
    ASSERT_TRUE(w) << nbd_get_error();
    write_bytes(w.get(), std::string(kMiB, 'z'), 0);
  }
  const Json taken = snapshot(vol);
  EXPECT_EQ(taken["status"], "creating");
  const std::string snap = taken["id"];
  EXPECT_EQ(rpc_reason(control(), "snapshot_delete", {{"snapshot_id", snap}}), "volume_busy");
  EXPECT_EQ(rpc_reason(control(), "volume_create", {{"name", "x"}, {"from_snapshot", snap}}),
            "volume_busy");
  EXPECT_EQ(rpc_reason(control(), "snapshot_create", {{"volume_id", vol}, {"name", "t"}}),
            "volume_busy");
  // Killed half way: the next start rolls the snapshot back, its backing too.
  const Json before = rpc_ok(control(), "volume_show", {{"volume_id", vol}});
  daemon_->stop(SIGKILL);
  start();
  EXPECT_EQ(rpc_reason(control(), "snapshot_show", {{"snapshot_id", snap}}), "not_found");
  EXPECT_FALSE(fs::exists(dir_.path() / "volumes" / (snap + ".img")));
  EXPECT_EQ(rpc_ok(control(), "snapshot_list").size(), 0u);
  EXPECT_EQ(rpc_ok(control(), "volume_show", {{"volume_id", vol}})["status"], before["status"]);
}

// The CLI names volumes and snapshots by name, and waits for the copies.
TEST_F(SnapshotTest, TheCliTakesSnapshotsByNameAndMakesVolumesFromThem) {
  start();
  auto cli = [&](std::vector<std::string> args) {
    std::vector<std::string> argv{SHAREBLK_CLI_PATH, "--socket", control()};
    argv.insert(argv.end(), args.begin(), args.end());
    return run(argv, std::chrono::seconds(60));
  };
  ASSERT_EQ(cli({"volume-create", "data", "8M"}).status, 0);
  RunResult r = cli({"--json", "snapshot-create", "data", "before-upgrade"});
  ASSERT_EQ(r.status, 0) << r.output;
  const Json taken = Json::parse(r.output, nullptr, false);
  EXPECT_EQ(taken.value("status", ""), "available") << r.output;
  r = cli({"--json", "volume-create", "restored", "--from-snapshot", "before-upgrade"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(Json::parse(r.output, nullptr, false).value("status", ""), "available") << r.output;
  r = cli({"--json", "volume-create", "twin", "16M", "--from-volume", "data"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(Json::parse(r.output, nullptr, false).value("size", 0u), 16 * kMiB) << r.output;
  r = cli({"--json", "snapshot-list", "data"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(Json::parse(r.output, nullptr, false).size(), 1u) << r.output;
  r = cli({"volume-delete", "data"});
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("volume_has_snapshots"), std::string::npos) << r.output;
  r = cli({"--json", "snapshot-delete", "before-upgrade"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(Json::parse(r.output, nullptr, false).value("deleted", false), true) << r.output;
  EXPECT_EQ(cli({"volume-delete", "data"}).status, 0);
}

// On a file system with reflinks a snapshot shares the volume's blocks: it takes no space and
// no time, and writes to either side after it stay apart.
TEST_F(SnapshotTest, OnXfsASnapshotIsAReflinkThatTakesNoSpace) {
  SHAREBLK_REQUIRE(is_root(), "mounting XFS on a loop device needs root");
  SHAREBLK_REQUIRE(have_program("mkfs.xfs"), "mkfs.xfs is not installed (xfsprogs)");
  TempDir mnt;
  const std::string image = mnt / "xfs.img";
  const std::string state = mnt / "state";
  RunResult made = run({"truncate", "-s", "512M", image});
  ASSERT_EQ(made.status, 0) << made.output;
  made = run({"mkfs.xfs", "-q", "-m", "reflink=1", image});
  ASSERT_EQ(made.status, 0) << made.output;
  fs::create_directory(state);
  RunResult mounted = run({"mount", "-o", "loop", image, state});
  SHAREBLK_REQUIRE(mounted.status == 0, "cannot mount XFS on a loop device: " + mounted.output);
  struct Unmount {
    std::string path;
    ~Unmount() { run({"umount", "-l", path}); }
  } unmount{state};
  std::unique_ptr<Daemon> daemon =
      std::make_unique<Daemon>(std::vector<std::string>{"--state-dir", state, "--listen-unix",
                                                        socket_dir_ / "xfs.sock", "--workers", "1"},
                               state + "/shareblk.sock");
  const std::string control = state + "/shareblk.sock";
  const std::string vol = rpc_ok(control, "volume_create", {{"name", "v"}, {"size", "128M"}})["id"];
  const std::string link = rpc_ok(
      control, "attachment_create",
      {{"volume_id", vol},
       {"instance_uuid", "a"},
       {"connector", {{"host", "a"}, {"transport", "unix"}}}})["connection_info"]["data"]["uri"];
  NbdHandle w = nbd_connect(link);
  ASSERT_TRUE(w) << nbd_get_error();
  write_bytes(w.get(), std::string(64 * kMiB, 'R'), 0);
  ASSERT_EQ(nbd_flush(w.get(), 0), 0);
  struct statvfs before {};
  ASSERT_EQ(::statvfs(state.c_str(), &before), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string snap =
      rpc_ok(control, "snapshot_create", {{"volume_id", vol}, {"name", "s"}})["id"];
  Json s = rpc_ok(control, "snapshot_show", {{"snapshot_id", snap}});
  for (int i = 0; i < 500 && s["status"] == "creating"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    s = rpc_ok(control, "snapshot_show", {{"snapshot_id", snap}});
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_EQ(s["status"], "available") << s;
  struct statvfs after {};
  ASSERT_EQ(::statvfs(state.c_str(), &after), 0);
  const uint64_t used = (before.f_bavail - after.f_bavail) * before.f_frsize;
  EXPECT_LT(used, 8 * kMiB) << "a reflink of 64 MiB of data must not copy it";
  EXPECT_LT(took, std::chrono::seconds(2));
  daemon->stop(SIGTERM);
  EXPECT_NE(daemon->log().find(snap), std::string::npos);

  // Writes after the snapshot change the volume only.
  daemon =
      std::make_unique<Daemon>(std::vector<std::string>{"--state-dir", state, "--listen-unix",
                                                        socket_dir_ / "xfs.sock", "--workers", "1"},
                               control);
  {
    NbdHandle again = nbd_connect(link);
    ASSERT_TRUE(again) << nbd_get_error();
    write_bytes(again.get(), std::string(kMiB, 'W'), 0);
  }
  const std::string copy =
      rpc_ok(control, "volume_create", {{"name", "c"}, {"from_snapshot", snap}})["id"];
  Json c = rpc_ok(control, "volume_show", {{"volume_id", copy}});
  for (int i = 0; i < 500 && c["status"] == "creating"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    c = rpc_ok(control, "volume_show", {{"volume_id", copy}});
  }
  ASSERT_EQ(c["status"], "available") << c;
  const std::string read_uri = rpc_ok(
      control, "attachment_create",
      {{"volume_id", copy},
       {"instance_uuid", "b"},
       {"connector", {{"host", "b"}, {"transport", "unix"}}}})["connection_info"]["data"]["uri"];
  NbdHandle r = nbd_connect(read_uri);
  ASSERT_TRUE(r) << nbd_get_error();
  EXPECT_TRUE(all(read_bytes(r.get(), 4096, 0), 'R'));
  daemon->stop(SIGTERM);
}

}  // namespace
}  // namespace shareblk::testing
