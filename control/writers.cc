// Who may write (docs/fencing.md): a single-writer volume's takeover and live mode changes (the
// write-access gates at start are Recovery's). Every change holds the volume's lock. Taking write
// access away acts in memory first (the gate is closed and drained, nbdkit told) and is recorded
// after; giving it is recorded first and acts after, so that neither a crash nor a full disk can
// leave two attachments able to write.
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstring>

#include "control/service.h"
#include "text/iso_time.h"

namespace shareblk::control {

namespace {

// The errno of a flush of everything the volume acknowledged (0 when it succeeded).
int try_flush(VolumeRegistry& volumes, const VolumeRow& v) {
  if (const int err = test_flush_error(); err != 0) return err;
  auto volume = volumes.open(v.id, v.size);
  return volume ? backend::Handle(volume, backend::AttachMode::ReadOnly).flush() : EIO;
}

// The same; throws ApiError (internal) saying `why` it was flushed.
void flush_volume(VolumeRegistry& volumes, const VolumeRow& v, const std::string& why) {
  if (const int err = try_flush(volumes, v); err != 0) {
    throw ApiError("internal", why + ", but volume " + v.id + " cannot be flushed (" +
                                   std::strerror(err) +
                                   "): writes acknowledged before may not be durable");
  }
}

// Whether the database shows `v`'s writer and generation: a commit whose sync failed stands.
bool commit_stands(Database& db, const VolumeRow& v) {
  try {
    Database::Transaction tx(db);
    const std::optional<VolumeRow> row = tx.volume(v.id);
    return row && row->writer == v.writer && row->fencing_generation == v.fencing_generation;
  } catch (const DbError&) {
    return false;
  }
}

}  // namespace

bool may_write(const AttachmentRow& a, const VolumeRow& v) {
  return may_hold_write_access(a.attach_status) && a.mode == backend::AttachMode::ReadWrite &&
         (v.writer_policy == WriterPolicy::Multi || v.writer == a.id);
}

void make_writer(VolumeRow& v, const std::string& attachment_id, const std::string& now) {
  v.writer = attachment_id;
  v.fencing_generation += 1;
  v.writer_since = now;
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
    transition(a.id, a.attach_status, AttachEvent::TakeOver);
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
  const std::string fenced = shared_.fence_writer(v);
  const std::string old_id = v.writer;
  const uint64_t old_generation = v.fencing_generation;
  // The fence: from here on no change of the old writer runs, and none that it had sent
  // is still running; then everything acknowledged so far is made durable. A flush that fails
  // does not stop it (docs/fencing.md, "When the disk fails"): the call says so at the end.
  if (!old_id.empty()) {
    exports_.set_write_access(old_id, false);
    exports_.cut_subscribers(old_id);
  }
  const int flush_err = try_flush(volumes_, v);
  crash_point("volume_takeover:fenced");
  const std::optional<Database::PendingWriter> superseded = db_.pending_writer(v.id);
  const auto when = std::chrono::system_clock::now();
  const std::string now = iso8601_utc(when);
  make_writer(v, a.id, now);
  a.write_access_since = now;
  bool journaled = false;
  std::string unsynced;  // the database's sync failed: why
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
    // The database cannot record it (a full disk): the journal's preallocated slot can, and
    // the next start puts it into the database. Only if neither can does nothing change.
    const RevocationJournal::Writer record{
        a.id, v.fencing_generation,
        std::chrono::duration_cast<std::chrono::microseconds>(when.time_since_epoch()).count()};
    if (journal_.record_writer(record)) {
      db_.set_pending_writer(v.id, {a.id, v.fencing_generation, now});
      journaled = true;
      spdlog::warn(
          "control: volume {}: the database cannot record the takeover by attachment {} ({}); "
          "the revocation journal holds it until it can",
          v.id, a.id, e.what());
    } else if (commit_stands(db_, v)) {
      // Only its sync failed: the database shows the new writer, so it is done, unsynced
      // (docs/state.md, "Durability"), and the call says so.
      unsynced = e.what();
    } else {
      if (!old_id.empty()) exports_.set_write_access(old_id, true);
      throw ApiError(e.disk_full() ? "no_space" : "internal",
                     "neither the database (" + std::string(e.what()) +
                         ") nor the revocation journal could record attachment " + a.id +
                         " as the writer of volume " + v.id + ": nothing changed, " +
                         (old_id.empty() ? std::string("the volume has no writer")
                                         : "attachment " + old_id + " still writes") +
                         (flush_err != 0 ? std::string("; the volume cannot be flushed either (") +
                                               std::strerror(flush_err) + ")"
                                         : ""),
                     Json{{"writer", old_id.empty() ? Json(nullptr) : Json(old_id)},
                          {"fencing_generation", old_generation}});
    }
  }
  if (superseded) {  // a takeover only the journal held: this one replaces it
    journal_.clear_writer(superseded->writer, superseded->generation);
    if (!journaled) db_.drop_pending_writer(v.id);
  }
  crash_point("volume_takeover:recorded");
  shared_.publish_writer(v);
  exports_.set_write_access(a.id, true);
  exports_.cut_subscribers(a.id);  // nbdkit resolved it without write access: connect again
  spdlog::info("control: volume {}: takeover: writer {} -> {} (generation {})", v.id,
               old_id.empty() ? "(none)" : old_id, a.id, v.fencing_generation);
  if (flush_err != 0 || !unsynced.empty()) {
    const std::string why =
        flush_err != 0 ? "the volume cannot be flushed (" + std::string(std::strerror(flush_err)) +
                             "): writes acknowledged before may not be durable"
                       : "the database could not sync it (" + unsynced + "): it may not be durable";
    throw ApiError(
        "internal",
        "attachment " + a.id + " is the writer of volume " + v.id + " (generation " +
            std::to_string(v.fencing_generation) + ")" +
            (old_id.empty() ? std::string() : " and attachment " + old_id + " no longer writes") +
            ", but " + why,
        Json{{"writer", a.id}, {"fencing_generation", v.fencing_generation}});
  }
  return Json{{"writer", a.id},
              {"fencing_generation", v.fencing_generation},
              {"writer_since", v.writer_since},
              {"previous_writer", old_id.empty() ? Json(nullptr) : Json(old_id)},
              {"fenced_gateway", fenced.empty() ? Json(nullptr) : Json(fenced)}};
}

Json Service::change_mode(const std::string& id, backend::AttachMode mode) {
  const std::string volume_id = volume_of(db_, id);
  const VolumeLock lock = volumes_.lock(volume_id);
  VolumeRow v;
  AttachmentRow a;
  {
    Database::Transaction tx(db_);
    a = find_attachment(tx, id);
    v = find_volume(tx, volume_id);
  }
  transition(a.id, a.attach_status, AttachEvent::ChangeMode);
  if (a.mode == mode) return views_.attachment_json(a, v);  // nothing to change: a retried call
  const std::string now = now_iso();
  const std::string was_writer = v.writer;
  a.mode = mode;
  if (mode == backend::AttachMode::ReadOnly) {
    // Demotion, in memory first: its changes are refused and drained, nbdkit told; its NBD
    // connections stay (advertised read-write, every change gets EPERM).
    exports_.set_write_access(a.id, false);
    exports_.cut_subscribers(a.id);
    flush_volume(volumes_, v, "attachment " + a.id + " no longer writes");
    a.write_access_since.clear();
    if (v.writer == a.id) {
      make_writer(v, "", now);
      shared_.publish_writer(v);
      shared_.release_writer(v);
    }
  } else if (v.writer_policy == WriterPolicy::Single && v.writer.empty() &&
             shared_.claim_writer(v)) {
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
    if (!v.writer.empty()) shared_.publish_writer(v);  // a demotion's was, before the lock went
  }
  return views_.attachment_json(a, v);
}

}  // namespace shareblk::control
