// Several gateways, one store (docs/scale-out.md, "Several gateways"): in a store that other
// shareblk daemons serve too (rbd), each volume's definition is saved with its image, so that
// any gateway can serve it, and a single-writer volume's writer is backed by the image's
// exclusive lock, which a takeover breaks only after the cluster has fenced the old holder.
#include <spdlog/spdlog.h>

#include <cstring>

#include "control/service.h"

namespace shareblk::control {

namespace {

std::string definition_of(const VolumeRow& v) {
  Json d{{"name", v.name},
         {"size", v.size},
         {"multiattach", v.multiattach},
         {"bootable", v.bootable},
         {"writer_policy", std::string(to_string(v.writer_policy))},
         {"created_at", v.created_at}};
  if (!v.qos.empty()) d["qos"] = v.qos;
  // Who was made the writer last, on whichever gateway: a gateway that restarts with another
  // writer on record was taken over while it was down or hung (reclaim_shared_writer).
  if (v.writer_policy == WriterPolicy::Single) {
    d["writer"] = v.writer.empty() ? Json(nullptr) : Json(v.writer);
  }
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
    const std::string policy = d.at("writer_policy").get<std::string>();
    if (policy != "single" && policy != "multi") return std::nullopt;
    v.writer_policy = policy == "single" ? WriterPolicy::Single : WriterPolicy::Multi;
    v.created_at = d.at("created_at").get<std::string>();
    v.qos = d.value("qos", std::string());
    return v;
  } catch (const Json::exception&) {
    return std::nullopt;
  }
}

}  // namespace

void Service::publish(const VolumeRow& v) {
  if (volumes_.shared()) volumes_.save_definition(v.id, definition_of(v));
}

void Service::republish(const VolumeRow& v) {
  try {
    publish(v);
  } catch (const ApiError& e) {
    spdlog::error("control: {}; gateways that learn it from now on see its former definition",
                  e.what());
  }
}

std::optional<VolumeRow> Service::learn_volume(Database::Transaction& tx, const std::string& id) {
  if (!volumes_.shared() || tx.snapshot(id)) return std::nullopt;
  const std::optional<std::string> text = volumes_.load_definition(id);
  if (!text) return std::nullopt;
  std::optional<VolumeRow> v = volume_of_definition(id, *text);
  if (!v) {
    spdlog::warn("control: volume {}: its definition in the shared store cannot be read", id);
    return std::nullopt;
  }
  // Its writer, if any, is another gateway's: none here until this gateway claims it.
  tx.insert_volume(*v);
  spdlog::info("control: volume {} ({}) learnt from the shared store: another gateway made it", id,
               printable(v->name));
  return v;
}

namespace {

// The volume's image, when it lives in a store that other gateways share.
backend::RemoteImage* shared_image(const std::shared_ptr<backend::Volume>& volume) {
  return volume ? volume->remote().get() : nullptr;
}

}  // namespace

bool Service::claim_shared_writer(const VolumeRow& v) {
  if (!volumes_.shared() || v.writer_policy != WriterPolicy::Single) return true;
  const auto volume = volumes_.open(v.id, v.size);
  backend::RemoteImage* image = shared_image(volume);
  if (image == nullptr) throw ApiError("internal", "volume " + v.id + " cannot be opened");
  const int err = image->claim_writer();
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
  backend::RemoteImage* image = shared_image(volume);
  if (image == nullptr) throw ApiError("internal", "volume " + v.id + " cannot be opened");
  std::string fenced;
  if (const int err = image->fence_writer(fenced)) {
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
  try {
    // The lock may be free again (the new writer detached): the record still tells.
    const std::optional<std::string> text =
        volumes_.shared() ? volumes_.load_definition(v.id) : std::nullopt;
    const Json d = text ? Json::parse(*text, nullptr, false) : Json();
    const bool taken_over = d.is_object() && d.contains("writer") && d["writer"] != v.writer;
    if (!taken_over && claim_shared_writer(v)) return true;
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
  const auto volume = volumes_.open(v.id, v.size);
  if (backend::RemoteImage* image = shared_image(volume)) image->release_writer();
}

}  // namespace shareblk::control
