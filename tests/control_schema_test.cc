// The control plane's state database across releases (docs/state.md): versioned, constrained,
// migrated forward in one transaction, and never touched by a release older than it. Also the
// store's failures as the API reports them, through the fake store.
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "control/control.h"
#include "control/db.h"
#include "tests/fake_volume_store.h"
#include "tests/support.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using shareblk::control::ControlPlane;
using shareblk::testing::FakeVolumeStore;

const fs::path kFixtures = SHAREBLK_FIXTURES_DIR;

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream all;
  all << in.rdbuf();
  return all.str();
}

// Runs `sql` on the database file directly, as an operator's sqlite3 would; returns the first
// column of the first row, or the error text prefixed with "error: ".
std::string sql(const std::string& path, const std::string& statement) {
  sqlite3* db = nullptr;
  std::string out;
  if (sqlite3_open(path.c_str(), &db) != SQLITE_OK) return "error: open";
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v2(db, statement.c_str(), -1, &stmt, nullptr) != SQLITE_OK) {
    out = std::string("error: ") + sqlite3_errmsg(db);
  } else {
    int rc = sqlite3_step(stmt);
    if (rc == SQLITE_ROW) {
      const auto* text = sqlite3_column_text(stmt, 0);
      out = text ? reinterpret_cast<const char*>(text) : "";
    } else if (rc != SQLITE_DONE) {
      out = std::string("error: ") + sqlite3_errmsg(db);
    }
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return out;
}

class StateDatabaseTest : public ::testing::Test {
 protected:
  std::string db_path() const { return dir_ / "shareblk.db"; }
  void expect_migrated_from(const char* fixture, int version);
  void copy_fixture(const std::string& name = "state-v0.db") {
    fs::copy_file(kFixtures / name, db_path());
  }
  // The backing the release that wrote a fixture had for its volumes.
  void back_volumes(const Json& volumes) {
    for (const Json& v : volumes) {
      ASSERT_FALSE(store_.create(v["id"].get<std::string>(), v["size"].get<uint64_t>()));
    }
  }

  Json call(ControlPlane& plane, const std::string& method, const Json& params = Json::object()) {
    const Json req{{"jsonrpc", "2.0"}, {"id", 1}, {"method", method}, {"params", params}};
    return Json::parse(plane.handle(req.dump(), caller_));
  }

  shareblk::testing::TempDir dir_;
  FakeVolumeStore store_;
  shareblk::control::Caller caller_{1, 0};
};

// state-v0.db was written by shareblkd 0.1.0 (the unversioned schema): three volumes and an
// attachment in each state it could leave behind. Opening it migrates it to the current
// version, and every field reads back as 0.1.0 showed it (the state-v0-*.json files).
TEST_F(StateDatabaseTest, A010DatabaseIsMigratedWithNothingLost) {
  copy_fixture();
  ASSERT_EQ(sql(db_path(), "PRAGMA user_version"), "0");
  Json before_attachments = Json::parse(slurp(kFixtures / "state-v0-attachments.json"));
  Json before_volumes = Json::parse(slurp(kFixtures / "state-v0-volumes.json"));
  back_volumes(before_volumes);
  {
    ControlPlane plane(db_path(), store_, {});
    plane.bind(nullptr, {"/run/x/nbd.sock", "127.0.0.1:10809"});
    Json attachments = call(plane, "attachment_list")["result"];
    ASSERT_EQ(attachments.size(), before_attachments.size()) << attachments;
    for (size_t i = 0; i < attachments.size(); ++i) {
      const Json& now = attachments[i];
      const Json& then = before_attachments[i];
      for (const char* field : {"id", "volume_id", "instance_uuid", "attached_host", "mode",
                                "attach_status", "attach_time", "detach_time", "connector"}) {
        EXPECT_EQ(now[field], then[field]) << field << " of " << then["id"];
      }
      EXPECT_EQ(now["connection_info"].is_null(), then["connection_info"].is_null());
      if (!then["connection_info"].is_null()) {
        EXPECT_EQ(now["connection_info"]["data"]["export_name"],
                  then["connection_info"]["data"]["export_name"]);
      }
    }
    Json volumes = call(plane, "volume_list")["result"];
    ASSERT_EQ(volumes.size(), before_volumes.size());
    for (size_t i = 0; i < volumes.size(); ++i) {
      for (const char* field :
           {"id", "name", "size", "multiattach", "bootable", "status", "created_at"}) {
        EXPECT_EQ(volumes[i][field], before_volumes[i][field]) << field;
      }
      EXPECT_EQ(volumes[i]["attachments"].size(), before_volumes[i]["attachments"].size());
    }
    // The rules hold on the migrated state: an instance cannot attach twice through a host.
    const std::string shared = before_volumes[0]["id"];
    Json dup =
        call(plane, "attachment_create",
             {{"volume_id", shared}, {"instance_uuid", "inst-a"}, {"attached_host", "node-a"}});
    EXPECT_EQ(dup["error"]["data"]["reason"], "duplicate_attachment") << dup;
  }
  EXPECT_EQ(sql(db_path(), "PRAGMA user_version"),
            std::to_string(shareblk::control::kSchemaVersion));
  // A second open finds nothing to do.
  ControlPlane again(db_path(), store_, {});
  EXPECT_EQ(call(again, "attachment_list")["result"].size(), before_attachments.size());
}

// state-v1.db was written by the release before the volume_intent table (schema version 1):
// three volumes, attachments attached, attaching, reserved and detached; state-v2.db is the
// same state as the release before the writer columns left it (schema version 2),
// state-v3.db as the release before QoS left it (version 3), and state-v4.db as the release
// before snapshots left it (version 4, main at 8a66600). Each
// migrates with every field as that release listed it, the volumes get the writer policy
// multi (what they had: every read-write attachment writes), and creates and deletes work.
void StateDatabaseTest::expect_migrated_from(const char* fixture, int version) {
  copy_fixture(fixture);
  ASSERT_EQ(sql(db_path(), "PRAGMA user_version"), std::to_string(version));
  if (version < 2) {
    ASSERT_NE(sql(db_path(), "SELECT count(*) FROM volume_intent").find("no such table"),
              std::string::npos);
  }
  const Json before_attachments = Json::parse(slurp(kFixtures / "state-v1-attachments.json"));
  const Json before_volumes = Json::parse(slurp(kFixtures / "state-v1-volumes.json"));
  back_volumes(before_volumes);
  {
    ControlPlane plane(db_path(), store_, {});
    plane.bind(nullptr, {"/tmp/fx1/nbd.sock", "127.0.0.1:10809"});
    const Json attachments = call(plane, "attachment_list")["result"];
    ASSERT_EQ(attachments.size(), before_attachments.size()) << attachments;
    for (size_t i = 0; i < attachments.size(); ++i) {
      const Json& then = before_attachments[i];
      for (const char* field : {"id", "volume_id", "instance_uuid", "attached_host", "mode",
                                "attach_status", "attach_time", "detach_time", "connector"}) {
        EXPECT_EQ(attachments[i][field], then[field]) << field << " of " << then["id"];
      }
      // connection_info as that release showed it (the fixture's socket is the one bound
      // above); later releases may add to it.
      const Json& info = attachments[i]["connection_info"];
      ASSERT_EQ(info.is_null(), then["connection_info"].is_null()) << then["id"];
      if (info.is_null()) continue;
      EXPECT_EQ(info["driver_volume_type"], then["connection_info"]["driver_volume_type"]);
      for (const auto& [key, value] : then["connection_info"]["data"].items()) {
        EXPECT_EQ(info["data"][key], value) << key << " of " << then["id"];
      }
    }
    const Json volumes = call(plane, "volume_list")["result"];
    ASSERT_EQ(volumes.size(), before_volumes.size());
    for (size_t i = 0; i < volumes.size(); ++i) {
      for (const char* field :
           {"id", "name", "size", "multiattach", "bootable", "status", "created_at"}) {
        EXPECT_EQ(volumes[i][field], before_volumes[i][field]) << field;
      }
      EXPECT_TRUE(volumes[i]["status_reason"].is_null()) << volumes[i];
      EXPECT_EQ(volumes[i]["writer_policy"], "multi") << volumes[i];
      EXPECT_TRUE(volumes[i]["writer"].is_null()) << volumes[i];
      EXPECT_EQ(volumes[i]["fencing_generation"], 0) << volumes[i];
      EXPECT_EQ(volumes[i]["qos"], Json::object()) << volumes[i];  // no limits
    }
    for (const Json& a : attachments) {  // every read-write one still writes
      EXPECT_EQ(a["write_access"], a["mode"] == "rw" && a["attach_status"] != "detached") << a;
      EXPECT_EQ(a["qos"], Json::object()) << a;
    }
    // The migrated database takes creates and deletes, each leaving no intent behind.
    const Json made = call(plane, "volume_create", {{"name", "new"}, {"size", "1M"}});
    ASSERT_TRUE(made.contains("result")) << made;
    const std::string plain = before_volumes[1]["id"];
    EXPECT_TRUE(
        call(plane, "volume_delete", {{"volume_id", plain}, {"wait", true}})["result"]["deleted"]);
    EXPECT_EQ(store_.volumes().count(plain), 0u);
  }
  EXPECT_EQ(sql(db_path(), "PRAGMA user_version"),
            std::to_string(shareblk::control::kSchemaVersion));
  EXPECT_EQ(sql(db_path(), "SELECT count(*) FROM volume_intent"), "0");
  EXPECT_EQ(sql(db_path(), "SELECT count(*) FROM volume_snapshot"), "0");
}

TEST_F(StateDatabaseTest, AVersion1DatabaseIsMigratedWithNothingLost) {
  expect_migrated_from("state-v1.db", 1);
}

TEST_F(StateDatabaseTest, AVersion2DatabaseIsMigratedWithNothingLost) {
  expect_migrated_from("state-v2.db", 2);
}

TEST_F(StateDatabaseTest, AVersion3DatabaseIsMigratedWithNothingLost) {
  expect_migrated_from("state-v3.db", 3);
}

TEST_F(StateDatabaseTest, AVersion4DatabaseIsMigratedWithNothingLost) {
  expect_migrated_from("state-v4.db", 4);
}

TEST_F(StateDatabaseTest, TheStatusColumnAdmitsOnlyTheLifecycleStates) {
  { ControlPlane plane(db_path(), store_, {}); }
  EXPECT_EQ(sql(db_path(), "PRAGMA user_version"),
            std::to_string(shareblk::control::kSchemaVersion));
  EXPECT_EQ(sql(db_path(),
                "INSERT INTO volumes (id, name, size, multiattach, bootable, created_at) "
                "VALUES ('v', 'n', 512, 0, 0, 't')"),
            "");
  const std::string insert =
      "INSERT INTO volume_attachment (id, volume_id, instance_uuid, attached_host, mode, "
      "attach_status, attach_time, detach_time, connector, export_name, created_at) "
      "VALUES ('a', 'v', 'i', 'h', 'rw', '%s', '', '', '', 'e', 't')";
  std::string bogus = insert;
  bogus.replace(bogus.find("%s"), 2, "in-use");
  EXPECT_NE(sql(db_path(), bogus).find("CHECK constraint failed"), std::string::npos);
  std::string good = insert;
  good.replace(good.find("%s"), 2, "detached");
  EXPECT_EQ(sql(db_path(), good), "");
}

// Even with the WAL a killed daemon leaves behind: refusing must not checkpoint it.
TEST_F(StateDatabaseTest, ANewerDatabaseIsRefusedAndLeftAsItWas) {
  copy_fixture();
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(db_path().c_str(), &db), SQLITE_OK);
    sqlite3_db_config(db, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, nullptr);
    ASSERT_EQ(sqlite3_exec(db, "PRAGMA journal_mode=WAL; PRAGMA user_version = 99", nullptr,
                           nullptr, nullptr),
              SQLITE_OK);
    sqlite3_close(db);
  }
  ASSERT_TRUE(fs::exists(db_path() + "-wal"));
  const std::string wal_before = slurp(db_path() + "-wal");
  const std::string before = slurp(db_path());
  try {
    ControlPlane plane(db_path(), store_, {});
    ADD_FAILURE() << "a database of version 99 was opened";
  } catch (const std::exception& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("schema version 99"), std::string::npos) << message;
    EXPECT_NE(message.find("newer"), std::string::npos) << message;
  }
  EXPECT_EQ(slurp(db_path()), before);
  ASSERT_TRUE(fs::exists(db_path() + "-wal"));
  EXPECT_EQ(slurp(db_path() + "-wal"), wal_before);
  EXPECT_EQ(sql(db_path(), "PRAGMA user_version"), "99");
}

// A migration that fails half way (here a row the new constraint refuses) changes nothing.
TEST_F(StateDatabaseTest, AFailedMigrationChangesNothing) {
  copy_fixture();
  ASSERT_EQ(sql(db_path(),
                "UPDATE volume_attachment SET attach_status = 'bogus' WHERE "
                "attach_status = 'reserved'"),
            "");
  const std::string rows =
      sql(db_path(), "SELECT group_concat(attach_status) FROM volume_attachment");
  try {
    ControlPlane plane(db_path(), store_, {});
    ADD_FAILURE() << "a database with an unknown attach_status was opened";
  } catch (const std::exception& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("CHECK constraint failed"), std::string::npos) << message;
    EXPECT_NE(message.find("nothing was changed"), std::string::npos) << message;
  }
  EXPECT_EQ(sql(db_path(), "PRAGMA user_version"), "0");
  EXPECT_EQ(sql(db_path(), "SELECT group_concat(attach_status) FROM volume_attachment"), rows);
}

// --- The store's failures, as the API reports them ---

TEST_F(StateDatabaseTest, StoreFailuresHaveTheirReasonsAndLeaveNoRow) {
  ControlPlane plane(db_path(), store_, {});
  plane.bind(nullptr, {"/run/x/nbd.sock", "127.0.0.1:10809"});
  store_.fail_next(FakeVolumeStore::Call::Create, ENOSPC);
  Json full = call(plane, "volume_create", {{"name", "v"}, {"size", "1M"}});
  EXPECT_EQ(full["error"]["data"]["reason"], "no_space") << full;
  store_.fail_next(FakeVolumeStore::Call::Create, EIO);
  Json broken = call(plane, "volume_create", {{"name", "v"}, {"size", "1M"}});
  EXPECT_EQ(broken["error"]["data"]["reason"], "internal") << broken;
  EXPECT_EQ(call(plane, "volume_list")["result"].size(), 0u);
  EXPECT_TRUE(store_.volumes().empty());

  const std::string id =
      call(plane, "volume_create", {{"name", "v"}, {"size", "1M"}})["result"]["id"];
  store_.fail_next(FakeVolumeStore::Call::Extend, ENOSPC);
  Json grow = call(plane, "volume_extend", {{"volume_id", id}, {"size", "2M"}});
  EXPECT_EQ(grow["error"]["data"]["reason"], "no_space") << grow;
  EXPECT_EQ(call(plane, "volume_show", {{"volume_id", id}})["result"]["size"], 1u << 20);
  // A store that cannot remove the backing leaves the volume to retry on, in status error
  // (its backing may be half gone: an LVM volume is zeroed before lvremove), not attachable.
  store_.fail_next(FakeVolumeStore::Call::Remove, EIO);
  Json del = call(plane, "volume_delete", {{"volume_id", id}, {"wait", true}});
  EXPECT_EQ(del["error"]["data"]["reason"], "internal") << del;
  Json shown = call(plane, "volume_show", {{"volume_id", id}})["result"];
  EXPECT_EQ(shown["id"], id);
  EXPECT_EQ(shown["status"], "error") << shown;
  EXPECT_NE(shown["status_reason"].get<std::string>().find("volume_delete"), std::string::npos)
      << shown;
  Json refused = call(plane, "attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}});
  EXPECT_EQ(refused["error"]["data"]["reason"], "volume_error") << refused;
  EXPECT_TRUE(
      call(plane, "volume_delete", {{"volume_id", id}, {"wait", true}})["result"]["deleted"]);
  EXPECT_TRUE(store_.volumes().empty());
  EXPECT_EQ(sql(db_path(), "SELECT count(*) FROM volume_intent"), "0");
}

// A store that fails to make the backing leaves neither a row nor backing, nor an intent once
// the roll-back is done.
TEST_F(StateDatabaseTest, AFailedCreateLeavesNoIntent) {
  ControlPlane plane(db_path(), store_, {});
  store_.fail_next(FakeVolumeStore::Call::Create, EIO);
  EXPECT_TRUE(call(plane, "volume_create", {{"name", "v"}, {"size", "1M"}}).contains("error"));
  EXPECT_EQ(sql(db_path(), "SELECT count(*) FROM volume_intent"), "0");
  EXPECT_TRUE(store_.volumes().empty());
}

// A create whose roll-back fails too (the backing was made, then could not be removed) keeps
// its intent; the next volume_create tries the roll-back again, so that a daemon that runs
// for months does not keep half-made backing, nor a list of intents that grows with each such
// failure, until its next start. (The control-plane fuzzer found the list growing: volume_list
// reads it on every call, and the fuzzer slowed tenfold.)
TEST_F(StateDatabaseTest, ARollBackThatFailedIsTriedAgainByTheNextCreate) {
  ControlPlane plane(db_path(), store_, {});
  store_.fail_next(FakeVolumeStore::Call::Create, EIO);
  store_.fail_next(FakeVolumeStore::Call::Remove, EIO);
  EXPECT_TRUE(call(plane, "volume_create", {{"name", "v"}, {"size", "1M"}}).contains("error"));
  ASSERT_EQ(sql(db_path(), "SELECT count(*) FROM volume_intent"), "1");
  // What a store that failed half way leaves (an LVM volume made, then its activation failed).
  ASSERT_FALSE(store_.create(sql(db_path(), "SELECT volume_id FROM volume_intent"), 512));
  const Json made = call(plane, "volume_create", {{"name", "w"}, {"size", "2M"}});
  ASSERT_TRUE(made.contains("result")) << made;
  EXPECT_EQ(store_.volumes(), (std::map<std::string, uint64_t>{{made["result"]["id"], 2u << 20}}));
  EXPECT_EQ(sql(db_path(), "SELECT count(*) FROM volume_intent"), "0");
}

// Intents a killed daemon left (written here as it would have): the next start rolls the
// create back and finishes the delete, before it serves anything.
TEST_F(StateDatabaseTest, AStartFinishesTheIntentsItFinds) {
  std::string kept, deleted;
  {
    ControlPlane plane(db_path(), store_, {});
    kept = call(plane, "volume_create", {{"name", "kept"}, {"size", "1M"}})["result"]["id"];
    deleted = call(plane, "volume_create", {{"name", "gone"}, {"size", "1M"}})["result"]["id"];
  }
  ASSERT_FALSE(store_.create("half-made", 512));  // a create killed after the store's part
  ASSERT_EQ(sql(db_path(), "INSERT INTO volume_intent VALUES ('half-made', 'create', '', 't')"),
            "");
  ASSERT_EQ(
      sql(db_path(), "INSERT INTO volume_intent VALUES ('" + deleted + "', 'delete', '', 't')"),
      "");
  ASSERT_NE(sql(db_path(), "INSERT INTO volume_intent VALUES ('x', 'resize', '', 't')")
                .find("CHECK constraint failed"),
            std::string::npos);
  ControlPlane plane(db_path(), store_, {});
  // The create is rolled back before the start returns; the delete is finished in the
  // background (status "deleting" until then).
  Json volumes = call(plane, "volume_list")["result"];
  for (int i = 0; i < 500 && volumes.size() > 1; ++i) {
    EXPECT_EQ(volumes[1]["status"], "deleting") << volumes;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    volumes = call(plane, "volume_list")["result"];
  }
  ASSERT_EQ(volumes.size(), 1u) << volumes;
  EXPECT_EQ(volumes[0]["id"], kept);
  EXPECT_EQ(volumes[0]["status"], "available");
  EXPECT_EQ(store_.volumes(), (std::map<std::string, uint64_t>{{kept, 1u << 20}}));
  EXPECT_EQ(sql(db_path(), "SELECT count(*) FROM volume_intent"), "0");
}

// A volume whose backing is gone for another reason (here: the store lost it) is shown as
// status error with the reason, and refuses attachments; it can still be deleted.
TEST_F(StateDatabaseTest, AVolumeWithoutBackingIsAnErrorAndRefusesAttachments) {
  ControlPlane plane(db_path(), store_, {});
  plane.bind(nullptr, {"/run/x/nbd.sock", "127.0.0.1:10809"});
  const std::string id =
      call(plane, "volume_create", {{"name", "v"}, {"size", "1M"}})["result"]["id"];
  const std::string reserved =
      call(plane, "attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}})["result"]["id"];
  ASSERT_FALSE(store_.remove(id, {}));
  Json refused = call(plane, "attachment_create", {{"volume_id", id}, {"instance_uuid", "j"}});
  EXPECT_EQ(refused["error"]["data"]["reason"], "volume_error") << refused;
  EXPECT_EQ(refused["error"]["code"], -32009) << refused;
  Json update =
      call(plane, "attachment_update",
           {{"attachment_id", reserved}, {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  EXPECT_EQ(update["error"]["data"]["reason"], "volume_error") << update;
  Json shown = call(plane, "volume_show", {{"volume_id", id}})["result"];
  EXPECT_EQ(shown["status"], "error") << shown;
  EXPECT_NE(shown["status_reason"].get<std::string>().find("backing is missing"), std::string::npos)
      << shown;
  // Back again (restored, say): attachable again.
  ASSERT_FALSE(store_.create(id, 1u << 20));
  update =
      call(plane, "attachment_update",
           {{"attachment_id", reserved}, {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  EXPECT_TRUE(update.contains("result")) << update;
  shown = call(plane, "volume_show", {{"volume_id", id}})["result"];
  EXPECT_EQ(shown["status"], "attaching") << shown;
  EXPECT_TRUE(shown["status_reason"].is_null()) << shown;
}

// A full state directory is the caller's to fix, so it says no_space, not internal.
TEST_F(StateDatabaseTest, AFullStateDirectoryIsNoSpace) {
  SHAREBLK_REQUIRE(shareblk::testing::is_root(), "needs root to mount a small tmpfs");
  const std::string mnt = dir_ / "small";
  fs::create_directory(mnt);
  ASSERT_EQ(shareblk::testing::run({"mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt}).status,
            0);
  {
    ControlPlane plane(mnt + "/shareblk.db", store_, {});
    plane.bind(nullptr, {"/run/x/nbd.sock", "127.0.0.1:10809"});
    ASSERT_TRUE(call(plane, "volume_create", {{"name", "v"}, {"size", "1M"}}).contains("result"));
    {  // fill the file system
      std::ofstream filler(mnt + "/filler", std::ios::binary);
      const std::string block(64 * 1024, 'x');
      while (filler.write(block.data(), block.size())) {
      }
    }
    Json full;
    for (int i = 0; i < 200 && !full.contains("error"); ++i) {  // until the WAL needs a page
      full = call(plane, "volume_create", {{"name", std::string(200, 'v')}, {"size", "1M"}});
    }
    EXPECT_EQ(full["error"]["data"]["reason"], "no_space") << full;
    fs::remove(mnt + "/filler");
    EXPECT_TRUE(
        call(plane, "volume_create", {{"name", "after"}, {"size", "1M"}}).contains("result"));
  }
  EXPECT_EQ(shareblk::testing::run({"umount", mnt}).status, 0);
}

}  // namespace
