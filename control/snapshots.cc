// Snapshots (docs/snapshots.md): point-in-time copies of a volume, made by the store (a reflink)
// or copied in the background, while the volume's writes wait between requests.
#include <spdlog/spdlog.h>

#include "control/service.h"

namespace shareblk::control {

CopyHolds::Accesses live_write_accesses(const ExportRegistry& exports,
                                        const std::vector<AttachmentRow>& attachments) {
  CopyHolds::Accesses accesses;
  for (const AttachmentRow& a : attachments) {
    if (!is_live(a.attach_status)) continue;
    if (std::shared_ptr<backend::WriteAccess> access = exports.write_access(a.id)) {
      accesses.push_back(std::move(access));
    }
  }
  return accesses;
}

// The intent and the row go in one transaction before the store is touched; the copy holds the
// intent until it is whole (status "creating"), so a crash at any point leaves a snapshot that
// the next start rolls back, never one that looks whole and is not.
Json Service::snapshot_create(const std::string& volume_id, const std::string& name) {
  SnapshotRow s{new_uuid(), volume_id, name, 0, now_iso()};
  std::shared_ptr<void> held;
  {
    const VolumeLock lock = volumes_.lock(volume_id);
    std::vector<AttachmentRow> attachments;
    {
      Database::Transaction tx(db_);
      const VolumeRow v = find_volume(tx, volume_id);
      checks_.refuse_unusable(tx, v, "snapshotted");
      s.size = v.size;
      attachments = tx.attachments(v.id);
    }
    // Outside the transaction: the pause waits for the writes in flight, and other volumes'
    // calls need the database meanwhile.
    held = copies_.hold_for_copy(volume_id, live_write_accesses(exports_, attachments));
    Database::Transaction tx(db_);
    tx.put_intent({s.id, IntentAction::Create, "", s.created_at});
    tx.insert_snapshot(s);
    tx.commit();
  }
  crash_point("snapshot_create:recorded");
  spdlog::info("control: snapshot {} ({}) of volume {}: copying {} bytes", s.id, printable(s.name),
               volume_id, s.size);
  backing_.start_populate(s.id, s.created_at, "volume " + volume_id,
                          backing_.copy_job(volume_id, s.size, s.id, s.size, std::move(held)));
  Database::Transaction tx(db_);
  return views_.snapshot_json(s, tx.intent(s.id));
}

Json Service::snapshot_list(const std::string& volume_id) {
  std::vector<SnapshotRow> rows;
  std::map<std::string, IntentRow> intents;
  {
    Database::Transaction tx(db_);
    if (!volume_id.empty()) find_volume(tx, volume_id);
    rows = tx.snapshots(volume_id);
    for (IntentRow& i : tx.intents()) intents.emplace(i.volume_id, std::move(i));
  }
  Json out = Json::array();
  for (const SnapshotRow& s : rows) {
    auto i = intents.find(s.id);
    out.push_back(
        views_.snapshot_json(s, i == intents.end() ? std::nullopt : std::optional(i->second)));
  }
  return out;
}

Json Service::snapshot_show(const std::string& id) {
  Database::Transaction tx(db_);
  const std::optional<SnapshotRow> s = tx.snapshot(id);
  if (!s) throw ApiError("not_found", "no snapshot " + id);
  return views_.snapshot_json(*s, tx.intent(id));
}

// As volume_delete: the intent first, then the store's part on a job, then the row.
Json Service::snapshot_delete(const std::string& id, bool wait) {
  {
    const VolumeLock lock = volumes_.lock(id);
    Database::Transaction tx(db_);
    if (!tx.snapshot(id)) throw ApiError("not_found", "no snapshot " + id);
    const std::optional<IntentRow> intent = tx.intent(id);
    const bool running = jobs_.state(id).has_value();
    if (intent && intent->action == IntentAction::Create && running) {
      throw ApiError("volume_busy", "snapshot " + id + " is being created; delete it once its " +
                                        "status is no longer creating");
    }
    if (copies_.is_copy_source(id)) {
      throw ApiError("volume_busy", "snapshot " + id + " is being copied into a new volume");
    }
    if (!running) {
      tx.put_intent({id, IntentAction::Delete, "", now_iso()});
      tx.commit();
    }
  }
  backing_.start_delete(id);
  if (!wait) return Json{{"id", id}, {"status", api::to_string(api::VolumeStatus::Deleting)}};
  if (std::optional<ApiError> failure = jobs_.wait(id)) throw *failure;
  Database::Transaction tx(db_);
  if (tx.snapshot(id)) {
    throw ApiError("internal", "snapshot " + id + " is not deleted: " +
                                   checks_.error_of(tx.intent(id), id).value_or("(no reason)"));
  }
  return Json{{"id", id}, {"deleted", true}};
}

}  // namespace shareblk::control
