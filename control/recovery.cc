#include "control/recovery.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <string>
#include <vector>

#include "control/backing_jobs.h"
#include "control/export_registry.h"
#include "control/revocation_journal.h"
#include "control/service.h"
#include "control/shared_store.h"
#include "control/volume_registry.h"
#include "text/iso_time.h"

namespace shareblk::control {

void Recovery::run() {
  for (const std::string& id : p_.journal.pending()) {
    try {
      Database::Transaction tx(p_.db);
      if (auto a = tx.attachment(id); a && is_live(a->attach_status)) {
        a->attach_status = transition(a->id, a->attach_status, AttachEvent::Detach);
        a->attach_status = transition(a->id, a->attach_status, AttachEvent::Finish);
        a->detach_time = now_iso();
        tx.update_attachment(*a);
        tx.commit();
        spdlog::info("control: attachment {} was revoked before the stop; now detached", id);
      }
      p_.journal.clear(id);
    } catch (const std::exception& e) {
      p_.exports.mark_revoked(id);  // refused all the same, until a start can record it
      spdlog::error("control: attachment {} stays revoked but cannot be recorded detached: {}", id,
                    e.what());
    }
  }
  settle_journaled_writers();
  finish_intents();
  Database::Transaction tx(p_.db);
  std::vector<std::pair<std::string, std::string>> known;
  for (AttachmentRow a : tx.attachments()) {
    if (is_detaching(a.attach_status)) {
      a.attach_status = transition(a.id, a.attach_status, AttachEvent::Finish);
      a.detach_time = now_iso();
      tx.update_attachment(a);
      spdlog::info("control: attachment {} was detaching at shutdown; now detached", a.id);
    }
  }
  for (const VolumeRow& v : tx.volumes()) known.emplace_back(v.id, v.name);
  for (const SnapshotRow& s : tx.snapshots()) known.emplace_back(s.id, "snapshot " + s.name);
  std::set<std::string> deleting;  // finish_intents() started their deletes
  for (const IntentRow& i : tx.intents()) {
    if (i.action == IntentAction::Delete) deleting.insert(i.volume_id);
  }
  p_.volumes.reconcile(known, deleting);
  load_write_access(tx);
  tx.commit();
}

// A takeover that only the journal recorded (docs/fencing.md, "When the disk fails") happened:
// its caller was told so. Lowest generation first, so that a volume's latest one stands.
void Recovery::settle_journaled_writers() {
  std::vector<RevocationJournal::Writer> writers = p_.journal.writers();
  std::sort(writers.begin(), writers.end(),
            [](const auto& x, const auto& y) { return x.generation < y.generation; });
  for (const RevocationJournal::Writer& w : writers) {
    std::optional<AttachmentRow> a;
    std::optional<VolumeRow> v;
    {
      Database::Transaction tx(p_.db);
      a = tx.attachment(w.attachment_id);
      if (a) v = tx.volume(a->volume_id);
    }
    if (!a || !v || v->fencing_generation >= w.generation) {  // gone, or a later change stands
      p_.journal.clear_writer(w.attachment_id, w.generation);
      continue;
    }
    const std::string since =
        iso8601_utc(std::chrono::system_clock::time_point(std::chrono::microseconds(w.since_us)));
    const std::string previous = v->writer;
    v->writer = a->id;
    v->fencing_generation = w.generation;
    v->writer_since = since;
    try {
      Database::Transaction tx(p_.db);
      tx.update_volume(*v);
      a->write_access_since = since;
      tx.update_attachment(*a);
      if (auto old = previous.empty() ? std::nullopt : tx.attachment(previous);
          old && old->id != a->id) {
        old->write_access_since.clear();
        tx.update_attachment(*old);
      }
      tx.commit();
      p_.journal.clear_writer(w.attachment_id, w.generation);
      spdlog::info(
          "control: volume {}: the takeover by attachment {} (generation {}) is recorded from "
          "the revocation journal",
          v->id, a->id, w.generation);
    } catch (const std::exception& e) {
      p_.db.set_pending_writer(v->id, {a->id, w.generation, since});
      spdlog::error(
          "control: volume {}: attachment {} stays the writer (generation {}) from the "
          "revocation journal; the database cannot record it yet: {}",
          v->id, a->id, w.generation, e.what());
    }
  }
}

// A create or delete that a crash interrupted: a create is rolled back (its caller never
// learnt the volume's id, and its backing may be half made; or it was being filled from an
// image, which cannot be trusted half done), a delete is finished (its caller asked for it, and
// its backing may be half gone) on a job's thread, as volume_delete does. Removing backing is
// harmless when it is already gone. A rollback that cannot be done now is kept for the next
// start; a delete that fails shows status error.
void Recovery::finish_intents() {
  std::vector<IntentRow> intents;
  {
    Database::Transaction tx(p_.db);
    intents = tx.intents();
  }
  for (IntentRow& i : intents) {
    if (i.action == IntentAction::Delete) {
      spdlog::info("control: the volume_delete of volume {} was interrupted; it is being finished",
                   i.volume_id);
      try {
        p_.backing.start_delete(i.volume_id);
      } catch (const std::exception&) {  // logged, and its status is error
      }
      continue;
    }
    std::optional<std::string> failed = p_.backing.roll_back_create(i.volume_id);
    if (!failed) {
      spdlog::info(
          "control: the volume_create of volume {} was interrupted; rolled back (its backing "
          "is removed)",
          i.volume_id);
      continue;
    }
    spdlog::error(
        "control: the volume_create of volume {} was interrupted and cannot be rolled back "
        "now ({}); the next start tries again",
        i.volume_id, *failed);
    try {
      Database::Transaction tx(p_.db);
      i.error = std::move(*failed);
      tx.put_intent(i);
      tx.commit();
    } catch (const std::exception&) {  // the log has it
    }
  }
}

void Recovery::load_write_access(Database::Transaction& tx) {
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
        unclaimed = !p_.shared.reclaim_writer(tx, v);
      }
    }
    for (const AttachmentRow& a : attachments) {
      // One the journal still holds revoked (the database could not record it) gets none.
      if (is_live(a.attach_status)) {
        p_.exports.set_write_access(a.id,
                                    may_write(a, v) && !p_.exports.is_revoked(a.id) && !unclaimed);
      }
    }
  }
}

}  // namespace shareblk::control
