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
  EXPECT_EQ(admit(tcp, "att-1", Peer::tcp("192.0.2.1"), policy), Admission::Admitted);
  EXPECT_EQ(admit(old, "att-1", Peer::tcp("192.0.2.1"), policy), Admission::Admitted);
  EXPECT_EQ(admit(unix, "att-1", unix_peer(1000), policy), Admission::Admitted);
  EXPECT_EQ(admit(tcp, "att-1", unix_peer(1000), policy), Admission::WrongTransport);
  EXPECT_EQ(admit(old, "att-1", unix_peer(1000), policy), Admission::WrongTransport);
  EXPECT_EQ(admit(unix, "att-1", Peer::tcp("192.0.2.1"), policy), Admission::WrongTransport);
  EXPECT_EQ(admit(fuse, "att-1", Peer::tcp("192.0.2.1"), policy), Admission::WrongTransport);
  EXPECT_EQ(admit(fuse, "att-1", unix_peer(0), policy), Admission::WrongTransport);
  // Refused for its transport, a client cannot tell the name from one that does not exist.
  EXPECT_EQ(shareblk::control::refusal_of(Admission::WrongTransport),
            shareblk::target::ExportCatalog::Refusal::Unknown);
}

TEST(Admission, AnIpBindsTcpClientsToThatAddress) {
  const shareblk::control::Policy policy;
  const Json c{{"host", "h"}, {"transport", "tcp"}, {"ip", "192.0.2.1"}};
  EXPECT_EQ(admit(c, "att-1", Peer::tcp("192.0.2.1"), policy), Admission::Admitted);
  EXPECT_EQ(admit(c, "att-1", Peer::tcp("::ffff:192.0.2.1"), policy), Admission::Admitted);
  EXPECT_EQ(admit(c, "att-1", Peer::tcp("192.0.2.2"), policy), Admission::WrongAddress);
  EXPECT_EQ(admit(Json{{"transport", "tcp"}, {"ip", nullptr}}, "att-1", Peer::tcp("198.51.100.1"),
                  policy),
            Admission::Admitted);
  EXPECT_EQ(shareblk::control::refusal_of(Admission::WrongAddress),
            shareblk::target::ExportCatalog::Refusal::Policy);
}

TEST(Admission, AUidBindsUnixClientsToThatUserAndRootOnlyWhenAllowed) {
  shareblk::control::Policy policy;
  const Json c{{"host", "h"}, {"transport", "unix"}, {"uid", 1000}};
  EXPECT_EQ(admit(c, "att-1", unix_peer(1000), policy), Admission::Admitted);
  EXPECT_EQ(admit(c, "att-1", unix_peer(1001), policy), Admission::WrongUser);
  EXPECT_EQ(admit(c, "att-1", unix_peer(0), policy), Admission::WrongUser);
  EXPECT_EQ(admit(c, "att-1", unix_peer(std::nullopt), policy), Admission::WrongUser);
  policy.nbd_allow_root = true;
  EXPECT_EQ(admit(c, "att-1", unix_peer(0), policy), Admission::Admitted);
  EXPECT_EQ(admit(c, "att-1", unix_peer(1001), policy), Admission::WrongUser);
  // A binding that cannot be read binds to nobody.
  policy.nbd_allow_root = false;
  EXPECT_EQ(admit(Json{{"transport", "unix"}, {"uid", "1000"}}, "att-1", unix_peer(1000), policy),
            Admission::WrongUser);
  EXPECT_EQ(admit(Json{{"transport", "unix"}, {"uid", -1}}, "att-1", unix_peer(0), policy),
            Admission::WrongUser);
  // Without a uid binding any local user who knows the name is admitted, as before.
  EXPECT_EQ(admit(Json{{"transport", "unix"}}, "att-1", unix_peer(1001), policy),
            Admission::Admitted);
  EXPECT_EQ(shareblk::control::refusal_of(Admission::WrongUser),
            shareblk::target::ExportCatalog::Refusal::Unknown);
}

}  // namespace

TEST(Admission, TlsOnlyAttachmentsNeedTlsAndTheirOwnIdentity) {
  using Mode = shareblk::target::TlsOptions::Mode;
  shareblk::control::Policy policy;
  policy.tls = Mode::On;
  const Json plain{{"host", "h"}, {"transport", "tcp"}};
  const Json tls{{"host", "h"}, {"transport", "tcp"}, {"tls", true}};
  const Json dn{{"host", "h"}, {"transport", "unix"}, {"tls_dn", "CN=client1,O=Example"}};
  auto over_tls = [](Peer peer, std::string identity, std::string x509_dn) {
    peer.tls = shareblk::target::TlsPeer{std::move(identity), std::move(x509_dn)};
    return peer;
  };
  const Peer clear = Peer::tcp("192.0.2.1");
  EXPECT_EQ(admit(plain, "att-1", clear, policy), Admission::Admitted);
  EXPECT_EQ(admit(tls, "att-1", clear, policy), Admission::TlsRequired);
  EXPECT_EQ(admit(tls, "att-1", over_tls(clear, "att-1", ""), policy), Admission::Admitted);
  // Another attachment's valid PSK proves that attachment, not this one.
  EXPECT_EQ(admit(tls, "att-1", over_tls(clear, "att-2", ""), policy), Admission::WrongTlsIdentity);
  EXPECT_EQ(admit(plain, "att-1", over_tls(clear, "att-2", ""), policy),
            Admission::WrongTlsIdentity);
  // A certificate the CA signed reaches a TLS-only attachment that binds no DN.
  EXPECT_EQ(admit(tls, "att-1", over_tls(clear, "", "CN=any"), policy), Admission::Admitted);
  // A DN binding admits that certificate only, never a PSK.
  const Peer local = unix_peer(1000);
  EXPECT_EQ(admit(dn, "att-1", local, policy), Admission::TlsRequired);
  EXPECT_EQ(admit(dn, "att-1", over_tls(local, "", "CN=client1,O=Example"), policy),
            Admission::Admitted);
  EXPECT_EQ(admit(dn, "att-1", over_tls(local, "", "CN=client2,O=Example"), policy),
            Admission::WrongTlsIdentity);
  EXPECT_EQ(admit(dn, "att-1", over_tls(local, "att-1", ""), policy), Admission::WrongTlsIdentity);
  EXPECT_TRUE(shareblk::control::has_psk(tls, policy));
  EXPECT_FALSE(shareblk::control::has_psk(dn, policy));
  EXPECT_FALSE(shareblk::control::has_psk(plain, policy));
  // --tls require: every attachment is TLS-only, with a key of its own.
  policy.tls = Mode::Require;
  EXPECT_EQ(admit(plain, "att-1", clear, policy), Admission::TlsRequired);
  EXPECT_TRUE(shareblk::control::has_psk(plain, policy));
  EXPECT_EQ(shareblk::control::refusal_of(Admission::TlsRequired),
            shareblk::target::ExportCatalog::Refusal::TlsRequired);
  EXPECT_EQ(shareblk::control::refusal_of(Admission::WrongTlsIdentity),
            shareblk::target::ExportCatalog::Refusal::Unknown);
}
