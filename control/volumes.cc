// The volume methods (docs/api.md, "Volumes").
#include <spdlog/spdlog.h>

#include "control/service.h"

namespace shareblk::control {

Json Service::volume_create(const VolumeSpec& spec) {
  if (spec.multiattach && !policy_.allow_multiattach) {
    throw ApiError("policy_denied", "policy forbids multiattach volumes");
  }
  VolumeRow v{new_uuid(), spec.name, spec.size, spec.multiattach, spec.bootable, now_iso()};
  volumes_.create(v.id, v.size);
  try {
    Database::Transaction tx(db_);
    tx.insert_volume(v);
    Json out = volume_json(tx, v);
    tx.commit();
    spdlog::info("control: created volume {} ({}, {} bytes)", v.id, printable(v.name), v.size);
    return out;
  } catch (...) {
    try {
      volumes_.remove(v.id);  // never leave backing that no volume owns
    } catch (const ApiError& e) {
      spdlog::error("control: volume {} left backing behind: {}", v.id, e.what());
    }
    throw;
  }
}

Json Service::volume_list() {
  Database::Transaction tx(db_);
  Json out = Json::array();
  for (const VolumeRow& v : tx.volumes()) out.push_back(volume_json(tx, v));
  return out;
}

Json Service::volume_show(const std::string& id) {
  Database::Transaction tx(db_);
  return volume_json(tx, find_volume(tx, id));
}

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
  }
  // Backing first: if the store fails, the volume is still there to retry on.
  volumes_.remove(id);
  Database::Transaction tx(db_);
  tx.delete_volume(id);
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
    if (*multiattach && !policy_.allow_multiattach) {
      throw ApiError("policy_denied", "policy forbids multiattach volumes");
    }
    v.multiattach = *multiattach;
  }
  if (auto bootable = opt_bool(p, "bootable")) {
    // Making a volume that several attachments share bootable would make the shared bootable
    // volume that the policy forbids attaching.
    if (*bootable && !v.bootable && !policy_.allow_multiattach_bootable) {
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
