// `shareblk backup` while the daemon serves, and the documented restore (docs/state.md,
// "Backup and restore"): the copy is consistent while NBD clients write and calls change the
// state, a restored daemon serves the same volumes and attachments, and a backup that cannot
// be written (a full file system, a file already there) leaves nothing behind.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/mount.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
namespace fs = std::filesystem;
using Json = nlohmann::json;

st::RunResult cli(const std::string& control, const std::vector<std::string>& args) {
  std::vector<std::string> argv{SHAREBLK_CLI_PATH, "--socket", control};
  argv.insert(argv.end(), args.begin(), args.end());
  return st::run(argv, std::chrono::seconds(30));
}

// PRAGMA integrity_check of the file, and the ids in `table`.
std::string integrity(const std::string& path) {
  sqlite3* db = nullptr;
  std::string result = "cannot open";
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK) {
    sqlite3_stmt* s = nullptr;
    if (sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &s, nullptr) == SQLITE_OK &&
        sqlite3_step(s) == SQLITE_ROW) {
      result = reinterpret_cast<const char*>(sqlite3_column_text(s, 0));
    }
    sqlite3_finalize(s);
  }
  sqlite3_close(db);
  return result;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::set<std::string> ids(const Json& list) {
  std::set<std::string> out;
  for (const Json& item : list) out.insert(item["id"].get<std::string>());
  return out;
}

TEST(StateBackup, ACopyTakenWhileServingRestoresTheSameVolumesAndAttachments) {
  st::TempDir dir;
  const std::string state = dir / "state";
  const std::string control = dir / "shareblk.sock";
  const std::vector<std::string> args{
      "--state-dir", state, "--control-socket", control, "--listen-unix", dir / "nbd.sock",
      "--workers",   "1"};
  auto daemon = std::make_unique<st::Daemon>(args, control);
  std::vector<std::string> volumes;
  for (int i = 0; i < 3; ++i) {
    volumes.push_back(st::rpc_ok(
        control, "volume_create",
        {{"name", "v" + std::to_string(i)}, {"size", "4M"}, {"multiattach", true}})["id"]);
  }
  const Json a = st::rpc_ok(control, "attachment_create",
                            {{"volume_id", volumes[0]},
                             {"instance_uuid", "vm-1"},
                             {"connector", {{"host", "h1"}, {"transport", "unix"}}}});
  const std::string uri = a["connection_info"]["data"]["uri"];
  const Json before_volumes = st::rpc_ok(control, "volume_list", Json::object());
  const Json before_attachments = st::rpc_ok(control, "attachment_list", Json::object());

  // While backups are taken: a client writes, and calls rename a volume back and forth.
  std::atomic<bool> done{false};
  std::atomic<int> writes{0};
  std::thread writer([&] {
    auto h = st::nbd_connect(uri);
    if (!h) return;
    const std::string block = st::pattern('w', 65536);
    for (uint64_t off = 0; !done; off = (off + block.size()) % (4 << 20)) {
      if (nbd_pwrite(h.get(), block.data(), block.size(), off, 0) == 0) ++writes;
    }
  });
  std::thread renamer([&] {
    for (int i = 0; !done; ++i) {
      st::rpc(control, "volume_update",
              {{"volume_id", volumes[1]}, {"name", i % 2 ? "v1" : "v1-renamed"}});
    }
  });
  std::vector<std::string> backups;
  for (int i = 0; i < 5; ++i) {
    backups.push_back(dir / ("backup-" + std::to_string(i) + ".db"));
    const st::RunResult r = cli(control, {"--json", "backup", backups.back()});
    ASSERT_EQ(r.status, 0) << r.output;
    const Json shown = Json::parse(r.output);
    EXPECT_EQ(shown["path"], backups.back());
    EXPECT_EQ(shown["volumes"], 3);
    EXPECT_EQ(shown["attachments"], 1);
    EXPECT_EQ(fs::status(backups.back()).permissions() & fs::perms::all,
              fs::perms::owner_read | fs::perms::owner_write);
  }
  done = true;
  writer.join();
  renamer.join();
  EXPECT_GT(writes.load(), 0) << "the client never wrote while backups were taken";
  for (const std::string& b : backups) EXPECT_EQ(integrity(b), "ok") << b;

  // Restore, as docs/state.md says: stop, copy over, drop the old WAL, start.
  EXPECT_EQ(daemon->stop(SIGTERM), 0) << daemon->log();
  daemon.reset();
  fs::copy_file(backups.front(), state + "/shareblk.db", fs::copy_options::overwrite_existing);
  fs::remove(state + "/shareblk.db-wal");
  fs::remove(state + "/shareblk.db-shm");
  daemon = std::make_unique<st::Daemon>(args, control);
  EXPECT_EQ(ids(st::rpc_ok(control, "volume_list", Json::object())), ids(before_volumes));
  EXPECT_EQ(ids(st::rpc_ok(control, "attachment_list", Json::object())), ids(before_attachments));
  auto h = st::nbd_connect(uri);
  ASSERT_TRUE(h) << "the restored attachment serves under its export name\n" << daemon->log();
  EXPECT_EQ(st::nbd_read(h.get(), 0, 65536), st::pattern('w', 65536));
  h.reset();
  EXPECT_EQ(daemon->stop(SIGTERM), 0) << daemon->log();
}

TEST(StateBackup, ABackupThatCannotBeWrittenSaysWhyAndLeavesNothing) {
  st::TempDir dir;
  const std::string control = dir / "shareblk.sock";
  st::Daemon daemon({"--state-dir", dir / "state", "--control-socket", control, "--listen-unix",
                     dir / "nbd.sock", "--workers", "1"},
                    control);
  st::rpc_ok(control, "volume_create", {{"name", "v"}, {"size", "1M"}});
  EXPECT_EQ(st::rpc_reason(control, "state_backup", {{"path", "relative.db"}}), "invalid_params");
  EXPECT_EQ(st::rpc_reason(control, "state_backup", {{"path", dir / "no/such/dir.db"}}),
            "invalid_params");
  EXPECT_EQ(st::rpc_reason(control, "state_backup", {{"path", 7}}), "invalid_params");
  write_text(dir / "taken.db", "precious");
  const st::RunResult taken = cli(control, {"backup", dir / "taken.db"});
  EXPECT_EQ(taken.status, 1) << taken.output;
  EXPECT_NE(taken.output.find("exists: a backup never replaces a file"), std::string::npos)
      << taken.output;
  EXPECT_EQ(read_text(dir / "taken.db"), "precious");

  // A file system with room for less than the database.
  const std::string full = dir / "full";
  fs::create_directories(full);
  const bool mounted = ::mount("tmpfs", full.c_str(), "tmpfs", 0, "size=16k") == 0;
  SHAREBLK_REQUIRE(mounted, "needs to mount a small tmpfs (root)");
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount(path.c_str()); }
  } unmount{full};
  EXPECT_EQ(st::rpc_reason(control, "state_backup", {{"path", full + "/b.db"}}), "no_space");
  EXPECT_TRUE(fs::is_empty(full)) << "a partial backup was left behind";
  EXPECT_EQ(cli(control, {"backup", dir / "after.db"}).status, 0) << "the daemon goes on";
  EXPECT_EQ(integrity(dir / "after.db"), "ok");
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

}  // namespace
