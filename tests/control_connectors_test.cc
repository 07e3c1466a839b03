// The control plane in-process, its connectors: connection_info, listeners, ip, FUSE mountpoints.
#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <string>

#include "control/db.h"
#include "control/service.h"
#include "tests/control_fixture.h"

namespace shareblk::testing::control_unit {
namespace {

// --- connection_info ---

TEST_F(ControlPlaneTest, ConnectionInfoDescribesTheExport) {
  const std::string id = create_volume("2M", /*multiattach=*/true)["id"];
  Json ro = attach(id, "instance-1", {{"mode", "ro"}, {"connector", unix_connector()}});
  Json rw = attach(id, "instance-2",
                   {{"connector", {{"host", "h2"}, {"transport", "tcp"}, {"ip", "10.0.0.2"}}}});
  Json tcp_default = attach(id, "instance-3", {{"connector", {{"host", "h3"}}}});

  const std::regex hex32("[0-9a-f]{32}");
  std::set<std::string> names;
  for (const Json& a : {ro, rw, tcp_default}) {
    const Json& info = a["connection_info"];
    ASSERT_TRUE(info.is_object()) << a;
    EXPECT_EQ(info["driver_volume_type"], "nbd");
    const Json& data = info["data"];
    const std::string name = data["export_name"];
    EXPECT_TRUE(std::regex_match(name, hex32)) << name;
    names.insert(name);
    EXPECT_EQ(data["shareable"], true);
    EXPECT_EQ(data["size"], 2 * 1048576);
    EXPECT_EQ(data["access_mode"], a["mode"]);
  }
  EXPECT_EQ(names.size(), 3u) << "export names must differ per attachment";

  const Json& ro_data = ro["connection_info"]["data"];
  EXPECT_EQ(ro_data["access_mode"], "ro");
  EXPECT_EQ(ro_data["uri"],
            "nbd+unix:///" + ro_data["export_name"].get<std::string>() + "?socket=" + kUnixSocket);
  const Json& rw_data = rw["connection_info"]["data"];
  EXPECT_EQ(rw_data["access_mode"], "rw");
  EXPECT_EQ(rw_data["uri"],
            "nbd://" + std::string(kTcpEndpoint) + "/" + rw_data["export_name"].get<std::string>());
  EXPECT_EQ(rw["connector"]["ip"], "10.0.0.2");
  EXPECT_EQ(tcp_default["connector"]["transport"], "tcp");
  EXPECT_EQ(tcp_default["connection_info"]["data"]["uri"],
            "nbd://" + std::string(kTcpEndpoint) + "/" +
                tcp_default["connection_info"]["data"]["export_name"].get<std::string>());

  // The name is fixed for the attachment's life: show and a second update give the same.
  const std::string ro_id = ro["id"];
  EXPECT_EQ(ok("attachment_show", {{"attachment_id", ro_id}})["connection_info"],
            ro["connection_info"]);
  Json updated =
      ok("attachment_update", {{"attachment_id", ro_id}, {"connector", unix_connector("h9")}});
  EXPECT_EQ(updated["connection_info"]["data"]["export_name"], ro_data["export_name"]);

  // A volume that is not multiattach is not shareable.
  const std::string single = create_volume()["id"];
  EXPECT_EQ(attach(single, "instance-1",
                   {{"connector", unix_connector()}})["connection_info"]["data"]["shareable"],
            false);
}

TEST_F(ControlPlaneTest, TransportNeedsAListener) {
  open(Policy{}, Endpoints{kUnixSocket, ""});
  const std::string id = create_volume()["id"];
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id},
                                         {"instance_uuid", "i"},
                                         {"connector", {{"host", "h"}, {"transport", "tcp"}}}}),
            "invalid_params");
  open(Policy{}, Endpoints{"", kTcpEndpoint});
  EXPECT_EQ(reason("attachment_create",
                   {{"volume_id", id}, {"instance_uuid", "i"}, {"connector", unix_connector()}}),
            "invalid_params");
  EXPECT_EQ(volume_status(id), "available");
}

// --- Connectors ---

// "ip": null is no ip: TCP clients from anywhere reach the attachment, as without one.
TEST_F(ControlPlaneTest, ANullConnectorIpIsNoIp) {
  const std::string id = create_volume()["id"];
  Json a = attach(id, "instance-1",
                  {{"connector", {{"host", "h"}, {"transport", "tcp"}, {"ip", nullptr}}}});
  EXPECT_FALSE(a["connector"].contains("ip")) << a;
  const std::string name = a["connection_info"]["data"]["export_name"];
  const auto tcp_peer = shareblk::target::Peer::tcp("10.0.0.7");
  EXPECT_TRUE(plane_->catalog()->resolve(name, tcp_peer).found.has_value());
  // A tcp attachment is served on the TCP listener only (transport binding).
  EXPECT_FALSE(plane_->catalog()->resolve(name, shareblk::target::Peer{}).found.has_value());

  // A null ip that an older daemon stored is no ip either.
  close();
  {
    shareblk::control::Database db(db_path());
    shareblk::control::Database::Transaction tx(db);
    auto row = tx.attachment(a["id"]);
    ASSERT_TRUE(row.has_value());
    row->connector = Json{{"host", "h"}, {"transport", "tcp"}, {"ip", nullptr}}.dump();
    tx.update_attachment(*row);
    tx.commit();
  }
  open();
  EXPECT_TRUE(plane_->catalog()->resolve(name, tcp_peer).found.has_value());
}

// A FUSE mountpoint is refused, before anything is mounted, when a live attachment's mount is
// there, above or below it, or when it is in the state directory (the database's).
TEST_F(ControlPlaneTest, AFuseMountpointInUseOrInTheStateDirectoryIsRefused) {
  const std::string id = create_volume("1M", /*multiattach=*/true)["id"];
  shareblk::testing::TempDir elsewhere;
  const std::string mnt = elsewhere / "mnt";  // never made: nothing can be mounted there
  const std::string x = attach(id, "instance-1", {{"connector", unix_connector()}})["id"];
  close();
  {
    // The unit tests mount nothing: X is given a FUSE connector as a mounted one has.
    shareblk::control::Database db(db_path());
    shareblk::control::Database::Transaction tx(db);
    auto row = tx.attachment(x);
    ASSERT_TRUE(row.has_value());
    row->connector = Json{{"host", "compute-1"}, {"transport", "fuse"}, {"mountpoint", mnt}}.dump();
    tx.update_attachment(*row);
    tx.commit();
  }
  // Without bind(), which would mount X again.
  plane_ = std::make_unique<ControlPlane>(db_path(), *store_, Policy{});
  auto fuse_at = [](const std::string& mountpoint) {
    return Json{{"host", "compute-2"}, {"transport", "fuse"}, {"mountpoint", mountpoint}};
  };
  // The refusal's message: invalid_params is checked here, the cause by the caller.
  auto refusal = [&](const std::string& method, const Json& params) -> std::string {
    Json response = request(method, params);
    EXPECT_EQ(response["error"]["data"]["reason"], "invalid_params") << response;
    return response["error"].value("message", "");
  };
  auto create_at = [&](const std::string& mountpoint) {
    return refusal(
        "attachment_create",
        {{"volume_id", id}, {"instance_uuid", "instance-2"}, {"connector", fuse_at(mountpoint)}});
  };
  // All missing (x/.. too, for stat): a path not refused fails at the mount, never mounts.
  for (const std::string& m :
       {mnt, mnt + "/", elsewhere / "./mnt", mnt + "/inner", elsewhere / "x/.."}) {
    EXPECT_NE(create_at(m).find(x), std::string::npos) << m;
  }
  const std::string y = attach(id, "instance-2")["id"];
  EXPECT_NE(
      refusal("attachment_update", {{"attachment_id", y}, {"connector", fuse_at(mnt)}}).find(x),
      std::string::npos);
  for (const std::string& m : {dir_ / "mnt", volumes_dir() + "/mnt", dir_ / "x/.."}) {
    EXPECT_NE(create_at(m).find("state directory"), std::string::npos) << m;
  }
  EXPECT_EQ(attach_status(y), "reserved");

  // Once X is detached its mountpoint is free: this one fails later, at the mount.
  ok("attachment_delete", {{"attachment_id", x}});
  EXPECT_EQ(create_at(mnt).find(x), std::string::npos);
}

}  // namespace
}  // namespace shareblk::testing::control_unit
