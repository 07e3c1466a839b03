// The attachment methods (docs/api.md, "Attachments"). States change only through
// transition(); exposure and revocation go through the ExportRegistry.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>

#include "control/service.h"
#include "fuse/local_attach.h"

namespace shareblk::control {

namespace {

// One live attachment per instance and host: a second one is a caller's retry or mistake
// (Cinder's attachment API has the same rule). `host` is the one `a` has or is about to get.
void refuse_duplicate(const std::vector<AttachmentRow>& attachments, const AttachmentRow& a,
                      const std::string& host) {
  for (const auto& other : attachments) {
    if (other.id != a.id && is_live(other.attach_status) &&
        other.instance_uuid == a.instance_uuid && other.attached_host == host) {
      throw ApiError("duplicate_attachment",
                     "instance " + a.instance_uuid + " already has attachment " + other.id);
    }
  }
}

// A reservation's host, given later by its connector: refused as a duplicate of another
// gateway's attachment too (duplicate_attachment), then written into its entry in the shared
// record with a guarded write. Nothing for a local store (`records` null). Throws ApiError.
void share_host(GatewayRecords* records, const std::string& volume_id, const AttachmentRow& a,
                const std::string& host) {
  if (records == nullptr) return;
  records->change_attachments(volume_id, [&](GatewayRecords::Attachments& shared) {
    refuse_duplicate(records->elsewhere(volume_id, shared), a, host);
    if (!shared.entries.contains(a.id)) return false;  // pruned: the others do not count it
    shared.entries[a.id]["attached_host"] = host;
    return true;
  });
}

// Whether this gateway's database has the attachment (else another gateway may serve it).
bool known_here(Database& db, const std::string& attachment_id) {
  Database::Transaction tx(db);
  return tx.attachment(attachment_id).has_value();
}

// Whether one of two comparable paths is the other or inside it: a mount at either hides or
// is hidden by a mount at the other.
bool nested(const std::filesystem::path& a, const std::filesystem::path& b) {
  auto [ia, ib] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return ia == a.end() || ib == b.end();
}

}  // namespace

std::filesystem::path comparable_path(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  if (ec) p = path.lexically_normal();
  if (!p.has_filename() && p.has_relative_path()) p = p.parent_path();
  return p;
}

// A FUSE mount over another attachment's would be cleared by LocalAttach::mount (it takes it
// for a stale one), and the other's detach would unmount this one; a mount in or over the
// state directory would hide the database or the volumes. Refused as invalid_params, as a failed
// mount is: the caller must name another mountpoint, while invalid_state is about the
// attachment's own state. The caller's transaction holds the database (and so every
// attachment_create and attachment_update) until the mount is recorded: no race between two.
void Service::refuse_taken_mountpoint(Database::Transaction& tx, const AttachmentRow& a,
                                      const std::string& mountpoint) {
  const std::filesystem::path wanted = comparable_path(mountpoint);
  if (nested(wanted, state_dir_)) {
    invalid("mountpoint " + mountpoint + " overlaps the state directory " + state_dir_.string());
  }
  for (const AttachmentRow& other : tx.attachments()) {
    if (other.id == a.id || !is_live(other.attach_status) || other.connector.empty()) continue;
    const Json c = Json::parse(other.connector);
    if (c.value("transport", "") != "fuse" || !c.contains("mountpoint")) continue;
    const std::string theirs = c["mountpoint"].get<std::string>();
    if (nested(wanted, comparable_path(theirs))) {
      std::string why = "mountpoint " + mountpoint;
      why += " overlaps " + theirs;
      why += " of attachment " + other.id;
      invalid(why);
    }
  }
  // Then where it may go at all: below the mount root, or `forbidden` (docs/security.md).
  std::string resolved;
  std::string refusal;
  if (const int err =
          fuse::resolve_below(mountpoint, policy().fuse_mount_root, resolved, refusal)) {
    throw ApiError(err == EACCES ? "forbidden" : "invalid_params", refusal);
  }
}

// Checks a connector, moves the attachment to attaching and, for FUSE, mounts it. A new
// connector replaces the old one, and with it any mount the old one had.
void Service::connect(Database::Transaction& tx, AttachmentRow& a, const VolumeRow& v,
                      const Json& connector_params) {
  const Connector connector = decode_connector(connector_params);
  if (connector.transport == "tcp" && endpoints_.tcp.empty()) {
    invalid("this daemon has no TCP listener");
  }
  if (connector.transport == "unix" && endpoints_.unix_socket.empty()) {
    invalid("this daemon has no Unix socket listener");
  }
  if (connector.tls && policy().tls == target::TlsOptions::Mode::Off) {
    invalid("connector tls needs TLS on the daemon (shareblkd --tls on or require)");
  }
  if (connector.tls_dn && !policy().tls_x509) {
    invalid("connector tls_dn needs x509 credentials on the daemon (shareblkd --tls-x509-dir)");
  }
  if (connector.transport == "fuse") refuse_taken_mountpoint(tx, a, connector.mountpoint);
  const AttachStatus next = transition(a.id, a.attach_status, AttachEvent::Connect);
  exports_.unmount(a.id);
  if (connector.transport == "fuse") {
    auto volume = volumes_.open(a.volume_id, v.size);
    if (!volume) throw ApiError("internal", "cannot open volume " + a.volume_id);
    exports_.mount(a.id, connector.mountpoint, policy().fuse_mount_root,
                   backend::Handle(volume, a.mode, exports_.write_access(a.id)));
  }
  a.connector = connector.stored;
  a.attach_status = next;
  if (a.attached_host.empty()) a.attached_host = connector.host;
}

Json Service::attachment_create(const AttachmentSpec& spec) {
  AttachmentRow a;
  a.volume_id = spec.volume_id;
  a.instance_uuid = spec.instance_uuid;
  a.attached_host = spec.attached_host;
  a.mode = spec.mode;
  // The volume's lock keeps this gateway's calls on the volume out until the end. What may
  // wait on a remote store (its backing, the gateways' record, the writer's lock) runs
  // between two transactions, so that other volumes' calls go on meanwhile.
  const VolumeLock lock = volumes_.lock(spec.volume_id);
  VolumeRow v;
  std::vector<AttachmentRow> local;
  {
    Database::Transaction tx(db_);
    v = find_volume(tx, spec.volume_id);
    checks_.refuse_pending(tx, "volume", v.id, "attached");
    for (auto& other : tx.attachments(spec.volume_id)) {
      if (is_live(other.attach_status)) local.push_back(std::move(other));
    }
    tx.commit();  // a volume learnt from the shared store
  }
  checks_.refuse_missing("volume", v.id, v.size, "attached");
  a.id = new_uuid();
  a.export_name = random_hex(16);  // 128 random bits: the name is the capability
  a.attach_status = AttachStatus::Reserved;
  a.created_at = now_iso();
  // One live attachment unless multiattach (or the same instance migrating), and what policy
  // allows: counted over `current`, every live attachment of the volume.
  const auto refuse_second_user = [&](const std::vector<AttachmentRow>& current) {
    refuse_duplicate(current, a, a.attached_host);
    // The same instance may attach a volume that is not multiattach once more, from another
    // host: a live migration holds both hosts' attachments until the old one is deleted
    // (Cinder's _attachment_reserve allows exactly this). It is not a second user.
    const bool same_instance = std::all_of(
        current.begin(), current.end(),
        [&](const AttachmentRow& other) { return other.instance_uuid == a.instance_uuid; });
    if (current.empty() || (same_instance && !v.multiattach)) return;
    if (!v.multiattach) {
      throw ApiError("not_multiattach", "volume " + v.id + " is attached (" + current.front().id +
                                            ") and is not multiattach");
    }
    if (!policy().allow_multiattach) throw ApiError("policy_denied", "policy forbids multiattach");
    if (v.bootable && !policy().allow_multiattach_bootable) {
      throw ApiError("policy_denied", "policy forbids attaching a bootable volume twice");
    }
  };
  if (records_ == nullptr) {
    refuse_second_user(local);
  } else {
    // The other gateways' attachments count too; this one joins their record only if no
    // other gateway changed it since it was read.
    records_->change_attachments(v.id, [&](GatewayRecords::Attachments& shared) {
      std::vector<AttachmentRow> current = local;
      for (AttachmentRow& other : records_->elsewhere(v.id, shared))
        current.push_back(std::move(other));
      refuse_second_user(current);
      shared.entries[a.id] = records_->entry_of(a);
      return true;
    });
    try {
      records_->link_attachment(a.id, v.id);  // any gateway finds it by its id from now on
    } catch (...) {
      records_->remove_attachment(v.id, a.id);
      throw;
    }
  }
  // The first read-write attachment of a single-writer volume without one is its writer; the
  // others are standbys until a takeover (docs/fencing.md).
  // In a shared store the writer may be another gateway's, which holds the image's lock.
  bool becomes_writer = false;
  try {
    becomes_writer = a.mode == backend::AttachMode::ReadWrite &&
                     v.writer_policy == WriterPolicy::Single && v.writer.empty() &&
                     shared_.claim_writer(v);
  } catch (...) {
    if (records_ != nullptr) records_->remove_attachment(v.id, a.id);
    throw;
  }
  if (becomes_writer) make_writer(v, a.id, a.created_at);
  if (may_write(a, v)) a.write_access_since = a.created_at;
  // Unreachable until committed: no export of it resolves before that.
  exports_.set_write_access(a.id, may_write(a, v));
  copies_.hold_if_quiesced(v.id, exports_.write_access(a.id));  // its volume is being copied
  try {
    Database::Transaction tx(db_);
    if (spec.connector != nullptr && !spec.connector->is_null()) {
      connect(tx, a, v, *spec.connector);
    }
    tx.insert_attachment(a);
    if (becomes_writer) tx.update_volume(v);
    tx.commit();
  } catch (...) {
    exports_.unmount(a.id);  // never a mount the database does not know of
    exports_.forget_write_access(a.id);
    qos_.forget_attachment(a.id);
    if (becomes_writer) shared_.release_writer(v);
    if (records_ != nullptr) records_->remove_attachment(v.id, a.id);
    throw;
  }
  try {
    if (records_ != nullptr)
      records_->watch_attachments(v.id);  // revocations by other gateways reach it
  } catch (const ApiError& e) {
    spdlog::error(
        "control: {}; attachment {} is revoked by other gateways only from this "
        "gateway's next start",
        e.what(), a.id);
  }
  spdlog::info("control: attachment {} of volume {} for {} ({}, {}{})", a.id, v.id,
               printable(a.instance_uuid), to_string(a.mode), to_string(a.attach_status),
               v.writer_policy == WriterPolicy::Multi || a.mode == backend::AttachMode::ReadOnly
                   ? ""
                   : (becomes_writer ? ", the writer" : ", a standby"));
  if (becomes_writer) {
    spdlog::info("control: volume {}: writer (none) -> {} (generation {})", v.id, a.id,
                 v.fencing_generation);
    shared_.publish_writer(v);
  }
  return views_.attachment_json(a, v);
}

Json Service::attachment_update(const std::string& id, const Json* connector_params,
                                std::optional<backend::AttachMode> mode) {
  if (connector_params == nullptr) return change_mode(id, mode.value());
  const Json& connector = *connector_params;
  const std::string volume_id = volume_of(db_, id);
  const VolumeLock lock = volumes_.lock(volume_id);  // as in attachment_create
  AttachmentRow a;
  VolumeRow v;
  std::vector<AttachmentRow> all;
  {
    Database::Transaction tx(db_);
    a = find_attachment(tx, id);
    v = find_volume(tx, volume_id);
    checks_.refuse_pending(tx, "volume", v.id, "attached");
    all = tx.attachments(volume_id);
    tx.commit();
  }
  checks_.refuse_missing("volume", v.id, v.size, "attached");
  // A reservation without a host takes the connector's (see connect()): that host must not
  // make it a duplicate, which attachment_create could not see yet.
  if (next_status(a.attach_status, AttachEvent::Connect) && a.attached_host.empty() &&
      connector.is_object() && connector.contains("host") && connector["host"].is_string()) {
    const std::string host = connector["host"].get<std::string>();
    refuse_duplicate(all, a, host);
    share_host(records_.get(), volume_id, a, host);
  }
  Database::Transaction tx(db_);
  connect(tx, a, v, connector);
  try {
    tx.update_attachment(a);
    tx.commit();
  } catch (...) {
    exports_.unmount(a.id);
    throw;
  }
  return views_.attachment_json(a, v);
}

Json Service::attachment_qos(const std::string& id, const target::QosSpec& spec) {
  const std::string volume_id = volume_of(db_, id);
  const VolumeLock lock = volumes_.lock(volume_id);
  Database::Transaction tx(db_);
  AttachmentRow a = find_attachment(tx, id);
  const VolumeRow v = find_volume(tx, volume_id);
  transition(a.id, a.attach_status, AttachEvent::ChangeQos);
  a.qos = qos_text(spec);
  tx.update_attachment(a);
  Json out = views_.attachment_json(a, v);
  tx.commit();
  // Its connections take it from their next request on.
  qos_.set_attachment(a.id, volume_id, spec, v.qos);
  return out;
}

Json Service::attachment_complete(const std::string& id) {
  const std::string volume_id = volume_of(db_, id);
  const VolumeLock lock = volumes_.lock(volume_id);
  Database::Transaction tx(db_);
  AttachmentRow a = find_attachment(tx, id);
  VolumeRow v = find_volume(tx, volume_id);
  const AttachStatus next = transition(a.id, a.attach_status, AttachEvent::Complete);
  if (next != a.attach_status) {
    a.attach_status = next;
    a.attach_time = now_iso();
    tx.update_attachment(a);
  }
  Json out = views_.attachment_json(a, v);
  tx.commit();
  return out;
}

// Revocation never waits for the disk: the attachment is revoked in memory first (its export
// refused, nbdkit told, its NBD connections closed once their requests in flight are
// answered, its FUSE mount gone), and only then recorded detached. Before the revocation, its
// id goes into the revocation journal, which needs no new disk space, so that a start after a
// crash, or after a database that could not record it, detaches it before serving anything.
// Without a journal, the database's "detaching" plays that part, as far as it can be written.
// The caller holds the volume lock.
Json Service::detach(const std::string& volume_id, const std::string& attachment_id) {
  VolumeRow v;
  AttachmentRow a;
  {
    Database::Transaction tx(db_);
    a = find_attachment(tx, attachment_id);
    v = find_volume(tx, volume_id);
  }
  a.attach_status = transition(a.id, a.attach_status, AttachEvent::Detach);
  if (!is_live(a.attach_status)) return views_.attachment_json(a, v);  // done before
  const bool journaled = journal_.record(a.id);
  if (!journaled) {
    try {
      Database::Transaction tx(db_);
      tx.update_attachment(a);  // detaching
      tx.commit();
    } catch (const DbError& e) {
      spdlog::error("control: attachment {}: cannot record the detach before revoking: {}", a.id,
                    e.what());
    }
  }
  const bool lazy = exports_.revoke(a.id);
  if (records_ != nullptr)
    records_->remove_attachment(volume_id, a.id);  // the other gateways may count without it now
  a.attach_status = transition(a.id, a.attach_status, AttachEvent::Finish);
  a.detach_time = now_iso();
  a.write_access_since.clear();
  const bool was_writer = v.writer == a.id;
  if (was_writer) {
    make_writer(v, "", a.detach_time);
    // Its writes are drained: another gateway may take the lock, once the record says so.
    shared_.publish_writer(v);
    shared_.release_writer(v);
  }
  Json out;
  bool idle = false;  // no live attachment of the volume is left here
  try {
    Database::Transaction tx(db_);
    tx.update_attachment(a);
    if (was_writer) tx.update_volume(v);
    out = views_.attachment_json(a, v);
    const auto attachments = tx.attachments(volume_id);
    idle = std::none_of(attachments.begin(), attachments.end(),
                        [](const AttachmentRow& other) { return is_live(other.attach_status); });
    tx.commit();
  } catch (const DbError& e) {
    throw ApiError(e.disk_full() ? "no_space" : "internal",
                   "attachment " + a.id +
                       " is revoked (no connection reaches it, its export is refused) but the "
                       "database could not record it detached: " +
                       e.what() +
                       (journaled ? "; it will be detached at the next start"
                                  : "; it stays revoked until the daemon stops"));
  }
  journal_.clear(a.id);
  // Another gateway may delete the volume once no gateway has its image open; nothing here
  // is left to revoke.
  if (idle && records_ != nullptr) {
    volumes_.close(volume_id);
    records_->unwatch_attachments(volume_id);
  }
  exports_.forget_revoked(a.id);
  exports_.forget_write_access(a.id);
  qos_.forget_attachment(a.id);
  if (lazy) out["unmounted_lazily"] = true;
  spdlog::info("control: attachment {} of volume {} detached", a.id, volume_id);
  if (was_writer) {
    spdlog::info("control: volume {}: writer {} -> (none) (generation {})", volume_id, a.id,
                 v.fencing_generation);
  }
  return out;
}

Json Service::attachment_delete(const std::string& id) {
  if (!known_here(db_, id)) {
    if (auto other = shared_.find_elsewhere(id)) return shared_.detach_elsewhere(other->first, id);
  }
  const std::string volume_id = volume_of(db_, id);
  const VolumeLock lock = volumes_.lock(volume_id);
  return detach(volume_id, id);
}

Json Service::volume_detach(const std::string& volume_id,
                            std::optional<std::string> attachment_id) {
  const VolumeLock lock = volumes_.lock(volume_id);
  bool elsewhere = false;
  {
    Database::Transaction tx(db_);
    find_volume(tx, volume_id);
    std::vector<AttachmentRow> current;
    for (auto& a : tx.attachments(volume_id)) {
      if (is_live(a.attach_status)) current.push_back(std::move(a));
    }
    if (attachment_id && records_ != nullptr && !tx.attachment(*attachment_id)) {
      elsewhere = true;  // maybe another gateway's (detach_elsewhere says)
    } else if (attachment_id) {
      AttachmentRow a = find_attachment(tx, *attachment_id);
      if (a.volume_id != volume_id) {
        throw ApiError("not_found",
                       "attachment " + *attachment_id + " is not of volume " + volume_id);
      }
    } else if (current.empty()) {
      throw ApiError("invalid_state", "volume " + volume_id + " is not attached");
    } else if (current.size() > 1) {
      throw ApiError("attachment_id_required", "volume " + volume_id + " has " +
                                                   std::to_string(current.size()) +
                                                   " attachments; say which to detach");
    } else {
      attachment_id = current.front().id;
    }
  }
  if (elsewhere) return shared_.detach_elsewhere(volume_id, *attachment_id);
  return detach(volume_id, *attachment_id);
}

Json Service::attachment_list(const std::string& volume_id) {
  std::vector<AttachmentRow> attachments;
  std::map<std::string, VolumeRow> volumes;
  {
    Database::Transaction tx(db_);
    if (volume_id.empty()) {
      for (VolumeRow& v : tx.volumes()) volumes.emplace(v.id, std::move(v));
    } else {
      volumes.emplace(volume_id, find_volume(tx, volume_id));
    }
    attachments = tx.attachments(volume_id);
  }
  Json out = Json::array();
  for (const AttachmentRow& a : attachments)
    out.push_back(views_.attachment_json(a, volumes.at(a.volume_id)));
  // One volume's: the other gateways' live ones too, from its record (a list of them all
  // would read every volume's record).
  if (!volume_id.empty() && records_ != nullptr) {
    for (const AttachmentRow& a : records_->elsewhere(volume_id)) {
      out.push_back(views_.attachment_view(a));
    }
  }
  return out;
}

Json Service::attachment_show(const std::string& id) {
  if (!known_here(db_, id)) {
    if (auto other = shared_.find_elsewhere(id)) return std::move(other->second);
  }
  Database::Transaction tx(db_);
  AttachmentRow a = find_attachment(tx, id);
  return views_.attachment_json(a, find_volume(tx, a.volume_id));
}

}  // namespace shareblk::control
