#include "control/db.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace shareblk::control {

// A prepared statement: from the connection's cache (Database::statements_; parsing costs more
// than running most of these), reset and unbound on scope exit; or, when that SQL is already
// in use further up the stack, one of its own.
class Statement {
 public:
  // One of its own, finalized on scope exit (the migration's: its tables change under it).
  Statement(sqlite3* db, const std::string& sql) : db_(db) {
    if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt_, nullptr) != SQLITE_OK) fail();
  }
  Statement(Database& db, const std::string& sql) : db_(db.db_) {
    auto [it, added] = db.statements_.try_emplace(sql);
    if (added || it->second.in_use) {
      sqlite3_stmt* fresh = nullptr;
      if (sqlite3_prepare_v3(db_, sql.c_str(), -1, added ? SQLITE_PREPARE_PERSISTENT : 0, &fresh,
                             nullptr) != SQLITE_OK) {
        if (added) db.statements_.erase(it);
        fail();
      }
      if (added) {
        it->second.stmt = fresh;
      } else {
        stmt_ = fresh;
        return;
      }
    }
    cached_ = &it->second;
    cached_->in_use = true;
    stmt_ = cached_->stmt;
  }
  ~Statement() {
    if (cached_ == nullptr) {
      sqlite3_finalize(stmt_);
      return;
    }
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
    cached_->in_use = false;
  }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& bind(int i, const std::string& v) {
    check(sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT));
    return *this;
  }
  Statement& bind(int i, int64_t v) {
    check(sqlite3_bind_int64(stmt_, i, v));
    return *this;
  }
  // True while there is a row.
  bool step() {
    int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc != SQLITE_DONE) fail();
    return false;
  }
  std::string text(int col) const {
    const auto* p = sqlite3_column_text(stmt_, col);
    return p ? std::string(reinterpret_cast<const char*>(p)) : std::string();
  }
  int64_t integer(int col) const { return sqlite3_column_int64(stmt_, col); }

 private:
  void check(int rc) {
    if (rc != SQLITE_OK) fail();
  }
  [[noreturn]] void fail() {
    throw DbError(std::string("sqlite: ") + sqlite3_errmsg(db_), sqlite3_errcode(db_) & 0xff);
  }
  sqlite3* db_;
  Database::CachedStatement* cached_ = nullptr;
  sqlite3_stmt* stmt_ = nullptr;
};

namespace {

// The tables as version 4 has them (5 added volume_snapshot). Version 0 (0.1.0) had no CHECK on
// attach_status; version 1 had no volume_intent; version 2 had no writer columns (kWriterColumns),
// 3 no qos (kQosColumns).
const char* kVolumesTable = R"sql(
CREATE TABLE volumes (
  id          TEXT PRIMARY KEY,
  name        TEXT NOT NULL,
  size        INTEGER NOT NULL CHECK (size > 0),
  multiattach INTEGER NOT NULL,
  bootable    INTEGER NOT NULL,
  created_at  TEXT NOT NULL
);
)sql";

// 2 → 3: who may write (docs/fencing.md). ALTER TABLE ADD COLUMN, on a new database too, so
// that both have the same table.
const char* kWriterColumns[] = {
    "ALTER TABLE volumes ADD COLUMN writer_policy TEXT NOT NULL DEFAULT 'multi' "
    "CHECK (writer_policy IN ('multi', 'single'))",
    "ALTER TABLE volumes ADD COLUMN writer TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE volumes ADD COLUMN fencing_generation INTEGER NOT NULL DEFAULT 0 "
    "CHECK (fencing_generation >= 0)",
    "ALTER TABLE volumes ADD COLUMN writer_since TEXT NOT NULL DEFAULT ''",
    // Existing read-write attachments wrote under the policy multi: since they were created.
    "ALTER TABLE volume_attachment ADD COLUMN write_access_since TEXT NOT NULL DEFAULT ''",
    "UPDATE volume_attachment SET write_access_since = created_at "
    "WHERE mode = 'rw' AND attach_status != 'detached'",
};

// 3 → 4: QoS specs (docs/qos.md), JSON text; '' for none.
const char* kQosColumns[] = {
    "ALTER TABLE volumes ADD COLUMN qos TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE volume_attachment ADD COLUMN qos TEXT NOT NULL DEFAULT ''",
};

// `%s` is the table's name: the migration builds it under a new name first.
const char* kAttachmentTableV1 = R"sql(
CREATE TABLE %s (
  id            TEXT PRIMARY KEY,
  volume_id     TEXT NOT NULL REFERENCES volumes(id) ON DELETE CASCADE,
  instance_uuid TEXT NOT NULL,
  attached_host TEXT NOT NULL,
  mode          TEXT NOT NULL CHECK (mode IN ('rw', 'ro')),
  attach_status TEXT NOT NULL
                CHECK (attach_status IN ('reserved', 'attaching', 'attached', 'detaching',
                                         'detached')),
  attach_time   TEXT NOT NULL,
  detach_time   TEXT NOT NULL,
  connector     TEXT NOT NULL,
  export_name   TEXT NOT NULL UNIQUE,
  created_at    TEXT NOT NULL
);
)sql";

const char* kAttachmentIndex = "CREATE INDEX attachment_by_volume ON volume_attachment(volume_id);";

// No reference to volumes: a create's intent comes before its row.
const char* kIntentTable = R"sql(
CREATE TABLE volume_intent (
  volume_id  TEXT PRIMARY KEY,
  action     TEXT NOT NULL CHECK (action IN ('create', 'delete')),
  error      TEXT NOT NULL,
  created_at TEXT NOT NULL
);
)sql";

// 4 → 5: snapshots. A volume with snapshots is never deleted (volume_has_snapshots), so the
// reference has no cascade.
const char* kSnapshotTable[] = {
    R"sql(
CREATE TABLE volume_snapshot (
  id         TEXT PRIMARY KEY,
  volume_id  TEXT NOT NULL REFERENCES volumes(id),
  name       TEXT NOT NULL,
  size       INTEGER NOT NULL CHECK (size > 0),
  created_at TEXT NOT NULL
);
)sql",
    "CREATE INDEX snapshot_by_volume ON volume_snapshot(volume_id);",
};

std::string attachment_table(const char* name) {
  std::string sql = kAttachmentTableV1;
  sql.replace(sql.find("%s"), 2, name);
  return sql;
}

constexpr const char* kVolumeColumns =
    "id, name, size, multiattach, bootable, created_at, writer_policy, writer, "
    "fencing_generation, writer_since, qos";
// The attachment table's columns up to version 2; version 3 added write_access_since, 4 qos.
#define SHAREBLK_ATTACHMENT_COLUMNS_V1                                              \
  "id, volume_id, instance_uuid, attached_host, mode, attach_status, attach_time, " \
  "detach_time, connector, export_name, created_at"
constexpr const char* kAttachmentColumnsV1 = SHAREBLK_ATTACHMENT_COLUMNS_V1;
constexpr const char* kAttachmentColumns =
    SHAREBLK_ATTACHMENT_COLUMNS_V1 ", write_access_since, qos";
#undef SHAREBLK_ATTACHMENT_COLUMNS_V1

VolumeRow volume_from(const Statement& s) {
  VolumeRow v{s.text(0),         s.text(1),         static_cast<uint64_t>(s.integer(2)),
              s.integer(3) != 0, s.integer(4) != 0, s.text(5)};
  v.writer_policy = writer_policy_named(s.text(6)).value_or(WriterPolicy::Multi);
  v.writer = s.text(7);
  v.fencing_generation = static_cast<uint64_t>(s.integer(8));
  v.writer_since = s.text(9);
  v.qos = s.text(10);
  return v;
}

AttachmentRow attachment_from(const Statement& s) {
  AttachmentRow a;
  a.id = s.text(0);
  a.volume_id = s.text(1);
  a.instance_uuid = s.text(2);
  a.attached_host = s.text(3);
  // The schema's CHECK admits only the two; anything else would be read-only, never writable.
  a.mode = backend::parse_attach_mode(s.text(4)).value_or(backend::AttachMode::ReadOnly);
  // The CHECK constraint admits only the names parse_attach_status knows.
  a.attach_status = parse_attach_status(s.text(5)).value_or(AttachStatus::Detached);
  a.attach_time = s.text(6);
  a.detach_time = s.text(7);
  a.connector = s.text(8);
  a.export_name = s.text(9);
  a.created_at = s.text(10);
  a.write_access_since = s.text(11);
  a.qos = s.text(12);
  return a;
}

constexpr const char* kIntentColumns = "volume_id, action, error, created_at";
constexpr const char* kSnapshotColumns = "id, volume_id, name, size, created_at";

SnapshotRow snapshot_from(const Statement& s) {
  return {s.text(0), s.text(1), s.text(2), static_cast<uint64_t>(s.integer(3)), s.text(4)};
}

IntentRow intent_from(const Statement& s) {
  // The CHECK constraint admits only the two names.
  return IntentRow{s.text(0), s.text(1) == "delete" ? IntentAction::Delete : IntentAction::Create,
                   s.text(2), s.text(3)};
}

void bind_attachment(Statement& s, const AttachmentRow& a) {
  s.bind(1, a.id).bind(2, a.volume_id).bind(3, a.instance_uuid).bind(4, a.attached_host);
  s.bind(5, std::string(to_string(a.mode))).bind(6, std::string(to_string(a.attach_status)));
  s.bind(7, a.attach_time).bind(8, a.detach_time);
  s.bind(9, a.connector).bind(10, a.export_name).bind(11, a.created_at);
  s.bind(12, a.write_access_since).bind(13, a.qos);
}

}  // namespace

std::string_view to_string(WriterPolicy policy) {
  return policy == WriterPolicy::Single ? "single" : "multi";
}

std::optional<WriterPolicy> writer_policy_named(std::string_view name) {
  if (name == "multi") return WriterPolicy::Multi;
  if (name == "single") return WriterPolicy::Single;
  return std::nullopt;
}

std::string_view to_string(IntentAction action) {
  return action == IntentAction::Delete ? "delete" : "create";
}

Database::Database(const std::string& path) {
  if (sqlite3_open_v2(path.c_str(), &db_,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    std::string message = db_ ? sqlite3_errmsg(db_) : "out of memory";
    sqlite3_close(db_);
    db_ = nullptr;
    throw DbError("cannot open " + path + ": " + message);
  }
  sqlite3_busy_timeout(db_, 5000);
  try {
    migrate(path);  // first: a newer database must not even be switched to WAL
    // It holds export names, which admit clients: readable by the daemon's user alone. SQLite
    // gives the WAL and shared-memory files the database's mode when it creates them.
    for (const char* suffix : {"", "-wal", "-shm"}) {
      const std::string file = path + suffix;
      if (::chmod(file.c_str(), 0600) != 0 && errno != ENOENT) {
        throw DbError("cannot make " + file + " private: " + std::strerror(errno));
      }
    }
    exec("PRAGMA journal_mode=WAL");
    // A commit writes the WAL; make_durable() syncs it, once for every commit before it (the
    // group commit of docs/state.md). SQLite itself still syncs around each checkpoint.
    exec("PRAGMA synchronous=NORMAL");
    exec("PRAGMA foreign_keys=ON");
    wal_path_ = path + "-wal";
  } catch (...) {
    // Closing the last connection would checkpoint a leftover WAL (a killed daemon's) into
    // the file: a database this release refuses is left exactly as it was.
    sqlite3_db_config(db_, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, nullptr);
    close();
    throw;
  }
}

void Database::close() {
  for (auto& [sql, cached] : statements_) sqlite3_finalize(cached.stmt);
  statements_.clear();
  sqlite3_close(db_);
  db_ = nullptr;
  // After SQLite's own descriptors: closing a descriptor drops the process's POSIX locks on
  // that file (SQLite keeps none on the WAL, but its descriptors go first all the same).
  if (wal_fd_ >= 0) ::close(wal_fd_);
  wal_fd_ = -1;
}

void Database::make_durable(uint64_t commit) {
  if (synced_.load(std::memory_order_acquire) >= commit) return;
  std::lock_guard lock(sync_mutex_);
  if (synced_.load(std::memory_order_relaxed) >= commit) return;  // synced while we waited
  // Every commit counted so far has its frames written into the WAL: one sync covers them all.
  const uint64_t covered = committed_.load(std::memory_order_acquire);
  if (wal_fd_ < 0) wal_fd_ = ::open(wal_path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (wal_fd_ < 0 || ::fdatasync(wal_fd_) != 0) {
    const int err = errno;
    throw DbError("sqlite: cannot sync " + wal_path_ + ": " + std::strerror(err),
                  err == ENOSPC || err == EDQUOT ? SQLITE_FULL : SQLITE_IOERR);
  }
  synced_.store(covered, std::memory_order_release);
}

int Database::user_version() {
  Statement s(db_, "PRAGMA user_version");
  return s.step() ? static_cast<int>(s.integer(0)) : 0;
}

// One transaction from whatever version the file has to kSchemaVersion: a failure (a row the
// new constraints refuse, a full disk) leaves the file as it was. Foreign keys are off while
// the attachment table is rebuilt (SQLite's procedure for changes ALTER TABLE cannot make).
void Database::migrate(const std::string& path) {
  auto refuse_newer = [&](int version) {
    if (version <= kSchemaVersion) return;
    throw DbError(path + " has schema version " + std::to_string(version) +
                  ", newer than this shareblkd understands (" + std::to_string(kSchemaVersion) +
                  "); run the release that wrote it, or restore a backup. Nothing was changed.");
  };
  int version = user_version();
  refuse_newer(version);
  if (version == kSchemaVersion) return;
  exec("PRAGMA foreign_keys=OFF");
  exec("BEGIN IMMEDIATE");
  try {
    version = user_version();  // again, under the write lock: another process may have won
    refuse_newer(version);
    if (version == kSchemaVersion) {
      exec("COMMIT");
      return;
    }
    bool fresh = false;
    {  // finalized before the tables change: an open statement locks them
      Statement tables(
          db_, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'volumes'");
      fresh = tables.step() && tables.integer(0) == 0;
    }
    if (fresh) {
      exec(kVolumesTable);
      exec(attachment_table("volume_attachment").c_str());
      exec(kAttachmentIndex);
      exec(kIntentTable);
    } else {
      if (version < 1) {  // 0 → 1: the same columns, and a CHECK on attach_status
        exec(attachment_table("volume_attachment_v1").c_str());
        exec((std::string("INSERT INTO volume_attachment_v1 (") + kAttachmentColumnsV1 +
              ") SELECT " + kAttachmentColumnsV1 + " FROM volume_attachment")
                 .c_str());
        exec("DROP TABLE volume_attachment");
        exec("ALTER TABLE volume_attachment_v1 RENAME TO volume_attachment");
        exec(kAttachmentIndex);
      }
      if (version < 2) exec(kIntentTable);  // 1 → 2: creates and deletes under way
    }
    if (fresh || version < 3) {
      for (const char* sql : kWriterColumns) exec(sql);
    }
    if (fresh || version < 4) {
      for (const char* sql : kQosColumns) exec(sql);
    }
    if (fresh || version < 5) {
      for (const char* sql : kSnapshotTable) exec(sql);
    }
    {  // step 10 of SQLite's table rebuild: the copy kept every reference whole
      Statement check(db_, "PRAGMA foreign_key_check");
      if (check.step()) throw DbError("a row refers to a volume that does not exist");
    }
    exec(("PRAGMA user_version = " + std::to_string(kSchemaVersion)).c_str());
    exec("COMMIT");
  } catch (const DbError& e) {
    try {
      exec("ROLLBACK");
    } catch (const DbError&) {  // the transaction is gone either way
    }
    throw DbError("cannot bring " + path + " from schema version " + std::to_string(version) +
                  " to " + std::to_string(kSchemaVersion) + " (nothing was changed): " + e.what());
  }
}

Database::~Database() {
  close();
}

void Database::backup_into(const std::string& path) {
  std::lock_guard lock(mutex_);
  sqlite3* copy = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &copy, SQLITE_OPEN_READWRITE, nullptr);
  if (rc == SQLITE_OK) {
    sqlite3_backup* backup = sqlite3_backup_init(copy, "main", db_, "main");
    if (backup == nullptr) {
      rc = sqlite3_errcode(copy);
    } else {
      rc = sqlite3_backup_step(backup, -1);  // every page at once
      const int finished = sqlite3_backup_finish(backup);
      rc = rc == SQLITE_DONE ? finished : rc;
    }
  }
  // The copy carries the source's WAL flag; a backup is one self-contained file instead.
  if (rc == SQLITE_OK)
    rc = sqlite3_exec(copy, "PRAGMA journal_mode=DELETE", nullptr, nullptr, nullptr);
  const std::string message = copy != nullptr ? sqlite3_errmsg(copy) : "out of memory";
  sqlite3_close(copy);
  if (rc != SQLITE_OK) throw DbError("backup to " + path + ": " + message, rc & 0xff);
}

void Database::exec(const char* sql) {
  char* message = nullptr;
  if (int rc = sqlite3_exec(db_, sql, nullptr, nullptr, &message); rc != SQLITE_OK) {
    std::string text = message ? message : "unknown error";
    sqlite3_free(message);
    throw DbError("sqlite: " + text, rc & 0xff);
  }
}

Database::Transaction::Transaction(Database& db)
    : db_(db), lock_(db.mutex_), seen_(db.committed_.load(std::memory_order_relaxed)) {
  Statement(db_, "BEGIN IMMEDIATE").step();
}

Database::Transaction::~Transaction() {
  if (done_) return;
  try {
    Statement(db_, "ROLLBACK").step();
  } catch (const DbError&) {  // nothing more to do: the transaction is gone either way
  }
  lock_.unlock();
  // What it read was committed; its caller replies only once that is on disk too.
  try {
    db_.make_durable(seen_);
  } catch (const DbError&) {  // the commit that wrote it has reported this failure
  }
}

void Database::Transaction::commit() {
  Statement(live(), "COMMIT").step();
  done_ = true;
  const uint64_t mine = db_.committed_.fetch_add(1, std::memory_order_acq_rel) + 1;
  lock_.unlock();  // others may commit while this one is synced, and share its sync
  db_.make_durable(mine);
}

Database& Database::Transaction::live() {
  if (!lock_.owns_lock()) throw std::logic_error("a database transaction used after its commit");
  return db_;
}

void Database::set_pending_writer(const std::string& volume_id, const PendingWriter& w) {
  std::lock_guard lock(pending_mutex_);
  auto [it, added] = pending_writers_.try_emplace(volume_id, w);
  if (!added && it->second.generation < w.generation) it->second = w;
}

std::optional<Database::PendingWriter> Database::pending_writer(
    const std::string& volume_id) const {
  std::lock_guard lock(pending_mutex_);
  const auto it = pending_writers_.find(volume_id);
  if (it == pending_writers_.end()) return std::nullopt;
  return it->second;
}

void Database::drop_pending_writer(const std::string& volume_id) {
  std::lock_guard lock(pending_mutex_);
  pending_writers_.erase(volume_id);
}

void Database::overlay(VolumeRow& v) const {
  std::lock_guard lock(pending_mutex_);
  const auto it = pending_writers_.find(v.id);
  if (it == pending_writers_.end() || it->second.generation <= v.fencing_generation) return;
  v.writer = it->second.writer;
  v.fencing_generation = it->second.generation;
  v.writer_since = it->second.since;
}

std::vector<VolumeRow> Database::Transaction::volumes() {
  Statement s(live(),
              std::string("SELECT ") + kVolumeColumns + " FROM volumes ORDER BY created_at, id");
  std::vector<VolumeRow> rows;
  while (s.step()) {
    rows.push_back(volume_from(s));
    db_.overlay(rows.back());
  }
  return rows;
}

std::optional<VolumeRow> Database::Transaction::volume(const std::string& id) {
  Statement s(live(),
              (std::string("SELECT ") + kVolumeColumns + " FROM volumes WHERE id = ?").c_str());
  s.bind(1, id);
  if (!s.step()) return std::nullopt;
  VolumeRow v = volume_from(s);
  db_.overlay(v);
  return v;
}

void Database::Transaction::insert_volume(const VolumeRow& v) {
  Statement s(live(), (std::string("INSERT INTO volumes (") + kVolumeColumns +
                       ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
                          .c_str());
  s.bind(1, v.id).bind(2, v.name).bind(3, static_cast<int64_t>(v.size));
  s.bind(4, int64_t{v.multiattach}).bind(5, int64_t{v.bootable}).bind(6, v.created_at);
  s.bind(7, std::string(to_string(v.writer_policy))).bind(8, v.writer);
  s.bind(9, static_cast<int64_t>(v.fencing_generation)).bind(10, v.writer_since);
  s.bind(11, v.qos);
  s.step();
}

void Database::Transaction::update_volume(const VolumeRow& v) {
  Statement s(live(),
              "UPDATE volumes SET name = ?, size = ?, multiattach = ?, bootable = ?, "
              "writer_policy = ?, writer = ?, fencing_generation = ?, writer_since = ?, qos = ? "
              "WHERE id = ?");
  s.bind(1, v.name).bind(2, static_cast<int64_t>(v.size)).bind(3, int64_t{v.multiattach});
  s.bind(4, int64_t{v.bootable}).bind(5, std::string(to_string(v.writer_policy)));
  s.bind(6, v.writer).bind(7, static_cast<int64_t>(v.fencing_generation));
  s.bind(8, v.writer_since).bind(9, v.qos).bind(10, v.id);
  s.step();
}

void Database::Transaction::delete_volume(const std::string& id) {
  Statement a(live(), "DELETE FROM volume_attachment WHERE volume_id = ?");
  a.bind(1, id);
  a.step();
  Statement v(live(), "DELETE FROM volumes WHERE id = ?");
  v.bind(1, id);
  v.step();
}

std::vector<AttachmentRow> Database::Transaction::attachments(const std::string& volume_id) {
  std::string sql = std::string("SELECT ") + kAttachmentColumns + " FROM volume_attachment";
  if (!volume_id.empty()) sql += " WHERE volume_id = ?";
  sql += " ORDER BY created_at, id";
  Statement s(live(), sql.c_str());
  if (!volume_id.empty()) s.bind(1, volume_id);
  std::vector<AttachmentRow> rows;
  while (s.step()) rows.push_back(attachment_from(s));
  return rows;
}

std::optional<AttachmentRow> Database::Transaction::attachment(const std::string& id) {
  Statement s(live(),
              (std::string("SELECT ") + kAttachmentColumns + " FROM volume_attachment WHERE id = ?")
                  .c_str());
  s.bind(1, id);
  if (!s.step()) return std::nullopt;
  return attachment_from(s);
}

std::optional<AttachmentRow> Database::Transaction::attachment_by_export(
    const std::string& export_name) {
  Statement s(live(), (std::string("SELECT ") + kAttachmentColumns +
                       " FROM volume_attachment WHERE export_name = ?")
                          .c_str());
  s.bind(1, export_name);
  if (!s.step()) return std::nullopt;
  return attachment_from(s);
}

void Database::Transaction::insert_attachment(const AttachmentRow& a) {
  Statement s(live(), (std::string("INSERT INTO volume_attachment (") + kAttachmentColumns +
                       ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
                          .c_str());
  bind_attachment(s, a);
  s.step();
}

void Database::Transaction::update_attachment(const AttachmentRow& a) {
  Statement s(live(),
              "UPDATE volume_attachment SET id = ?, volume_id = ?, instance_uuid = ?, "
              "attached_host = ?, mode = ?, attach_status = ?, attach_time = ?, detach_time = ?, "
              "connector = ?, export_name = ?, created_at = ?, write_access_since = ?, qos = ? "
              "WHERE id = ?1");
  bind_attachment(s, a);
  s.step();
}

std::vector<SnapshotRow> Database::Transaction::snapshots(const std::string& volume_id) {
  std::string sql = std::string("SELECT ") + kSnapshotColumns + " FROM volume_snapshot";
  if (!volume_id.empty()) sql += " WHERE volume_id = ?";
  sql += " ORDER BY created_at, id";
  Statement s(live(), sql.c_str());
  if (!volume_id.empty()) s.bind(1, volume_id);
  std::vector<SnapshotRow> rows;
  while (s.step()) rows.push_back(snapshot_from(s));
  return rows;
}

std::optional<SnapshotRow> Database::Transaction::snapshot(const std::string& id) {
  Statement s(
      live(),
      (std::string("SELECT ") + kSnapshotColumns + " FROM volume_snapshot WHERE id = ?").c_str());
  s.bind(1, id);
  if (!s.step()) return std::nullopt;
  return snapshot_from(s);
}

void Database::Transaction::insert_snapshot(const SnapshotRow& r) {
  Statement s(live(), (std::string("INSERT INTO volume_snapshot (") + kSnapshotColumns +
                       ") VALUES (?, ?, ?, ?, ?)")
                          .c_str());
  s.bind(1, r.id).bind(2, r.volume_id).bind(3, r.name).bind(4, static_cast<int64_t>(r.size));
  s.bind(5, r.created_at);
  s.step();
}

void Database::Transaction::delete_snapshot(const std::string& id) {
  Statement s(live(), "DELETE FROM volume_snapshot WHERE id = ?");
  s.bind(1, id);
  s.step();
}

std::vector<IntentRow> Database::Transaction::intents() {
  Statement s(live(), (std::string("SELECT ") + kIntentColumns +
                       " FROM volume_intent ORDER BY created_at, volume_id")
                          .c_str());
  std::vector<IntentRow> rows;
  while (s.step()) rows.push_back(intent_from(s));
  return rows;
}

std::optional<IntentRow> Database::Transaction::intent(const std::string& volume_id) {
  Statement s(live(),
              (std::string("SELECT ") + kIntentColumns + " FROM volume_intent WHERE volume_id = ?")
                  .c_str());
  s.bind(1, volume_id);
  if (!s.step()) return std::nullopt;
  return intent_from(s);
}

void Database::Transaction::put_intent(const IntentRow& i) {
  Statement s(live(),
              "INSERT OR REPLACE INTO volume_intent (volume_id, action, error, created_at) "
              "VALUES (?, ?, ?, ?)");
  s.bind(1, i.volume_id).bind(2, std::string(to_string(i.action))).bind(3, i.error);
  s.bind(4, i.created_at);
  s.step();
}

void Database::Transaction::delete_intent(const std::string& volume_id) {
  Statement s(live(), "DELETE FROM volume_intent WHERE volume_id = ?");
  s.bind(1, volume_id);
  s.step();
}

}  // namespace shareblk::control
