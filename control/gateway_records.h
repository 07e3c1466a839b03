// Internal to control/: the records that the gateways of a shared store keep there
// (store::Gateways), as the control plane uses them (docs/scale-out.md, "Attachments across
// gateways"): each volume's record of its attachments on every gateway, changed only by
// compare-and-set; the watches on the records of the volumes this gateway serves, and the
// revoker thread that hands their revocations to Service; volume definitions; the writer lock.
// Failures become ApiError (internal) or a logged warning, as each call says. Service has one
// only when the store is shared.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "control/db.h"
#include "store/gateways.h"

namespace shareblk::control {

class GatewayRecords {
 public:
  using DefinitionPart = store::Gateways::DefinitionPart;
  using Json = nlohmann::json;
  // `gateway_id`: this gateway's name in the records. `revoked(volume_id)` runs on the revoker
  // thread when the volume's record may hold revocations of this gateway's attachments (a
  // watch fired, or queue_revocations()); one call at a time.
  GatewayRecords(store::Gateways& gateways, std::string gateway_id,
                 std::function<void(const std::string& volume_id)> revoked);
  // stop().
  ~GatewayRecords();
  GatewayRecords(const GatewayRecords&) = delete;
  GatewayRecords& operator=(const GatewayRecords&) = delete;
  // Ends the watches, then the revoker thread: no call of `revoked` runs after it returns.
  void stop();

  const std::string& gateway_id() const { return gateway_id_; }

  // A volume's attachments across the gateways: the record's version and its entries, by
  // attachment id. Throws when the record cannot be read.
  struct Attachments {
    uint64_t version = 0;
    Json entries = Json::object();
  };
  Attachments read_attachments(const std::string& volume_id);
  // The other gateways' entries, as rows that the attachment rules count and attachment_view
  // shows: live (detaching once revoked), their mode read failing closed.
  std::vector<AttachmentRow> elsewhere(const std::string& volume_id,
                                       const Attachments& attachments) const;
  std::vector<AttachmentRow> elsewhere(const std::string& volume_id) {
    return elsewhere(volume_id, read_attachments(volume_id));
  }
  // Another gateway's attachment found by its id alone (through its link); nullopt when no
  // other gateway has it. Throws when the cluster cannot say.
  std::optional<AttachmentRow> find_elsewhere(const std::string& attachment_id);
  // This gateway's entry for `a`.
  Json entry_of(const AttachmentRow& a) const;
  // Edits a volume's record with a guarded write: `change` edits the record as read, or
  // refuses by throwing ApiError, and returns false when there is nothing to write; when
  // another gateway wrote in between, the record is read and changed again. Throws ApiError:
  // volume_busy after 20 lost races, internal when the cluster cannot say.
  void change_attachments(const std::string& volume_id,
                          const std::function<bool(Attachments&)>& change);
  // Takes the attachment out of its volume's record and unlinks it; a failure is logged (the
  // next start prunes it).
  void remove_attachment(const std::string& volume_id, const std::string& attachment_id);
  // The ids of this gateway's attachments in the volume's record. Throws.
  std::vector<std::string> here(const std::string& volume_id);
  // This gateway's attachments of the volume that the record says are revoked, with the
  // gateway that revoked each. Throws.
  std::vector<std::pair<std::string, std::string>> revoked_here(const std::string& volume_id);
  // Revokes another gateway's attachment: marks it in the record, notifies the watchers and
  // waits up to 10 s for its gateway to take it out. Returns that gateway. Throws ApiError:
  // not_found (no such entry), volume_busy, internal (its gateway did not act in time).
  std::string revoke_elsewhere(const std::string& volume_id, const std::string& attachment_id);

  // Watches the volume's record (a volume this gateway serves), so that revocations by other
  // gateways reach `revoked`; throws. unwatch once none of its attachments is left here.
  void watch_attachments(const std::string& volume_id);
  void unwatch_attachments(const std::string& volume_id);
  // Has `revoked` look at the volume's record (at start: a revocation written while this
  // gateway was down).
  void queue_revocations(const std::string& volume_id);

  // Throws when it cannot be saved.
  void save_definition(const std::string& id, DefinitionPart part, const std::string& text);
  // nullopt when the store has no such part of `id`'s definition (no such volume, or it was
  // never saved) or it cannot be read (logged).
  std::optional<std::string> load_definition(const std::string& id, DefinitionPart part);

  // The volume's record: read_record() throws when it cannot be read; write_record() returns
  // false when another gateway changed it since `version`, and throws when it cannot be written.
  void read_record(const std::string& id, std::string& text, uint64_t& version);
  bool write_record(const std::string& id, const std::string& text, uint64_t version);

  // watch() throws; notify() only logs a watcher that did not answer in time (the caller waits
  // for the record to change, not for the answers).
  void watch(const std::string& id, const store::Gateways::RecordChanged& changed);
  void unwatch(const std::string& id) { gateways_.unwatch_record(id); }
  void notify(const std::string& id, std::chrono::milliseconds timeout);

  // link_attachment() throws; linked_volume() is nullopt when there is no link and throws when
  // it cannot be read; unlink_attachment() only logs a failure.
  void link_attachment(const std::string& attachment_id, const std::string& volume_id);
  std::optional<std::string> linked_volume(const std::string& attachment_id);
  void unlink_attachment(const std::string& attachment_id);

  // Volume `id`'s writer lock, held through `volume`, its open volume: claim and fence return
  // 0 or an errno as store::Gateways says, and throw when the volume could not be opened
  // (null). lock_owner() is "" when none is held or the volume is not open; release_writer()
  // does nothing for a volume that is not open (nothing can be held through it).
  int claim_writer(const std::shared_ptr<backend::Volume>& volume, const std::string& id);
  int fence_writer(const std::shared_ptr<backend::Volume>& volume, const std::string& id,
                   std::string& fenced, const std::string& only);
  std::string lock_owner(const std::shared_ptr<backend::Volume>& volume);
  void release_writer(const std::shared_ptr<backend::Volume>& volume);

 private:
  // An entry this gateway wrote. One that is not an object is no gateway's.
  bool is_here(const Json& entry) const {
    return entry.is_object() && entry.value("gateway", "") == gateway_id_;
  }
  void run_revoker();

  store::Gateways& gateways_;
  const std::string gateway_id_;
  const std::function<void(const std::string&)> revoked_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::string> queue_;  // volumes whose records to read
  bool stopping_ = false;
  std::set<std::string> watched_;
  std::thread revoker_;  // last: it uses the members above
};

}  // namespace shareblk::control
