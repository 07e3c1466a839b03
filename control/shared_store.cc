// Several gateways, one store (docs/scale-out.md, "Several gateways"): in a store that other
// shareblk daemons serve too (rbd), each volume's definition is saved with its image, so that
// any gateway can serve it, and a single-writer volume's writer is backed by the image's
// exclusive lock, which a takeover breaks only after the cluster has fenced the old holder.
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <thread>

#include "control/service.h"
#include "control/small_file.h"

namespace shareblk::control {

namespace {

using DefinitionPart = lvm::VolumeStore::DefinitionPart;

std::string definition_of(const VolumeRow& v) {
  Json d{{"name", v.name},
         {"size", v.size},
         {"multiattach", v.multiattach},
         {"bootable", v.bootable},
         {"writer_policy", std::string(to_string(v.writer_policy))},
         {"created_at", v.created_at}};
  if (!v.qos.empty()) d["qos"] = v.qos;
  return d.dump();
}

// nullopt when `text` is not a definition this version understands.
std::optional<VolumeRow> volume_of_definition(const std::string& id, const std::string& text) {
  const Json d = Json::parse(text, nullptr, false);
  if (!d.is_object()) return std::nullopt;
  try {
    VolumeRow v;
    v.id = id;
    v.name = d.at("name").get<std::string>();
    v.size = d.at("size").get<uint64_t>();
    v.multiattach = d.at("multiattach").get<bool>();
    v.bootable = d.at("bootable").get<bool>();
    const auto policy = writer_policy_named(d.at("writer_policy").get<std::string>());
    if (!policy) return std::nullopt;
    v.writer_policy = *policy;
    v.created_at = d.at("created_at").get<std::string>();
    v.qos = d.value("qos", std::string());
    return v;
  } catch (const Json::exception&) {
    return std::nullopt;
  }
}

}  // namespace

std::string gateway_id(const std::filesystem::path& state_dir) {
  const std::filesystem::path path = state_dir / "gateway-id";
  std::string id;
  if (std::ifstream in(path); in >> id && !id.empty()) return id;
  id = new_uuid();
  if (const int err = replace_small_file(path, id + "\n", 0644)) {
    throw std::runtime_error("cannot make " + path.string() + ": " + std::strerror(err));
  }
  spdlog::info("control: this gateway is {} in the shared store's records", id);
  return id;
}

void Service::publish(const VolumeRow& v) {
  if (volumes_.shared()) volumes_.save_definition(v.id, DefinitionPart::Volume, definition_of(v));
}

// Who was made the writer last, on whichever gateway, and the lock holder (a client instance
// of its gateway) that backs it: a gateway that restarts with another writer on record was
// taken over while it was down or hung; one that finds its own writer on record and the lock
// still with that holder has crashed holding it (reclaim_shared_writer). Only the gateway
// that holds or has just given up the lock writes it.
void Service::publish_writer(const VolumeRow& v) {
  if (!volumes_.shared() || v.writer_policy != WriterPolicy::Single) return;
  try {
    std::string holder;
    if (!v.writer.empty()) {
      const auto volume = volumes_.open(v.id, v.size);
      if (volume && volume->remote()) volume->remote()->lock_owner(holder);
    }
    const Json d{{"writer", v.writer.empty() ? Json(nullptr) : Json(v.writer)},
                 {"lock_holder", holder.empty() ? Json(nullptr) : Json(holder)}};
    volumes_.save_definition(v.id, DefinitionPart::Writer, d.dump());
  } catch (const ApiError& e) {
    spdlog::error(
        "control: {}; a restart of the gateway whose writer this record names may take its "
        "writer for taken over",
        e.what());
  }
}

void Service::republish(const VolumeRow& v) {
  try {
    publish(v);
  } catch (const ApiError& e) {
    spdlog::error("control: {}; gateways that learn it from now on see its former definition",
                  e.what());
  }
}

void Service::learn_volume(const std::string& id) {
  if (!volumes_.shared()) return;
  {
    Database::Transaction tx(db_);
    if (tx.volume(id) || tx.snapshot(id)) return;
  }
  // The cluster is read with the database free: a slow or frozen OSD holds this call only.
  const std::optional<std::string> text = volumes_.load_definition(id, DefinitionPart::Volume);
  if (!text) return;  // no such volume anywhere: the call says not_found
  const std::optional<VolumeRow> v = volume_of_definition(id, *text);
  if (!v) {
    spdlog::warn("control: volume {}: its definition in the shared store cannot be read", id);
    return;
  }
  Database::Transaction tx(db_);
  if (tx.volume(id)) return;  // a call naming it at the same time added it first
  // Its writer, if any, is another gateway's: none here until this gateway claims it.
  tx.insert_volume(*v);
  tx.commit();
  spdlog::info("control: volume {} ({}) learnt from the shared store: another gateway made it", id,
               printable(v->name));
}

namespace {

// The open volume's image in the shared store; throws ApiError (internal) when it cannot be
// opened. `volume` keeps it open for the caller.
backend::RemoteImage& shared_image(const std::shared_ptr<backend::Volume>& volume,
                                   const std::string& id) {
  if (!volume || !volume->remote())
    throw ApiError("internal", "volume " + id + " cannot be opened");
  return *volume->remote();
}

}  // namespace

bool Service::claim_shared_writer(const VolumeRow& v) {
  if (!volumes_.shared() || v.writer_policy != WriterPolicy::Single) return true;
  const auto volume = volumes_.open(v.id, v.size);
  const int err = shared_image(volume, v.id).claim_writer();
  if (err == EBUSY) {
    spdlog::info("control: volume {}: another gateway holds its writer lock", v.id);
    return false;
  }
  if (err != 0) {
    throw ApiError("internal", "volume " + v.id + ": cannot take its image's exclusive lock (" +
                                   std::strerror(err) + ")");
  }
  return true;
}

std::string Service::fence_shared_writer(const VolumeRow& v) {
  if (!volumes_.shared() || v.writer_policy != WriterPolicy::Single) return "";
  const auto volume = volumes_.open(v.id, v.size);
  std::string fenced;
  if (const int err = shared_image(volume, v.id).fence_writer(fenced, "")) {
    throw ApiError("internal", "volume " + v.id +
                                   ": cannot fence the gateway holding its image's lock" +
                                   (fenced.empty() ? "" : " (" + fenced + ")") + ": " +
                                   std::strerror(err) + "; no attachment was given write access");
  }
  if (!fenced.empty()) {
    spdlog::warn("control: volume {}: fenced the gateway {} (blocklisted; its lock broken)", v.id,
                 fenced);
  }
  return fenced;
}

bool Service::reclaim_shared_writer(Database::Transaction& tx, VolumeRow& v) {
  if (!volumes_.shared() || v.writer_policy != WriterPolicy::Single) return true;
  try {
    // The lock may be free again (the new writer detached): the record still tells.
    const std::optional<std::string> text = volumes_.load_definition(v.id, DefinitionPart::Writer);
    const Json d = text ? Json::parse(*text, nullptr, false) : Json();
    const bool taken_over = d.is_object() && d.contains("writer") && d["writer"] != v.writer;
    if (!taken_over && claim_shared_writer(v)) {
      publish_writer(v);  // held by this run's client now
      return true;
    }
    // Still held by the client this gateway had before a crash (a lock taken by hand outlives
    // its holder): that client, and only it, is cut off. A takeover elsewhere since would
    // have broken its lock, or recorded another writer.
    const std::string holder =
        d.is_object() && d.value("lock_holder", Json()).is_string() ? d["lock_holder"] : "";
    if (!taken_over && !holder.empty()) {
      const auto volume = volumes_.open(v.id, v.size);
      std::string fenced;
      const int err = shared_image(volume, v.id).fence_writer(fenced, holder);
      if (err == 0) {
        spdlog::warn(
            "control: volume {}: writer {} taken back from this gateway's previous client {} "
            "(blocklisted; its lock broken)",
            v.id, v.writer, holder);
        publish_writer(v);
        return true;
      }
      if (err != EBUSY) {
        throw ApiError("internal", "volume " + v.id +
                                       ": cannot fence this gateway's previous "
                                       "client " +
                                       holder + ": " + std::strerror(err));
      }
    }
    spdlog::warn("control: volume {}: writer {} was taken over by another gateway; no writer now",
                 v.id, v.writer);
    make_writer(v, "", now_iso());
    tx.update_volume(v);
    return true;
  } catch (const ApiError& e) {
    spdlog::error("control: {}; its writer {} gets no write access until a takeover", e.what(),
                  v.writer);
    return false;
  }
}

void Service::release_shared_writer(const VolumeRow& v) {
  if (!volumes_.shared() || v.writer_policy != WriterPolicy::Single) return;
  const auto volume = volumes_.open(v.id, v.size);  // only logs: nothing held if not open
  if (volume && volume->remote()) volume->remote()->release_writer();
}

Service::SharedAttachments Service::read_shared(const std::string& volume_id) {
  SharedAttachments shared;
  if (!volumes_.shared()) return shared;
  std::string text;
  volumes_.read_record(volume_id, text, shared.version);
  if (text.empty()) return shared;
  const Json record = Json::parse(text, nullptr, false);
  if (!record.is_object() || !record.contains("attachments") ||
      !record["attachments"].is_object()) {
    throw ApiError("internal", "volume " + volume_id + ": the gateways' record cannot be read");
  }
  shared.entries = record["attachments"];
  return shared;
}

namespace {

// Another gateway's entry of a volume's record as a row (docs/scale-out.md, "Attachments
// across gateways"). Its mode fails closed; a revoked one waits for its gateway: detaching.
AttachmentRow shared_row(const std::string& volume_id, const std::string& id, const Json& entry) {
  AttachmentRow row;
  row.id = id;
  row.volume_id = volume_id;
  row.gateway = entry.value("gateway", "");
  row.instance_uuid = entry.value("instance_uuid", "");
  row.attached_host = entry.value("attached_host", "");
  row.mode =
      backend::parse_attach_mode(entry.value("mode", "")).value_or(backend::AttachMode::ReadOnly);
  row.attach_status =
      entry.value("revoked", false) ? AttachStatus::Detaching : AttachStatus::Attached;
  row.created_at = entry.value("created_at", "");
  return row;
}

}  // namespace

std::vector<AttachmentRow> Service::elsewhere(const std::string& volume_id,
                                              const SharedAttachments& shared) const {
  std::vector<AttachmentRow> rows;
  for (const auto& [id, entry] : shared.entries.items()) {
    if (!entry.is_object() || entry.value("gateway", "") == gateway_id_) continue;
    rows.push_back(shared_row(volume_id, id, entry));
  }
  return rows;
}

std::optional<std::pair<std::string, Json>> Service::find_elsewhere(
    const std::string& attachment_id) {
  if (!volumes_.shared()) return std::nullopt;
  const std::optional<std::string> volume_id = volumes_.linked_volume(attachment_id);
  if (!volume_id) return std::nullopt;
  const SharedAttachments shared = read_shared(*volume_id);
  if (!shared.entries.contains(attachment_id)) return std::nullopt;  // a stale link
  const Json& entry = shared.entries[attachment_id];
  if (!entry.is_object() || entry.value("gateway", "") == gateway_id_) return std::nullopt;
  return std::pair(*volume_id, attachment_view(shared_row(*volume_id, attachment_id, entry)));
}

Json Service::shared_entry(const AttachmentRow& a) const {
  return Json{{"gateway", gateway_id_},
              {"instance_uuid", a.instance_uuid},
              {"attached_host", a.attached_host},
              {"mode", std::string(to_string(a.mode))},
              {"created_at", a.created_at}};
}

void Service::change_shared(const std::string& volume_id,
                            const std::function<bool(SharedAttachments&)>& change) {
  // A lost race means another gateway wrote in between, maybe what makes this change refused:
  // the change is made again on what it wrote.
  constexpr int kLostRaces = 20;
  for (int lost = 0; lost < kLostRaces; ++lost) {
    SharedAttachments shared = read_shared(volume_id);
    if (!change(shared)) return;
    if (volumes_.write_record(volume_id, Json{{"attachments", shared.entries}}.dump(),
                              shared.version)) {
      return;
    }
  }
  throw ApiError("volume_busy", "volume " + volume_id +
                                    ": the gateways' record of its attachments kept changing; "
                                    "try again");
}

void Service::remove_shared(const std::string& volume_id, const std::string& attachment_id) {
  if (!volumes_.shared()) return;
  try {
    change_shared(volume_id, [&](SharedAttachments& shared) {
      return shared.entries.erase(attachment_id) != 0;
    });
    volumes_.unlink_attachment(attachment_id);
  } catch (const ApiError& e) {
    spdlog::error("control: {}; attachment {} stays in it until the next start", e.what(),
                  attachment_id);
  }
}

void Service::prune_shared() {
  if (!volumes_.shared()) return;
  std::vector<std::pair<std::string, std::vector<std::string>>> stale;  // volume, attachments
  std::vector<std::string> served;  // volumes with live attachments here
  {
    Database::Transaction tx(db_);
    for (const VolumeRow& v : tx.volumes()) {
      std::set<std::string> live;
      for (const AttachmentRow& a : tx.attachments(v.id)) {
        if (is_live(a.attach_status)) live.insert(a.id);
      }
      if (!live.empty()) served.push_back(v.id);
      try {
        const SharedAttachments shared = read_shared(v.id);
        std::vector<std::string> gone;
        for (const auto& [id, entry] : shared.entries.items()) {
          if (entry.value("gateway", "") == gateway_id_ && live.count(id) == 0) gone.push_back(id);
        }
        if (!gone.empty()) stale.emplace_back(v.id, std::move(gone));
      } catch (const ApiError& e) {
        spdlog::error("control: {}", e.what());
      }
    }
  }
  for (const auto& [volume_id, attachments] : stale) {
    for (const std::string& id : attachments) {
      spdlog::info(
          "control: volume {}: attachment {} is no longer live here; out of the "
          "gateways' record",
          volume_id, id);
      remove_shared(volume_id, id);
    }
  }
  for (const std::string& volume_id : served) {
    try {
      watch_shared(volume_id);
    } catch (const ApiError& e) {
      spdlog::error(
          "control: {}; revocations from other gateways reach this one at its next "
          "start",
          e.what());
    }
    revoke_requested(volume_id);  // a revocation written while this gateway was down
  }
}

void Service::watch_shared(const std::string& volume_id) {
  if (!volumes_.shared()) return;
  {
    std::lock_guard lock(revoker_mutex_);
    if (watched_.count(volume_id) != 0) return;
  }
  volumes_.watch(volume_id, [this](const std::string& id) { revoke_requested(id); });
  std::lock_guard lock(revoker_mutex_);
  watched_.insert(volume_id);
}

void Service::unwatch_shared(const std::string& volume_id) {
  {
    std::lock_guard lock(revoker_mutex_);
    if (watched_.erase(volume_id) == 0) return;
  }
  volumes_.unwatch(volume_id);
}

void Service::revoke_requested(const std::string& volume_id) {
  {
    std::lock_guard lock(revoker_mutex_);
    if (revoker_stop_) return;
    revoker_queue_.push_back(volume_id);
  }
  revoker_wake_.notify_one();
}

void Service::run_revoker() {
  for (;;) {
    std::string volume_id;
    {
      std::unique_lock lock(revoker_mutex_);
      revoker_wake_.wait(lock, [this] { return revoker_stop_ || !revoker_queue_.empty(); });
      if (revoker_stop_) return;
      volume_id = std::move(revoker_queue_.front());
      revoker_queue_.pop_front();
    }
    try {
      act_on_revocations(volume_id);
    } catch (const std::exception& e) {
      spdlog::error("control: volume {}: revocations from other gateways: {}", volume_id, e.what());
    }
  }
}

void Service::act_on_revocations(const std::string& volume_id) {
  const SharedAttachments shared = read_shared(volume_id);
  for (const auto& [id, entry] : shared.entries.items()) {
    if (entry.value("gateway", "") != gateway_id_ || !entry.value("revoked", false)) continue;
    const std::string by = entry.value("revoked_by", "(unknown)");
    const VolumeLock lock = volumes_.lock(volume_id);
    std::optional<AttachmentRow> a;
    {
      Database::Transaction tx(db_);
      a = tx.attachment(id);
    }
    if (a && a->volume_id == volume_id && is_live(a->attach_status)) {
      spdlog::info("control: attachment {} of volume {}: revoked by gateway {}", id, volume_id, by);
      detach(volume_id, id);  // takes it out of the record too
    } else {
      remove_shared(volume_id, id);
    }
  }
}

Json Service::detach_elsewhere(const std::string& volume_id, const std::string& attachment_id) {
  std::string gateway;
  const std::string unknown =
      "no attachment " + attachment_id + " of volume " + volume_id + " on any gateway";
  change_shared(volume_id, [&](SharedAttachments& shared) {
    if (!shared.entries.contains(attachment_id)) throw ApiError("not_found", unknown);
    Json& entry = shared.entries[attachment_id];
    gateway = entry.value("gateway", "");
    if (entry.value("revoked", false)) return false;  // asked before: notify again below
    entry["revoked"] = true;
    entry["revoked_by"] = gateway_id_;
    return true;
  });
  spdlog::info("control: attachment {} of volume {}: revoked here, served by gateway {}",
               attachment_id, volume_id, gateway);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  volumes_.notify(volume_id, std::chrono::seconds(10));
  while (std::chrono::steady_clock::now() < deadline) {
    if (!read_shared(volume_id).entries.contains(attachment_id)) {
      return Json{{"id", attachment_id},
                  {"volume_id", volume_id},
                  {"attach_status", to_string(AttachStatus::Detached)},
                  {"gateway", gateway}};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw ApiError("internal", "attachment " + attachment_id +
                                 " is marked revoked in the gateways' record, but its gateway " +
                                 gateway +
                                 " has not detached it within 10 s (down or hung?): it does "
                                 "when it next reads the record, at its start at the latest; a "
                                 "writer is fenced at once with volume_takeover");
}

Service::~Service() {
  if (!revoker_.joinable()) return;
  std::set<std::string> watched;
  {
    std::lock_guard lock(revoker_mutex_);
    watched.swap(watched_);
  }
  for (const std::string& id : watched) volumes_.unwatch(id);  // no callback runs after
  {
    std::lock_guard lock(revoker_mutex_);
    revoker_stop_ = true;
  }
  revoker_wake_.notify_all();
  revoker_.join();
}

}  // namespace shareblk::control
