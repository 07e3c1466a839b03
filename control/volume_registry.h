// Internal to control/: the volume registry, the control plane's one way to a volume's bytes.
// It owns the store's calls (create, extend, remove: failures become ApiError with the reasons
// no_space, not_found or internal), the cache of open volumes that every connection of a volume
// shares, the per-volume locks that serialize every change to a volume and its attachments, and
// what it has learnt of volumes whose backing is missing.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "store/volume_store.h"

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
  explicit VolumeRegistry(store::VolumeStore& store) : store_(store) {}
  // Throws not_supported, naming `what`, where the store's volumes are not local files or
  // devices (store::VolumeStore::local()): copies, fills and the nbdkit plugin need them.
  void require_local(const std::string& what) const;

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
  // Forgets the open volume first. Backing that is already gone counts as removed. May take
  // long (store::VolumeStore::remove), telling `progress`.
  void remove(const std::string& id, const store::Progress& progress = {});

  // Writes an image into a new volume's backing (store::fill_from_image), telling `progress`.
  void fill(const std::string& id, uint64_t size, const store::ImageSource& image,
            const store::ImageInfo& info, const store::Progress& progress);

  // Makes backing `to` of `size` bytes holding the first `length` bytes of `from` (a volume's or
  // a snapshot's): a reflink where the store has them, else a new backing and a copy
  // (store::copy_volume), telling `progress`.
  void copy(const std::string& from, uint64_t length, const std::string& to, uint64_t size,
            const store::Progress& progress);

  // Lets go of the open volume, if any: the store's handle closes once the last connection
  // using it has ended. For a shared store, where a gateway must not keep open what it no
  // longer serves (librbd refuses to remove an image another client has open).
  void close(const std::string& id);
  // The open volume, opened on first use; nullptr (logged) when the store cannot open it.
  std::shared_ptr<backend::Volume> open(const std::string& id, uint64_t size);

  // Makes what every open volume acknowledged durable (at shutdown, once no client is left).
  // Returns the ids of the volumes that could not be flushed, with why.
  std::vector<std::pair<std::string, std::string>> flush_all();

  // Opens the backing afresh (a cached handle may be a file someone has since removed) and
  // returns why it is missing, or nullopt when it is there. A backing found missing stays so
  // for missing() until a check finds it again; an open handle of it is dropped, so that no new
  // connection gets it. Other failures throw ApiError (internal).
  std::optional<std::string> check(const std::string& id, uint64_t size);
  // Why the volume's backing is missing, as the last start, check() or open() found it;
  // nullopt when none of them found it missing.
  std::optional<std::string> missing(const std::string& id) const;

  // At start-up: what the store holds against the ids the database knows, logged, never
  // "fixed" by deleting anything. Volumes without backing are missing() from then on, except
  // those `deleting` (an interrupted delete being finished), whose backing may be gone.
  void reconcile(const std::vector<std::pair<std::string, std::string>>& known_ids_and_names,
                 const std::set<std::string>& deleting);

 private:
  store::VolumeStore& store_;
  mutable std::mutex locks_mutex_;
  std::map<std::string, std::weak_ptr<std::mutex>> locks_;
  // Records (and logs, the first time) that the backing is missing; returns the reason.
  std::string set_missing(const std::string& id, const std::string& why);
  std::mutex open_mutex_;  // held while the store opens a volume
  std::map<std::string, std::shared_ptr<backend::Volume>> open_;
  // Its own lock, never held while another is taken: the views read it inside a database
  // transaction, and must not wait for a store's open.
  mutable std::mutex missing_mutex_;
  std::map<std::string, std::string> missing_;  // id -> why
};

}  // namespace shareblk::control
