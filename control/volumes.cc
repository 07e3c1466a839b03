// The volume methods (docs/api.md, "Volumes").
#include <spdlog/spdlog.h>

#include <map>

#include "control/service.h"

namespace shareblk::control {

// An intent is recorded before the store is touched and removed in the transaction that adds
// the row, so that a crash at any point leaves either a whole volume or an intent that the next
// start rolls back (docs/state.md, "Creates and deletes").
Json Service::volume_create(const VolumeSpec& spec) {
  if (spec.multiattach && !policy().allow_multiattach) {
    throw ApiError("policy_denied", "policy forbids multiattach volumes");
  }
  VolumeRow v{new_uuid(), spec.name, spec.size, spec.multiattach, spec.bootable, now_iso()};
  v.writer_policy = spec.writer_policy;
  {
    Database::Transaction tx(db_);
    tx.put_intent({v.id, IntentAction::Create, "", v.created_at});
    tx.commit();
  }
  crash_point("volume_create:intent");
  // Never leave backing that no volume owns: a store that failed half way may have made some.
  auto roll_back = [&] {
    try {
      volumes_.remove(v.id);
      Database::Transaction tx(db_);
      tx.delete_intent(v.id);
      tx.commit();
    } catch (const std::exception& e) {
      spdlog::error("control: volume {} could not be rolled back ({}); the next start does it",
                    v.id, e.what());
    }
  };
  try {
    volumes_.create(v.id, v.size);
  } catch (...) {
    roll_back();
    throw;
  }
  crash_point("volume_create:stored");
  try {
    Database::Transaction tx(db_);
    tx.insert_volume(v);
    tx.delete_intent(v.id);
    Json out = volume_json(tx, v);
    tx.commit();
    spdlog::info("control: created volume {} ({}, {} bytes)", v.id, printable(v.name), v.size);
    return out;
  } catch (...) {
    roll_back();
    throw;
  }
}

Json Service::volume_list() {
  Database::Transaction tx(db_);
  Json out = Json::array();
  std::map<std::string, IntentRow> intents;  // almost always none: one query, not one a volume
  for (IntentRow& i : tx.intents()) intents.emplace(i.volume_id, std::move(i));
  for (const VolumeRow& v : tx.volumes()) {
    auto it = intents.find(v.id);
    out.push_back(volume_json(
        tx, v, it == intents.end() ? std::nullopt : std::optional<IntentRow>(it->second)));
  }
  return out;
}

Json Service::volume_show(const std::string& id) {
  Database::Transaction tx(db_);
  return volume_json(tx, find_volume(tx, id));
}

// The intent is recorded with the check for live attachments, under the volume's lock, and
// removed with the row: a crash at any point leaves the volume whole or an intent that the
// next start finishes. A store that fails leaves the intent with its error: the volume shows
// status error (its backing may be half gone) until a delete succeeds.
Json Service::volume_delete(const std::string& id) {
  const VolumeLock lock = volumes_.lock(id);
  {
    Database::Transaction tx(db_);
    find_volume(tx, id);
    for (const auto& a : tx.attachments(id)) {
      if (is_live(a.attach_status)) {
        throw ApiError("volume_in_use", "volume " + id + " has attachment " + a.id + " (" +
                                            std::string(to_string(a.attach_status)) + ")");
      }
    }
    tx.put_intent({id, IntentAction::Delete, "", now_iso()});
    tx.commit();
  }
  crash_point("volume_delete:intent");
  try {
    volumes_.remove(id);
  } catch (const ApiError& e) {
    try {
      Database::Transaction tx(db_);
      tx.put_intent({id, IntentAction::Delete, e.what(), now_iso()});
      tx.commit();
    } catch (const std::exception& db) {  // the intent stays, without the store's words
      spdlog::error("control: volume {}: cannot record why its delete failed: {}", id, db.what());
    }
    throw;
  }
  crash_point("volume_delete:removed");
  Database::Transaction tx(db_);
  tx.delete_volume(id);
  tx.delete_intent(id);
  tx.commit();
  spdlog::info("control: deleted volume {}", id);
  return Json{{"id", id}, {"deleted", true}};
}

Json Service::volume_extend(const std::string& id, uint64_t size) {
  const VolumeLock lock = volumes_.lock(id);
  VolumeRow v;
  {
    Database::Transaction tx(db_);
    v = find_volume(tx, id);
  }
  if (size <= v.size) {
    invalid("a volume only grows: " + std::to_string(size) + " <= " + std::to_string(v.size));
  }
  volumes_.extend(id, size);
  Database::Transaction tx(db_);
  v.size = size;
  tx.update_volume(v);
  Json out = volume_json(tx, v);
  tx.commit();
  volumes_.refresh(id, size);
  return out;
}

Json Service::volume_update(const VolumeChange& change) {
  const VolumeLock lock = volumes_.lock(change.id);
  Database::Transaction tx(db_);
  VolumeRow v = find_volume(tx, change.id);
  const Json& p = *change.params;
  if (auto name = opt_string(p, "name")) {
    if (name->empty() || name->size() > kMaxVolumeName) invalid("name must be 1 to 255 bytes");
    v.name = *name;
  }
  if (auto multiattach = opt_bool(p, "multiattach"); multiattach && *multiattach != v.multiattach) {
    // Hypervisors decide caching and locking at attach time, so only an unattached volume
    // may change (Cinder's retype rule).
    if (volume_status(tx.attachments(v.id)) != "available") {
      throw ApiError("volume_in_use", "multiattach can change only while the volume is available");
    }
    if (*multiattach && !policy().allow_multiattach) {
      throw ApiError("policy_denied", "policy forbids multiattach volumes");
    }
    v.multiattach = *multiattach;
  }
  if (auto policy = opt_writer_policy(p, "writer_policy"); policy && *policy != v.writer_policy) {
    // Who holds write access is decided as attachments come: a change under live
    // attachments would have to take it from some of them at once. Only while available.
    if (volume_status(tx.attachments(v.id)) != "available") {
      throw ApiError("volume_in_use",
                     "writer_policy can change only while the volume is available");
    }
    v.writer_policy = *policy;
    v.writer.clear();
  }
  if (auto bootable = opt_bool(p, "bootable")) {
    // Making a volume that several attachments share bootable would make the shared bootable
    // volume that the policy forbids attaching.
    if (*bootable && !v.bootable && !policy().allow_multiattach_bootable) {
      size_t live_attachments = 0;
      for (const auto& a : tx.attachments(v.id)) live_attachments += is_live(a.attach_status);
      if (live_attachments > 1) {
        throw ApiError("policy_denied",
                       "policy forbids a bootable volume with several attachments");
      }
    }
    v.bootable = *bootable;
  }
  tx.update_volume(v);
  Json out = volume_json(tx, v);
  tx.commit();
  return out;
}

}  // namespace shareblk::control
