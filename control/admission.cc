#include "control/admission.h"

#include <arpa/inet.h>

#include <cstring>

namespace shareblk::control {

namespace {

// Whether two textual IP addresses are one address: "::ffff:10.0.0.1" is 10.0.0.1 and
// "0:0::1" is ::1, as the peer's address is written one way only.
bool same_address(const std::string& a, const std::string& b) {
  auto parse = [](const std::string& text, in6_addr& out) {
    in_addr v4{};
    if (inet_pton(AF_INET, text.c_str(), &v4) == 1) {  // as the IPv4-mapped IPv6 address
      out = in6_addr{};
      out.s6_addr[10] = 0xff;
      out.s6_addr[11] = 0xff;
      std::memcpy(&out.s6_addr[12], &v4, sizeof v4);
      return true;
    }
    return inet_pton(AF_INET6, text.c_str(), &out) == 1;
  };
  in6_addr x{};
  in6_addr y{};
  return parse(a, x) && parse(b, y) && std::memcmp(&x, &y, sizeof x) == 0;
}

}  // namespace

bool tls_only(const nlohmann::json& connector, const Policy& policy) {
  if (connector.value("transport", "tcp") == "fuse") return false;
  return policy.tls == target::TlsOptions::Mode::Require || connector.value("tls", false) ||
         connector.contains("tls_dn");
}

bool has_psk(const nlohmann::json& connector, const Policy& policy) {
  return tls_only(connector, policy) && !connector.contains("tls_dn");
}

Admission admit(const nlohmann::json& connector, const std::string& attachment_id,
                const target::Peer& peer, const Policy& policy) {
  using Transport = target::Peer::Transport;
  const bool tcp = peer.transport == Transport::Tcp;
  if (connector.value("transport", "tcp") != (tcp ? "tcp" : "unix")) {
    return Admission::WrongTransport;
  }
  // A null ip, which older daemons stored, is no ip.
  if (tcp && connector.contains("ip") && connector["ip"].is_string() &&
      !same_address(connector["ip"].get<std::string>(), peer.address)) {
    return Admission::WrongAddress;
  }
  // A binding that cannot be read binds to nobody: it fails closed.
  if (!tcp && connector.contains("uid") && !connector["uid"].is_null()) {
    const nlohmann::json& uid = connector["uid"];
    const bool root_allowed = policy.nbd_allow_root && peer.uid && *peer.uid == 0;
    const bool same = peer.uid && uid.is_number_integer() && uid.get<int64_t>() >= 0 &&
                      static_cast<uint64_t>(uid.get<int64_t>()) == *peer.uid;
    if (!same && !root_allowed) return Admission::WrongUser;
  }
  if (!peer.tls) return tls_only(connector, policy) ? Admission::TlsRequired : Admission::Admitted;
  // A PSK proves one attachment, whatever name the client then asks for.
  if (!peer.tls->psk_identity.empty() && peer.tls->psk_identity != attachment_id) {
    return Admission::WrongTlsIdentity;
  }
  if (auto dn = connector.find("tls_dn"); dn != connector.end()) {
    if (!dn->is_string() || peer.tls->x509_dn.empty() ||
        dn->get<std::string>() != peer.tls->x509_dn) {
      return Admission::WrongTlsIdentity;
    }
  }
  return Admission::Admitted;
}

target::ExportCatalog::Refusal refusal_of(Admission admission) {
  using Refusal = target::ExportCatalog::Refusal;
  switch (admission) {
    case Admission::WrongAddress:
      return Refusal::Policy;
    case Admission::TlsRequired:
      return Refusal::TlsRequired;
    default:
      return Refusal::Unknown;
  }
}

const char* to_string(Admission admission) {
  switch (admission) {
    case Admission::Admitted:
      return "admitted";
    case Admission::WrongTransport:
      return "not served on this transport";
    case Admission::WrongAddress:
      return "not from the connector's ip";
    case Admission::WrongUser:
      return "not the connector's uid";
    case Admission::TlsRequired:
      return "TLS-only, asked for without TLS";
    case Admission::WrongTlsIdentity:
      return "not the TLS identity (PSK or certificate DN) it is bound to";
  }
  return "refused";
}

}  // namespace shareblk::control
