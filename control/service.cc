// The Service's setup, policy and the exports' resolution for the frontends; the actions are
// in volumes.cc, attachments.cc, writers.cc and snapshots.cc.
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
#include "text/hex.h"
#include "text/iso_time.h"

namespace shareblk::control {

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw ApiError("internal", "getrandom failed");
    got += static_cast<size_t>(n);
  }
  return to_hex(raw);
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
                              [this](const std::string& id) { shared_.act_on_revocations(id); })
                        : nullptr),
      journal_((std::filesystem::path(db_path).parent_path() / "revocations").string()),
      policy_(std::move(policy)),
      state_dir_(comparable_path(std::filesystem::absolute(db_path).parent_path())) {
  if (policy_.tls != target::TlsOptions::Mode::Off) {
    psk_ = PskKeys((std::filesystem::path(db_path).parent_path() / "tls-psk.secret").string());
  }
  Recovery({db_, journal_, exports_, volumes_, shared_, backing_}).run();
  shared_.prune();
}

Service::~Service() {
  // The revoker calls into shared_: it ends before any member goes.
  if (records_) records_->stop();
}

Service::Counts Service::counts() const {
  return {volumes_.lock_count(), jobs_.running(), exports_.subscriber_count()};
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
// the credential).
target::ExportCatalog::Lookup Service::resolve(const std::string& export_name,
                                               const target::Peer& peer) {
  using Refusal = target::ExportCatalog::Refusal;
  AttachmentRow a;
  VolumeRow v;
  {
    Database::Transaction tx(db_);
    auto found = tx.attachment_by_export(export_name);
    if (!found || !is_serving(found->attach_status) || exports_.is_revoked(found->id)) {
      spdlog::info("nbd: refused {}: no live export of that name", describe(peer));
      return {std::nullopt, Refusal::Unknown};
    }
    a = *found;
    v = find_volume(tx, a.volume_id);
  }
  const Json connector = Json::parse(a.connector);
  const Admission admission = admit(connector, a.id, peer, policy());
  if (admission != Admission::Admitted) {
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
    return std::nullopt;
  }
  return psk_.key(a->id);
}

}  // namespace shareblk::control
