// The Service's setup, start-up recovery and lookups; the actions are in volumes.cc and
// attachments.cc, the JSON views in views.cc.
#include "control/service.h"

#include <spdlog/spdlog.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>

#include "control/admission.h"
#include "text/iso_time.h"

namespace shareblk::control {

namespace {}  // namespace

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw ApiError("internal", "getrandom failed");
    got += static_cast<size_t>(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

// A random (version 4) UUID.
std::string new_uuid() {
  std::string h = random_hex(16);
  h[12] = '4';
  h[16] = "89ab"[std::stoi(h.substr(16, 1), nullptr, 16) & 3];
  return h.substr(0, 8) + "-" + h.substr(8, 4) + "-" + h.substr(12, 4) + "-" + h.substr(16, 4) +
         "-" + h.substr(20);
}

std::string now_iso() {
  return iso8601_utc(std::chrono::system_clock::now());
}

#if SHAREBLK_TEST_HOOKS
void crash_point(const char* point) {
  // Read once, at the first call; set only by the tests that start the daemon with it.
  static const char* const wanted = std::getenv("SHAREBLK_TEST_KILL_AT");
  if (wanted == nullptr || std::strcmp(wanted, point) != 0) return;
  spdlog::warn("test: SHAREBLK_TEST_KILL_AT={}: the daemon kills itself here", point);
  spdlog::default_logger()->flush();
  ::kill(::getpid(), SIGKILL);
}

void test_pause() {
  static const char* const ms = std::getenv("SHAREBLK_TEST_JOB_PAUSE_MS");
  if (ms != nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(ms)));
}

int test_flush_error() {
  static const char* const path = std::getenv("SHAREBLK_TEST_FAIL_FLUSH");
  return path != nullptr && ::access(path, F_OK) == 0 ? EIO : 0;
}
#else
// A build without the test hooks (a plain one, the package preset): no environment variable
// can kill or stall a shipped daemon.
void crash_point(const char* /*point*/) {}
void test_pause() {}
int test_flush_error() {
  return 0;
}
#endif

Service::Service(const std::string& db_path, store::VolumeStore& store, Policy policy,
                 store::Gateways* gateways)
    : db_(db_path),
      volumes_(store),
      records_(gateways ? std::make_unique<GatewayRecords>(
                              *gateways, gateway_id(std::filesystem::path(db_path).parent_path()),
                              [this](const std::string& id) { act_on_revocations(id); })
                        : nullptr),
      journal_((std::filesystem::path(db_path).parent_path() / "revocations").string()),
      policy_(std::move(policy)),
      state_dir_(comparable_path(std::filesystem::absolute(db_path).parent_path())) {
  if (policy_.tls != target::TlsOptions::Mode::Off) {
    psk_ = PskKeys((std::filesystem::path(db_path).parent_path() / "tls-psk.secret").string());
  }
  reconcile();
  prune_shared();
}

Policy Service::policy() const {
  std::lock_guard lock(policy_mutex_);
  return policy_;
}

std::string Service::set_policy(const Policy& policy) {
  std::lock_guard lock(policy_mutex_);
  std::string changed;
  auto take = [&](bool Policy::*field, const char* name) {
    if (policy_.*field == policy.*field) return;
    policy_.*field = policy.*field;
    changed +=
        std::string(changed.empty() ? "" : ", ") + name + "=" + (policy.*field ? "true" : "false");
  };
  take(&Policy::allow_multiattach, "allow-multiattach");
  take(&Policy::allow_multiattach_bootable, "allow-multiattach-bootable");
  take(&Policy::nbd_allow_root, "nbd-allow-root");
  return changed;
}

bool Service::flush_volumes() {
  const auto failed = volumes_.flush_all();
  for (const auto& [id, why] : failed) {
    spdlog::error(
        "volume {}: cannot flush at shutdown ({}): writes acknowledged before may not "
        "be durable",
        id, why);
  }
  return failed.empty();
}

void Service::bind(target::Server* server, Endpoints endpoints) {
  exports_.bind_server(server);
  endpoints_ = std::move(endpoints);
  // FUSE attachments live as long as their attachment, across restarts: mount them again
  // (a stale mount of a killed daemon is cleared first).
  std::vector<std::pair<AttachmentRow, VolumeRow>> fuse_attachments;
  {
    Database::Transaction tx(db_);
    for (const AttachmentRow& a : tx.attachments()) {
      if (is_serving(a.attach_status) && !a.connector.empty() &&
          Json::parse(a.connector).value("transport", "") == "fuse") {
        fuse_attachments.emplace_back(a, find_volume(tx, a.volume_id));
      }
    }
  }
  for (auto& [a, v] : fuse_attachments) {
    try {
      remount(a, v);
    } catch (const std::exception& e) {
      spdlog::error("control: cannot mount attachment {} again: {}", a.id, e.what());
    }
  }
}

void Service::remount(const AttachmentRow& a, const VolumeRow& v) {
  const std::string mountpoint = Json::parse(a.connector)["mountpoint"].get<std::string>();
  {
    Database::Transaction tx(db_);  // the mountpoint is checked against the others'
    refuse_taken_mountpoint(tx, a, mountpoint);
  }
  auto volume = volumes_.open(a.volume_id, v.size);
  if (!volume) throw ApiError("internal", "cannot open volume " + a.volume_id);
  exports_.mount(a.id, mountpoint, policy().fuse_mount_root,
                 backend::Handle(volume, a.mode, exports_.write_access(a.id)));
  spdlog::info("control: attachment {} mounted again at {}", a.id, mountpoint);
}

// At start-up, before anything is served: no connection survives a restart, so a detach that
// was under way is done, whether the database or only the revocation journal knew of it; and
// the store and the database are compared.
void Service::reconcile() {
  for (const std::string& id : journal_.pending()) {
    try {
      Database::Transaction tx(db_);
      if (auto a = tx.attachment(id); a && is_live(a->attach_status)) {
        a->attach_status = transition(a->id, a->attach_status, AttachEvent::Detach);
        a->attach_status = transition(a->id, a->attach_status, AttachEvent::Finish);
        a->detach_time = now_iso();
        tx.update_attachment(*a);
        tx.commit();
        spdlog::info("control: attachment {} was revoked before the stop; now detached", id);
      }
      journal_.clear(id);
    } catch (const std::exception& e) {
      exports_.mark_revoked(id);  // refused all the same, until a start can record it
      spdlog::error("control: attachment {} stays revoked but cannot be recorded detached: {}", id,
                    e.what());
    }
  }
  settle_journaled_writers();
  finish_intents();
  Database::Transaction tx(db_);
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
  volumes_.reconcile(known, deleting);
  load_write_access(tx);
  tx.commit();
}

// A takeover that only the journal recorded (docs/fencing.md, "When the disk fails") happened:
// its caller was told so. Lowest generation first, so that a volume's latest one stands.
void Service::settle_journaled_writers() {
  std::vector<RevocationJournal::Writer> writers = journal_.writers();
  std::sort(writers.begin(), writers.end(),
            [](const auto& x, const auto& y) { return x.generation < y.generation; });
  for (const RevocationJournal::Writer& w : writers) {
    std::optional<AttachmentRow> a;
    std::optional<VolumeRow> v;
    {
      Database::Transaction tx(db_);
      a = tx.attachment(w.attachment_id);
      if (a) v = tx.volume(a->volume_id);
    }
    if (!a || !v || v->fencing_generation >= w.generation) {  // gone, or a later change stands
      journal_.clear_writer(w.attachment_id, w.generation);
      continue;
    }
    const std::string since =
        iso8601_utc(std::chrono::system_clock::time_point(std::chrono::microseconds(w.since_us)));
    const std::string previous = v->writer;
    v->writer = a->id;
    v->fencing_generation = w.generation;
    v->writer_since = since;
    try {
      Database::Transaction tx(db_);
      tx.update_volume(*v);
      a->write_access_since = since;
      tx.update_attachment(*a);
      if (auto old = previous.empty() ? std::nullopt : tx.attachment(previous);
          old && old->id != a->id) {
        old->write_access_since.clear();
        tx.update_attachment(*old);
      }
      tx.commit();
      journal_.clear_writer(w.attachment_id, w.generation);
      spdlog::info(
          "control: volume {}: the takeover by attachment {} (generation {}) is recorded from "
          "the revocation journal",
          v->id, a->id, w.generation);
    } catch (const std::exception& e) {
      db_.set_pending_writer(v->id, {a->id, w.generation, since});
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
void Service::finish_intents() {
  std::vector<IntentRow> intents;
  {
    Database::Transaction tx(db_);
    intents = tx.intents();
  }
  for (IntentRow& i : intents) {
    if (i.action == IntentAction::Delete) {
      spdlog::info("control: the volume_delete of volume {} was interrupted; it is being finished",
                   i.volume_id);
      try {
        start_delete(i.volume_id);
      } catch (const std::exception&) {  // logged, and its status is error
      }
      continue;
    }
    std::optional<std::string> failed = roll_back_create(i.volume_id);
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
      Database::Transaction tx(db_);
      i.error = std::move(*failed);
      tx.put_intent(i);
      tx.commit();
    } catch (const std::exception&) {  // the log has it
    }
  }
}

std::optional<std::string> Service::error_of(const std::optional<IntentRow>& intent,
                                             const std::string& volume_id) {
  if (intent && !intent->error.empty() && !jobs_.state(volume_id)) {
    if (intent->action == IntentAction::Delete) {
      return "a volume_delete of it failed (" + intent->error + "); delete it again";
    }
    return "filling it failed (" + intent->error + "); delete it";
  }
  if (intent) return std::nullopt;  // being deleted or filled (from an image or a copy)
  return volumes_.missing(volume_id);
}

namespace {

std::string refused(const char* what, const std::string& id, const char* use) {
  return std::string(what) + " " + id + " cannot be " + use + ": ";
}

}  // namespace

void Service::refuse_pending(Database::Transaction& tx, const char* what, const std::string& id,
                             const char* use) {
  const std::optional<IntentRow> intent = tx.intent(id);
  if (!intent) return;
  if (const std::optional<std::string> why = error_of(intent, id)) {
    throw ApiError("volume_error", refused(what, id, use) + *why);
  }
  throw ApiError("volume_busy",
                 refused(what, id, use) + "it is being " +
                     (intent->action == IntentAction::Delete ? "deleted" : "filled"));
}

void Service::refuse_missing(const char* what, const std::string& id, uint64_t size,
                             const char* use) {
  if (const std::optional<std::string> why = volumes_.check(id, size)) {
    throw ApiError("volume_error", refused(what, id, use) + *why);
  }
}

// The volume an attachment belongs to, looked up before taking that volume's lock.
std::string Service::volume_of(const std::string& attachment_id) {
  Database::Transaction tx(db_);
  return find_attachment(tx, attachment_id).volume_id;
}

VolumeRow Service::find_volume(Database::Transaction& tx, const std::string& id) {
  auto v = tx.volume(id);
  if (!v) throw ApiError("not_found", "no volume " + id);
  return *v;
}

AttachmentRow Service::find_attachment(Database::Transaction& tx, const std::string& id) {
  auto a = tx.attachment(id);
  if (!a) throw ApiError("not_found", "no attachment " + id);
  return *a;
}

Json Service::export_resolve(const std::string& name, const Caller& caller) {
  AttachmentRow a;
  VolumeRow v;
  {
    Database::Transaction tx(db_);
    auto found = tx.attachment_by_export(name);
    if (!found || !is_serving(found->attach_status) || exports_.is_revoked(found->id)) {
      throw ApiError("not_found", "no live export of that name");
    }
    a = *found;
    v = find_volume(tx, a.volume_id);
  }
  volumes_.require_local("serving an attachment through the nbdkit plugin");
  auto volume = volumes_.open(a.volume_id, v.size);
  if (!volume) throw ApiError("internal", "cannot open volume " + a.volume_id);
  Json segments = Json::array();
  for (const backend::MappedSegment& m : volume->layout()) {
    segments.push_back({{"path", m.path}, {"offset", m.offset}, {"length", m.length}});
  }
  if (!caller.subscriber.expired()) {
    exports_.subscribe(a.id, caller.subscriber);
    // A detach that began before we subscribed has already sent its notices: look again.
    Database::Transaction tx(db_);
    auto now = tx.attachment(a.id);
    if (!now || !is_serving(now->attach_status) || exports_.is_revoked(a.id)) {
      throw ApiError("not_found", "no live export of that name");
    }
  }
  auto access = exports_.write_access(a.id);
  return Json{{"attachment_id", a.id},
              {"volume_id", a.volume_id},
              {"mode", to_string(a.mode)},
              // nbdkit serves it read-only without it, and is told to let go at any change
              {"write_access", access != nullptr && access->granted()},
              {"size", v.size},
              {"backing", {{"mapped", volume->is_mapped()}, {"segments", segments}}}};
}

// Every decision is logged at info, by attachment id and peer (never the export name: it is
// the credential), and counted.
target::ExportCatalog::Lookup Service::resolve(const std::string& export_name,
                                               const target::Peer& peer) {
  using Refusal = target::ExportCatalog::Refusal;
  AttachmentRow a;
  VolumeRow v;
  {
    Database::Transaction tx(db_);
    auto found = tx.attachment_by_export(export_name);
    if (!found || !is_serving(found->attach_status) || exports_.is_revoked(found->id)) {
      refused_unknown_.fetch_add(1, std::memory_order_relaxed);
      spdlog::info("nbd: refused {}: no live export of that name", describe(peer));
      return {std::nullopt, Refusal::Unknown};
    }
    a = *found;
    v = find_volume(tx, a.volume_id);
  }
  const Json connector = Json::parse(a.connector);
  const Admission admission = admit(connector, a.id, peer, policy());
  if (admission != Admission::Admitted) {
    refused_by_binding_.fetch_add(1, std::memory_order_relaxed);
    spdlog::info("nbd: refused {} the export of attachment {}: {}", describe(peer), a.id,
                 to_string(admission));
    return {std::nullopt, refusal_of(admission)};
  }
  auto volume = volumes_.open(a.volume_id, v.size);
  auto access = exports_.write_access(a.id);
  if (!volume || !access) return {std::nullopt, Refusal::Unknown};
  spdlog::info(
      "nbd: admitted {} to attachment {} ({}{}{})", describe(peer), a.id, to_string(a.mode),
      a.mode == backend::AttachMode::ReadWrite && !access->granted() ? ", no write access" : "",
      peer.tls ? ", TLS" : "");
  // One connection at a time, unless the connector asked for several: a reconnect replaces
  // the old one (docs/nbd.md, "Reconnects").
  const bool exclusive = !connector.value("multi_conn", false);
  return {target::Export{volume, a.mode, a.id, "", std::move(access), exclusive,
                         qos_.attachment(a.id, a.volume_id, a.qos, v.qos)}};
}

std::optional<std::string> Service::psk_key(const std::string& attachment_id) {
  if (!psk_.enabled()) return std::nullopt;
  Database::Transaction tx(db_);
  auto a = tx.attachment(attachment_id);
  if (!a || !is_serving(a->attach_status) || exports_.is_revoked(a->id) ||
      !has_psk(Json::parse(a->connector), policy())) {
    spdlog::info("nbd: refused a TLS-PSK identity that is no live TLS attachment");
    refused_unknown_.fetch_add(1, std::memory_order_relaxed);
    return std::nullopt;
  }
  return psk_.key(a->id);
}

}  // namespace shareblk::control
