// Who may open an attachment's export (control/admission.h), as a table: the connector's
// binding against what the listener knows of the peer.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "control/admission.h"

namespace {

using shareblk::control::Admission;
using shareblk::control::admit;
using shareblk::target::Peer;
using Json = nlohmann::json;

Peer unix_peer(std::optional<uid_t> uid) {
  Peer p;
  p.uid = uid;
  p.pid = 42;
  return p;
}

TEST(Admission, AnAttachmentIsServedOnlyOnItsConnectorsTransport) {
  const shareblk::control::Policy policy;
  const Json tcp{{"host", "h"}, {"transport", "tcp"}};
  const Json unix{{"host", "h"}, {"transport", "unix"}};
  const Json fuse{{"host", "h"}, {"transport", "fuse"}, {"mountpoint", "/m"}};
  const Json old{{"host", "h"}};  // a row from before "transport" was stored: tcp
  EXPECT_EQ(admit(tcp, Peer::tcp("192.0.2.1"), policy), Admission::Admitted);
  EXPECT_EQ(admit(old, Peer::tcp("192.0.2.1"), policy), Admission::Admitted);
  EXPECT_EQ(admit(unix, unix_peer(1000), policy), Admission::Admitted);
  EXPECT_EQ(admit(tcp, unix_peer(1000), policy), Admission::WrongTransport);
  EXPECT_EQ(admit(old, unix_peer(1000), policy), Admission::WrongTransport);
  EXPECT_EQ(admit(unix, Peer::tcp("192.0.2.1"), policy), Admission::WrongTransport);
  EXPECT_EQ(admit(fuse, Peer::tcp("192.0.2.1"), policy), Admission::WrongTransport);
  EXPECT_EQ(admit(fuse, unix_peer(0), policy), Admission::WrongTransport);
  // Refused for its transport, a client cannot tell the name from one that does not exist.
  EXPECT_EQ(shareblk::control::refusal_of(Admission::WrongTransport),
            shareblk::target::ExportCatalog::Refusal::Unknown);
}

TEST(Admission, AnIpBindsTcpClientsToThatAddress) {
  const shareblk::control::Policy policy;
  const Json c{{"host", "h"}, {"transport", "tcp"}, {"ip", "192.0.2.1"}};
  EXPECT_EQ(admit(c, Peer::tcp("192.0.2.1"), policy), Admission::Admitted);
  EXPECT_EQ(admit(c, Peer::tcp("::ffff:192.0.2.1"), policy), Admission::Admitted);
  EXPECT_EQ(admit(c, Peer::tcp("192.0.2.2"), policy), Admission::WrongAddress);
  EXPECT_EQ(admit(Json{{"transport", "tcp"}, {"ip", nullptr}}, Peer::tcp("198.51.100.1"), policy),
            Admission::Admitted);
  EXPECT_EQ(shareblk::control::refusal_of(Admission::WrongAddress),
            shareblk::target::ExportCatalog::Refusal::Policy);
}

TEST(Admission, AUidBindsUnixClientsToThatUserAndRootOnlyWhenAllowed) {
  shareblk::control::Policy policy;
  const Json c{{"host", "h"}, {"transport", "unix"}, {"uid", 1000}};
  EXPECT_EQ(admit(c, unix_peer(1000), policy), Admission::Admitted);
  EXPECT_EQ(admit(c, unix_peer(1001), policy), Admission::WrongUser);
  EXPECT_EQ(admit(c, unix_peer(0), policy), Admission::WrongUser);
  EXPECT_EQ(admit(c, unix_peer(std::nullopt), policy), Admission::WrongUser);
  policy.nbd_allow_root = true;
  EXPECT_EQ(admit(c, unix_peer(0), policy), Admission::Admitted);
  EXPECT_EQ(admit(c, unix_peer(1001), policy), Admission::WrongUser);
  // A binding that cannot be read binds to nobody.
  policy.nbd_allow_root = false;
  EXPECT_EQ(admit(Json{{"transport", "unix"}, {"uid", "1000"}}, unix_peer(1000), policy),
            Admission::WrongUser);
  EXPECT_EQ(admit(Json{{"transport", "unix"}, {"uid", -1}}, unix_peer(0), policy),
            Admission::WrongUser);
  // Without a uid binding any local user who knows the name is admitted, as before.
  EXPECT_EQ(admit(Json{{"transport", "unix"}}, unix_peer(1001), policy), Admission::Admitted);
  EXPECT_EQ(shareblk::control::refusal_of(Admission::WrongUser),
            shareblk::target::ExportCatalog::Refusal::Unknown);
}

}  // namespace
