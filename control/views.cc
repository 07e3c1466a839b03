// What the API shows of volumes and attachments (docs/api.md, "Objects").
#include "control/admission.h"
#include "control/service.h"

namespace shareblk::control {

std::string volume_status(const std::vector<AttachmentRow>& attachments) {
  // Derived on every read, never stored: the most advanced state of any attachment.
  for (AttachStatus status : {AttachStatus::Attached, AttachStatus::Attaching,
                              AttachStatus::Reserved, AttachStatus::Detaching}) {
    for (const auto& a : attachments) {
      if (a.attach_status == status) {
        return status == AttachStatus::Attached ? "in-use" : std::string(to_string(status));
      }
    }
  }
  return "available";
}

Json Service::connection_info(const AttachmentRow& a, const VolumeRow& v, const Json& connector) {
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
  const bool tls = tls_only(connector, policy());
  const bool psk = has_psk(connector, policy());
  const std::string user = psk ? a.id + "@" : "";
  std::string uri;
  if (transport == "unix") {
    uri = (tls ? "nbds+unix://" : "nbd+unix://") + user + "/" + a.export_name +
          "?socket=" + endpoints_.unix_socket;
  } else {
    uri = (tls ? "nbds://" : "nbd://") + user + endpoints_.tcp + "/" + a.export_name;
  }
  Json data = {{"export_name", a.export_name}, {"uri", uri},     {"access_mode", mode},
               {"shareable", v.multiattach},   {"size", v.size}, {"tls", tls}};
  if (psk) {
    data["tls_psk_identity"] = a.id;
    data["tls_psk_key"] = PskKeys::hex(psk_.key(a.id));
  }
  return Json{{"driver_volume_type", "nbd"}, {"data", data}};
}

Json Service::attachment_json(const AttachmentRow& a, const VolumeRow& v) {
  auto or_null = [](const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); };
  Json connector = a.connector.empty() ? Json(nullptr) : Json::parse(a.connector);
  Json info = connection_info(a, v, connector);
  // What its connections can do: a revocation the database could not record yet counts, and
  // a writer only the journal holds (docs/fencing.md) shows when it became one.
  const bool writes = may_write(a, v) && !exports_.is_revoked(a.id);
  std::string since = writes ? a.write_access_since : std::string();
  if (writes && since.empty() && v.writer == a.id) since = v.writer_since;
  return Json{{"id", a.id},
              {"volume_id", a.volume_id},
              {"gateway", volumes_.shared() ? Json(gateway_id_) : Json(nullptr)},
              {"instance_uuid", a.instance_uuid},
              {"attached_host", or_null(a.attached_host)},
              {"mode", to_string(a.mode)},
              {"attach_status", to_string(a.attach_status)},
              {"attach_time", or_null(a.attach_time)},
              {"detach_time", or_null(a.detach_time)},
              {"connector", std::move(connector)},
              {"connection_info", std::move(info)},
              {"connections", exports_.connections(a.id)},
              {"write_access", writes},
              {"write_access_since", or_null(since)},
              {"qos", qos_json(qos_from_text(a.qos))}};
}

Json Service::volume_json(Database::Transaction& tx, const VolumeRow& v) {
  return volume_json(v, tx.attachments(v.id), tx.intent(v.id));
}

Json Service::volume_json(const VolumeRow& v, const std::vector<AttachmentRow>& all,
                          const std::optional<IntentRow>& intent) {
  Json attachments = Json::array();
  for (const auto& a : all) {
    if (is_live(a.attach_status)) attachments.push_back(attachment_json(a, v));
  }
  // A volume that cannot be attached says so, whatever its attachments' states: it is being
  // deleted or filled (with how far that has come), or its status is error.
  const std::optional<std::string> error = error_of(intent, v.id);
  std::string status = error ? "error" : volume_status(all);
  Json progress = nullptr;
  if (!error && intent) {
    status = intent->action == IntentAction::Delete ? "deleting" : "creating";
    const std::optional<VolumeJobs::State> job = jobs_.state(v.id);
    progress = job ? job->percent : 0;
  }
  return Json{{"id", v.id},
              {"name", v.name},
              {"size", v.size},
              {"multiattach", v.multiattach},
              {"bootable", v.bootable},
              {"status", status},
              {"status_reason", error ? Json(*error) : Json(nullptr)},
              {"progress", progress},
              {"created_at", v.created_at},
              {"writer_policy", to_string(v.writer_policy)},
              {"writer", v.writer.empty() ? Json(nullptr) : Json(v.writer)},
              {"fencing_generation", v.fencing_generation},
              {"writer_since", v.writer_since.empty() ? Json(nullptr) : Json(v.writer_since)},
              {"qos", qos_json(qos_from_text(v.qos))},
              {"attachments", std::move(attachments)}};
}

}  // namespace shareblk::control
