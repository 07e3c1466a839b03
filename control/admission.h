// Internal to control/: who may open a live attachment's NBD export, decided in one function.
// The export name says which attachment a client claims; admit() decides whether this client
// may have it, from the attachment's connector and what the listener knows of the peer:
//   1. transport: only on the kind of listener the connector named (tcp, unix; a fuse
//      attachment is served by its mount, never over NBD);
//   2. ip (tcp): only from the connector's address;
//   3. uid (unix): only to the connector's local user; root too only with --nbd-allow-root;
//   4. TLS: a TLS-only attachment (connector "tls" or "tls_dn", or --tls require) only on a
//      TLS session; a PSK session reaches only the attachment whose identity it proved, and an
//      attachment that binds a DN only the client certificate with that DN.
// A refusal for transport, uid or TLS identity looks to the client exactly like an unknown name
// (NBD_REP_ERR_UNKNOWN), so a name's existence is not revealed; a refusal for ip keeps
// NBD_REP_ERR_POLICY, as before; a TLS-only export asked for in the clear gets
// NBD_REP_ERR_TLS_REQD, as the NBD spec's SELECTIVETLS mode requires. docs/api.md ("Connector") and
// README say the same.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "control/control.h"
#include "target/target.h"

namespace shareblk::control {

enum class Admission {
  Admitted,
  WrongTransport,
  WrongAddress,
  WrongUser,
  TlsRequired,
  WrongTlsIdentity
};

// Whether the attachment with this stored connector is TLS-only under `policy`, and whether
// it then has a PSK of its own (it does unless it binds a certificate's DN).
bool tls_only(const nlohmann::json& connector, const Policy& policy);
bool has_psk(const nlohmann::json& connector, const Policy& policy);

// `connector` is the attachment's stored connector (an older row may lack "transport": tcp);
// `attachment_id` is its PSK identity.
Admission admit(const nlohmann::json& connector, const std::string& attachment_id,
                const target::Peer& peer, const Policy& policy);

// How the client is told: Unknown for all but WrongAddress.
target::ExportCatalog::Refusal refusal_of(Admission admission);
// For log lines: "admitted", "wrong transport", ...
const char* to_string(Admission admission);

}  // namespace shareblk::control
