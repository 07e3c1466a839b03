// Internal to control/: the volume registry, the control plane's one way to a volume's bytes.
// It owns the store's calls (create, extend, remove: failures become ApiError with the reasons
// no_space, not_found or internal), the cache of open volumes that every connection of a volume
// shares, and the per-volume locks that serialize every change to a volume and its attachments.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "lvm/volume_store.h"

namespace shareblk::control {

// Held while a call changes one volume or its attachments.
class VolumeLock {
 public:
  explicit VolumeLock(std::shared_ptr<std::mutex> mutex)
      : mutex_(std::move(mutex)), lock_(*mutex_) {}

 private:
  std::shared_ptr<std::mutex> mutex_;  // declared first: it outlives the lock
  std::unique_lock<std::mutex> lock_;
};

class VolumeRegistry {
 public:
  explicit VolumeRegistry(lvm::VolumeStore& store) : store_(store) {}

  // Waits for and takes the volume's lock. The table keeps an entry only while someone holds
  // or waits for it: ids come from clients, unknown ones included.
  VolumeLock lock(const std::string& volume_id);
  size_t lock_count() const;  // for tests

  // Throw ApiError.
  void create(const std::string& id, uint64_t size);
  void extend(const std::string& id, uint64_t size);
  // After extend() and the new size is committed: the open volume (if any) sees it. Called
  // only then, so that a volume opened meanwhile (from the old size in the database) is
  // refreshed too; one that cannot be is dropped, and reopened by the next user.
  void refresh(const std::string& id, uint64_t size);
  // Forgets the open volume first. Backing that is already gone counts as removed.
  void remove(const std::string& id);

  // The open volume, opened on first use; nullptr (logged) when the store cannot open it.
  std::shared_ptr<backend::Volume> open(const std::string& id, uint64_t size);

  // At start-up: what the store holds against the ids the database knows, logged, never
  // "fixed" by deleting anything.
  void reconcile(const std::vector<std::pair<std::string, std::string>>& known_ids_and_names);

 private:
  lvm::VolumeStore& store_;
  mutable std::mutex locks_mutex_;
  std::map<std::string, std::weak_ptr<std::mutex>> locks_;
  std::mutex open_mutex_;
  std::map<std::string, std::shared_ptr<backend::Volume>> open_;
};

}  // namespace shareblk::control
