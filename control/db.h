// Internal to control/: the SQLite state (volumes, the volume_attachment table, snapshots, and
// the volume_intent table of creates and deletes under way).
//
// One connection, used under one mutex; every change is committed and its WAL synced to disk
// before the caller replies, so neither a kill -9 nor a power cut loses what was acknowledged.
// Commits made while a sync runs share the next one (group commit), so that many callers at
// once are not held to one disk flush each. A reply never shows what is not yet on disk. The schema
// carries its version in PRAGMA user_version; opening migrates an older database forward in one
// transaction and refuses a newer one without changing it (docs/state.md).
#pragma once

#include <sqlite3.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "control/attachment_state.h"

namespace shareblk::control {

// Multi: every read-write attachment may write (cluster file systems). Single: at most one,
// the volume's writer, may at a time; the others are standbys until volume_takeover.
enum class WriterPolicy { Multi, Single };
std::string_view to_string(WriterPolicy policy);  // "multi" | "single"
// The policy a name from to_string() stands for; nullopt for any other text.
std::optional<WriterPolicy> writer_policy_named(std::string_view name);

struct VolumeRow {
  std::string id;
  std::string name;
  uint64_t size = 0;
  bool multiattach = false;
  bool bootable = false;
  std::string created_at;
  WriterPolicy writer_policy = WriterPolicy::Multi;
  std::string writer;               // single: the attachment holding write access, "" if none
  uint64_t fencing_generation = 0;  // + 1 at every change of writer
  std::string writer_since;         // when the writer last changed; "" before the first
  std::string qos;                  // its QoS spec as JSON text (control/qos.h); "" for none
};

struct AttachmentRow {
  std::string id;
  std::string volume_id;
  std::string instance_uuid;
  std::string attached_host;
  backend::AttachMode mode = backend::AttachMode::ReadOnly;  // stored as backend::to_string's
  AttachStatus attach_status = AttachStatus::Reserved;       // changed only by transition()
  std::string attach_time;  // ISO 8601, empty when not yet attached
  std::string detach_time;
  std::string connector;  // JSON text, empty when none
  std::string export_name;
  std::string created_at;
  // When it last gained write access; "" while it has none (read-only, a standby of a
  // single-writer volume, detached). Set and cleared with the volume's writer.
  std::string write_access_since;
  std::string qos;  // its QoS spec as JSON text (control/qos.h); "" for none
  // Not stored: the gateway that serves another gateway's attachment, read from the volume's
  // shared record (docs/scale-out.md); empty for this gateway's own.
  std::string gateway;
};

// A point-in-time copy of a volume (docs/snapshots.md): backing of its own in the store, under
// its own id, read only by the copies made from it.
struct SnapshotRow {
  std::string id;
  std::string volume_id;
  std::string name;
  uint64_t size = 0;  // the volume's when it was taken
  std::string created_at;
};

// A volume_create or volume_delete recorded before the store is touched, and removed in the
// transaction that completes it: one left behind is a call a crash interrupted, which the next
// start finishes (docs/state.md, "Creates and deletes").
enum class IntentAction { Create, Delete };
std::string_view to_string(IntentAction action);

// Snapshots have theirs too, under the snapshot's id (ids are UUIDs: never a volume's too).
struct IntentRow {
  std::string volume_id;  // or the snapshot's id
  IntentAction action = IntentAction::Create;
  std::string error;  // why the last attempt to finish it failed; empty when none has
  std::string created_at;
};

struct DbError : std::runtime_error {
  explicit DbError(const std::string& message, int sqlite_code = 0)
      : std::runtime_error(message), code(sqlite_code) {}
  // SQLite's primary result code, 0 when the error is not SQLite's. SQLITE_FULL: the disk.
  int code;
  bool disk_full() const { return code == SQLITE_FULL; }
};

// The schema this build writes. Version 0 is the unversioned schema of 0.1.0.
inline constexpr int kSchemaVersion = 5;

class Database {
 public:
  // Opens (creating when new) and migrates; throws DbError, for a newer schema too.
  explicit Database(const std::string& path);
  ~Database();
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  // Copies the whole database, as one consistent snapshot, into the empty file at `path` (SQLite's
  // online backup, under the database mutex: no change lands halfway). The copy is a plain
  // rollback-journal database, synced. Throws DbError (disk_full() when the file system is).
  void backup_into(const std::string& path);

  // A change of writer that the database could not record and the revocation journal did
  // (docs/fencing.md): every read of the volume shows it while its generation is above the
  // row's, so that a later change the database records supersedes it.
  struct PendingWriter {
    std::string writer;
    uint64_t generation = 0;
    std::string since;
  };
  // Keeps the higher generation of the one it had and `w`.
  void set_pending_writer(const std::string& volume_id, const PendingWriter& w);
  std::optional<PendingWriter> pending_writer(const std::string& volume_id) const;
  void drop_pending_writer(const std::string& volume_id);

  // All access goes through a Transaction, which holds the database mutex until it commits
  // or ends. Both return once what it wrote, or read, is on disk.
  class Transaction {
   public:
    explicit Transaction(Database& db);
    ~Transaction();  // rolls back unless committed
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    // Commits and waits for the sync that covers it. Throws DbError; if the sync fails (the
    // commit then stands, unsynced), disk_full() tells ENOSPC. The transaction is done after.
    void commit();

    std::vector<VolumeRow> volumes();
    std::optional<VolumeRow> volume(const std::string& id);
    void insert_volume(const VolumeRow& v);
    void update_volume(const VolumeRow& v);
    void delete_volume(const std::string& id);  // and its attachments

    std::vector<AttachmentRow> attachments(const std::string& volume_id = {});
    std::optional<AttachmentRow> attachment(const std::string& id);
    std::optional<AttachmentRow> attachment_by_export(const std::string& export_name);
    void insert_attachment(const AttachmentRow& a);
    void update_attachment(const AttachmentRow& a);

    std::vector<SnapshotRow> snapshots(const std::string& volume_id = {});  // oldest first
    std::optional<SnapshotRow> snapshot(const std::string& id);
    void insert_snapshot(const SnapshotRow& s);
    void delete_snapshot(const std::string& id);

    std::vector<IntentRow> intents();  // oldest first
    std::optional<IntentRow> intent(const std::string& volume_id);
    void put_intent(const IntentRow& i);  // replaces the volume's intent, if it has one
    void delete_intent(const std::string& volume_id);

   private:
    Database& live();  // db_, while the transaction is open
    Database& db_;
    std::unique_lock<std::mutex> lock_;
    uint64_t seen_;  // the commits before it, which it may have read
    bool done_ = false;
  };

 private:
  friend class Transaction;
  friend class Statement;
  struct CachedStatement {
    sqlite3_stmt* stmt = nullptr;
    bool in_use = false;
  };
  void exec(const char* sql);
  int user_version();
  void migrate(const std::string& path);
  void close();
  // Returns once commit number `commit` (and all before it) is on disk; throws DbError.
  void make_durable(uint64_t commit);
  sqlite3* db_ = nullptr;
  std::mutex mutex_;
  std::unordered_map<std::string, CachedStatement> statements_;  // under mutex_
  std::atomic<uint64_t> committed_{0};  // commits so far; written under mutex_
  std::mutex sync_mutex_;               // one sync at a time
  std::atomic<uint64_t> synced_{0};     // commits known on disk
  std::string wal_path_;
  int wal_fd_ = -1;  // opened at the first sync, under sync_mutex_
  // Shows a pending writer in `v` if it has one above the row's generation.
  void overlay(VolumeRow& v) const;
  mutable std::mutex pending_mutex_;  // not mutex_: set while a transaction may be open
  std::unordered_map<std::string, PendingWriter> pending_writers_;
};

}  // namespace shareblk::control
