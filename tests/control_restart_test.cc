// What the control plane keeps: its state across a restart, and what clients can make it hold.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "control/db.h"
#include "control/methods.h"
#include "control/params.h"
#include "control/service.h"
#include "tests/control_fixture.h"

namespace shareblk::testing::control_unit {
namespace {

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
    shareblk::store::StoreError error;
    store_ = shareblk::store::make_file_store(dir_ / "volumes", false, error);
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
  std::unique_ptr<shareblk::store::VolumeStore> store_;
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
  EXPECT_EQ(service_->counts().volume_locks, 0u);
  // Nor does a volume once its calls are answered, deleted or not.
  const std::string id = call("volume_create", {{"name", "v"}, {"size", "1M"}})["id"];
  call("volume_update", {{"volume_id", id}, {"bootable", true}});
  const std::string a =
      call("attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}})["id"];
  call("attachment_delete", {{"attachment_id", a}});
  call("volume_delete", {{"volume_id", id}, {"wait", true}});
  EXPECT_EQ(service_->counts().volume_locks, 0u);
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
  EXPECT_LE(service_->counts().subscribers, 1u);
  // One client resolving again and again is one subscriber, told of the revocation once.
  auto kept = std::make_shared<NullSubscriber>();
  caller_.subscriber = kept;
  for (int i = 0; i < 100; ++i) call("export_resolve", resolve);
  EXPECT_EQ(service_->counts().subscribers, 1u);
  call("attachment_delete", {{"attachment_id", a["id"]}});
  EXPECT_EQ(kept->notices, 1);
  EXPECT_EQ(service_->counts().subscribers, 0u);
}

}  // namespace
}  // namespace shareblk::testing::control_unit
