// What the API shows of volumes and attachments (docs/api.md, "Objects").
#include "control/views.h"

#include "control/admission.h"
#include "control/export_registry.h"
#include "control/gateway_records.h"
#include "control/psk_keys.h"
#include "control/qos.h"
#include "control/service.h"
#include "control/volume_checks.h"
#include "control/volume_jobs.h"
#include "text/hex.h"

namespace shareblk::control {

api::VolumeStatus derive_status(bool error, const std::optional<IntentRow>& intent,
                                const std::vector<AttachmentRow>& attachments) {
  using api::VolumeStatus;
  if (error) return VolumeStatus::Error;
  if (intent) {
    return intent->action == IntentAction::Delete ? VolumeStatus::Deleting : VolumeStatus::Creating;
  }
  // The attachment states that show, most advanced first.
  constexpr std::array<std::pair<AttachStatus, VolumeStatus>, 4> kShown = {{
      {AttachStatus::Attached, VolumeStatus::InUse},
      {AttachStatus::Attaching, VolumeStatus::Attaching},
      {AttachStatus::Reserved, VolumeStatus::Reserved},
      {AttachStatus::Detaching, VolumeStatus::Detaching},
  }};
  for (const auto& [state, shown] : kShown) {
    for (const auto& a : attachments) {
      if (a.attach_status == state) return shown;
    }
  }
  return VolumeStatus::Available;
}

Json Views::connection_info(const AttachmentRow& a, const VolumeRow& v,
                            const Json& connector) const {
  if (!is_serving(a.attach_status) || connector.is_null()) return nullptr;
  const std::string transport = connector.value("transport", "tcp");
  const std::string mode(to_string(a.mode));
  if (transport == "fuse") {
    return Json{{"driver_volume_type", "local"},
                {"data",
                 {{"device_path", connector["mountpoint"].get<std::string>() + "/disk"},
                  {"access_mode", mode},
                  {"shareable", v.multiattach},
                  {"size", v.size}}}};
  }
  // A TLS-only attachment: nbds URIs, and its PSK (the identity as the URI's user, as libnbd
  // reads it), the way Cinder hands out CHAP credentials.
  const Policy policy = s_.policy();
  const bool tls = tls_only(connector, policy);
  const bool psk = has_psk(connector, policy);
  const std::string user = psk ? a.id + "@" : "";
  std::string uri;
  if (transport == "unix") {
    uri = (tls ? "nbds+unix://" : "nbd+unix://") + user + "/" + a.export_name +
          "?socket=" + s_.endpoints.unix_socket;
  } else {
    uri = (tls ? "nbds://" : "nbd://") + user + s_.endpoints.tcp + "/" + a.export_name;
  }
  Json data = {{"export_name", a.export_name}, {"uri", uri},     {"access_mode", mode},
               {"shareable", v.multiattach},   {"size", v.size}, {"tls", tls}};
  if (psk) {
    data["tls_psk_identity"] = a.id;
    data["tls_psk_key"] = to_hex(s_.psk.key(a.id));  // as a keys.psk line has it
  }
  return Json{{"driver_volume_type", "nbd"}, {"data", data}};
}

namespace {
Json or_null(const std::string& s) {
  return s.empty() ? Json(nullptr) : Json(s);
}
}  // namespace

Json Views::attachment_view(const AttachmentRow& a) const {
  Json gateway = nullptr;  // a store of one gateway names none
  if (!a.gateway.empty()) {
    gateway = a.gateway;
  } else if (s_.records != nullptr) {
    gateway = s_.records->gateway_id();
  }
  return Json{{"id", a.id},
              {"volume_id", a.volume_id},
              {"gateway", std::move(gateway)},
              {"instance_uuid", a.instance_uuid},
              {"attached_host", or_null(a.attached_host)},
              {"mode", to_string(a.mode)},
              {"attach_status", to_string(a.attach_status)},
              {"attach_time", or_null(a.attach_time)},
              {"detach_time", or_null(a.detach_time)},
              {"connector", nullptr},
              {"connection_info", nullptr},
              {"connections", nullptr},
              {"write_access", nullptr},
              {"write_access_since", nullptr},
              {"qos", nullptr}};
}

Json Views::attachment_json(const AttachmentRow& a, const VolumeRow& v) const {
  Json out = attachment_view(a);
  Json connector = a.connector.empty() ? Json(nullptr) : Json::parse(a.connector);
  out["connection_info"] = connection_info(a, v, connector);
  out["connector"] = std::move(connector);
  out["connections"] = s_.exports.connections(a.id);
  // What its connections can do: a revocation the database could not record yet counts, and
  // a writer only the journal holds (docs/fencing.md) shows when it became one.
  const bool writes = may_write(a, v) && !s_.exports.is_revoked(a.id);
  std::string since = writes ? a.write_access_since : std::string();
  if (writes && since.empty() && v.writer == a.id) since = v.writer_since;
  out["write_access"] = writes;
  out["write_access_since"] = or_null(since);
  out["qos"] = qos_json(qos_from_text(a.qos));
  return out;
}

Json Views::volume_json(Database::Transaction& tx, const VolumeRow& v) const {
  return volume_json(v, tx.attachments(v.id), tx.intent(v.id));
}

Json Views::volume_json(const VolumeRow& v, const std::vector<AttachmentRow>& all,
                        const std::optional<IntentRow>& intent) const {
  Json attachments = Json::array();
  for (const auto& a : all) {
    if (is_live(a.attach_status)) attachments.push_back(attachment_json(a, v));
  }
  // A volume that cannot be attached says so, whatever its attachments' states: it is being
  // deleted or filled (with how far that has come), or its status is error.
  const std::optional<std::string> error = s_.checks.error_of(intent, v.id);
  const api::VolumeStatus status = derive_status(error.has_value(), intent, all);
  return Json{{"id", v.id},
              {"name", v.name},
              {"size", v.size},
              {"multiattach", v.multiattach},
              {"bootable", v.bootable},
              {"status", api::to_string(status)},
              {"status_reason", error ? Json(*error) : Json(nullptr)},
              {"progress", progress(status, v.id)},
              {"created_at", v.created_at},
              {"writer_policy", to_string(v.writer_policy)},
              {"writer", v.writer.empty() ? Json(nullptr) : Json(v.writer)},
              {"fencing_generation", v.fencing_generation},
              {"writer_since", v.writer_since.empty() ? Json(nullptr) : Json(v.writer_since)},
              {"qos", qos_json(qos_from_text(v.qos))},
              {"attachments", std::move(attachments)}};
}

Json Views::progress(api::VolumeStatus status, const std::string& id) const {
  if (!api::is_job_running(status)) return nullptr;
  const std::optional<VolumeJobs::State> job = s_.jobs.state(id);
  return job ? job->percent : 0;
}

Json Views::snapshot_json(const SnapshotRow& s, const std::optional<IntentRow>& intent) const {
  const std::optional<std::string> error = s_.checks.error_of(intent, s.id);
  const api::VolumeStatus status = derive_status(error.has_value(), intent, {});
  return Json{{"id", s.id},
              {"volume_id", s.volume_id},
              {"name", s.name},
              {"size", s.size},
              {"status", api::to_string(status)},
              {"status_reason", error ? Json(*error) : Json(nullptr)},
              {"progress", progress(status, s.id)},
              {"created_at", s.created_at}};
}

}  // namespace shareblk::control
