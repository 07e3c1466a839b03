// Internal to control/: what copies of a volume's bytes hold while they run (docs/snapshots.md).
// A snapshot or clone of a live volume holds the writes of every attachment of it between
// requests, so that the copy is one point in time; a copy's source, volume or snapshot, may not
// be deleted under it. Each hold is an object: the hold ends when its last owner lets it go.
// Thread-safe; Service decides under the volume's lock which attachments are held.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace shareblk::control {

class CopyHolds {
 public:
  using Accesses = std::vector<std::shared_ptr<backend::WriteAccess>>;

  // Pauses `accesses` (a volume's live attachments' write gates: each waits for its changes in
  // flight; new ones wait in the engines) until the returned object goes, then resumes them.
  // Throws ApiError volume_busy when the volume is held already: one copy of it at a time.
  std::shared_ptr<void> quiesce(const std::string& volume_id, Accesses accesses);
  // An attachment made while its volume is held starts held, and is resumed with the rest.
  void hold_if_quiesced(const std::string& volume_id, std::shared_ptr<backend::WriteAccess> access);
  bool quiesced(const std::string& volume_id) const;

  // Marks `id` (a volume or a snapshot) as read by a copy until the returned object goes.
  // Holds nest: several copies may read one source.
  std::shared_ptr<void> read_by_copy(const std::string& id);
  bool is_copy_source(const std::string& id) const;

  // A volume about to be copied: read_by_copy() and quiesce() together.
  std::shared_ptr<void> hold_for_copy(const std::string& volume_id, Accesses accesses);

 private:
  mutable std::mutex mutex_;
  std::map<std::string, Accesses> quiesced_;  // volume -> the gates it holds paused
  std::multiset<std::string> sources_;
};

}  // namespace shareblk::control
