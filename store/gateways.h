// store: what gateways (daemons) that serve one shared store keep beside the volumes' bytes to
// coordinate (docs/scale-out.md, "Several gateways"): each volume's definition, a record of its
// attachments that they all change, watches on it, links from attachments to their volumes,
// and which gateway writes a single-writer volume. Only a store several gateways share provides
// it (rbd/); the control plane receives it when one exists and otherwise keeps all of this in
// its own database. A VolumeStore (store/volume_store.h) holds bytes only.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "backend/backend.h"
#include "store/volume_store.h"

namespace shareblk::store {

class Gateways {
 public:
  virtual ~Gateways() = default;

  // A volume's definition: text the control plane writes and reads back, kept with the
  // backing so that another gateway can serve the volume. Its parts are written apart, each
  // whole: what the volume is, and who its writer is (written only by the gateway that holds
  // or takes the writer's lock). ENOENT when there is no such volume or part.
  enum class DefinitionPart { Volume, Writer };
  virtual StoreError save_definition(const std::string& id, DefinitionPart part,
                                     const std::string& text) = 0;
  virtual StoreError load_definition(const std::string& id, DefinitionPart part,
                                     std::string& text) = 0;

  // A small record per volume that every gateway reads and changes (its attachments across
  // gateways), with a version: 0 and "" when there is none. write_record() replaces it only if
  // its version is still `version`, making it version + 1; ECANCELED when another gateway
  // changed it since (read it again). So two gateways never both succeed from the same
  // version. The store's remove() removes it with the backing.
  virtual StoreError read_record(const std::string& id, std::string& text, uint64_t& version) = 0;
  virtual StoreError write_record(const std::string& id, const std::string& text,
                                  uint64_t version) = 0;

  // Watching a record: `changed(id)` runs, on a thread of the store's, whenever a gateway
  // calls notify_record() for it (and when the watch may have missed one); it must not
  // block. unwatch_record() returns once no call of it runs or will. notify_record() returns
  // once every watcher has seen the notify, or after `timeout` (ETIMEDOUT).
  using RecordChanged = std::function<void(const std::string& id)>;
  virtual StoreError watch_record(const std::string& id, const RecordChanged& changed) = 0;
  virtual void unwatch_record(const std::string& id) = 0;
  virtual StoreError notify_record(const std::string& id, std::chrono::milliseconds timeout) = 0;

  // Which volume's record an attachment is in, so that any gateway finds an attachment by its
  // id alone. linked_volume() is ENOENT without a link; forgetting one that is not linked
  // succeeds.
  virtual StoreError link_attachment(const std::string& attachment_id,
                                     const std::string& volume_id) = 0;
  virtual StoreError linked_volume(const std::string& attachment_id, std::string& volume_id) = 0;
  virtual StoreError unlink_attachment(const std::string& attachment_id) = 0;

  // Write ownership of a single-writer volume among the gateways (docs/scale-out.md, "Fencing
  // across gateways"), held through `volume`, opened from this store. claim_writer(): this
  // gateway takes the volume's exclusive lock in the store and keeps it, refusing to hand it
  // over, until release_writer(); EBUSY when another gateway holds it. fence_writer(): the
  // same, but another holder is first cut off by the store itself (its later requests are
  // refused there, in flight or not) and its lock broken; `fenced` then names it. With `only`
  // not empty, only the holder so named is cut off: EBUSY when another holds the lock.
  // lock_owner(): this gateway's name as a holder of the lock ("" when it holds none), as
  // `fenced` would name it. All return 0 or an errno (EINVAL for a volume not of this store);
  // release_writer() may be called when nothing is held.
  virtual int claim_writer(backend::Volume& volume) = 0;
  virtual int fence_writer(backend::Volume& volume, std::string& fenced,
                           const std::string& only) = 0;
  virtual int lock_owner(backend::Volume& volume, std::string& out) = 0;
  virtual void release_writer(backend::Volume& volume) = 0;
};

}  // namespace shareblk::store
