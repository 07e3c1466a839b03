// The control plane in-process: the attachment state machine, the volume store and the JSON-RPC
// framing, driven through ControlPlane::handle() with no NBD server bound (so attachments have
// no connections and detach has none to close).
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/statfs.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "control/control.h"
#include "control/db.h"
#include "control/methods.h"
#include "control/params.h"
#include "control/service.h"
#include "lvm/volume_store.h"
#include "tests/support.h"

namespace {

namespace fs = std::filesystem;
using shareblk::control::ControlPlane;
using shareblk::control::Endpoints;
using shareblk::control::Policy;
using Json = nlohmann::json;

constexpr const char* kUnixSocket = "/run/shareblk-test/nbd.sock";
constexpr const char* kTcpEndpoint = "127.0.0.1:10809";

class ControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shareblk::lvm::StoreError error;
    store_ = shareblk::lvm::make_file_store(volumes_dir(), false, error);
    ASSERT_TRUE(store_) << error.message;
    open();
  }

  std::string db_path() const { return dir_ / "shareblk.db"; }
  std::string volumes_dir() const { return dir_ / "volumes"; }
  std::string backing(const std::string& volume_id) const {
    return volumes_dir() + "/" + volume_id + ".img";
  }

  // (Re)opens the control plane on the same database, as a daemon restart does.
  void open(Policy policy = {}, Endpoints endpoints = {kUnixSocket, kTcpEndpoint}) {
    plane_.reset();
    plane_ = std::make_unique<ControlPlane>(db_path(), *store_, policy);
    plane_->bind(nullptr, std::move(endpoints));
  }
  void close() { plane_.reset(); }

  // One request; the whole response object.
  Json request(const std::string& method, const Json& params) {
    const Json req{{"jsonrpc", "2.0"}, {"id", next_id_++}, {"method", method}, {"params", params}};
    const std::string reply = plane_->handle(req.dump(), caller_);
    Json response = Json::parse(reply, nullptr, false);
    EXPECT_FALSE(response.is_discarded()) << reply;
    EXPECT_EQ(response["id"], req["id"]) << reply;
    EXPECT_EQ(response["jsonrpc"], "2.0") << reply;
    return response;
  }

  // A call that must succeed: its result.
  Json ok(const std::string& method, const Json& params) {
    Json response = request(method, params);
    EXPECT_TRUE(response.contains("result")) << method << " " << params << " -> " << response;
    return response.value("result", Json());
  }

  // A call that must fail: its data.reason.
  std::string reason(const std::string& method, const Json& params) {
    Json response = request(method, params);
    EXPECT_TRUE(response.contains("error")) << method << " " << params << " -> " << response;
    if (!response.contains("error")) return "(succeeded)";
    const Json& error = response["error"];
    EXPECT_TRUE(error["code"].is_number_integer()) << response;
    EXPECT_TRUE(error["message"].is_string()) << response;
    return error["data"].value("reason", "(no reason)");
  }

  Json create_volume(const Json& size = "1M", bool multiattach = false, bool bootable = false) {
    return ok("volume_create", {{"name", "vol" + std::to_string(next_id_)},
                                {"size", size},
                                {"multiattach", multiattach},
                                {"bootable", bootable}});
  }
  Json attach(const std::string& volume_id, const std::string& instance,
              const Json& extra = Json::object()) {
    Json params{{"volume_id", volume_id}, {"instance_uuid", instance}};
    params.update(extra);
    return ok("attachment_create", params);
  }
  static Json unix_connector(const std::string& host = "compute-1") {
    return {{"host", host}, {"transport", "unix"}};
  }
  std::string volume_status(const std::string& volume_id) {
    return ok("volume_show", {{"volume_id", volume_id}}).value("status", "");
  }
  std::string attach_status(const std::string& attachment_id) {
    return ok("attachment_show", {{"attachment_id", attachment_id}}).value("attach_status", "");
  }

  shareblk::testing::TempDir dir_;
  std::unique_ptr<shareblk::lvm::VolumeStore> store_;
  std::unique_ptr<ControlPlane> plane_;
  shareblk::control::Caller caller_{1234, 1000};
  int next_id_ = 1;
};

// --- Volumes ---

TEST_F(ControlPlaneTest, VolumeCreateAcceptsBytesAndSuffixes) {
  const std::pair<Json, uint64_t> cases[] = {
      {"1G", uint64_t{1} << 30},
      {1048576, 1048576},
      {"10M", 10 * (uint64_t{1} << 20)},
      {"4K", 4096},
      {"512", 512},
      {"2k", 2048},
  };
  for (const auto& [size, bytes] : cases) {
    Json v = create_volume(size);
    EXPECT_EQ(v["size"], bytes) << size;
    EXPECT_EQ(fs::file_size(backing(v["id"])), bytes) << size;
  }
}

TEST_F(ControlPlaneTest, VolumeCreateHasTheDocumentedFields) {
  Json v = ok("volume_create", {{"name", "data"}, {"size", "1M"}});
  EXPECT_TRUE(std::regex_match(v["id"].get<std::string>(),
                               std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-"
                                          "[0-9a-f]{12}")))
      << v["id"];
  EXPECT_EQ(v["name"], "data");
  EXPECT_EQ(v["size"], 1048576);
  EXPECT_EQ(v["multiattach"], false);
  EXPECT_EQ(v["bootable"], false);
  EXPECT_EQ(v["status"], "available");
  EXPECT_EQ(v["attachments"], Json::array());
  // A new volume reads as zeroes.
  EXPECT_EQ(shareblk::testing::read_file(backing(v["id"]), 0, 4096), std::string(4096, '\0'));
}

TEST_F(ControlPlaneTest, VolumeCreateRejectsBadSizes) {
  const Json bad_sizes[] = {0,
                            1000,
                            "-5",
                            "1X",
                            -512,
                            "",
                            "0",
                            "1.5G",
                            1.5,
                            true,
                            "513",
                            Json(nullptr),
                            "99999999999999999999",
                            "100000000T"};
  for (const Json& size : bad_sizes) {
    EXPECT_EQ(reason("volume_create", {{"name", "v"}, {"size", size}}), "invalid_params") << size;
  }
  EXPECT_EQ(reason("volume_create", {{"name", "v"}}), "invalid_params");
  EXPECT_EQ(reason("volume_create", {{"size", "1M"}}), "invalid_params");
  EXPECT_EQ(reason("volume_create", {{"name", ""}, {"size", "1M"}}), "invalid_params");
  EXPECT_EQ(reason("volume_create", {{"name", std::string(256, 'n')}, {"size", "1M"}}),
            "invalid_params");
  EXPECT_EQ(reason("volume_create", {{"name", "v"}, {"size", "1M"}, {"multiattach", "yes"}}),
            "invalid_params");
  // A refused create leaves no volume and no backing behind.
  EXPECT_EQ(ok("volume_list", Json::object()), Json::array());
  EXPECT_TRUE(fs::is_empty(volumes_dir()));
}

// A size the file system cannot hold is no_space, and leaves no backing behind. Only where
// the file system refuses at once (ext4: past its largest file; tmpfs: past its size), never
// by filling a disk.
TEST_F(ControlPlaneTest, VolumeCreateBeyondTheStoreIsNoSpace) {
  struct statfs fs_info {};
  ASSERT_EQ(::statfs(volumes_dir().c_str(), &fs_info), 0);
  if (fs_info.f_type != EXT4_SUPER_MAGIC && fs_info.f_type != TMPFS_MAGIC) {
    GTEST_SKIP() << "the volume directory is on neither ext4 nor tmpfs";
  }
  EXPECT_EQ(reason("volume_create", {{"name", "huge"}, {"size", "1000T"}}), "no_space");
  EXPECT_EQ(ok("volume_list", Json::object()), Json::array());
  EXPECT_TRUE(fs::is_empty(volumes_dir()));
}

TEST_F(ControlPlaneTest, UnknownParametersAreRefused) {
  Json v = create_volume();
  const std::string id = v["id"];
  EXPECT_EQ(reason("volume_create", {{"name", "v"}, {"size", "1M"}, {"sise", "1M"}}),
            "invalid_params");
  EXPECT_EQ(reason("volume_list", {{"all", true}}), "invalid_params");
  EXPECT_EQ(reason("volume_show", {{"volume_id", id}, {"verbose", true}}), "invalid_params");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}, {"size", "2M"}, {"force", true}}),
            "invalid_params");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}, {"x", 1}}),
            "invalid_params");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id},
                                         {"instance_uuid", "i"},
                                         {"connector", {{"host", "h"}, {"colour", "red"}}}}),
            "invalid_params");
  // Nothing was attached by the refused calls.
  EXPECT_EQ(volume_status(id), "available");
  EXPECT_EQ(ok("volume_show", {{"volume_id", id}})["size"], 1048576);
}

TEST_F(ControlPlaneTest, BadParameterValuesAreRefused) {
  const std::string id = create_volume()["id"];
  EXPECT_EQ(reason("volume_show", Json::object()), "invalid_params");
  EXPECT_EQ(reason("volume_show", {{"volume_id", 42}}), "invalid_params");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id}}), "invalid_params");
  EXPECT_EQ(
      reason("attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}, {"mode", "wr"}}),
      "invalid_params");
  const Json bad_connectors[] = {
      "compute-1",                                         // not an object
      Json::object(),                                      // no host
      {{"host", "h"}, {"transport", "rdma"}},              // unknown transport
      {{"host", "h"}, {"ip", "not-an-ip"}},                // not an address
      {{"host", "h"}, {"transport", "tcp"}, {"ip", 127}},  // not a string
  };
  for (const Json& connector : bad_connectors) {
    EXPECT_EQ(reason("attachment_create",
                     {{"volume_id", id}, {"instance_uuid", "i"}, {"connector", connector}}),
              "invalid_params")
        << connector;
  }
  EXPECT_EQ(volume_status(id), "available");
  const std::string attachment = attach(id, "i")["id"];
  EXPECT_EQ(reason("attachment_update", {{"attachment_id", attachment}}), "invalid_params");
  EXPECT_EQ(reason("attachment_update",
                   {{"attachment_id", attachment}, {"connector", {{"transport", "unix"}}}}),
            "invalid_params");
  EXPECT_EQ(attach_status(attachment), "reserved");
}

TEST_F(ControlPlaneTest, UnknownIdsAreNotFound) {
  const std::string nobody = "00000000-0000-4000-8000-000000000000";
  EXPECT_EQ(reason("volume_show", {{"volume_id", nobody}}), "not_found");
  EXPECT_EQ(reason("volume_delete", {{"volume_id", nobody}}), "not_found");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", nobody}, {"size", "2M"}}), "not_found");
  EXPECT_EQ(reason("volume_update", {{"volume_id", nobody}, {"name", "x"}}), "not_found");
  EXPECT_EQ(reason("volume_detach", {{"volume_id", nobody}}), "not_found");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", nobody}, {"instance_uuid", "i"}}),
            "not_found");
  EXPECT_EQ(reason("attachment_list", {{"volume_id", nobody}}), "not_found");
  EXPECT_EQ(reason("attachment_show", {{"attachment_id", nobody}}), "not_found");
  EXPECT_EQ(
      reason("attachment_update", {{"attachment_id", nobody}, {"connector", unix_connector()}}),
      "not_found");
  EXPECT_EQ(reason("attachment_complete", {{"attachment_id", nobody}}), "not_found");
  EXPECT_EQ(reason("attachment_delete", {{"attachment_id", nobody}}), "not_found");
}

TEST_F(ControlPlaneTest, VolumeDeleteIsRefusedWhileAttached) {
  const std::string id = create_volume()["id"];
  ASSERT_TRUE(fs::exists(backing(id)));
  const std::string attachment = attach(id, "instance-1")["id"];  // reserved is live too
  EXPECT_EQ(reason("volume_delete", {{"volume_id", id}}), "volume_in_use");
  ok("attachment_update", {{"attachment_id", attachment}, {"connector", unix_connector()}});
  EXPECT_EQ(reason("volume_delete", {{"volume_id", id}}), "volume_in_use");
  ok("attachment_complete", {{"attachment_id", attachment}});
  EXPECT_EQ(reason("volume_delete", {{"volume_id", id}}), "volume_in_use");
  EXPECT_TRUE(fs::exists(backing(id)));
  EXPECT_EQ(volume_status(id), "in-use");

  ok("attachment_delete", {{"attachment_id", attachment}});
  Json deleted = ok("volume_delete", {{"volume_id", id}, {"wait", true}});
  EXPECT_EQ(deleted["id"], id);
  EXPECT_EQ(deleted["deleted"], true);
  EXPECT_FALSE(fs::exists(backing(id)));
  EXPECT_EQ(reason("volume_show", {{"volume_id", id}}), "not_found");
  EXPECT_EQ(reason("attachment_show", {{"attachment_id", attachment}}), "not_found");
  EXPECT_EQ(ok("volume_list", Json::object()), Json::array());
  EXPECT_EQ(ok("attachment_list", Json::object()), Json::array());
}

TEST_F(ControlPlaneTest, VolumeExtendOnlyGrows) {
  const std::string id = create_volume("1M")["id"];
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}, {"size", "1M"}}), "invalid_params");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}, {"size", "512K"}}), "invalid_params");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}, {"size", "3000"}}), "invalid_params");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}}), "invalid_params");
  EXPECT_EQ(fs::file_size(backing(id)), 1048576u);

  Json grown = ok("volume_extend", {{"volume_id", id}, {"size", "3M"}});
  EXPECT_EQ(grown["size"], 3 * 1048576);
  EXPECT_EQ(fs::file_size(backing(id)), 3u * 1048576);
  EXPECT_EQ(ok("volume_show", {{"volume_id", id}})["size"], 3 * 1048576);
  // The new bytes read as zeroes.
  EXPECT_EQ(shareblk::testing::read_file(backing(id), 2 * 1048576, 4096), std::string(4096, '\0'));

  // Grows while attached too: the hypervisor rescans.
  const std::string attachment = attach(id, "i", {{"connector", unix_connector()}})["id"];
  Json bigger = ok("volume_extend", {{"volume_id", id}, {"size", 4 * 1048576}});
  EXPECT_EQ(bigger["size"], 4 * 1048576);
  EXPECT_EQ(bigger["attachments"][0]["connection_info"]["data"]["size"], 4 * 1048576);
  EXPECT_EQ(
      ok("attachment_show", {{"attachment_id", attachment}})["connection_info"]["data"]["size"],
      4 * 1048576);
}

TEST_F(ControlPlaneTest, VolumeUpdateChangesMultiattachOnlyWhileAvailable) {
  const std::string id = create_volume()["id"];
  Json v = ok("volume_update", {{"volume_id", id}, {"multiattach", true}});
  EXPECT_EQ(v["multiattach"], true);
  v = ok("volume_update", {{"volume_id", id}, {"multiattach", false}, {"name", "renamed"}});
  EXPECT_EQ(v["multiattach"], false);
  EXPECT_EQ(v["name"], "renamed");

  const std::string attachment = attach(id, "instance-1")["id"];
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"multiattach", true}}), "volume_in_use");
  ok("attachment_update", {{"attachment_id", attachment}, {"connector", unix_connector()}});
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"multiattach", true}}), "volume_in_use");
  ok("attachment_complete", {{"attachment_id", attachment}});
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"multiattach", true}}), "volume_in_use");
  EXPECT_EQ(ok("volume_show", {{"volume_id", id}})["multiattach"], false);

  // Other fields may change while attached, and "changing" multiattach to its value is no change.
  v = ok("volume_update", {{"volume_id", id}, {"name", "still-attached"}, {"bootable", true}});
  EXPECT_EQ(v["name"], "still-attached");
  EXPECT_EQ(v["bootable"], true);
  EXPECT_EQ(v["status"], "in-use");
  ok("volume_update", {{"volume_id", id}, {"multiattach", false}});

  ok("attachment_delete", {{"attachment_id", attachment}});
  v = ok("volume_update", {{"volume_id", id}, {"multiattach", true}});
  EXPECT_EQ(v["multiattach"], true);
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"name", ""}}), "invalid_params");
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"multiattach", 1}}), "invalid_params");
}

// --- The attachment state machine ---

TEST_F(ControlPlaneTest, StatusFollowsTheAttachmentLifecycle) {
  const std::string id = create_volume()["id"];
  EXPECT_EQ(volume_status(id), "available");

  Json a = attach(id, "instance-1", {{"mode", "ro"}});
  const std::string attachment = a["id"];
  EXPECT_EQ(a["attach_status"], "reserved");
  EXPECT_EQ(a["volume_id"], id);
  EXPECT_EQ(a["instance_uuid"], "instance-1");
  EXPECT_EQ(a["mode"], "ro");
  EXPECT_EQ(a["connector"], nullptr);
  EXPECT_EQ(a["connection_info"], nullptr);  // no export name before there is a connector
  EXPECT_EQ(a["attach_time"], nullptr);
  EXPECT_EQ(a["detach_time"], nullptr);
  EXPECT_EQ(a["connections"], 0);
  EXPECT_EQ(volume_status(id), "reserved");

  a = ok("attachment_update", {{"attachment_id", attachment}, {"connector", unix_connector()}});
  EXPECT_EQ(a["attach_status"], "attaching");
  EXPECT_EQ(a["attached_host"], "compute-1");
  EXPECT_EQ(a["connector"]["host"], "compute-1");
  EXPECT_EQ(a["connector"]["transport"], "unix");
  EXPECT_TRUE(a["connection_info"].is_object());
  EXPECT_EQ(volume_status(id), "attaching");
  // A second update (say, a new connector after a migration) stays attaching.
  a = ok("attachment_update",
         {{"attachment_id", attachment}, {"connector", unix_connector("compute-2")}});
  EXPECT_EQ(a["attach_status"], "attaching");
  EXPECT_EQ(a["connector"]["host"], "compute-2");

  a = ok("attachment_complete", {{"attachment_id", attachment}});
  EXPECT_EQ(a["attach_status"], "attached");
  EXPECT_TRUE(a["attach_time"].is_string());
  EXPECT_EQ(volume_status(id), "in-use");
  // Completing twice is harmless.
  EXPECT_EQ(ok("attachment_complete", {{"attachment_id", attachment}})["attach_status"],
            "attached");
  // An attached attachment takes no new connector.
  EXPECT_EQ(
      reason("attachment_update", {{"attachment_id", attachment}, {"connector", unix_connector()}}),
      "invalid_state");

  Json v = ok("volume_show", {{"volume_id", id}});
  ASSERT_EQ(v["attachments"].size(), 1u);
  EXPECT_EQ(v["attachments"][0]["id"], attachment);

  // With no server bound the detach has no connection to wait for: "detaching" is transient
  // and is never what the call leaves behind.
  a = ok("attachment_delete", {{"attachment_id", attachment}});
  EXPECT_EQ(a["attach_status"], "detached");
  EXPECT_TRUE(a["detach_time"].is_string());
  EXPECT_EQ(a["connection_info"], nullptr);
  EXPECT_EQ(attach_status(attachment), "detached");
  EXPECT_EQ(volume_status(id), "available");
  EXPECT_EQ(ok("volume_show", {{"volume_id", id}})["attachments"], Json::array());
  // Detached is final.
  EXPECT_EQ(ok("attachment_delete", {{"attachment_id", attachment}})["attach_status"], "detached");
  EXPECT_EQ(
      reason("attachment_update", {{"attachment_id", attachment}, {"connector", unix_connector()}}),
      "invalid_state");
  EXPECT_EQ(reason("attachment_complete", {{"attachment_id", attachment}}), "invalid_state");
  EXPECT_EQ(attach_status(attachment), "detached");
}

TEST_F(ControlPlaneTest, AttachmentCreateWithConnectorIsAttaching) {
  const std::string id = create_volume()["id"];
  Json a = attach(id, "instance-1", {{"connector", unix_connector("h1")}});
  EXPECT_EQ(a["attach_status"], "attaching");
  EXPECT_EQ(a["attached_host"], "h1");
  EXPECT_EQ(a["mode"], "rw");  // the default
  EXPECT_TRUE(a["connection_info"].is_object());
  EXPECT_EQ(volume_status(id), "attaching");
}

TEST_F(ControlPlaneTest, VolumeStatusAggregatesAttachments) {
  const std::string id = create_volume("1M", /*multiattach=*/true)["id"];
  const std::string reserved = attach(id, "i-reserved")["id"];
  EXPECT_EQ(volume_status(id), "reserved");
  const std::string attaching = attach(id, "i-attaching", {{"connector", unix_connector()}})["id"];
  EXPECT_EQ(volume_status(id), "attaching");
  const std::string attached = attach(id, "i-attached", {{"connector", unix_connector()}})["id"];
  ok("attachment_complete", {{"attachment_id", attached}});
  EXPECT_EQ(volume_status(id), "in-use");  // attached wins over everything

  ok("attachment_delete", {{"attachment_id", attached}});
  EXPECT_EQ(volume_status(id), "attaching");
  ok("attachment_delete", {{"attachment_id", attaching}});
  EXPECT_EQ(volume_status(id), "reserved");
  ok("attachment_delete", {{"attachment_id", reserved}});
  EXPECT_EQ(volume_status(id), "available");
  // Detached attachments stay listable but are not the volume's attachments any more.
  EXPECT_EQ(ok("attachment_list", {{"volume_id", id}}).size(), 3u);
  EXPECT_EQ(ok("volume_show", {{"volume_id", id}})["attachments"].size(), 0u);
}

TEST_F(ControlPlaneTest, AttachmentCompleteNeedsAConnector) {
  const std::string id = create_volume()["id"];
  const std::string attachment = attach(id, "instance-1")["id"];
  EXPECT_EQ(reason("attachment_complete", {{"attachment_id", attachment}}), "invalid_state");
  EXPECT_EQ(attach_status(attachment), "reserved");
  EXPECT_EQ(volume_status(id), "reserved");
}

TEST_F(ControlPlaneTest, NonMultiattachVolumeHoldsOneLiveAttachment) {
  const std::string id = create_volume()["id"];
  const std::string first = attach(id, "instance-1")["id"];
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id}, {"instance_uuid", "instance-2"}}),
            "not_multiattach");
  ok("attachment_update", {{"attachment_id", first}, {"connector", unix_connector()}});
  ok("attachment_complete", {{"attachment_id", first}});
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id},
                                         {"instance_uuid", "instance-2"},
                                         {"connector", unix_connector("h2")}}),
            "not_multiattach");
  EXPECT_EQ(ok("attachment_list", {{"volume_id", id}}).size(), 1u);

  ok("volume_detach", {{"volume_id", id}});
  EXPECT_EQ(attach_status(first), "detached");
  Json second = attach(id, "instance-2");
  EXPECT_EQ(second["attach_status"], "reserved");
}

// Live migration (Cinder's _attachment_reserve): the instance that holds a volume that is not
// multiattach may attach it once more from another host, until the old host's attachment is
// deleted; another instance may not, and the same host twice is a duplicate.
TEST_F(ControlPlaneTest, TheSameInstanceMayAttachFromASecondHostWhileItMigrates) {
  const std::string id = create_volume()["id"];
  const std::string source = attach(id, "instance-1", {{"connector", unix_connector("h1")}})["id"];
  const Json target = attach(id, "instance-1", {{"connector", unix_connector("h2")}});
  EXPECT_EQ(target["attach_status"], "attaching");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id},
                                         {"instance_uuid", "instance-2"},
                                         {"connector", unix_connector("h3")}}),
            "not_multiattach");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id},
                                         {"instance_uuid", "instance-1"},
                                         {"connector", unix_connector("h2")}}),
            "duplicate_attachment");
  ok("attachment_delete", {{"attachment_id", source}});
  EXPECT_EQ(volume_status(id), "attaching");
  EXPECT_EQ(ok("volume_show", {{"volume_id", id}})["attachments"].size(), 1u);
}

TEST_F(ControlPlaneTest, DuplicateAttachmentIsRefused) {
  const std::string id = create_volume("1M", /*multiattach=*/true)["id"];
  const std::string first = attach(id, "instance-1", {{"attached_host", "h1"}})["id"];
  EXPECT_EQ(reason("attachment_create",
                   {{"volume_id", id}, {"instance_uuid", "instance-1"}, {"attached_host", "h1"}}),
            "duplicate_attachment");
  // The same instance on another host is another attachment (a live migration's target).
  attach(id, "instance-1", {{"attached_host", "h2"}});
  // The same on a volume that is not multiattach is still a duplicate first.
  const std::string single = create_volume()["id"];
  attach(single, "instance-1", {{"attached_host", "h1"}});
  EXPECT_EQ(
      reason("attachment_create",
             {{"volume_id", single}, {"instance_uuid", "instance-1"}, {"attached_host", "h1"}}),
      "duplicate_attachment");
  // A detached attachment does not count.
  ok("attachment_delete", {{"attachment_id", first}});
  attach(id, "instance-1", {{"attached_host", "h1"}});
}

// The host of a connector is the attachment's host when none is given: attaching the same
// instance twice through the same connector is a duplicate, however the host was named.
TEST_F(ControlPlaneTest, DuplicateAttachmentCountsTheConnectorHost) {
  const std::string id = create_volume("1M", /*multiattach=*/true)["id"];
  attach(id, "instance-1", {{"connector", unix_connector("h1")}});
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id},
                                         {"instance_uuid", "instance-1"},
                                         {"connector", unix_connector("h1")}}),
            "duplicate_attachment");
  EXPECT_EQ(reason("attachment_create",
                   {{"volume_id", id}, {"instance_uuid", "instance-1"}, {"attached_host", "h1"}}),
            "duplicate_attachment");
  EXPECT_EQ(ok("attachment_list", {{"volume_id", id}}).size(), 1u);
}

// A reservation without a host takes its connector's host at attachment_update: that must not
// make it a second live attachment of the same instance on the same host.
TEST_F(ControlPlaneTest, UpdateDoesNotMakeADuplicateThroughTheConnectorHost) {
  const std::string id = create_volume("1M", /*multiattach=*/true)["id"];
  attach(id, "instance-1", {{"connector", unix_connector("h1")}});
  const std::string reserved = attach(id, "instance-1")["id"];
  EXPECT_EQ(reason("attachment_update",
                   {{"attachment_id", reserved}, {"connector", unix_connector("h1")}}),
            "duplicate_attachment");
  EXPECT_EQ(attach_status(reserved), "reserved");
  // Through another host it is another attachment, as at create.
  Json moved =
      ok("attachment_update", {{"attachment_id", reserved}, {"connector", unix_connector("h2")}});
  EXPECT_EQ(moved["attach_status"], "attaching");
  EXPECT_EQ(moved["attached_host"], "h2");
}

TEST_F(ControlPlaneTest, VolumeDetachNeedsAnIdWithSeveralAttachments) {
  const std::string id = create_volume("1M", /*multiattach=*/true)["id"];
  EXPECT_EQ(reason("volume_detach", {{"volume_id", id}}), "invalid_state");  // nothing to detach
  const std::string a1 = attach(id, "instance-1", {{"connector", unix_connector("h1")}})["id"];
  const std::string a2 = attach(id, "instance-2", {{"connector", unix_connector("h2")}})["id"];
  ok("attachment_complete", {{"attachment_id", a1}});
  EXPECT_EQ(reason("volume_detach", {{"volume_id", id}}), "attachment_id_required");
  EXPECT_EQ(attach_status(a1), "attached");
  EXPECT_EQ(attach_status(a2), "attaching");

  // An attachment of another volume is not this volume's.
  const std::string other = create_volume()["id"];
  const std::string foreign = attach(other, "instance-3")["id"];
  EXPECT_EQ(reason("volume_detach", {{"volume_id", id}, {"attachment_id", foreign}}), "not_found");
  EXPECT_EQ(attach_status(foreign), "reserved");

  Json detached = ok("volume_detach", {{"volume_id", id}, {"attachment_id", a2}});
  EXPECT_EQ(detached["id"], a2);
  EXPECT_EQ(detached["attach_status"], "detached");
  EXPECT_EQ(attach_status(a1), "attached");
  EXPECT_EQ(volume_status(id), "in-use");
  // One left: the id may be left out.
  detached = ok("volume_detach", {{"volume_id", id}});
  EXPECT_EQ(detached["id"], a1);
  EXPECT_EQ(volume_status(id), "available");
}

// --- Policy ---

TEST_F(ControlPlaneTest, PolicyCanForbidMultiattach) {
  // A multiattach volume made while the policy allowed it.
  const std::string shared = create_volume("1M", /*multiattach=*/true)["id"];
  const std::string single = create_volume()["id"];
  open(Policy{.allow_multiattach = false, .allow_multiattach_bootable = true});

  EXPECT_EQ(reason("volume_create", {{"name", "v"}, {"size", "1M"}, {"multiattach", true}}),
            "policy_denied");
  EXPECT_EQ(reason("volume_update", {{"volume_id", single}, {"multiattach", true}}),
            "policy_denied");
  EXPECT_EQ(ok("volume_show", {{"volume_id", single}})["multiattach"], false);
  create_volume("1M", /*multiattach=*/false);

  attach(shared, "instance-1");  // one attachment is not multiattach
  EXPECT_EQ(reason("attachment_create", {{"volume_id", shared}, {"instance_uuid", "instance-2"}}),
            "policy_denied");
  EXPECT_EQ(ok("attachment_list", {{"volume_id", shared}}).size(), 1u);
}

TEST_F(ControlPlaneTest, PolicyCanForbidSharingBootableVolumes) {
  open(Policy{.allow_multiattach = true, .allow_multiattach_bootable = false});
  const std::string boot = create_volume("1M", /*multiattach=*/true, /*bootable=*/true)["id"];
  attach(boot, "instance-1");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", boot}, {"instance_uuid", "instance-2"}}),
            "policy_denied");
  EXPECT_EQ(ok("attachment_list", {{"volume_id", boot}}).size(), 1u);

  // A data volume may still be shared.
  const std::string data = create_volume("1M", /*multiattach=*/true)["id"];
  attach(data, "instance-1");
  attach(data, "instance-2");
  // ...but not be made bootable while it is: that would be a shared bootable volume all the same.
  EXPECT_EQ(reason("volume_update", {{"volume_id", data}, {"bootable", true}}), "policy_denied");
  EXPECT_EQ(ok("volume_show", {{"volume_id", data}})["bootable"], false);
  // With one attachment it may.
  const std::string one = create_volume("1M", /*multiattach=*/true)["id"];
  attach(one, "instance-1");
  EXPECT_EQ(ok("volume_update", {{"volume_id", one}, {"bootable", true}})["bootable"], true);
}

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

// --- JSON-RPC framing ---

TEST_F(ControlPlaneTest, MalformedJsonIsAParseError) {
  for (const std::string line : {"{", "not json", "{\"jsonrpc\": \"2.0\", \"id\": 1,", "\xff\xfe{}",
                                 "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"\xc3\"}"}) {
    Json response = Json::parse(plane_->handle(line, caller_));
    ASSERT_TRUE(response.contains("error")) << response;
    EXPECT_EQ(response["error"]["code"], -32700) << line;
    EXPECT_EQ(response["id"], nullptr);
    EXPECT_EQ(response["jsonrpc"], "2.0");
  }
  // And the plane carries on.
  create_volume();
}

TEST_F(ControlPlaneTest, InvalidRequestsAreRefused) {
  auto error_code = [&](const std::string& line) {
    Json response = Json::parse(plane_->handle(line, caller_));
    EXPECT_TRUE(response.contains("error")) << line << " -> " << response;
    return response["error"].value("code", 0);
  };
  EXPECT_EQ(error_code(R"({"jsonrpc":"2.0","id":1,"method":"no_such_method"})"), -32601);
  EXPECT_EQ(error_code(R"({"jsonrpc":"2.0","id":1,"method":"no_such_method","params":{}})"),
            -32601);
  EXPECT_EQ(error_code(R"({"id":1,"method":"volume_list"})"), -32600);
  EXPECT_EQ(error_code(R"({"jsonrpc":"1.0","id":1,"method":"volume_list"})"), -32600);
  EXPECT_EQ(error_code(R"({"jsonrpc":"2.0","id":1,"method":7})"), -32600);
  // A "jsonrpc" member of the wrong type is an invalid request, not an exception.
  EXPECT_EQ(error_code(R"({"jsonrpc":2.0,"id":1,"method":"volume_list"})"), -32600);
  EXPECT_EQ(error_code(R"({"jsonrpc":null,"id":1,"method":"volume_list"})"), -32600);
  EXPECT_EQ(error_code(R"({"jsonrpc":["2.0"],"id":1,"method":"volume_list"})"), -32600);
  EXPECT_EQ(error_code(R"({"jsonrpc":"2.0","id":{},"method":"volume_list"})"), -32600);
  EXPECT_EQ(error_code(R"(42)"), -32600);
  EXPECT_EQ(error_code(R"("volume_list")"), -32600);
  EXPECT_EQ(error_code(R"([])"), -32600);
  // Deep nesting is one invalid request, refused before anything is built from it: copying or
  // dumping a deeply nested value would overflow the stack.
  Json nested =
      Json::parse(plane_->handle(std::string(100000, '[') + std::string(100000, ']'), caller_));
  ASSERT_TRUE(nested.is_object()) << nested;
  EXPECT_EQ(nested["error"]["code"], -32600);
  EXPECT_EQ(nested["error"]["data"]["reason"], "invalid_params");
  EXPECT_EQ(error_code(R"({"jsonrpc":"2.0","id":1,"method":"volume_list","params":[]})"), -32602);

  Json unknown = Json::parse(plane_->handle(
      R"({"jsonrpc":"2.0","id":"abc","method":"volume_shred","params":{}})", caller_));
  EXPECT_EQ(unknown["id"], "abc");
  EXPECT_EQ(unknown["error"]["code"], -32601);

  // Every API error names its reason in data.reason.
  Json refused = Json::parse(plane_->handle(
      R"({"jsonrpc":"2.0","id":9,"method":"volume_create","params":{"name":"v","size":0}})",
      caller_));
  EXPECT_EQ(refused["id"], 9);
  EXPECT_EQ(refused["error"]["code"], -32602);
  EXPECT_EQ(refused["error"]["data"]["reason"], "invalid_params");
}

TEST_F(ControlPlaneTest, NotificationsGetNoReply) {
  EXPECT_EQ(plane_->handle(R"({"jsonrpc":"2.0","method":"volume_list"})", caller_), "");
  // Not even when they fail...
  EXPECT_EQ(
      plane_->handle(R"({"jsonrpc":"2.0","method":"volume_create","params":{"size":0}})", caller_),
      "");
  EXPECT_EQ(plane_->handle(R"({"jsonrpc":"2.0","method":"no_such_method"})", caller_), "");
  // ...but they do run.
  EXPECT_EQ(plane_->handle(
                R"({"jsonrpc":"2.0","method":"volume_create","params":{"name":"n","size":"1M"}})",
                caller_),
            "");
  Json volumes = ok("volume_list", Json::object());
  ASSERT_EQ(volumes.size(), 1u);
  EXPECT_EQ(volumes[0]["name"], "n");
  // A null id is a request, not a notification.
  Json response =
      Json::parse(plane_->handle(R"({"jsonrpc":"2.0","id":null,"method":"volume_list"})", caller_));
  EXPECT_EQ(response["id"], nullptr);
  EXPECT_EQ(response["result"].size(), 1u);
}

// Strings from callers are bounded, NUL-free and of their documented type, connector fields
// included (docs/api.md): a name "a\u0000b" was stored as "a", and a 70 KB instance_uuid,
// an integer initiator or a string multipath were accepted.
TEST_F(ControlPlaneTest, CallerStringsAreBoundedNulFreeAndTyped) {
  EXPECT_EQ(reason("volume_create", {{"name", std::string("a\0b", 3)}, {"size", "1M"}}),
            "invalid_params");
  EXPECT_EQ(reason("volume_create", {{"name", std::string(256, 'n')}, {"size", "1M"}}),
            "invalid_params");
  ok("volume_create", {{"name", std::string(255, 'n')}, {"size", "1M"}});
  const std::string id = create_volume("1M", /*multiattach=*/true)["id"];
  EXPECT_EQ(reason("attachment_create",
                   {{"volume_id", id}, {"instance_uuid", std::string(70 * 1024, 'u')}}),
            "invalid_params");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id},
                                         {"instance_uuid", "i"},
                                         {"attached_host", std::string("h\0x", 3)}}),
            "invalid_params");
  for (const Json& bad :
       {Json{{"host", "h"}, {"transport", "unix"}, {"initiator", 5}},
        Json{{"host", "h"}, {"transport", "unix"}, {"platform", Json::array()}},
        Json{{"host", "h"}, {"transport", "unix"}, {"os_type", std::string(256, 'o')}},
        Json{{"host", "h"}, {"transport", "unix"}, {"multipath", "yes"}},
        Json{{"host", std::string(256, 'h')}, {"transport", "unix"}},
        Json{{"host", "h"}, {"transport", "fuse"}, {"mountpoint", "/" + std::string(4096, 'm')}}}) {
    EXPECT_EQ(reason("attachment_create",
                     {{"volume_id", id}, {"instance_uuid", "i"}, {"connector", bad}}),
              "invalid_params")
        << bad.dump().substr(0, 120);
  }
  Json a = attach(id, "i",
                  {{"connector",
                    {{"host", "h"},
                     {"transport", "unix"},
                     {"initiator", "iqn.2026-11.org.example:h"},
                     {"platform", "x86_64"},
                     {"os_type", "linux"},
                     {"multipath", false}}}});
  EXPECT_EQ(a["connector"]["multipath"], false);
}

// A caller's string cannot forge a log line: control characters are escaped, in names and in
// the messages that quote them.
TEST(Printable, EscapesWhatCouldForgeALogLine) {
  using shareblk::printable;
  EXPECT_EQ(printable("vol-1"), "vol-1");
  EXPECT_EQ(printable("a\n[info] forged"), "a\\n[info] forged");
  EXPECT_EQ(printable(std::string("a\0b\x1b[31m\\", 9)), "a\\x00b\\x1b[31m\\\\");
  EXPECT_EQ(printable("\xc3\xa9"), "\\xc3\\xa9");
  EXPECT_EQ(printable(std::string(300, 'x'), 256), std::string(256, 'x') + "...");
}

// Only a valid request without "id" is a notification: an invalid one is answered with
// -32600 and "id": null (JSON-RPC 2.0, sections 4.1 and 5), alone or in a batch.
TEST_F(ControlPlaneTest, InvalidRequestsWithoutAnIdAreAnswered) {
  for (const std::string line :
       {R"({"foo": 1})", R"({"jsonrpc":"2.0"})", R"({"jsonrpc":"1.0","method":"volume_list"})",
        R"({"jsonrpc":"2.0","method":7})", R"({"method":"volume_list"})"}) {
    const std::string reply = plane_->handle(line, caller_);
    ASSERT_FALSE(reply.empty()) << line;
    Json response = Json::parse(reply);
    EXPECT_EQ(response["jsonrpc"], "2.0") << reply;
    EXPECT_TRUE(response.contains("id") && response["id"].is_null()) << reply;
    EXPECT_EQ(response["error"]["code"], -32600) << reply;
    EXPECT_EQ(response["error"]["data"]["reason"], "invalid_params") << reply;
  }
  Json batch = Json::parse(
      plane_->handle(R"([{"foo": 1}, {"jsonrpc":"2.0","method":"volume_list"}])", caller_));
  ASSERT_TRUE(batch.is_array()) << batch;
  ASSERT_EQ(batch.size(), 1u) << batch;  // the notification gets nothing
  EXPECT_EQ(batch[0]["error"]["code"], -32600);
  EXPECT_TRUE(batch[0]["id"].is_null());
}

TEST_F(ControlPlaneTest, BatchesAnswerEachRequest) {
  const std::string line = R"([
    {"jsonrpc":"2.0","id":1,"method":"volume_create","params":{"name":"a","size":"1M"}},
    {"jsonrpc":"2.0","method":"volume_create","params":{"name":"b","size":"1M"}},
    {"jsonrpc":"2.0","id":"x","method":"volume_create","params":{"name":"c","size":0}},
    {"jsonrpc":"2.0","id":3,"method":"no_such_method"},
    17,
    {"jsonrpc":"2.0","id":4,"method":"volume_list"}
  ])";
  Json responses = Json::parse(plane_->handle(line, caller_));
  ASSERT_TRUE(responses.is_array()) << responses;
  ASSERT_EQ(responses.size(), 5u) << responses;
  EXPECT_EQ(responses[0]["id"], 1);
  EXPECT_EQ(responses[0]["result"]["name"], "a");
  EXPECT_EQ(responses[1]["id"], "x");
  EXPECT_EQ(responses[1]["error"]["data"]["reason"], "invalid_params");
  EXPECT_EQ(responses[2]["id"], 3);
  EXPECT_EQ(responses[2]["error"]["code"], -32601);
  EXPECT_EQ(responses[3]["id"], nullptr);
  EXPECT_EQ(responses[3]["error"]["code"], -32600);
  EXPECT_EQ(responses[4]["id"], 4);
  EXPECT_EQ(responses[4]["result"].size(), 2u);  // a and the notification's b, in order

  // A batch of notifications only gets no reply at all.
  EXPECT_EQ(plane_->handle(R"([{"jsonrpc":"2.0","method":"volume_list"}])", caller_), "");
}

// A line's reply is bounded (issue 19): one line under 1 MiB of 21,845 volume_list calls made
// a 1.34 GB reply. A batch holds at most 256 requests, and its reply at most 16 MiB: the
// request that crosses it gets an error instead, and the rest are not run.
TEST_F(ControlPlaneTest, BatchesAndRepliesAreBounded) {
  const Json call{{"jsonrpc", "2.0"}, {"id", 1}, {"method", "volume_list"}};
  Json too_many = Json::array();
  for (int i = 0; i < 257; ++i) too_many.push_back(call);
  Json refused = Json::parse(plane_->handle(too_many.dump(), caller_));
  EXPECT_EQ(refused["error"]["code"], -32600) << refused;
  EXPECT_NE(refused["error"]["message"].get<std::string>().find("at most 256"), std::string::npos);

  // Enough volumes that 200 volume_lists are over 16 MiB.
  while (ok("volume_list", Json::object()).dump().size() < (16u << 20) / 200) {
    for (int i = 0; i < 50; ++i) create_volume(512);
  }
  Json big = Json::array();
  for (int i = 0; i < 256; ++i) {
    Json one = call;
    one["id"] = i;
    big.push_back(one);
  }
  const std::string reply = plane_->handle(big.dump(), caller_);
  EXPECT_LE(reply.size(), (16u << 20) + 64 * 1024);
  Json responses = Json::parse(reply);
  ASSERT_EQ(responses.size(), 256u);
  size_t results = 0;
  while (results < responses.size() && responses[results].contains("result")) ++results;
  ASSERT_GT(results, 100u);
  ASSERT_LT(results, 256u);
  EXPECT_NE(responses[results]["error"]["message"].get<std::string>().find("bytes a reply line"),
            std::string::npos)
      << responses[results];
  EXPECT_EQ(responses[255]["id"], 255);
  EXPECT_EQ(responses[255]["error"]["data"]["reason"], "internal");
  EXPECT_NE(responses[255]["error"]["message"].get<std::string>().find("not run"),
            std::string::npos);
}

// --- Concurrency ---

// All changes to one volume's attachments are serialized: of many concurrent creates on a
// volume that is not multiattach, exactly one wins.
TEST_F(ControlPlaneTest, ConcurrentCreatesOnASingleAttachVolumeYieldOne) {
  const std::string id = create_volume()["id"];
  constexpr int kCallers = 50;
  std::vector<std::string> replies(kCallers);
  std::vector<std::thread> threads;
  std::atomic<bool> go{false};
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back([&, i] {
      const Json req{
          {"jsonrpc", "2.0"},
          {"id", i},
          {"method", "attachment_create"},
          {"params", {{"volume_id", id}, {"instance_uuid", "instance-" + std::to_string(i)}}}};
      while (!go.load()) std::this_thread::yield();
      replies[i] = plane_->handle(req.dump(), caller_);
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  int created = 0;
  int refused = 0;
  for (const std::string& reply : replies) {
    Json response = Json::parse(reply);
    if (response.contains("result")) ++created;
    if (response.contains("error") && response["error"]["data"]["reason"] == "not_multiattach") {
      ++refused;
    }
  }
  EXPECT_EQ(created, 1);
  EXPECT_EQ(refused, kCallers - 1);
  EXPECT_EQ(ok("attachment_list", {{"volume_id", id}}).size(), 1u);
}

// --- Restart ---

TEST_F(ControlPlaneTest, ReopeningKeepsEverything) {
  const std::string shared = create_volume("2M", /*multiattach=*/true, /*bootable=*/true)["id"];
  const std::string single = create_volume("1M")["id"];
  const std::string reserved = attach(shared, "i-1")["id"];
  const std::string attached =
      attach(shared, "i-2", {{"mode", "ro"}, {"connector", unix_connector()}})["id"];
  ok("attachment_complete", {{"attachment_id", attached}});
  const std::string detached = attach(single, "i-3", {{"connector", unix_connector()}})["id"];
  ok("attachment_delete", {{"attachment_id", detached}});
  const Json volumes = ok("volume_list", Json::object());
  const Json attachments = ok("attachment_list", Json::object());
  ASSERT_EQ(volumes.size(), 2u);
  ASSERT_EQ(attachments.size(), 3u);

  open();
  EXPECT_EQ(ok("volume_list", Json::object()), volumes);
  EXPECT_EQ(ok("attachment_list", Json::object()), attachments);
  EXPECT_EQ(attach_status(reserved), "reserved");
  EXPECT_EQ(attach_status(attached), "attached");
  EXPECT_EQ(attach_status(detached), "detached");
  // The rules still hold on the reopened state.
  EXPECT_EQ(reason("volume_delete", {{"volume_id", shared}}), "volume_in_use");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", shared}, {"instance_uuid", "i-1"}}),
            "duplicate_attachment");
}

TEST_F(ControlPlaneTest, AnAttachmentLeftDetachingIsDetachedAtOpen) {
  const std::string id = create_volume()["id"];
  const std::string attachment = attach(id, "instance-1", {{"connector", unix_connector()}})["id"];
  ok("attachment_complete", {{"attachment_id", attachment}});
  close();
  {
    // What a daemon killed in the middle of attachment_delete leaves behind.
    shareblk::control::Database db(db_path());
    shareblk::control::Database::Transaction tx(db);
    auto row = tx.attachment(attachment);
    ASSERT_TRUE(row.has_value());
    row->attach_status = shareblk::control::AttachStatus::Detaching;
    tx.update_attachment(*row);
    tx.commit();
  }
  open();
  Json a = ok("attachment_show", {{"attachment_id", attachment}});
  EXPECT_EQ(a["attach_status"], "detached");
  EXPECT_TRUE(a["detach_time"].is_string());
  EXPECT_EQ(volume_status(id), "available");
  ok("volume_delete", {{"volume_id", id}, {"wait", true}});
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

// --- What clients can make the daemon keep ---

class NullSubscriber : public shareblk::control::Subscriber {
 public:
  void notify(const std::string&) override { ++notices; }
  int notices = 0;
};

// A Service driven directly, for the tables a ControlPlane does not show.
class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shareblk::lvm::StoreError error;
    store_ = shareblk::lvm::make_file_store(dir_ / "volumes", false, error);
    ASSERT_TRUE(store_) << error.message;
    service_ =
        std::make_unique<shareblk::control::Service>(dir_ / "shareblk.db", *store_, Policy{});
    service_->bind(nullptr, Endpoints{kUnixSocket, kTcpEndpoint});
  }
  Json call(const std::string& method, const Json& params) {
    const shareblk::control::Method* m = shareblk::control::find_method(method);
    if (m == nullptr) throw std::runtime_error("no method " + method);
    shareblk::control::only_keys(params, m->params);
    return m->run(*service_, params, caller_);
  }
  std::string reason(const std::string& method, const Json& params) {
    try {
      call(method, params);
    } catch (const shareblk::control::ApiError& e) {
      return e.reason;
    }
    return "(succeeded)";
  }

  shareblk::testing::TempDir dir_;
  std::unique_ptr<shareblk::lvm::VolumeStore> store_;
  std::unique_ptr<shareblk::control::Service> service_;
  shareblk::control::Caller caller_{1234, 1000};
};

TEST_F(ServiceTest, UnknownVolumeIdsLeaveNoLockBehind) {
  for (int i = 0; i < 200; ++i) {
    const std::string bogus = "no-such-volume-" + std::to_string(i);
    EXPECT_EQ(reason("volume_update", {{"volume_id", bogus}, {"bootable", true}}), "not_found");
    EXPECT_EQ(reason("volume_extend", {{"volume_id", bogus}, {"size", "2M"}}), "not_found");
    EXPECT_EQ(reason("volume_delete", {{"volume_id", bogus}}), "not_found");
    EXPECT_EQ(reason("volume_detach", {{"volume_id", bogus}}), "not_found");
    EXPECT_EQ(reason("attachment_create", {{"volume_id", bogus}, {"instance_uuid", "i"}}),
              "not_found");
  }
  EXPECT_EQ(service_->volume_lock_count(), 0u);
  // Nor does a volume once its calls are answered, deleted or not.
  const std::string id = call("volume_create", {{"name", "v"}, {"size", "1M"}})["id"];
  call("volume_update", {{"volume_id", id}, {"bootable", true}});
  const std::string a =
      call("attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}})["id"];
  call("attachment_delete", {{"attachment_id", a}});
  call("volume_delete", {{"volume_id", id}, {"wait", true}});
  EXPECT_EQ(service_->volume_lock_count(), 0u);
}

TEST_F(ServiceTest, ExportResolveKeepsOneEntryPerLiveSubscriber) {
  const std::string id = call("volume_create", {{"name", "v"}, {"size", "1M"}})["id"];
  Json a = call("attachment_create", {{"volume_id", id},
                                      {"instance_uuid", "i"},
                                      {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  const Json resolve{{"export_name", a["connection_info"]["data"]["export_name"]}};
  // Each nbdkit connection is a control client of its own, gone when the connection is.
  for (int i = 0; i < 1000; ++i) {
    auto gone = std::make_shared<NullSubscriber>();
    caller_.subscriber = gone;
    call("export_resolve", resolve);
  }
  EXPECT_LE(service_->subscriber_count(), 1u);
  // One client resolving again and again is one subscriber, told of the revocation once.
  auto kept = std::make_shared<NullSubscriber>();
  caller_.subscriber = kept;
  for (int i = 0; i < 100; ++i) call("export_resolve", resolve);
  EXPECT_EQ(service_->subscriber_count(), 1u);
  call("attachment_delete", {{"attachment_id", a["id"]}});
  EXPECT_EQ(kept->notices, 1);
  EXPECT_EQ(service_->subscriber_count(), 0u);
}

}  // namespace
