// Internal to control/: who may open a live attachment's NBD export, decided in one function.
// The export name says which attachment a client claims; admit() decides whether this client
// may have it, from the attachment's connector and what the listener knows of the peer:
//   1. transport: only on the kind of listener the connector named (tcp, unix; a fuse
//      attachment is served by its mount, never over NBD);
//   2. ip (tcp): only from the connector's address;
//   3. uid (unix): only to the connector's local user; root too only with --nbd-allow-root.
// A refusal for transport or uid looks to the client exactly like an unknown name
// (NBD_REP_ERR_UNKNOWN), so a name's existence is not revealed; a refusal for ip keeps
// NBD_REP_ERR_POLICY, as before. docs/api.md ("Connector") and README say the same.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "control/control.h"
#include "target/target.h"

namespace shareblk::control {

enum class Admission { Admitted, WrongTransport, WrongAddress, WrongUser };

// `connector` is the attachment's stored connector (an older row may lack "transport": tcp).
Admission admit(const nlohmann::json& connector, const target::Peer& peer, const Policy& policy);

// How the client is told: Unknown for all but WrongAddress.
target::ExportCatalog::Refusal refusal_of(Admission admission);
// For log lines: "admitted", "wrong transport", ...
const char* to_string(Admission admission);

}  // namespace shareblk::control
