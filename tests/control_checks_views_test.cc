// Two of Service's objects on their own: whether a volume may be used now
// (control/volume_checks.h) and what the API shows of it (control/views.h), over a real state
// database and the fake store.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "control/api_error.h"
#include "control/db.h"
#include "control/export_registry.h"
#include "control/psk_keys.h"
#include "control/views.h"
#include "control/volume_checks.h"
#include "control/volume_jobs.h"
#include "control/volume_registry.h"
#include "tests/fake_volume_store.h"
#include "tests/support.h"

namespace {

using namespace shareblk::control;
using shareblk::testing::FakeVolumeStore;
using shareblk::testing::TempDir;

// The reason of the ApiError `call` throws; "" when it throws none.
template <typename Call>
std::string reason_of(Call&& call, std::string* message = nullptr) {
  try {
    call();
  } catch (const ApiError& e) {
    if (message != nullptr) *message = e.what();
    return e.reason;
  }
  return "";
}

class ChecksAndViewsTest : public ::testing::Test {
 protected:
  ChecksAndViewsTest() {
    volume_.id = "11111111-2222-4333-8444-555555555555";
    volume_.name = "data";
    volume_.size = 1 << 20;
    volume_.created_at = "2026-11-28T00:00:00.000000Z";
    Database::Transaction tx(db_);
    tx.insert_volume(volume_);
    tx.commit();
  }

  void put_intent(IntentAction action, const std::string& error) {
    Database::Transaction tx(db_);
    tx.put_intent({volume_.id, action, error, volume_.created_at});
    tx.commit();
  }
  std::string refuse_pending() {
    Database::Transaction tx(db_);
    return reason_of([&] { checks_.refuse_pending(tx, "volume", volume_.id, "attached"); },
                     &message_);
  }

  TempDir dir_;
  Database db_{dir_ / "state.db"};
  FakeVolumeStore store_;
  VolumeRegistry volumes_{store_};
  VolumeJobs jobs_;
  VolumeChecks checks_{volumes_, jobs_};
  ExportRegistry exports_;
  PskKeys psk_;
  Endpoints endpoints_{"/run/shareblk/nbd.sock", "192.0.2.10:10809"};
  Views views_{{exports_, checks_, jobs_, psk_, endpoints_, [] { return Policy{}; }, nullptr}};
  VolumeRow volume_;
  std::string message_;
};

TEST_F(ChecksAndViewsTest, AVolumeBeingDeletedIsBusyAndOneWhoseDeleteFailedIsInError) {
  put_intent(IntentAction::Delete, "");
  EXPECT_EQ(refuse_pending(), "volume_busy");
  EXPECT_NE(message_.find("being deleted"), std::string::npos) << message_;
  put_intent(IntentAction::Delete, "the disk said no");
  EXPECT_EQ(refuse_pending(), "volume_error");
  EXPECT_NE(message_.find("delete it again"), std::string::npos) << message_;
  // A volume in error may still change (a retried delete clears it); one being deleted not.
  Database::Transaction tx(db_);
  EXPECT_EQ(reason_of([&] { checks_.refuse_busy(tx, volume_, "grow"); }), "");
}

TEST_F(ChecksAndViewsTest, AFillThatFailedSaysSoAndAFillUnderWayIsBusy) {
  put_intent(IntentAction::Create, "");
  EXPECT_EQ(refuse_pending(), "volume_busy");
  EXPECT_NE(message_.find("being filled"), std::string::npos) << message_;
  {
    Database::Transaction tx(db_);
    EXPECT_EQ(reason_of([&] { checks_.refuse_busy(tx, volume_, "grow"); }), "volume_busy");
  }
  put_intent(IntentAction::Create, "qemu-img failed");
  EXPECT_EQ(refuse_pending(), "volume_error");
  EXPECT_NE(message_.find("filling it failed (qemu-img failed)"), std::string::npos) << message_;
}

TEST_F(ChecksAndViewsTest, AVolumeWithoutBackingIsInErrorUntilItIsThere) {
  EXPECT_EQ(reason_of([&] { checks_.refuse_missing("volume", volume_.id, volume_.size, "used"); }),
            "volume_error");
  EXPECT_TRUE(checks_.error_of(std::nullopt, volume_.id).has_value());
  ASSERT_FALSE(store_.create(volume_.id, volume_.size));
  EXPECT_EQ(reason_of([&] { checks_.refuse_missing("volume", volume_.id, volume_.size, "used"); }),
            "");
  EXPECT_FALSE(checks_.error_of(std::nullopt, volume_.id).has_value());
}

TEST_F(ChecksAndViewsTest, LookupsOfUnknownIdsAreNotFound) {
  Database::Transaction tx(db_);
  EXPECT_EQ(reason_of([&] { find_volume(tx, "nope"); }), "not_found");
  EXPECT_EQ(reason_of([&] { find_attachment(tx, "nope"); }), "not_found");
  EXPECT_EQ(find_volume(tx, volume_.id).name, "data");
}

TEST_F(ChecksAndViewsTest, AnotherGatewaysAttachmentShowsOnlyWhatAnyGatewayKnows) {
  AttachmentRow a;
  a.id = "a1";
  a.volume_id = volume_.id;
  a.instance_uuid = "i1";
  a.mode = shareblk::backend::AttachMode::ReadWrite;
  a.attach_status = AttachStatus::Attached;
  a.connector = R"({"transport":"unix"})";
  a.gateway = "gateway-b";
  const Json view = views_.attachment_view(a);
  EXPECT_EQ(view["gateway"], "gateway-b");
  EXPECT_EQ(view["mode"], "rw");
  EXPECT_EQ(view["attach_status"], "attached");
  for (const char* only_its_gateway_knows :
       {"connector", "connection_info", "connections", "write_access", "qos"}) {
    EXPECT_TRUE(view[only_its_gateway_knows].is_null()) << only_its_gateway_knows;
  }
  a.gateway.clear();  // this gateway's, in a store of one gateway: it names none
  EXPECT_TRUE(views_.attachment_view(a)["gateway"].is_null());
}

TEST_F(ChecksAndViewsTest, AServedAttachmentsConnectionInfoNamesTheListenerItsConnectorChose) {
  AttachmentRow a;
  a.id = "a1";
  a.volume_id = volume_.id;
  a.mode = shareblk::backend::AttachMode::ReadOnly;
  a.attach_status = AttachStatus::Attached;
  a.export_name = "secret-export";
  a.connector = R"({"transport":"unix"})";
  Json info = views_.attachment_json(a, volume_)["connection_info"];
  EXPECT_EQ(info["driver_volume_type"], "nbd");
  EXPECT_EQ(info["data"]["uri"], "nbd+unix:///secret-export?socket=/run/shareblk/nbd.sock");
  EXPECT_EQ(info["data"]["access_mode"], "ro");
  a.connector = R"({"transport":"tcp"})";
  info = views_.attachment_json(a, volume_)["connection_info"];
  EXPECT_EQ(info["data"]["uri"], "nbd://192.0.2.10:10809/secret-export");
  a.attach_status = AttachStatus::Reserved;  // not served yet: nothing to connect to
  a.connector.clear();
  EXPECT_TRUE(views_.attachment_json(a, volume_)["connection_info"].is_null());
}

TEST_F(ChecksAndViewsTest, ASnapshotWhoseCopyFailedShowsErrorWithItsReason) {
  const SnapshotRow s{"s1", volume_.id, "before-upgrade", volume_.size, volume_.created_at};
  const IntentRow failed{"s1", IntentAction::Create, "no space", volume_.created_at};
  const Json shown = views_.snapshot_json(s, failed);
  EXPECT_EQ(shown["status"], "error");
  EXPECT_NE(shown["status_reason"].get<std::string>().find("no space"), std::string::npos);
  EXPECT_TRUE(shown["progress"].is_null());
  const IntentRow copying{"s1", IntentAction::Create, "", volume_.created_at};
  EXPECT_EQ(views_.snapshot_json(s, copying)["status"], "creating");
  EXPECT_EQ(views_.snapshot_json(s, copying)["progress"], 0);  // no job: not started
}

}  // namespace
