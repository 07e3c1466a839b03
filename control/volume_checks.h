// Internal to control/: whether a call may act on a volume or snapshot now, and the lookups
// that refuse a missing one (docs/api.md, "Errors"). A volume with an intent is being deleted
// or filled (volume_busy); one whose delete or fill failed, or whose backing is missing,
// has status error (volume_error). Every refusal is an ApiError; the checks change nothing.
// Thread-safe as far as its parts are (the database transaction is the caller's).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "control/db.h"

namespace shareblk::control {

class VolumeJobs;
class VolumeRegistry;

// Throw ApiError not_found when there is no such row.
VolumeRow find_volume(Database::Transaction& tx, const std::string& id);
AttachmentRow find_attachment(Database::Transaction& tx, const std::string& id);
// The volume an attachment belongs to, looked up (in its own transaction) before the call
// takes that volume's lock.
std::string volume_of(Database& db, const std::string& attachment_id);

class VolumeChecks {
 public:
  // `jobs` says whether a delete or fill still runs; `volumes` whether the backing is there.
  VolumeChecks(VolumeRegistry& volumes, const VolumeJobs& jobs) : volumes_(volumes), jobs_(jobs) {}

  // Why the volume's (or snapshot's) status is error, or nullopt; `intent` is its own, if it
  // has one. One with an intent and no error is being deleted or created (filled).
  std::optional<std::string> error_of(const std::optional<IntentRow>& intent,
                                      const std::string& id) const;

  // Refuses to `use` ("attached", "copied") the volume or snapshot `id` of `size` bytes
  // (`what`: "volume" or "snapshot") while it is being deleted or filled (volume_busy), or
  // when its status is error (volume_error).
  void refuse_unusable(Database::Transaction& tx, const char* what, const std::string& id,
                       uint64_t size, const char* use) const {
    refuse_pending(tx, what, id, use);
    refuse_missing(what, id, size, use);
  }
  void refuse_unusable(Database::Transaction& tx, const VolumeRow& v, const char* use) const {
    refuse_unusable(tx, "volume", v.id, v.size, use);
  }
  // Its two halves: the database's (an intent: being deleted or filled, or failed) and the
  // store's (the backing, looked for afresh: a call that can wait on a remote store, made
  // outside the transaction where the caller can).
  void refuse_pending(Database::Transaction& tx, const char* what, const std::string& id,
                      const char* use) const;
  void refuse_missing(const char* what, const std::string& id, uint64_t size,
                      const char* use) const;
  // Refuses (volume_busy) a change (`what`: "grow", "change") to a volume that a delete or a
  // fill is under way on; one whose delete or fill failed may change.
  void refuse_busy(Database::Transaction& tx, const VolumeRow& v, const char* what) const;

 private:
  VolumeRegistry& volumes_;
  const VolumeJobs& jobs_;
};

}  // namespace shareblk::control
