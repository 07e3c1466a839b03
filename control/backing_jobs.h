// Internal to control/: the long parts of creates and deletes (docs/state.md, "Creates and
// deletes"), run on VolumeJobs' threads: a delete's removal of the backing (an LVM volume's
// zeroing), and a create's copy of bytes in (from an image, a snapshot or a volume). Each is
// covered by the volume's intent in the database: a job that ends well drops the intent (or
// the row, for a delete); one that fails keeps the intent with its error (status error); one
// that a stop interrupts is finished or rolled back by the next start.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "control/api_error.h"
#include "control/db.h"
#include "store/volume_store.h"

namespace shareblk::control {

class SharedStore;
class VolumeJobs;
class VolumeRegistry;

class BackingJobs {
 public:
  // Writes the bytes of a volume or snapshot being created, reporting its progress.
  using Populate = std::function<void(const store::Progress&)>;

  BackingJobs(Database& db, VolumeRegistry& volumes, SharedStore& shared, VolumeJobs& jobs)
      : db_(db), volumes_(volumes), shared_(shared), jobs_(jobs) {}

  // Starts removing the backing of `id` (a volume or snapshot with a delete intent); the row and
  // intent go once it is gone. Throws ApiError (internal) when no job can start: the intent
  // then records why (status error).
  void start_delete(const std::string& id);
  // Starts `work` on the volume or snapshot `id` (created at `created_at`; `what` says from
  // where, for the log); its intent is dropped once it is done (available). A job that cannot
  // start leaves the intent with why (status error).
  void start_populate(const std::string& id, const std::string& created_at, const std::string& what,
                      Populate work);
  // The work that copies the first `length` bytes of `from` into new backing `to` of `size`
  // bytes, letting go of `held` (the source's hold) as soon as the copy ends, before the
  // database is written.
  Populate copy_job(const std::string& from, uint64_t length, const std::string& to, uint64_t size,
                    std::shared_ptr<void> held);
  // Undoes a create (a failed volume_create, or one a crash interrupted): removes whatever
  // backing it made, its row if it has one (a fill's or a snapshot's) and its intent. What
  // went wrong when the store or the database cannot: then the intent stays.
  std::optional<std::string> roll_back_create(const std::string& id);

 private:
  std::optional<ApiError> finish_delete(const std::string& id, const store::Progress& progress);
  std::optional<ApiError> populate(const std::string& id, const std::string& created_at,
                                   const std::string& what, const Populate& work,
                                   const store::Progress& progress);

  Database& db_;
  VolumeRegistry& volumes_;
  SharedStore& shared_;
  VolumeJobs& jobs_;
};

}  // namespace shareblk::control
