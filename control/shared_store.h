// Internal to control/: this gateway's part in a store that other shareblk gateways serve too
// (rbd; docs/scale-out.md, "Several gateways"). Each volume's definition is saved with its
// backing so that any gateway can learn and serve it; a single-writer volume's writer is backed
// by the image's exclusive lock, which a takeover breaks only after the cluster has fenced the
// old holder; a detach of an attachment another gateway serves is a revocation written into the
// volume's record, which that gateway acts on. With a local store (no GatewayRecords) every
// call is a no-op that allows: claim_writer() is true, find_elsewhere() finds nothing.
// The caller holds the volume's lock for any call that changes a volume or its writer.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "control/db.h"
#include "control/params.h"

namespace shareblk::control {

class GatewayRecords;
class VolumeRegistry;
class Views;

class SharedStore {
 public:
  // Ends an attachment served here, as volume_detach does (it takes it out of the record too);
  // called with the volume's lock held.
  using Detach = std::function<void(const std::string& volume_id, const std::string& id)>;
  // `records`: null for a local store.
  SharedStore(Database& db, VolumeRegistry& volumes, GatewayRecords* records, const Views& views,
              Detach detach)
      : db_(db), volumes_(volumes), records_(records), views_(views), detach_(std::move(detach)) {}

  // A volume another gateway made, named by a call: its definition is read from the store and
  // its row added, before any transaction (the dispatcher calls this). Nothing when it is known
  // here. Throws ApiError (internal) when the cluster cannot say.
  void learn_volume(const std::string& id);
  // Saves the volume's definition with its backing. Throws ApiError.
  void publish(const VolumeRow& v);
  // After a change is committed here: publish(), a failure only logged (gateways that learn
  // the volume later see the definition before the change).
  void republish(const VolumeRow& v);
  // After this gateway's writer of a single-writer volume changed (made, taken over, gone,
  // taken back at start): records it, with the lock holder that backs it; a failure is logged.
  void publish_writer(const VolumeRow& v);

  // A single-writer volume's writer lock (docs/scale-out.md, "Fencing across gateways").
  // claim: false when another gateway holds it; fence: cuts that gateway off in the cluster
  // first, and returns its client as the cluster names it ("" for none). Both throw ApiError
  // (internal) when the cluster cannot say; release only logs. Nothing for other volumes.
  bool claim_writer(const VolumeRow& v);
  std::string fence_writer(const VolumeRow& v);
  void release_writer(const VolumeRow& v);
  // At start, for a writer recorded here: takes the lock back. Another gateway took it over
  // meanwhile: no writer now (recorded in `tx`). False when the cluster could not say: the
  // writer keeps its place, without write access until a takeover or the next start.
  bool reclaim_writer(Database::Transaction& tx, VolumeRow& v);

  // Another gateway's live attachment found by its id alone (through the store's link to its
  // volume): its volume and Attachment view; nullopt when no other gateway has it. Throws
  // ApiError (internal) when the cluster cannot say.
  std::optional<std::pair<std::string, Json>> find_elsewhere(const std::string& attachment_id);
  // volume_detach of an attachment another gateway serves: marks it revoked in the record,
  // notifies, and waits (up to 10 s) for that gateway to take it out.
  Json detach_elsewhere(const std::string& volume_id, const std::string& attachment_id);

  // At start: this gateway's entries whose attachments are no longer live here go; the
  // records of the volumes it serves are watched, and read once for revocations.
  void prune();
  // Revocations written by other gateways, on the records' revoker thread: detaches what the
  // volume's record marks revoked here.
  void act_on_revocations(const std::string& volume_id);

 private:
  bool single_writer_shared(const VolumeRow& v) const;

  Database& db_;
  VolumeRegistry& volumes_;
  GatewayRecords* const records_;
  const Views& views_;
  const Detach detach_;
};

}  // namespace shareblk::control
