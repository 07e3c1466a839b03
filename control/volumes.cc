// The volume methods (docs/api.md, "Volumes").
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <system_error>

#include "control/service.h"

namespace shareblk::control {

namespace {

// A volume_create's `from_image`, opened with the caller's rights: a file the caller could not
// read itself is `forbidden`, however much the daemon may read. Throws ApiError.
std::shared_ptr<store::ImageSource> open_image(const std::string& path,
                                               const rights::Credentials& reader) {
  if (path.empty() || path[0] != '/') invalid("from_image must be an absolute path: " + path);
  int fd = -1;
  // O_NONBLOCK: a FIFO must not hold the call until someone writes to it (inspect refuses it).
  if (const int err = rights::open_as(reader, path, O_RDONLY | O_NOCTTY | O_NONBLOCK, 0, fd)) {
    if (err == EACCES || err == EPERM) {
      throw ApiError("forbidden", "from_image: " + rights::refusal(reader, "read", path, err));
    }
    invalid("from_image: " + path + ": " + std::strerror(err));
  }
  return std::shared_ptr<store::ImageSource>(new store::ImageSource{path, fd},
                                             [](store::ImageSource* image) {
                                               ::close(image->fd);
                                               delete image;
                                             });
}

// What `qemu-img info` says of it; throws ApiError.
store::ImageInfo inspect(const store::ImageSource& image) {
  store::ImageInfo info;
  if (store::StoreError e = store::inspect_image(image, info)) {
    if (e.code.value() == ENOSYS || e.code.value() == EIO) throw ApiError("internal", e.message);
    invalid("from_image: " + e.message);
  }
  return info;
}

}  // namespace

// An intent is recorded before the store is touched and removed in the transaction that adds
// the row, so that a crash at any point leaves either a whole volume or an intent that the next
// start rolls back (docs/state.md, "Creates and deletes"). A volume that starts as a copy (of an
// image, a snapshot or a volume) gets its row at once and keeps its intent until the copy is
// done (status "creating").
Json Service::volume_create(const VolumeSpec& spec) {
  roll_backs_.retry();
  if (spec.multiattach && !policy().allow_multiattach) {
    throw ApiError("policy_denied", "policy forbids multiattach volumes");
  }
  if (int{!spec.from_image.empty()} + int{!spec.from_snapshot.empty()} +
          int{!spec.from_volume.empty()} >
      1) {
    invalid("give at most one of from_image, from_snapshot and from_volume");
  }
  if (!spec.from_image.empty()) volumes_.require_local("volume_create from_image");
  store::ImageInfo image;
  std::shared_ptr<store::ImageSource> image_source;  // open until its fill is done
  uint64_t source_size = 0;                          // the bytes the copy brings
  // A snapshot or volume copied from is kept from deletion until its copy is made, and a
  // volume's writes wait between requests meanwhile (docs/snapshots.md, "Crash consistency").
  std::shared_ptr<void> held;
  if (!spec.from_image.empty()) {
    image_source = open_image(spec.from_image, spec.image_reader);
    image = inspect(*image_source);
    source_size = image.virtual_size;
  } else if (!spec.from_snapshot.empty()) {
    const VolumeLock lock = volumes_.lock(spec.from_snapshot);
    held = copies_.read_by_copy(spec.from_snapshot);
    Database::Transaction tx(db_);
    const std::optional<SnapshotRow> snap = tx.snapshot(spec.from_snapshot);
    if (!snap) throw ApiError("not_found", "no snapshot " + spec.from_snapshot);
    checks_.refuse_unusable(tx, "snapshot", snap->id, snap->size, "copied");
    source_size = snap->size;
  } else if (!spec.from_volume.empty()) {
    const VolumeLock lock = volumes_.lock(spec.from_volume);
    std::vector<AttachmentRow> attachments;
    {
      Database::Transaction tx(db_);
      const VolumeRow source = find_volume(tx, spec.from_volume);
      checks_.refuse_unusable(tx, source, "copied");
      source_size = source.size;
      attachments = tx.attachments(source.id);
    }
    held = copies_.hold_for_copy(spec.from_volume, live_write_accesses(exports_, attachments));
  }
  const uint64_t size = spec.size == 0 ? source_size : spec.size;
  if (size < source_size) {
    invalid("size " + std::to_string(size) + " is smaller than the source's " +
            std::to_string(source_size) + " bytes");
  }
  if (size == 0) invalid("size is required without from_image, from_snapshot or from_volume");
  VolumeRow v{new_uuid(), spec.name, size, spec.multiattach, spec.bootable, now_iso()};
  v.writer_policy = spec.writer_policy;
  v.qos = qos_text(spec.qos);
  const bool copies = source_size != 0;
  BackingJobs::Populate work;  // what the copy's job does
  std::string what;
  if (!spec.from_image.empty()) {
    what = "image " + printable(spec.from_image);
    work = [this, id = v.id, size, source = std::move(image_source),
            image](const store::Progress& p) { volumes_.fill(id, size, *source, image, p); };
  } else if (copies) {
    const bool snapshot = !spec.from_snapshot.empty();
    const std::string from = snapshot ? spec.from_snapshot : spec.from_volume;
    what = (snapshot ? "snapshot " : "volume ") + from;
    work = backing_.copy_job(from, source_size, v.id, size, std::move(held));
  }
  {
    Database::Transaction tx(db_);
    tx.put_intent({v.id, IntentAction::Create, "", v.created_at});
    tx.commit();
  }
  crash_point("volume_create:intent");
  // Never leave backing that no volume owns: a store that failed half way may have made some.
  try {
    // A copy makes its backing itself (a reflink makes it whole at once).
    if (!copies || !spec.from_image.empty()) volumes_.create(v.id, v.size);
    if (!copies) shared_.publish(v);  // a copy's is saved once its bytes are in (populate)
  } catch (...) {
    roll_backs_.run_or_keep(v.id);
    throw;
  }
  crash_point("volume_create:stored");
  try {
    Database::Transaction tx(db_);
    tx.insert_volume(v);
    if (!copies) tx.delete_intent(v.id);
    Json out = views_.volume_json(tx, v);
    tx.commit();
    spdlog::info("control: created volume {} ({}, {} bytes{})", v.id, printable(v.name), v.size,
                 copies ? ", copying from " + what : "");
    if (!copies) return out;
  } catch (...) {
    roll_backs_.run_or_keep(v.id);
    throw;
  }
  backing_.start_populate(v.id, v.created_at, what, std::move(work));
  Database::Transaction tx(db_);
  return views_.volume_json(tx, v);
}

Json Service::volume_list() {
  std::vector<VolumeRow> volumes;
  std::map<std::string, std::vector<AttachmentRow>> attachments;
  std::map<std::string, IntentRow> intents;  // almost always none
  {
    Database::Transaction tx(db_);  // three queries, whatever the number of volumes
    volumes = tx.volumes();
    for (AttachmentRow& a : tx.attachments()) attachments[a.volume_id].push_back(std::move(a));
    for (IntentRow& i : tx.intents()) intents.emplace(i.volume_id, std::move(i));
  }
  Json out = Json::array();
  const std::vector<AttachmentRow> none;
  for (const VolumeRow& v : volumes) {
    auto a = attachments.find(v.id);
    auto i = intents.find(v.id);
    out.push_back(views_.volume_json(v, a == attachments.end() ? none : a->second,
                                     i == intents.end() ? std::nullopt : std::optional(i->second)));
  }
  return out;
}

Json Service::volume_show(const std::string& id) {
  Json out;
  {
    Database::Transaction tx(db_);
    out = views_.volume_json(tx, find_volume(tx, id));
  }
  if (records_ != nullptr) {  // read after the transaction: other calls need not wait for it
    Json others = Json::array();
    GatewayRecords::Attachments shared;
    try {
      shared = records_->read_attachments(id);
    } catch (const ApiError& e) {  // the volume is still shown, from this gateway's database
      spdlog::warn("control: {}", e.what());
      out["attachments_elsewhere"] = nullptr;
      return out;
    }
    for (const AttachmentRow& a : records_->elsewhere(id, shared)) {
      others.push_back(views_.attachment_view(a));
    }
    out["attachments_elsewhere"] = std::move(others);
  }
  return out;
}

// The intent is recorded with the check for live attachments, under the volume's lock, and
// removed with the row: a crash at any point leaves the volume whole or an intent that the
// next start finishes. The store's part (an LVM volume's zeroing) runs on a job's thread,
// without the volume's lock: status "deleting" meanwhile. A store that fails leaves the intent
// with its error: the volume shows status error (its backing may be half gone) until a delete
// succeeds.
Json Service::volume_delete(const std::string& id, bool wait) {
  {
    const VolumeLock lock = volumes_.lock(id);
    // Before the transaction: the cluster may keep it waiting (none for other stores).
    const std::vector<AttachmentRow> others =
        records_ != nullptr ? records_->elsewhere(id) : std::vector<AttachmentRow>{};
    Database::Transaction tx(db_);
    find_volume(tx, id);
    const std::optional<IntentRow> intent = tx.intent(id);
    const bool running = jobs_.state(id).has_value();
    if (intent && intent->action == IntentAction::Create && running) {
      throw ApiError("volume_busy", "volume " + id +
                                        " is being filled; delete it once that "
                                        "ends (its status is no longer creating)");
    }
    std::vector<AttachmentRow> attachments = tx.attachments(id);
    attachments.insert(attachments.end(), others.begin(), others.end());
    for (const auto& a : attachments) {
      if (is_live(a.attach_status)) {
        throw ApiError("volume_in_use", "volume " + id + " has attachment " + a.id + " (" +
                                            std::string(to_string(a.attach_status)) + ")");
      }
    }
    if (const std::vector<SnapshotRow> snaps = tx.snapshots(id); !snaps.empty()) {
      throw ApiError("volume_has_snapshots",
                     "volume " + id + " has " + std::to_string(snaps.size()) +
                         " snapshots (the first: " + snaps[0].id + "); delete them first");
    }
    if (copies_.is_copy_source(id)) {
      throw ApiError("volume_busy", "volume " + id + " is being copied into a new volume");
    }
    if (!running) {  // a retry clears the error of the last attempt
      tx.put_intent({id, IntentAction::Delete, "", now_iso()});
      tx.commit();
    }
  }
  crash_point("volume_delete:intent");
  backing_.start_delete(id);
  if (!wait) return Json{{"id", id}, {"status", api::to_string(api::VolumeStatus::Deleting)}};
  if (std::optional<ApiError> failure = jobs_.wait(id)) throw *failure;
  Database::Transaction tx(db_);
  if (tx.volume(id)) {  // another job's, which we did not see fail
    throw ApiError("internal", "volume " + id + " is not deleted: " +
                                   checks_.error_of(tx.intent(id), id).value_or("(no reason)"));
  }
  return Json{{"id", id}, {"deleted", true}};
}

Json Service::volume_extend(const std::string& id, uint64_t size) {
  const VolumeLock lock = volumes_.lock(id);
  VolumeRow v;
  {
    Database::Transaction tx(db_);
    v = find_volume(tx, id);
    checks_.refuse_busy(tx, v, "grow");
  }
  if (size <= v.size) {
    invalid("a volume only grows: " + std::to_string(size) + " <= " + std::to_string(v.size));
  }
  volumes_.extend(id, size);
  Database::Transaction tx(db_);
  v.size = size;
  tx.update_volume(v);
  Json out = views_.volume_json(tx, v);
  tx.commit();
  volumes_.refresh(id, size);
  shared_.republish(v);
  return out;
}

Json Service::volume_update(const VolumeChange& change) {
  const VolumeLock lock = volumes_.lock(change.id);
  Database::Transaction tx(db_);
  VolumeRow v = find_volume(tx, change.id);
  checks_.refuse_busy(tx, v, "change");
  const Json& p = *change.params;
  if (auto name = opt_string(p, "name")) {
    if (name->empty() || name->size() > kMaxVolumeName) invalid("name must be 1 to 255 bytes");
    v.name = *name;
  }
  if (auto multiattach = opt_bool(p, "multiattach"); multiattach && *multiattach != v.multiattach) {
    // Hypervisors decide caching and locking at attach time, so only an unattached volume
    // may change (Cinder's retype rule).
    if (derive_status(false, std::nullopt, tx.attachments(v.id)) != api::VolumeStatus::Available) {
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
    if (derive_status(false, std::nullopt, tx.attachments(v.id)) != api::VolumeStatus::Available) {
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
  std::optional<target::QosSpec> qos;
  if (auto it = p.find("qos"); it != p.end()) {
    qos = decode_qos(*it);
    v.qos = qos_text(*qos);
  }
  tx.update_volume(v);
  Json out = views_.volume_json(tx, v);
  tx.commit();
  // Every attachment's connections take it from their next request on.
  if (qos) qos_.set_volume(v.id, *qos);
  shared_.republish(v);
  return out;
}

}  // namespace shareblk::control
