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

#include "control/shared_store.h"

#include "control/gateway_records.h"
#include "control/service.h"
#include "control/small_file.h"
#include "control/views.h"
#include "control/volume_registry.h"

namespace shareblk::control {

namespace {

using DefinitionPart = GatewayRecords::DefinitionPart;

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

void SharedStore::publish(const VolumeRow& v) {
  if (records_ != nullptr)
    records_->save_definition(v.id, DefinitionPart::Volume, definition_of(v));
}

// Who was made the writer last, on whichever gateway, and the lock holder (a client instance
// of its gateway) that backs it: a gateway that restarts with another writer on record was
// taken over while it was down or hung; one that finds its own writer on record and the lock
// still with that holder has crashed holding it (reclaim_shared_writer). Only the gateway
// that holds or has just given up the lock writes it.
void SharedStore::publish_writer(const VolumeRow& v) {
  if (!single_writer_shared(v)) return;
  try {
    std::string holder;
    if (!v.writer.empty()) {
      holder = records_->lock_owner(volumes_.open(v.id, v.size));
    }
    const Json d{{"writer", v.writer.empty() ? Json(nullptr) : Json(v.writer)},
                 {"lock_holder", holder.empty() ? Json(nullptr) : Json(holder)}};
    records_->save_definition(v.id, DefinitionPart::Writer, d.dump());
  } catch (const ApiError& e) {
    spdlog::error(
        "control: {}; a restart of the gateway whose writer this record names may take its "
        "writer for taken over",
        e.what());
  }
}

void SharedStore::republish(const VolumeRow& v) {
  try {
    publish(v);
  } catch (const ApiError& e) {
    spdlog::error("control: {}; gateways that learn it from now on see its former definition",
                  e.what());
  }
}

void SharedStore::learn_volume(const std::string& id) {
  if (records_ == nullptr) return;
  {
    Database::Transaction tx(db_);
    if (tx.volume(id) || tx.snapshot(id)) return;
  }
  // The cluster is read with the database free: a slow or frozen OSD holds this call only.
  const std::optional<std::string> text = records_->load_definition(id, DefinitionPart::Volume);
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

bool SharedStore::claim_writer(const VolumeRow& v) {
  if (!single_writer_shared(v)) return true;
  const int err = records_->claim_writer(volumes_.open(v.id, v.size), v.id);
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

std::string SharedStore::fence_writer(const VolumeRow& v) {
  if (!single_writer_shared(v)) return "";
  std::string fenced;
  if (const int err = records_->fence_writer(volumes_.open(v.id, v.size), v.id, fenced, "")) {
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

bool SharedStore::reclaim_writer(Database::Transaction& tx, VolumeRow& v) {
  if (!single_writer_shared(v)) return true;
  try {
    // The lock may be free again (the new writer detached): the record still tells.
    const std::optional<std::string> text = records_->load_definition(v.id, DefinitionPart::Writer);
    const Json d = text ? Json::parse(*text, nullptr, false) : Json();
    const bool taken_over = d.is_object() && d.contains("writer") && d["writer"] != v.writer;
    if (!taken_over && claim_writer(v)) {
      publish_writer(v);  // held by this run's client now
      return true;
    }
    // Still held by the client this gateway had before a crash (a lock taken by hand outlives
    // its holder): that client, and only it, is cut off. A takeover elsewhere since would
    // have broken its lock, or recorded another writer.
    const std::string holder =
        d.is_object() && d.value("lock_holder", Json()).is_string() ? d["lock_holder"] : "";
    if (!taken_over && !holder.empty()) {
      std::string fenced;
      const int err = records_->fence_writer(volumes_.open(v.id, v.size), v.id, fenced, holder);
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

void SharedStore::release_writer(const VolumeRow& v) {
  if (!single_writer_shared(v)) return;
  records_->release_writer(volumes_.open(v.id, v.size));  // only logs: nothing held if not open
}

std::optional<std::pair<std::string, Json>> SharedStore::find_elsewhere(
    const std::string& attachment_id) {
  if (records_ == nullptr) return std::nullopt;
  const std::optional<AttachmentRow> row = records_->find_elsewhere(attachment_id);
  if (!row) return std::nullopt;
  return std::pair(row->volume_id, views_.attachment_view(*row));
}

void SharedStore::prune() {
  if (records_ == nullptr) return;
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
        std::vector<std::string> gone;
        for (const std::string& id : records_->here(v.id)) {
          if (live.count(id) == 0) gone.push_back(id);
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
      records_->remove_attachment(volume_id, id);
    }
  }
  for (const std::string& volume_id : served) {
    try {
      records_->watch_attachments(volume_id);
    } catch (const ApiError& e) {
      spdlog::error(
          "control: {}; revocations from other gateways reach this one at its next "
          "start",
          e.what());
    }
    records_->queue_revocations(volume_id);  // a revocation written while this gateway was down
  }
}

void SharedStore::act_on_revocations(const std::string& volume_id) {
  for (const auto& [id, by] : records_->revoked_here(volume_id)) {
    const VolumeLock lock = volumes_.lock(volume_id);
    std::optional<AttachmentRow> a;
    {
      Database::Transaction tx(db_);
      a = tx.attachment(id);
    }
    if (a && a->volume_id == volume_id && is_live(a->attach_status)) {
      spdlog::info("control: attachment {} of volume {}: revoked by gateway {}", id, volume_id, by);
      detach_(volume_id, id);  // takes it out of the record too
    } else {
      records_->remove_attachment(volume_id, id);
    }
  }
}

Json SharedStore::detach_elsewhere(const std::string& volume_id, const std::string& attachment_id) {
  const std::string gateway = records_->revoke_elsewhere(volume_id, attachment_id);
  return Json{{"id", attachment_id},
              {"volume_id", volume_id},
              {"attach_status", to_string(AttachStatus::Detached)},
              {"gateway", gateway}};
}

bool SharedStore::single_writer_shared(const VolumeRow& v) const {
  return records_ != nullptr && v.writer_policy == WriterPolicy::Single;
}

}  // namespace shareblk::control
