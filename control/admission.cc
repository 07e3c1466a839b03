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

Admission admit(const nlohmann::json& connector, const target::Peer& peer, const Policy& policy) {
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
  return Admission::Admitted;
}

target::ExportCatalog::Refusal refusal_of(Admission admission) {
  return admission == Admission::WrongAddress ? target::ExportCatalog::Refusal::Policy
                                              : target::ExportCatalog::Refusal::Unknown;
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
  }
  return "refused";
}

}  // namespace shareblk::control
