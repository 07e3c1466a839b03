// Internal to control/: the SQLite state (volumes and the volume_attachment table).
//
// One connection, used under one mutex; every change is committed (WAL, synchronous=FULL)
// before the caller replies, so a kill -9 loses nothing that was acknowledged.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace shareblk::control {

struct VolumeRow {
  std::string id;
  std::string name;
  uint64_t size = 0;
  bool multiattach = false;
  bool bootable = false;
  std::string created_at;
};

struct AttachmentRow {
  std::string id;
  std::string volume_id;
  std::string instance_uuid;
  std::string attached_host;
  std::string mode;           // "rw" | "ro"
  std::string attach_status;  // reserved | attaching | attached | detaching | detached
  std::string attach_time;    // ISO 8601, empty when not yet attached
  std::string detach_time;
  std::string connector;  // JSON text, empty when none
  std::string export_name;
  std::string created_at;
};

struct DbError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Database {
 public:
  explicit Database(const std::string& path);  // throws DbError
  ~Database();
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  // All access goes through a Transaction, which holds the database mutex.
  class Transaction {
   public:
    explicit Transaction(Database& db);
    ~Transaction();  // rolls back unless committed
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
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

   private:
    Database& db_;
    std::lock_guard<std::mutex> lock_;
    bool done_ = false;
  };

 private:
  friend class Transaction;
  void exec(const char* sql);
  sqlite3* db_ = nullptr;
  std::mutex mutex_;
};

}  // namespace shareblk::control
