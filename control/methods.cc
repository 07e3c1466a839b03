#include "control/methods.h"

#include <array>

namespace shareblk::control {

namespace {

Json volume_create(Service& s, const Json& p, const Caller& caller) {
  VolumeSpec spec;
  spec.name = need_string(p, "name", kMaxVolumeName);
  spec.from_image = opt_string(p, "from_image", 4096).value_or("");
  spec.image_reader = caller.credentials();
  spec.from_snapshot = opt_string(p, "from_snapshot").value_or("");
  spec.from_volume = opt_string(p, "from_volume").value_or("");
  // With a source, the size may be left to it.
  const bool has_source =
      !spec.from_image.empty() || !spec.from_snapshot.empty() || !spec.from_volume.empty();
  spec.size = !has_source || p.contains("size") ? need_size(p, "size") : 0;
  spec.multiattach = opt_bool(p, "multiattach").value_or(false);
  spec.bootable = opt_bool(p, "bootable").value_or(false);
  spec.writer_policy = opt_writer_policy(p, "writer_policy").value_or(WriterPolicy::Multi);
  if (auto it = p.find("qos"); it != p.end() && !it->is_null()) spec.qos = decode_qos(*it);
  return s.volume_create(spec);
}

Json volume_list(Service& s, const Json&, const Caller&) {
  return s.volume_list();
}

Json volume_show(Service& s, const Json& p, const Caller&) {
  return s.volume_show(need_string(p, "volume_id"));
}

Json volume_delete(Service& s, const Json& p, const Caller&) {
  return s.volume_delete(need_string(p, "volume_id"), opt_bool(p, "wait").value_or(false));
}

Json volume_extend(Service& s, const Json& p, const Caller&) {
  const std::string id = need_string(p, "volume_id");
  return s.volume_extend(id, need_size(p, "size"));
}

Json volume_update(Service& s, const Json& p, const Caller&) {
  return s.volume_update(VolumeChange{need_string(p, "volume_id"), &p});
}

Json volume_detach(Service& s, const Json& p, const Caller&) {
  const std::string volume_id = need_string(p, "volume_id");
  return s.volume_detach(volume_id, opt_string(p, "attachment_id"));
}

Json attachment_create(Service& s, const Json& p, const Caller&) {
  AttachmentSpec spec;
  spec.volume_id = need_string(p, "volume_id");
  spec.instance_uuid = need_string(p, "instance_uuid");
  spec.attached_host = opt_string(p, "attached_host").value_or("");
  // A connector names the host when the call does not; the duplicate check must compare that
  // same host, or one instance could attach twice through one host.
  if (auto it = p.find("connector"); it != p.end()) spec.connector = &*it;
  if (spec.attached_host.empty() && spec.connector != nullptr && spec.connector->is_object()) {
    spec.attached_host = opt_string(*spec.connector, "host").value_or("");
  }
  spec.mode = opt_mode(p, "mode");
  return s.attachment_create(spec);
}

Json attachment_update(Service& s, const Json& p, const Caller&) {
  const std::string id = need_string(p, "attachment_id");
  const bool has_mode = p.contains("mode") && !p["mode"].is_null();
  const bool has_qos = p.contains("qos");
  if (int{p.contains("connector")} + int{has_mode} + int{has_qos} != 1) {
    invalid(
        "give exactly one of 'connector' (a new connector), 'mode' (a live mode change) and "
        "'qos' (live QoS limits)");
  }
  if (has_qos) return s.attachment_qos(id, decode_qos(p["qos"]));
  if (has_mode) return s.attachment_update(id, nullptr, opt_mode(p, "mode"));
  return s.attachment_update(id, &p["connector"], std::nullopt);
}

Json volume_takeover(Service& s, const Json& p, const Caller&) {
  const std::string volume_id = need_string(p, "volume_id");
  return s.volume_takeover(volume_id, need_string(p, "attachment_id"));
}

Json attachment_complete(Service& s, const Json& p, const Caller&) {
  return s.attachment_complete(need_string(p, "attachment_id"));
}

Json attachment_delete(Service& s, const Json& p, const Caller&) {
  return s.attachment_delete(need_string(p, "attachment_id"));
}

Json attachment_list(Service& s, const Json& p, const Caller&) {
  return s.attachment_list(opt_string(p, "volume_id").value_or(""));
}

Json attachment_show(Service& s, const Json& p, const Caller&) {
  return s.attachment_show(need_string(p, "attachment_id"));
}

Json snapshot_create(Service& s, const Json& p, const Caller&) {
  const std::string volume_id = need_string(p, "volume_id");
  return s.snapshot_create(volume_id, need_string(p, "name", kMaxVolumeName));
}

Json snapshot_list(Service& s, const Json& p, const Caller&) {
  return s.snapshot_list(opt_string(p, "volume_id").value_or(""));
}

Json snapshot_show(Service& s, const Json& p, const Caller&) {
  return s.snapshot_show(need_string(p, "snapshot_id"));
}

Json snapshot_delete(Service& s, const Json& p, const Caller&) {
  return s.snapshot_delete(need_string(p, "snapshot_id"), opt_bool(p, "wait").value_or(false));
}

Json state_backup(Service& s, const Json& p, const Caller& caller) {
  return s.state_backup(need_string(p, "path", kMaxPath), caller.credentials());
}

Json stats(Service& s, const Json& p, const Caller&) {
  return s.stats(opt_string(p, "attachment_id").value_or(""),
                 opt_string(p, "volume_id").value_or(""));
}

Json export_resolve(Service& s, const Json& p, const Caller& caller) {
  return s.export_resolve(need_string(p, "export_name"), caller);
}

// The params each method accepts; any other key is invalid_params.
constexpr std::string_view kVolumeCreate[] = {"name",          "size",          "multiattach",
                                              "bootable",      "writer_policy", "from_image",
                                              "from_snapshot", "from_volume",   "qos"};
constexpr std::string_view kSnapshotCreate[] = {"volume_id", "name"};
constexpr std::string_view kSnapshotId[] = {"snapshot_id"};
constexpr std::string_view kSnapshotDelete[] = {"snapshot_id", "wait"};
constexpr std::string_view kVolumeDelete[] = {"volume_id", "wait"};
constexpr std::string_view kVolumeId[] = {"volume_id"};
constexpr std::string_view kVolumeUpdate[] = {"volume_id", "name",          "multiattach",
                                              "bootable",  "writer_policy", "qos"};
constexpr std::string_view kVolumeExtend[] = {"volume_id", "size"};
constexpr std::string_view kVolumeDetach[] = {"volume_id", "attachment_id"};
constexpr std::string_view kAttachmentCreate[] = {"volume_id", "instance_uuid", "attached_host",
                                                  "mode", "connector"};
constexpr std::string_view kAttachmentUpdate[] = {"attachment_id", "connector", "mode", "qos"};
constexpr std::string_view kVolumeTakeover[] = {"volume_id", "attachment_id"};
constexpr std::string_view kAttachmentId[] = {"attachment_id"};
constexpr std::string_view kExportResolve[] = {"export_name"};
constexpr std::string_view kStateBackup[] = {"path"};
constexpr std::string_view kStats[] = {"attachment_id", "volume_id"};

constexpr std::array kMethods = {
    Method{"volume_create", kVolumeCreate, Role::Admin, volume_create},
    Method{"volume_list", {}, Role::Read, volume_list},
    Method{"volume_show", kVolumeId, Role::Read, volume_show},
    Method{"volume_update", kVolumeUpdate, Role::Admin, volume_update},
    Method{"volume_extend", kVolumeExtend, Role::Admin, volume_extend},
    Method{"volume_delete", kVolumeDelete, Role::Admin, volume_delete},
    Method{"volume_detach", kVolumeDetach, Role::Admin, volume_detach},
    Method{"volume_takeover", kVolumeTakeover, Role::Admin, volume_takeover},
    Method{"attachment_create", kAttachmentCreate, Role::Admin, attachment_create},
    Method{"attachment_update", kAttachmentUpdate, Role::Admin, attachment_update},
    Method{"attachment_complete", kAttachmentId, Role::Admin, attachment_complete},
    Method{"attachment_delete", kAttachmentId, Role::Admin, attachment_delete},
    Method{"attachment_list", kVolumeId, Role::Read, attachment_list},
    Method{"attachment_show", kAttachmentId, Role::Read, attachment_show},
    Method{"snapshot_create", kSnapshotCreate, Role::Admin, snapshot_create},
    Method{"snapshot_list", kVolumeId, Role::Read, snapshot_list},
    Method{"snapshot_show", kSnapshotId, Role::Read, snapshot_show},
    Method{"snapshot_delete", kSnapshotDelete, Role::Admin, snapshot_delete},
    Method{"export_resolve", kExportResolve, Role::Admin, export_resolve},
    Method{"state_backup", kStateBackup, Role::Admin, state_backup},
    Method{"stats", kStats, Role::Read, stats},
};

}  // namespace

std::span<const Method> method_table() {
  return kMethods;
}

const Method* find_method(std::string_view name) {
  for (const Method& m : kMethods) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

}  // namespace shareblk::control
