// Two gateways' control planes on one shared store, in-process: the store's bytes are one file
// store both open, and what gateways keep beside the bytes (store::Gateways) is an in-memory
// cluster with the contract of store/gateways.h (compare-and-set records, watches, links, one
// writer lock per volume). What control does with it is the same code the RBD store drives
// (docs/scale-out.md); e2e_rbd_tests runs it on a real Ceph cluster.
#include <gtest/gtest.h>

#include <cerrno>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "control/api_error.h"
#include "control/control.h"
#include "control/gateway_records.h"
#include "store/gateways.h"
#include "store/volume_store.h"
#include "tests/support.h"

namespace {

namespace fs = std::filesystem;
using shareblk::control::ControlPlane;
using shareblk::store::Gateways;
using shareblk::store::StoreError;
using Json = nlohmann::json;

// What a cluster holds for every gateway: records, definitions, links, watchers, locks.
struct Cluster {
  std::mutex mutex;
  std::map<std::string, std::pair<std::string, uint64_t>> records;  // id -> (text, version)
  std::map<std::pair<std::string, Gateways::DefinitionPart>, std::string> definitions;
  std::map<std::string, std::string> links;  // attachment -> volume
  std::map<std::string, std::map<std::string, Gateways::RecordChanged>> watches;  // id -> client
  std::map<std::string, std::string> locks;  // the volume's path -> holder
  std::set<std::string> fenced;              // clients cut off
  int claims = 0;
  bool always_lose = false;  // another gateway wins every compare-and-set
};

// One gateway's client of the cluster.
class FakeGateways final : public Gateways {
 public:
  FakeGateways(std::shared_ptr<Cluster> cluster, std::string client)
      : cluster_(std::move(cluster)), client_(std::move(client)) {}

  StoreError save_definition(const std::string& id, DefinitionPart part,
                             const std::string& text) override {
    std::lock_guard lock(cluster_->mutex);
    cluster_->definitions[{id, part}] = text;
    return {};
  }
  StoreError load_definition(const std::string& id, DefinitionPart part,
                             std::string& text) override {
    std::lock_guard lock(cluster_->mutex);
    auto it = cluster_->definitions.find({id, part});
    if (it == cluster_->definitions.end()) return StoreError::from_errno(ENOENT, "definition");
    text = it->second;
    return {};
  }
  StoreError read_record(const std::string& id, std::string& text, uint64_t& version) override {
    std::lock_guard lock(cluster_->mutex);
    auto it = cluster_->records.find(id);
    text = it == cluster_->records.end() ? "" : it->second.first;
    version = it == cluster_->records.end() ? 0 : it->second.second;
    return {};
  }
  StoreError write_record(const std::string& id, const std::string& text,
                          uint64_t version) override {
    std::lock_guard lock(cluster_->mutex);
    if (cluster_->always_lose) return StoreError::from_errno(ECANCELED, "record");
    auto& [held, held_version] = cluster_->records[id];
    if (held_version != version) return StoreError::from_errno(ECANCELED, "record");
    held = text;
    held_version = version + 1;
    return {};
  }
  StoreError watch_record(const std::string& id, const RecordChanged& changed) override {
    std::lock_guard lock(cluster_->mutex);
    cluster_->watches[id][client_] = changed;
    return {};
  }
  void unwatch_record(const std::string& id) override {
    std::lock_guard lock(cluster_->mutex);
    cluster_->watches[id].erase(client_);
  }
  // The watchers are called here, before it returns, as "every watcher has seen it" allows.
  StoreError notify_record(const std::string& id, std::chrono::milliseconds) override {
    std::map<std::string, RecordChanged> watchers;
    {
      std::lock_guard lock(cluster_->mutex);
      watchers = cluster_->watches[id];
    }
    for (const auto& [client, changed] : watchers) changed(id);
    return {};
  }
  StoreError link_attachment(const std::string& attachment_id,
                             const std::string& volume_id) override {
    std::lock_guard lock(cluster_->mutex);
    cluster_->links[attachment_id] = volume_id;
    return {};
  }
  StoreError linked_volume(const std::string& attachment_id, std::string& volume_id) override {
    std::lock_guard lock(cluster_->mutex);
    auto it = cluster_->links.find(attachment_id);
    if (it == cluster_->links.end()) return StoreError::from_errno(ENOENT, "link");
    volume_id = it->second;
    return {};
  }
  StoreError unlink_attachment(const std::string& attachment_id) override {
    std::lock_guard lock(cluster_->mutex);
    cluster_->links.erase(attachment_id);
    return {};
  }
  int claim_writer(shareblk::backend::Volume& volume) override {
    std::lock_guard lock(cluster_->mutex);
    ++cluster_->claims;
    auto [it, made] = cluster_->locks.emplace(volume.path(), client_);
    return made || it->second == client_ ? 0 : EBUSY;
  }
  int fence_writer(shareblk::backend::Volume& volume, std::string& fenced,
                   const std::string& only) override {
    std::lock_guard lock(cluster_->mutex);
    auto it = cluster_->locks.find(volume.path());
    if (it != cluster_->locks.end() && it->second != client_) {
      if (!only.empty() && it->second != only) return EBUSY;
      fenced = it->second;
      cluster_->fenced.insert(fenced);
    }
    cluster_->locks[volume.path()] = client_;
    return 0;
  }
  int lock_owner(shareblk::backend::Volume& volume, std::string& out) override {
    std::lock_guard lock(cluster_->mutex);
    auto it = cluster_->locks.find(volume.path());
    out = it != cluster_->locks.end() && it->second == client_ ? client_ : "";
    return 0;
  }
  void release_writer(shareblk::backend::Volume& volume) override {
    std::lock_guard lock(cluster_->mutex);
    auto it = cluster_->locks.find(volume.path());
    if (it != cluster_->locks.end() && it->second == client_) cluster_->locks.erase(it);
  }

 private:
  std::shared_ptr<Cluster> cluster_;
  std::string client_;
};

// A gateway: its own state directory and database, the shared bytes and cluster.
struct Gateway {
  Gateway(const fs::path& state, shareblk::store::VolumeStore& store,
          std::shared_ptr<Cluster> cluster, const std::string& client)
      : gateways(std::move(cluster), client) {
    fs::create_directories(state);
    plane = std::make_unique<ControlPlane>((state / "shareblk.db").string(), store,
                                           shareblk::control::Policy{}, &gateways);
    plane->bind(nullptr, {"/run/shareblk-test/nbd.sock", "127.0.0.1:10809"});
  }
  ~Gateway() { plane.reset(); }  // its revoker stops before the cluster client goes

  Json request(const std::string& method, const Json& params) {
    const Json req{{"jsonrpc", "2.0"}, {"id", 1}, {"method", method}, {"params", params}};
    return Json::parse(plane->handle(req.dump(), shareblk::control::Caller{1234, 1000}));
  }
  Json ok(const std::string& method, const Json& params) {
    const Json response = request(method, params);
    EXPECT_TRUE(response.contains("result")) << method << " " << params << " -> " << response;
    return response.value("result", Json());
  }
  std::string reason(const std::string& method, const Json& params) {
    const Json response = request(method, params);
    EXPECT_TRUE(response.contains("error")) << method << " -> " << response;
    return response.contains("error") ? response["error"]["data"].value("reason", "") : "";
  }

  FakeGateways gateways;
  std::unique_ptr<ControlPlane> plane;
};

class TwoGatewaysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreError error;
    store_ = shareblk::store::make_file_store(dir_ / "volumes", false, error);
    ASSERT_TRUE(store_) << error.message;
    a_ = std::make_unique<Gateway>(dir_ / "a", *store_, cluster_, "client.a");
    b_ = std::make_unique<Gateway>(dir_ / "b", *store_, cluster_, "client.b");
  }
  void TearDown() override {
    b_.reset();
    a_.reset();
  }

  shareblk::testing::TempDir dir_;
  std::unique_ptr<shareblk::store::VolumeStore> store_;
  std::shared_ptr<Cluster> cluster_ = std::make_shared<Cluster>();
  std::unique_ptr<Gateway> a_;
  std::unique_ptr<Gateway> b_;
};

TEST_F(TwoGatewaysTest, AVolumeMadeThroughOneGatewayIsKnownToTheOther) {
  const Json v =
      a_->ok("volume_create", {{"name", "shared"}, {"size", "1M"}, {"multiattach", true}});
  const Json seen = b_->ok("volume_show", {{"volume_id", v["id"]}});
  EXPECT_EQ(seen["name"], "shared");
  EXPECT_EQ(seen["size"], v["size"]);
  EXPECT_EQ(seen["multiattach"], true);
}

TEST_F(TwoGatewaysTest, AnAttachmentThroughOneGatewayCountsOnTheOther) {
  const Json v =
      a_->ok("volume_create", {{"name", "shared"}, {"size", "1M"}, {"multiattach", true}});
  const Json at = a_->ok("attachment_create", {{"volume_id", v["id"]}, {"instance_uuid", "i-1"}});
  const Json seen = b_->ok("volume_show", {{"volume_id", v["id"]}});
  ASSERT_TRUE(seen["attachments_elsewhere"].is_array()) << seen;
  ASSERT_EQ(seen["attachments_elsewhere"].size(), 1u) << seen;
  EXPECT_EQ(seen["attachments_elsewhere"][0]["id"], at["id"]);
  EXPECT_EQ(seen["attachments_elsewhere"][0]["mode"], "rw");
  EXPECT_EQ(b_->reason("volume_delete", {{"volume_id", v["id"]}}), "volume_in_use");
  // Found by its id alone on the other gateway, through the link.
  EXPECT_EQ(b_->ok("attachment_show", {{"attachment_id", at["id"]}})["volume_id"], v["id"]);
}

TEST_F(TwoGatewaysTest, ADetachThroughTheOtherGatewayRevokesTheAttachmentWhereItLives) {
  const Json v =
      a_->ok("volume_create", {{"name", "shared"}, {"size", "1M"}, {"multiattach", true}});
  const Json at = a_->ok("attachment_create", {{"volume_id", v["id"]}, {"instance_uuid", "i-1"}});
  const Json done = b_->ok("attachment_delete", {{"attachment_id", at["id"]}});
  EXPECT_EQ(done["attach_status"], "detached") << done;
  EXPECT_NE(a_->ok("attachment_show", {{"attachment_id", at["id"]}})["attach_status"], "attached");
  EXPECT_TRUE(b_->ok("volume_show", {{"volume_id", v["id"]}})["attachments_elsewhere"].empty());
}

TEST_F(TwoGatewaysTest, TheSingleWriterHoldsTheLockAndATakeoverElsewhereFencesIt) {
  const Json v = a_->ok(
      "volume_create",
      {{"name", "quorum"}, {"size", "1M"}, {"multiattach", true}, {"writer_policy", "single"}});
  const Json first =
      a_->ok("attachment_create", {{"volume_id", v["id"]}, {"instance_uuid", "i-1"}});
  {
    std::lock_guard lock(cluster_->mutex);
    ASSERT_EQ(cluster_->locks.size(), 1u);
    EXPECT_EQ(cluster_->locks.begin()->second, "client.a");
  }
  const Json second =
      b_->ok("attachment_create", {{"volume_id", v["id"]}, {"instance_uuid", "i-2"}});
  b_->ok("volume_takeover", {{"volume_id", v["id"]}, {"attachment_id", second["id"]}});
  std::lock_guard lock(cluster_->mutex);
  EXPECT_EQ(cluster_->locks.begin()->second, "client.b");
  EXPECT_EQ(cluster_->fenced.count("client.a"), 1u);
  (void)first;
}

using shareblk::control::GatewayRecords;

GatewayRecords::Json record_of(const GatewayRecords::Json& attachments) {
  return {{"attachments", attachments}};
}

TEST(GatewayRecords, OtherGatewaysEntriesAreRowsWhoseModeFailsClosed) {
  auto cluster = std::make_shared<Cluster>();
  cluster->records["v"] = {record_of({{"mine", {{"gateway", "g-a"}, {"mode", "rw"}}},
                                      {"theirs", {{"gateway", "g-b"}, {"mode", "rw"}}},
                                      {"odd", {{"gateway", "g-b"}, {"mode", "RW"}}},
                                      {"gone", {{"gateway", "g-b"}, {"revoked", true}}}})
                               .dump(),
                           3};
  FakeGateways gateways(cluster, "client.a");
  GatewayRecords records(gateways, "g-a", [](const std::string&) {});
  std::map<std::string, shareblk::control::AttachmentRow> rows;
  for (const auto& row : records.elsewhere("v")) rows[row.id] = row;
  ASSERT_EQ(rows.size(), 3u);  // not this gateway's own
  EXPECT_EQ(rows["theirs"].mode, shareblk::backend::AttachMode::ReadWrite);
  EXPECT_EQ(rows["odd"].mode, shareblk::backend::AttachMode::ReadOnly);
  EXPECT_EQ(rows["gone"].attach_status, shareblk::control::AttachStatus::Detaching);
  EXPECT_EQ(rows["theirs"].gateway, "g-b");
}

TEST(GatewayRecords, AnEntryThatIsNotAnObjectIsNoGatewaysAndStopsNothing) {
  auto cluster = std::make_shared<Cluster>();
  cluster->records["v"] = {
      record_of({{"junk", 5}, {"mine", {{"gateway", "g-a"}, {"revoked", true}}}}).dump(), 1};
  FakeGateways gateways(cluster, "client.a");
  GatewayRecords records(gateways, "g-a", [](const std::string&) {});
  EXPECT_EQ(records.here("v"), std::vector<std::string>{"mine"});
  const auto revoked = records.revoked_here("v");
  ASSERT_EQ(revoked.size(), 1u);
  EXPECT_EQ(revoked[0].first, "mine");
  EXPECT_TRUE(records.elsewhere("v").empty());
}

TEST(GatewayRecords, AChangeThatKeepsLosingTheRaceIsVolumeBusyAndWritesNothing) {
  auto cluster = std::make_shared<Cluster>();
  cluster->always_lose = true;
  FakeGateways gateways(cluster, "client.a");
  GatewayRecords records(gateways, "g-a", [](const std::string&) {});
  int tries = 0;
  try {
    records.change_attachments("v", [&](GatewayRecords::Attachments& a) {
      ++tries;
      a.entries["x"] = GatewayRecords::Json::object();
      return true;
    });
    FAIL() << "a change that never won was reported written";
  } catch (const shareblk::control::ApiError& e) {
    EXPECT_EQ(e.reason, "volume_busy");
  }
  EXPECT_EQ(tries, 20);
  EXPECT_EQ(cluster->records.count("v"), 0u);
}

TEST(GatewayRecords, AWatchedRecordsNotifyReachesTheRevokerAndStopEndsIt) {
  auto cluster = std::make_shared<Cluster>();
  FakeGateways gateways(cluster, "client.a");
  std::mutex mutex;
  std::vector<std::string> revoked;
  GatewayRecords records(gateways, "g-a", [&](const std::string& id) {
    std::lock_guard lock(mutex);
    revoked.push_back(id);
  });
  records.watch_attachments("v");
  FakeGateways other(cluster, "client.b");
  other.notify_record("v", std::chrono::seconds(1));
  for (int i = 0; i < 200; ++i) {
    {
      std::lock_guard lock(mutex);
      if (!revoked.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  {
    std::lock_guard lock(mutex);
    EXPECT_EQ(revoked, std::vector<std::string>{"v"});
  }
  records.stop();
  EXPECT_TRUE(cluster->watches["v"].empty());  // the watch ended with it
  records.queue_revocations("v");              // ignored once stopped
  std::lock_guard lock(mutex);
  EXPECT_EQ(revoked.size(), 1u);
}

}  // namespace
