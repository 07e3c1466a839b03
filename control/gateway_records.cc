#include "control/gateway_records.h"

#include <spdlog/spdlog.h>

#include <cerrno>
#include <chrono>

#include "control/api_error.h"

namespace shareblk::control {

GatewayRecords::GatewayRecords(store::Gateways& gateways, std::string gateway_id,
                               std::function<void(const std::string& volume_id)> revoked)
    : gateways_(gateways),
      gateway_id_(std::move(gateway_id)),
      revoked_(std::move(revoked)),
      revoker_(&GatewayRecords::run_revoker, this) {}

GatewayRecords::~GatewayRecords() {
  stop();
}

void GatewayRecords::stop() {
  std::set<std::string> watched;
  {
    std::lock_guard lock(mutex_);
    watched.swap(watched_);
  }
  for (const std::string& id : watched) unwatch(id);  // no callback runs after
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (revoker_.joinable()) revoker_.join();
}

void GatewayRecords::save_definition(const std::string& id, DefinitionPart part,
                                     const std::string& text) {
  if (store::StoreError e = gateways_.save_definition(id, part, text)) {
    throw ApiError("internal", "volume " + id + ": " + e.message);
  }
}

std::optional<std::string> GatewayRecords::load_definition(const std::string& id,
                                                           DefinitionPart part) {
  std::string text;
  if (store::StoreError e = gateways_.load_definition(id, part, text)) {
    if (e.code.value() != ENOENT) spdlog::warn("control: volume {}: {}", id, e.message);
    return std::nullopt;
  }
  return text;
}

void GatewayRecords::read_record(const std::string& id, std::string& text, uint64_t& version) {
  if (store::StoreError e = gateways_.read_record(id, text, version)) {
    throw ApiError("internal", "volume " + id + ": the gateways' record: " + e.message);
  }
}

bool GatewayRecords::write_record(const std::string& id, const std::string& text,
                                  uint64_t version) {
  store::StoreError e = gateways_.write_record(id, text, version);
  if (e.code.value() == ECANCELED) return false;
  if (e) throw ApiError("internal", "volume " + id + ": the gateways' record: " + e.message);
  return true;
}

void GatewayRecords::watch(const std::string& id, const store::Gateways::RecordChanged& changed) {
  if (store::StoreError e = gateways_.watch_record(id, changed)) {
    throw ApiError("internal", "volume " + id + ": " + e.message);
  }
}

void GatewayRecords::notify(const std::string& id, std::chrono::milliseconds timeout) {
  if (store::StoreError e = gateways_.notify_record(id, timeout)) {
    spdlog::warn("control: volume {}: {}", id, e.message);
  }
}

void GatewayRecords::link_attachment(const std::string& attachment_id,
                                     const std::string& volume_id) {
  if (store::StoreError e = gateways_.link_attachment(attachment_id, volume_id)) {
    throw ApiError("internal", "attachment " + attachment_id + ": " + e.message);
  }
}

std::optional<std::string> GatewayRecords::linked_volume(const std::string& attachment_id) {
  std::string volume_id;
  store::StoreError e = gateways_.linked_volume(attachment_id, volume_id);
  if (e.code.value() == ENOENT) return std::nullopt;
  if (e) throw ApiError("internal", "attachment " + attachment_id + ": " + e.message);
  return volume_id;
}

void GatewayRecords::unlink_attachment(const std::string& attachment_id) {
  if (store::StoreError e = gateways_.unlink_attachment(attachment_id)) {
    spdlog::warn(
        "control: attachment {}: {}; a stale link is left (harmless: its volume's "
        "record no longer holds it)",
        attachment_id, e.message);
  }
}

namespace {

backend::Volume& opened(const std::shared_ptr<backend::Volume>& volume, const std::string& id) {
  if (!volume) throw ApiError("internal", "volume " + id + " cannot be opened");
  return *volume;
}

}  // namespace

int GatewayRecords::claim_writer(const std::shared_ptr<backend::Volume>& volume,
                                 const std::string& id) {
  return gateways_.claim_writer(opened(volume, id));
}

int GatewayRecords::fence_writer(const std::shared_ptr<backend::Volume>& volume,
                                 const std::string& id, std::string& fenced,
                                 const std::string& only) {
  return gateways_.fence_writer(opened(volume, id), fenced, only);
}

std::string GatewayRecords::lock_owner(const std::shared_ptr<backend::Volume>& volume) {
  std::string holder;
  if (volume) gateways_.lock_owner(*volume, holder);
  return holder;
}

void GatewayRecords::release_writer(const std::shared_ptr<backend::Volume>& volume) {
  if (volume) gateways_.release_writer(*volume);
}

namespace {

// Another gateway's entry of a volume's record as a row (docs/scale-out.md, "Attachments
// across gateways"). Its mode fails closed; a revoked one waits for its gateway: detaching.
AttachmentRow row_of(const std::string& volume_id, const std::string& id,
                     const nlohmann::json& entry) {
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

GatewayRecords::Attachments GatewayRecords::read_attachments(const std::string& volume_id) {
  Attachments attachments;
  std::string text;
  read_record(volume_id, text, attachments.version);
  if (text.empty()) return attachments;
  const Json record = Json::parse(text, nullptr, false);
  if (!record.is_object() || !record.contains("attachments") ||
      !record["attachments"].is_object()) {
    throw ApiError("internal", "volume " + volume_id + ": the gateways' record cannot be read");
  }
  attachments.entries = record["attachments"];
  return attachments;
}

std::vector<AttachmentRow> GatewayRecords::elsewhere(const std::string& volume_id,
                                                     const Attachments& attachments) const {
  std::vector<AttachmentRow> rows;
  for (const auto& [id, entry] : attachments.entries.items()) {
    if (!entry.is_object() || is_here(entry)) continue;
    rows.push_back(row_of(volume_id, id, entry));
  }
  return rows;
}

std::optional<AttachmentRow> GatewayRecords::find_elsewhere(const std::string& attachment_id) {
  const std::optional<std::string> volume_id = linked_volume(attachment_id);
  if (!volume_id) return std::nullopt;
  const Attachments attachments = read_attachments(*volume_id);
  if (!attachments.entries.contains(attachment_id)) return std::nullopt;  // a stale link
  const Json& entry = attachments.entries[attachment_id];
  if (!entry.is_object() || is_here(entry)) return std::nullopt;
  return row_of(*volume_id, attachment_id, entry);
}

GatewayRecords::Json GatewayRecords::entry_of(const AttachmentRow& a) const {
  return Json{{"gateway", gateway_id_},
              {"instance_uuid", a.instance_uuid},
              {"attached_host", a.attached_host},
              {"mode", std::string(to_string(a.mode))},
              {"created_at", a.created_at}};
}

void GatewayRecords::change_attachments(const std::string& volume_id,
                                        const std::function<bool(Attachments&)>& change) {
  // A lost race means another gateway wrote in between, maybe what makes this change refused:
  // the change is made again on what it wrote.
  constexpr int kLostRaces = 20;
  for (int lost = 0; lost < kLostRaces; ++lost) {
    Attachments attachments = read_attachments(volume_id);
    if (!change(attachments)) return;
    if (write_record(volume_id, Json{{"attachments", attachments.entries}}.dump(),
                     attachments.version)) {
      return;
    }
  }
  throw ApiError("volume_busy", "volume " + volume_id +
                                    ": the gateways' record of its attachments kept changing; "
                                    "try again");
}

void GatewayRecords::remove_attachment(const std::string& volume_id,
                                       const std::string& attachment_id) {
  try {
    change_attachments(volume_id, [&](Attachments& attachments) {
      return attachments.entries.erase(attachment_id) != 0;
    });
    unlink_attachment(attachment_id);
  } catch (const ApiError& e) {
    spdlog::error("control: {}; attachment {} stays in it until the next start", e.what(),
                  attachment_id);
  }
}

std::vector<std::string> GatewayRecords::here(const std::string& volume_id) {
  std::vector<std::string> ids;
  const Attachments attachments = read_attachments(volume_id);  // outlives the loop
  for (const auto& [id, entry] : attachments.entries.items()) {
    if (is_here(entry)) ids.push_back(id);
  }
  return ids;
}

std::vector<std::pair<std::string, std::string>> GatewayRecords::revoked_here(
    const std::string& volume_id) {
  std::vector<std::pair<std::string, std::string>> revoked;
  const Attachments attachments = read_attachments(volume_id);  // outlives the loop
  for (const auto& [id, entry] : attachments.entries.items()) {
    if (!is_here(entry) || !entry.value("revoked", false)) continue;
    revoked.emplace_back(id, entry.value("revoked_by", "(unknown)"));
  }
  return revoked;
}

std::string GatewayRecords::revoke_elsewhere(const std::string& volume_id,
                                             const std::string& attachment_id) {
  std::string gateway;
  const std::string unknown =
      "no attachment " + attachment_id + " of volume " + volume_id + " on any gateway";
  change_attachments(volume_id, [&](Attachments& attachments) {
    if (!attachments.entries.contains(attachment_id)) throw ApiError("not_found", unknown);
    Json& entry = attachments.entries[attachment_id];
    gateway = entry.value("gateway", "");
    if (entry.value("revoked", false)) return false;  // asked before: notify again below
    entry["revoked"] = true;
    entry["revoked_by"] = gateway_id_;
    return true;
  });
  spdlog::info("control: attachment {} of volume {}: revoked here, served by gateway {}",
               attachment_id, volume_id, gateway);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  notify(volume_id, std::chrono::seconds(10));
  while (std::chrono::steady_clock::now() < deadline) {
    if (!read_attachments(volume_id).entries.contains(attachment_id)) return gateway;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw ApiError("internal", "attachment " + attachment_id +
                                 " is marked revoked in the gateways' record, but its gateway " +
                                 gateway +
                                 " has not detached it within 10 s (down or hung?): it does "
                                 "when it next reads the record, at its start at the latest; a "
                                 "writer is fenced at once with volume_takeover");
}

void GatewayRecords::watch_attachments(const std::string& volume_id) {
  {
    std::lock_guard lock(mutex_);
    if (watched_.count(volume_id) != 0) return;
  }
  watch(volume_id, [this](const std::string& id) { queue_revocations(id); });
  std::lock_guard lock(mutex_);
  watched_.insert(volume_id);
}

void GatewayRecords::unwatch_attachments(const std::string& volume_id) {
  {
    std::lock_guard lock(mutex_);
    if (watched_.erase(volume_id) == 0) return;
  }
  unwatch(volume_id);
}

void GatewayRecords::queue_revocations(const std::string& volume_id) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    queue_.push_back(volume_id);
  }
  wake_.notify_one();
}

void GatewayRecords::run_revoker() {
  for (;;) {
    std::string volume_id;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      volume_id = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      revoked_(volume_id);
    } catch (const std::exception& e) {
      spdlog::error("control: volume {}: revocations from other gateways: {}", volume_id, e.what());
    }
  }
}

}  // namespace shareblk::control
