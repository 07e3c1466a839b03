// The control plane in-process, its attachments: the state machine, policy, concurrent creates.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_fixture.h"

namespace shareblk::testing::control_unit {
namespace {

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

}  // namespace
}  // namespace shareblk::testing::control_unit
