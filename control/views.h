// Internal to control/: what the API shows of volumes, attachments and snapshots (docs/api.md,
// "Objects"), built from database rows and what this gateway knows live (connections, write
// gates, job progress, TLS keys). Reads only: a view changes nothing. Thread-safe as far as
// its parts are; the transaction a view reads through is the caller's.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "api/status.h"
#include "control/control.h"
#include "control/db.h"
#include "control/params.h"

namespace shareblk::control {

class ExportRegistry;
class GatewayRecords;
class PskKeys;
class VolumeChecks;
class VolumeJobs;

class Views {
 public:
  struct Sources {
    const ExportRegistry& exports;
    const VolumeChecks& checks;
    const VolumeJobs& jobs;
    const PskKeys& psk;              // the TLS-PSK keys of TLS-only attachments
    const Endpoints& endpoints;      // where clients reach the NBD listeners
    std::function<Policy()> policy;  // the policy in force (TLS)
    const GatewayRecords* records;   // this gateway's name; null for a local store
  };
  explicit Views(Sources sources) : s_(std::move(sources)) {}

  // A Volume with its live attachments here.
  Json volume_json(Database::Transaction& tx, const VolumeRow& v) const;
  // From rows already read (volume_list reads them all at once, and builds the JSON after its
  // transaction: other calls need not wait for that).
  Json volume_json(const VolumeRow& v, const std::vector<AttachmentRow>& attachments,
                   const std::optional<IntentRow>& intent) const;
  // An Attachment as any gateway knows it, from its row: what only the serving gateway knows
  // (connector, connection_info, connections, write access, QoS) is null. Another gateway's
  // attachment (a.gateway set) is shown this way.
  Json attachment_view(const AttachmentRow& a) const;
  // This gateway's attachment: attachment_view with what this gateway knows filled in.
  Json attachment_json(const AttachmentRow& a, const VolumeRow& v) const;
  Json snapshot_json(const SnapshotRow& s, const std::optional<IntentRow>& intent) const;

 private:
  // os-brick's connection_info for the attachment's connector; null before it is connected.
  Json connection_info(const AttachmentRow& a, const VolumeRow& v, const Json& connector) const;
  // A running delete's or fill's progress in percent; null when none runs.
  Json progress(api::VolumeStatus status, const std::string& id) const;

  Sources s_;
};

}  // namespace shareblk::control
