// Internal to control/: the attachment API's methods and state machine.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "control/control.h"
#include "control/db.h"
#include "fuse/local_attach.h"

namespace shareblk::control {

using Json = nlohmann::json;

// A refused call: `reason` is one of the API's error reasons (invalid_params, not_found,
// volume_in_use, not_multiattach, attachment_id_required, duplicate_attachment,
// policy_denied, invalid_state, no_space, internal).
struct ApiError : std::runtime_error {
  ApiError(std::string why, const std::string& message)
      : std::runtime_error(message), reason(std::move(why)) {}
  std::string reason;
};

class Service {
 public:
  Service(const std::string& db_path, lvm::VolumeStore& store, Policy policy);

  void bind(target::Server* server, Endpoints endpoints);

  // Runs one method for `caller`. Throws ApiError (and DbError for a broken database).
  Json call(const std::string& method, const Json& params, const Caller& caller);
  bool has_method(const std::string& method) const;

  target::ExportCatalog::Lookup resolve(const std::string& export_name, const target::Peer& peer);

  // Subscribers (export_resolve callers that stay connected: one per nbdkit connection) at
  // most, so that they cannot take every control connection from the operators.
  void set_max_subscribers(size_t n);

  // For tests: entries in the per-volume lock table and in the revocation subscriber table.
  size_t volume_lock_count() const;
  size_t subscriber_count() const;

 private:
  Json volume_create(const Json& p);
  Json volume_list(const Json& p);
  Json volume_show(const Json& p);
  Json volume_delete(const Json& p);
  Json volume_extend(const Json& p);
  Json volume_update(const Json& p);
  Json attachment_create(const Json& p);
  Json attachment_update(const Json& p);
  Json attachment_complete(const Json& p);
  Json attachment_delete(const Json& p);
  Json attachment_list(const Json& p);
  Json attachment_show(const Json& p);
  Json volume_detach(const Json& p);
  Json export_resolve(const Json& p, const Caller& caller);

  // Serializes every change to one volume and its attachments.
  std::shared_ptr<std::mutex> volume_lock(const std::string& volume_id);
  std::shared_ptr<backend::Volume> open_volume(const std::string& volume_id, uint64_t size);
  void forget_volume(const std::string& volume_id);

  // Validates a connector and moves the attachment to attaching; mounts a FUSE one.
  void connect(Database::Transaction& tx, AttachmentRow& a, const VolumeRow& v,
               const Json& connector);
  void refuse_taken_mountpoint(Database::Transaction& tx, const AttachmentRow& a,
                               const std::string& mountpoint);
  void unmount(const std::string& attachment_id, bool& lazy);
  void notify_revoked(const std::string& attachment_id);
  Json detach(const std::string& volume_id, const std::string& attachment_id);
  AttachmentRow find_attachment(Database::Transaction& tx, const std::string& id);
  std::string volume_of(const std::string& attachment_id);
  VolumeRow find_volume(Database::Transaction& tx, const std::string& id);

  Json volume_json(Database::Transaction& tx, const VolumeRow& v);
  Json attachment_json(const AttachmentRow& a, const VolumeRow& v);
  Json connection_info(const AttachmentRow& a, const VolumeRow& v);
  void reconcile();

  Database db_;
  lvm::VolumeStore& store_;
  Policy policy_;
  target::Server* server_ = nullptr;
  Endpoints endpoints_;
  // The database's directory: the daemon's state directory (--state-dir), where no FUSE
  // attachment may be mounted.
  std::filesystem::path state_dir_;

  mutable std::mutex locks_mutex_;
  std::map<std::string, std::weak_ptr<std::mutex>> volume_locks_;  // see volume_lock()
  std::mutex open_mutex_;
  std::map<std::string, std::shared_ptr<backend::Volume>> open_volumes_;

  // FUSE local attaches by attachment id; changed under the attachment's volume lock.
  std::mutex mounts_mutex_;
  std::map<std::string, std::unique_ptr<fuse::LocalAttach>> mounts_;
  // export_resolve callers (the nbdkit plugin) by attachment id, told when it is revoked.
  mutable std::mutex subscribers_mutex_;
  std::multimap<std::string, std::weak_ptr<Subscriber>> subscribers_;
  size_t max_subscribers_ = SIZE_MAX;
};

}  // namespace shareblk::control
