// Who may write (docs/fencing.md): a single-writer volume's takeover, live mode changes, and the
// write-access gates at start. Every change holds the volume's lock. Taking write access away
// acts in memory first (the gate is closed and drained, nbdkit told) and is recorded after;
// giving it is recorded first and acts after, so that neither a crash nor a full disk can leave
// two attachments able to write.
#include <spdlog/spdlog.h>

#include <cstring>

#include "control/service.h"

namespace shareblk::control {

bool may_write(const AttachmentRow& a, const VolumeRow& v) {
  return is_live(a.attach_status) && a.attach_status != AttachStatus::Detaching &&
         a.mode == backend::AttachMode::ReadWrite &&
         (v.writer_policy == WriterPolicy::Multi || v.writer == a.id);
}

void make_writer(VolumeRow& v, const std::string& attachment_id, const std::string& now) {
  v.writer = attachment_id;
  v.fencing_generation += 1;
  v.writer_since = now;
}

void Service::load_write_access(Database::Transaction& tx) {
  for (VolumeRow v : tx.volumes()) {
    const std::vector<AttachmentRow> attachments = tx.attachments(v.id);
    bool unclaimed = false;  // a shared store's lock that could not be taken back
    if (!v.writer.empty()) {
      bool writer_live = false;
      for (const AttachmentRow& a : attachments) writer_live |= a.id == v.writer && may_write(a, v);
      if (!writer_live) {  // detached while the daemon was down, or by the journal above
        spdlog::info("control: volume {}: writer {} is no longer attached; no writer now", v.id,
                     v.writer);
        make_writer(v, "", now_iso());
        tx.update_volume(v);
      } else {
        unclaimed = !reclaim_shared_writer(tx, v);
      }
    }
    for (const AttachmentRow& a : attachments) {
      // One the journal still holds revoked (the database could not record it) gets none.
      if (is_live(a.attach_status)) {
        exports_.set_write_access(a.id,
                                  may_write(a, v) && !exports_.is_revoked(a.id) && !unclaimed);
      }
    }
  }
}

void Service::flush_volume(const VolumeRow& v, const std::string& why) {
  auto volume = volumes_.open(v.id, v.size);
  const int err = volume ? backend::Handle(volume, backend::AttachMode::ReadOnly).flush() : EIO;
  if (err != 0) {
    throw ApiError("internal", why + ", but volume " + v.id + " cannot be flushed (" +
                                   std::strerror(err) +
                                   "): writes acknowledged before may not be durable");
  }
}

Json Service::volume_takeover(const std::string& volume_id, const std::string& attachment_id) {
  const VolumeLock lock = volumes_.lock(volume_id);
  VolumeRow v;
  AttachmentRow a;
  std::optional<AttachmentRow> old;
  {
    Database::Transaction tx(db_);
    v = find_volume(tx, volume_id);
    a = find_attachment(tx, attachment_id);
    if (a.volume_id != v.id) {
      throw ApiError("not_found", "attachment " + a.id + " is not of volume " + v.id);
    }
    if (v.writer_policy != WriterPolicy::Single) {
      throw ApiError("not_single_writer",
                     "volume " + v.id +
                         " has writer_policy multi: every read-write attachment writes "
                         "(volume_update writer_policy single, while it is available)");
    }
    if (!is_live(a.attach_status) || a.attach_status == AttachStatus::Detaching) {
      throw ApiError("invalid_state", "attachment " + a.id + " is " +
                                          std::string(to_string(a.attach_status)) +
                                          "; only a live attachment can take over");
    }
    if (a.mode != backend::AttachMode::ReadWrite) {
      throw ApiError("invalid_state", "attachment " + a.id +
                                          " is read-only; make it read-write first "
                                          "(attachment_update with mode rw)");
    }
    if (v.writer == a.id) {
      throw ApiError("already_writer", "attachment " + a.id + " is already the writer of volume " +
                                           v.id + " (generation " +
                                           std::to_string(v.fencing_generation) + ")");
    }
    if (!v.writer.empty()) old = tx.attachment(v.writer);
  }
  // A writer on another gateway of a shared store is cut off by the cluster before anything
  // changes here; one on this gateway leaves the lock with us (docs/scale-out.md).
  const std::string fenced = fence_shared_writer(v);
  const std::string old_id = v.writer;
  // The fence: from here on no change of the old writer runs, and none that it had sent
  // is still running; then everything acknowledged so far is made durable.
  if (!old_id.empty()) {
    exports_.set_write_access(old_id, false);
    exports_.cut_subscribers(old_id);
  }
  flush_volume(
      v, "attachment " + (old_id.empty() ? std::string("(none)") : old_id) + " no longer writes");
  crash_point("volume_takeover:fenced");
  const std::string now = now_iso();
  make_writer(v, a.id, now);
  a.write_access_since = now;
  try {
    Database::Transaction tx(db_);
    tx.update_volume(v);
    tx.update_attachment(a);
    if (old) {
      old->write_access_since.clear();
      tx.update_attachment(*old);
    }
    tx.commit();
  } catch (const DbError& e) {
    // The old writer stays fenced; so that a restart cannot make it the writer again, it is
    // detached then. The new one gets nothing until the database says so.
    const bool journaled = !old_id.empty() && journal_.record(old_id);
    throw ApiError(e.disk_full() ? "no_space" : "internal",
                   "attachment " + (old_id.empty() ? std::string("(none)") : old_id) +
                       " no longer writes to volume " + v.id + ", but the database could not " +
                       "record attachment " + a.id + " as its writer: " + e.what() +
                       (journaled ? "; the old writer will be detached at the next start" : "") +
                       "; no attachment writes until a takeover succeeds");
  }
  crash_point("volume_takeover:recorded");
  publish_writer(v);
  exports_.set_write_access(a.id, true);
  exports_.cut_subscribers(a.id);  // nbdkit resolved it without write access: connect again
  spdlog::info("control: volume {}: takeover: writer {} -> {} (generation {})", v.id,
               old_id.empty() ? "(none)" : old_id, a.id, v.fencing_generation);
  return Json{{"writer", a.id},
              {"fencing_generation", v.fencing_generation},
              {"writer_since", v.writer_since},
              {"previous_writer", old_id.empty() ? Json(nullptr) : Json(old_id)},
              {"fenced_gateway", fenced.empty() ? Json(nullptr) : Json(fenced)}};
}

Json Service::change_mode(const std::string& id, backend::AttachMode mode) {
  const std::string volume_id = volume_of(id);
  const VolumeLock lock = volumes_.lock(volume_id);
  VolumeRow v;
  AttachmentRow a;
  {
    Database::Transaction tx(db_);
    a = find_attachment(tx, id);
    v = find_volume(tx, volume_id);
  }
  if (!is_live(a.attach_status) || a.attach_status == AttachStatus::Detaching) {
    throw ApiError("invalid_state", "attachment " + a.id + " is " +
                                        std::string(to_string(a.attach_status)) +
                                        "; cannot change its mode");
  }
  if (a.mode == mode) return attachment_json(a, v);  // nothing to change: a retried call
  const std::string now = now_iso();
  const std::string was_writer = v.writer;
  a.mode = mode;
  if (mode == backend::AttachMode::ReadOnly) {
    // Demotion, in memory first: its changes are refused and drained, nbdkit told; its NBD
    // connections stay (advertised read-write, every change gets EPERM).
    exports_.set_write_access(a.id, false);
    exports_.cut_subscribers(a.id);
    flush_volume(v, "attachment " + a.id + " no longer writes");
    a.write_access_since.clear();
    if (v.writer == a.id) {
      make_writer(v, "", now);
      publish_writer(v);
      release_shared_writer(v);
    }
  } else if (v.writer_policy == WriterPolicy::Single && v.writer.empty() &&
             claim_shared_writer(v)) {
    make_writer(v, a.id, now);
    a.write_access_since = now;
  } else if (v.writer_policy == WriterPolicy::Multi) {
    a.write_access_since = now;
  }
  try {
    Database::Transaction tx(db_);
    tx.update_attachment(a);
    if (v.writer != was_writer) tx.update_volume(v);
    tx.commit();
  } catch (const DbError& e) {
    if (mode == backend::AttachMode::ReadWrite) throw;  // nothing was given yet
    const bool journaled = journal_.record(a.id);
    throw ApiError(e.disk_full() ? "no_space" : "internal",
                   "attachment " + a.id +
                       " no longer writes, but the database could not record "
                       "it read-only: " +
                       e.what() +
                       (journaled ? "; it will be detached at the next start"
                                  : "; it stays read-only until the daemon stops"));
  }
  if (mode == backend::AttachMode::ReadWrite) {
    exports_.set_write_access(a.id, may_write(a, v));
    // Its connections were told "read-only" in their handshake: they must negotiate again.
    const size_t closed = exports_.reconnect(a.id);
    exports_.cut_subscribers(a.id);
    if (!a.connector.empty() && Json::parse(a.connector).value("transport", "") == "fuse") {
      remount(a, v);
    }
    spdlog::info(
        "control: attachment {} of volume {}: mode ro -> rw ({}; {} connection(s) "
        "closed to reconnect)",
        a.id, v.id, may_write(a, v) ? "writes" : "a standby until a takeover", closed);
  } else {
    spdlog::info("control: attachment {} of volume {}: mode rw -> ro", a.id, v.id);
  }
  if (v.writer != was_writer) {
    spdlog::info("control: volume {}: writer {} -> {} (generation {})", v.id,
                 was_writer.empty() ? "(none)" : was_writer, v.writer.empty() ? "(none)" : v.writer,
                 v.fencing_generation);
    if (!v.writer.empty()) publish_writer(v);  // a demotion's was, before the lock went
  }
  return attachment_json(a, v);
}

}  // namespace shareblk::control
