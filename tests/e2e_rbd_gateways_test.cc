// Two gateways (two shareblkd, each with its own state and listeners: two hosts) serving the
// volumes of one RBD pool on a real cluster (ceph_cluster.h). A volume made through one is
// served by the other; a single-writer volume's writer is backed by the image's exclusive
// lock, and a takeover on the other gateway has the cluster fence the old one, so that a hung
// gateway's late writes never reach the image (docs/scale-out.md).
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "tests/ceph_fixture.h"
#include "tests/control_client.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace shareblk::testing {
namespace {

using Json = nlohmann::json;

class RbdGateways : public CephSuite {
 protected:
  void SetUp() override {
    require_cluster();
    if (IsSkipped() || HasFatalFailure()) return;
    for (int g = 0; g < 2; ++g) gateway_[g] = start(g);
  }

  std::unique_ptr<Daemon> start(int g) {
    const std::string name = "gw" + std::to_string(g + 1);
    return std::make_unique<Daemon>(
        std::vector<std::string>{"--state-dir", dir_ / name, "--store", "rbd:" + ceph_->pool(),
                                 "--ceph-conf", ceph_->conf_path(), "--listen-unix",
                                 dir_ / (name + ".nbd"), "--workers", "1", "--ceph-timeout", "10"},
        socket(g));
  }
  std::string socket(int g) const {
    return dir_ / ("gw" + std::to_string(g + 1) + "/shareblk.sock");
  }
  Json attach(int g, const std::string& volume, const std::string& host, const std::string& mode) {
    return rpc_ok(socket(g), "attachment_create",
                  {{"volume_id", volume},
                   {"instance_uuid", host},
                   {"mode", mode},
                   {"connector", {{"host", host}, {"transport", "unix"}}}});
  }
  // A multiattach volume with one writer at most, made through gateway 1.
  std::string single_writer_volume() {
    return rpc_ok(socket(0), "volume_create",
                  {{"name", "quorum"},
                   {"size", "8M"},
                   {"multiattach", true},
                   {"writer_policy", "single"}})["id"];
  }
  static NbdHandle open_nbd(const Json& attachment) {
    return nbd_connect(attachment["connection_info"]["data"]["uri"].get<std::string>(), nullptr,
                       NbdOptions{false, false});
  }
  // `length` bytes at `offset` of the volume's image, as the cluster has them.
  std::string image_bytes(const std::string& id, uint64_t offset, size_t length) const {
    const std::string out = dir_ / ("export-" + id);
    std::filesystem::remove(out);
    RunResult r =
        run({"rbd", "-c", ceph_->conf_path(), "export", ceph_->pool() + "/volume-" + id, out},
            std::chrono::seconds(60));
    if (r.status != 0) return "rbd export failed: " + r.output;
    return read_file(out, offset, length);
  }

  TempDir dir_;
  std::unique_ptr<Daemon> gateway_[2];
};

// A volume made through gateway 1 is served by gateway 2, which learns it from the image; its
// one writer holds across the two: gateway 2's read-write attachment stays a standby while
// gateway 1's writer holds the image's lock, and takes over without fencing anyone once that
// writer is detached.
TEST_F(RbdGateways, AVolumeIsServedByBothAndItsOneWriterHoldsAcrossThem) {
  const Json v = rpc_ok(
      socket(0), "volume_create",
      {{"name", "shared"}, {"size", "8M"}, {"multiattach", true}, {"writer_policy", "single"}});
  const std::string id = v["id"];
  const Json shown = rpc_ok(socket(1), "volume_show", {{"volume_id", id}});
  EXPECT_EQ(shown["name"], "shared") << shown.dump();
  EXPECT_EQ(shown["size"], 8 << 20);
  EXPECT_EQ(shown["writer_policy"], "single");

  const Json writer = attach(0, id, "host-a", "rw");
  EXPECT_EQ(writer["write_access"], true) << writer.dump();
  const Json standby = attach(1, id, "host-b", "rw");
  EXPECT_EQ(standby["write_access"], false) << standby.dump();

  NbdHandle a = open_nbd(writer);
  NbdHandle b = open_nbd(standby);
  ASSERT_TRUE(a && b) << nbd_get_error();
  const std::string one = patterned(4096, 1);
  ASSERT_EQ(nbd_pwrite(a.get(), one.data(), one.size(), 0, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  EXPECT_EQ(nbd_pwrite(b.get(), one.data(), one.size(), 4096, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM) << nbd_get_error();
  std::string back(4096, '\0');
  ASSERT_EQ(nbd_pread(b.get(), back.data(), back.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == one);

  // The image's lock held by hand does not stand in the way of growing the volume or
  // changing its definition, from either gateway.
  rpc_ok(socket(0), "volume_extend", {{"volume_id", id}, {"size", "16M"}});
  rpc_ok(socket(0), "volume_update", {{"volume_id", id}, {"name", "renamed"}});
  EXPECT_EQ(gateway_[0]->log().find("former definition"), std::string::npos);

  rpc_ok(socket(0), "attachment_delete", {{"attachment_id", writer["id"]}});
  const Json took =
      rpc_ok(socket(1), "volume_takeover", {{"volume_id", id}, {"attachment_id", standby["id"]}});
  EXPECT_EQ(took["writer"], standby["id"]) << took.dump();
  NbdHandle b2 = open_nbd(standby);
  ASSERT_TRUE(b2) << nbd_get_error();
  const std::string two = patterned(4096, 2);
  ASSERT_EQ(nbd_pwrite(b2.get(), two.data(), two.size(), 4096, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  EXPECT_TRUE(image_bytes(id, 4096, 4096) == two);
  EXPECT_TRUE(took["fenced_gateway"].is_null()) << took.dump();

  // Gateway 1 was not fenced: it still serves.
  const Json reader = attach(0, id, "host-c", "ro");
  NbdHandle c = open_nbd(reader);
  ASSERT_TRUE(c) << nbd_get_error();
  ASSERT_EQ(nbd_pread(c.get(), back.data(), back.size(), 4096, 0), 0) << nbd_get_error();
  EXPECT_TRUE(back == two);
  for (auto& g : gateway_) EXPECT_EQ(g->stop(SIGTERM), 0) << g->log();
}

// The attachment rules count the other gateway's attachments: a volume that is not
// multiattach has one live attachment across both (the same instance may attach it from a
// second host, as in a live migration), a volume attached elsewhere is not deleted, and when
// both gateways attach it at the same moment exactly one succeeds: the record they share
// changes only from the version each read.
TEST_F(RbdGateways, AttachmentRulesHoldAcrossGateways) {
  const std::string id = rpc_ok(socket(0), "volume_create",
                                {{"name", "boot"}, {"size", "8M"}, {"multiattach", false}})["id"];
  const Json first = attach(0, id, "vm-1", "rw");
  EXPECT_EQ(rpc_reason(socket(1), "attachment_create",
                       {{"volume_id", id},
                        {"instance_uuid", "vm-2"},
                        {"connector", {{"host", "vm-2"}, {"transport", "unix"}}}}),
            "not_multiattach");
  const Json shown = rpc_ok(socket(1), "volume_show", {{"volume_id", id}});
  ASSERT_EQ(shown["attachments_elsewhere"].size(), 1U) << shown.dump();
  EXPECT_EQ(shown["attachments_elsewhere"][0]["id"], first["id"]);
  EXPECT_EQ(rpc_reason(socket(1), "volume_delete", {{"volume_id", id}}), "volume_in_use");

  // vm-1 migrates to a host that gateway 2 serves, then leaves the first one.
  const Json migrated = rpc_ok(socket(1), "attachment_create",
                               {{"volume_id", id},
                                {"instance_uuid", "vm-1"},
                                {"connector", {{"host", "host-b"}, {"transport", "unix"}}}});
  rpc_ok(socket(0), "attachment_delete", {{"attachment_id", first["id"]}});
  rpc_ok(socket(1), "attachment_delete", {{"attachment_id", migrated["id"]}});

  // Both at once, ten times: one wins each time.
  for (int round = 0; round < 10; ++round) {
    Json won[2];
    std::thread racers[2];
    for (int g = 0; g < 2; ++g) {
      racers[g] = std::thread([&, g] {
        won[g] = rpc(socket(g), "attachment_create",
                     {{"volume_id", id},
                      {"instance_uuid", "racer-" + std::to_string(g)},
                      {"connector", {{"host", "h" + std::to_string(g)}, {"transport", "unix"}}}});
      });
    }
    for (auto& t : racers) t.join();
    int winners = 0;
    for (int g = 0; g < 2; ++g) {
      if (!won[g].contains("result")) continue;
      ++winners;
      rpc_ok(socket(g), "attachment_delete", {{"attachment_id", won[g]["result"]["id"]}});
    }
    EXPECT_EQ(winners, 1) << "round " << round << ": " << won[0].dump() << " " << won[1].dump();
  }
  rpc_ok(socket(1), "volume_delete", {{"volume_id", id}, {"wait", true}});
  for (auto& g : gateway_) EXPECT_EQ(g->stop(SIGTERM), 0) << g->log();
}

// The first call on gateway 2 that names a volume gateway 1 made reads its definition from
// the cluster. With the OSD frozen that call waits (up to --ceph-timeout), but gateway 2's
// calls that need only its database (the lists) go on meanwhile.
TEST_F(RbdGateways, LearningAVolumeFromAFrozenClusterHoldsNoOtherCall) {
  const std::string mine =
      rpc_ok(socket(1), "volume_create", {{"name", "own"}, {"size", "8M"}})["id"];
  const std::string theirs = single_writer_volume();
  Json shown;
  std::chrono::steady_clock::duration listed_after{};
  std::thread learning;
  {
    const CephCluster::Frozen osd = ceph_->freeze_osd();
    learning = std::thread([&] { shown = rpc(socket(1), "volume_show", {{"volume_id", theirs}}); });
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const auto begin = std::chrono::steady_clock::now();
    const Json volumes = rpc_ok(socket(1), "volume_list", Json::object());
    rpc_ok(socket(1), "attachment_list", Json::object());
    listed_after = std::chrono::steady_clock::now() - begin;
    EXPECT_EQ(volumes.size(), 1U) << volumes.dump();  // no ASSERT: `learning` is joined below
    if (!volumes.empty()) {
      EXPECT_EQ(volumes[0]["id"], mine);
    }
  }  // the OSD goes on: the learning call ends (or has timed out)
  learning.join();
  EXPECT_LT(listed_after, std::chrono::seconds(2));
  // The volume is learnt, by that call or by the next.
  for (int i = 0; i < 30 && !shown.contains("result"); ++i) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    shown = rpc(socket(1), "volume_show", {{"volume_id", theirs}});
  }
  ASSERT_TRUE(shown.contains("result")) << shown.dump();
  EXPECT_EQ(shown["result"]["name"], "quorum");
  EXPECT_EQ(rpc_ok(socket(1), "volume_list", Json::object()).size(), 2U);
}

// A reservation (no host yet) on one gateway whose connector later names the host of the same
// instance's attachment on the other gateway is a duplicate, as it is on one gateway.
TEST_F(RbdGateways, AReservationsHostGivenLaterCountsAcrossGateways) {
  const std::string id = rpc_ok(socket(0), "volume_create",
                                {{"name", "shared"}, {"size", "8M"}, {"multiattach", true}})["id"];
  const Json reserved =
      rpc_ok(socket(0), "attachment_create", {{"volume_id", id}, {"instance_uuid", "vm-3"}});
  attach(1, id, "vm-3", "rw");  // host vm-3, on gateway 2
  EXPECT_EQ(rpc_reason(socket(0), "attachment_update",
                       {{"attachment_id", reserved["id"]},
                        {"connector", {{"host", "vm-3"}, {"transport", "unix"}}}}),
            "duplicate_attachment");
  const Json other = rpc_ok(socket(0), "attachment_update",
                            {{"attachment_id", reserved["id"]},
                             {"connector", {{"host", "host-c"}, {"transport", "unix"}}}});
  EXPECT_EQ(other["attached_host"], "host-c") << other.dump();
  const Json seen = rpc_ok(socket(1), "attachment_show", {{"attachment_id", reserved["id"]}});
  EXPECT_EQ(seen["attached_host"], "host-c") << seen.dump();  // in the record now
  for (auto& g : gateway_) EXPECT_EQ(g->stop(SIGTERM), 0) << g->log();
}

// A detach asked of the other gateway reaches the gateway that serves the attachment (a
// notify on the volume's record): it revokes it there, its NBD client is cut off, and the
// volume may then be attached elsewhere.
TEST_F(RbdGateways, ADetachOnAnotherGatewayRevokesTheAttachmentWhereItIsServed) {
  const std::string id = rpc_ok(socket(0), "volume_create",
                                {{"name", "one"}, {"size", "8M"}, {"multiattach", false}})["id"];
  const Json served = attach(0, id, "vm-1", "rw");
  NbdHandle a = open_nbd(served);
  ASSERT_TRUE(a) << nbd_get_error();
  const std::string block = patterned(4096, 3);
  ASSERT_EQ(nbd_pwrite(a.get(), block.data(), block.size(), 0, 0), 0) << nbd_get_error();

  const auto begin = std::chrono::steady_clock::now();
  const Json detached =
      rpc_ok(socket(1), "volume_detach", {{"volume_id", id}, {"attachment_id", served["id"]}});
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(5));
  EXPECT_EQ(detached["attach_status"], "detached") << detached.dump();
  const Json there = rpc_ok(socket(0), "attachment_show", {{"attachment_id", served["id"]}});
  EXPECT_EQ(there["attach_status"], "detached") << there.dump();
  std::string back(4096, '\0');
  EXPECT_EQ(nbd_pread(a.get(), back.data(), back.size(), 0, 0), -1);  // its connection is gone

  const Json next = attach(1, id, "vm-2", "rw");  // not_multiattach no more
  EXPECT_EQ(next["attach_status"], "attaching") << next.dump();
  EXPECT_EQ(rpc_reason(socket(0), "volume_detach",
                       {{"volume_id", id}, {"attachment_id", "no-such-attachment"}}),
            "not_found");
  for (auto& g : gateway_) EXPECT_EQ(g->stop(SIGTERM), 0) << g->log();
}

// A writer's gateway that crashes (kill -9) leaves the image's lock with its dead client; at
// its restart it finds its own writer on record with that client as the holder, fences that
// client only, and its writer writes again. A volume_update through the other gateway
// meanwhile does not change who the record says the writer is.
TEST_F(RbdGateways, AWritersGatewayThatCrashedTakesItsWriterBackAtRestart) {
  const std::string id = single_writer_volume();
  const Json writer = attach(0, id, "host-a", "rw");
  const Json standby = attach(1, id, "host-b", "rw");
  EXPECT_EQ(standby["write_access"], false) << standby.dump();
  {
    NbdHandle a = open_nbd(writer);
    ASSERT_TRUE(a) << nbd_get_error();
    const std::string block = patterned(4096, 21);
    ASSERT_EQ(nbd_pwrite(a.get(), block.data(), block.size(), 0, LIBNBD_CMD_FLAG_FUA), 0)
        << nbd_get_error();
  }
  rpc_ok(socket(1), "volume_update", {{"volume_id", id}, {"name", "quorum-disk"}});
  gateway_[0]->stop(SIGKILL);

  gateway_[0] = start(0);  // within the dead client's 30 s: it still holds the lock
  const Json back = rpc_ok(socket(0), "attachment_show", {{"attachment_id", writer["id"]}});
  EXPECT_EQ(back["write_access"], true) << back.dump() << gateway_[0]->log();
  EXPECT_EQ(rpc_ok(socket(0), "volume_show", {{"volume_id", id}})["writer"], writer["id"]);
  NbdHandle a = open_nbd(writer);
  ASSERT_TRUE(a) << nbd_get_error();
  const std::string block = patterned(4096, 22);
  EXPECT_EQ(nbd_pwrite(a.get(), block.data(), block.size(), 4096, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  EXPECT_TRUE(image_bytes(id, 0, 4096) == patterned(4096, 21));
  EXPECT_TRUE(image_bytes(id, 4096, 4096) == block);
  // The standby on gateway 2 is still one, and a takeover still fences the writer's gateway.
  EXPECT_EQ(
      rpc_ok(socket(1), "attachment_show", {{"attachment_id", standby["id"]}})["write_access"],
      false);
  const Json took =
      rpc_ok(socket(1), "volume_takeover", {{"volume_id", id}, {"attachment_id", standby["id"]}});
  EXPECT_TRUE(took["fenced_gateway"].is_string()) << took.dump();
  a.reset();
  gateway_[0]->stop(SIGTERM);  // fenced: whatever its exit says
  EXPECT_EQ(gateway_[1]->stop(SIGTERM), 0) << gateway_[1]->log();
}

// Any gateway shows, lists and deletes an attachment another gateway serves, knowing only
// its id: the link in RADOS leads to the volume's record.
TEST_F(RbdGateways, AnyGatewayShowsListsAndDeletesAnotherGatewaysAttachment) {
  const std::string id = rpc_ok(socket(0), "volume_create",
                                {{"name", "shared"}, {"size", "8M"}, {"multiattach", true}})["id"];
  const Json first = attach(0, id, "vm-1", "rw");
  const Json second = attach(1, id, "vm-2", "ro");
  NbdHandle a = open_nbd(first);
  ASSERT_TRUE(a) << nbd_get_error();
  const std::string gateway1 = read_file(dir_ / "gw1/gateway-id", 0, 36);

  const Json there = rpc_ok(socket(0), "attachment_show", {{"attachment_id", first["id"]}});
  EXPECT_EQ(there["gateway"], gateway1) << there.dump();
  const Json seen = rpc_ok(socket(1), "attachment_show", {{"attachment_id", first["id"]}});
  EXPECT_EQ(seen["gateway"], gateway1) << seen.dump();
  EXPECT_EQ(seen["volume_id"], id);
  EXPECT_EQ(seen["instance_uuid"], "vm-1");
  EXPECT_EQ(seen["mode"], "rw");
  EXPECT_EQ(seen["attach_status"], "attached");
  EXPECT_TRUE(seen["connection_info"].is_null()) << seen.dump();  // its gateway's to give

  const Json listed = rpc_ok(socket(1), "attachment_list", {{"volume_id", id}});
  ASSERT_EQ(listed.size(), 2U) << listed.dump();
  EXPECT_EQ(listed[0]["id"], second["id"]);  // its own first
  EXPECT_EQ(listed[1]["id"], first["id"]);
  EXPECT_EQ(rpc_ok(socket(0), "attachment_list", Json::object()).size(), 1U);  // own only

  const Json deleted = rpc_ok(socket(1), "attachment_delete", {{"attachment_id", first["id"]}});
  EXPECT_EQ(deleted["attach_status"], "detached") << deleted.dump();
  EXPECT_EQ(rpc_ok(socket(0), "attachment_show", {{"attachment_id", first["id"]}})["attach_status"],
            "detached");
  std::string back(4096, '\0');
  EXPECT_EQ(nbd_pread(a.get(), back.data(), back.size(), 0, 0), -1);  // cut off where served
  EXPECT_EQ(rpc_reason(socket(1), "attachment_show", {{"attachment_id", first["id"]}}),
            "not_found");  // history stays with its gateway
  EXPECT_EQ(rpc_ok(socket(1), "attachment_list", {{"volume_id", id}}).size(), 1U);
  RunResult link = run({"rados", "-c", ceph_->conf_path(), "-p", ceph_->pool(), "stat",
                        "shareblk.attachment." + first["id"].get<std::string>()},
                       std::chrono::seconds(30));
  EXPECT_NE(link.status, 0) << "the link outlived its attachment: " << link.output;
  EXPECT_EQ(rpc_reason(socket(1), "attachment_delete", {{"attachment_id", "no-such-attachment"}}),
            "not_found");
  for (auto& g : gateway_) EXPECT_EQ(g->stop(SIGTERM), 0) << g->log();
}

// The case: a volume attached read-write through gateway 1 (its writer) and read-only
// through gateway 2; gateway 1 hangs (SIGSTOP) with writes sent to it; gateway 2's attachment
// becomes read-write and takes over. When gateway 1 resumes, none of the writes it got while
// hung reach the image (the OSDs refuse its requests: it is blocklisted), and every write it
// acknowledged before is there.
TEST_F(RbdGateways, ATakeoverFencesAHungGatewaySoItsLateWritesNeverLand) {
  const std::string id = single_writer_volume();
  const Json writer = attach(0, id, "host-a", "rw");
  const Json reader = attach(1, id, "host-b", "ro");
  NbdHandle a = open_nbd(writer);
  ASSERT_TRUE(a) << nbd_get_error();
  constexpr int kAcked = 16;  // blocks 0..15, acknowledged before the hang
  for (int i = 0; i < kAcked; ++i) {
    const std::string block = patterned(4096, 100 + i);
    ASSERT_EQ(nbd_pwrite(a.get(), block.data(), block.size(), i * 4096ULL, 0), 0)
        << nbd_get_error();
  }

  // Gateway 1 hangs (every thread stopped); its client goes on writing blocks 16..31 (they
  // wait in its socket).
  CephCluster::Frozen hung(gateway_[0]->pid());
  std::vector<int64_t> late;
  std::vector<std::string> late_blocks;  // libnbd sends from them until each is answered
  late_blocks.reserve(16);
  for (int i = 0; i < 16; ++i) {
    const std::string& block = late_blocks.emplace_back(patterned(4096, 200 + i));
    late.push_back(nbd_aio_pwrite(a.get(), block.data(), block.size(), (kAcked + i) * 4096ULL,
                                  NBD_NULL_COMPLETION, LIBNBD_CMD_FLAG_FUA));
    ASSERT_GT(late.back(), 0) << nbd_get_error();
  }
  for (int i = 0; i < 50; ++i) nbd_poll(a.get(), 10);  // sends them; no reply can come

  rpc_ok(socket(1), "attachment_update", {{"attachment_id", reader["id"]}, {"mode", "rw"}});
  const auto begin = std::chrono::steady_clock::now();
  const Json took =
      rpc_ok(socket(1), "volume_takeover", {{"volume_id", id}, {"attachment_id", reader["id"]}});
  const auto took_for = std::chrono::steady_clock::now() - begin;
  EXPECT_EQ(took["writer"], reader["id"]) << took.dump();
  EXPECT_LT(took_for, std::chrono::seconds(10));
  EXPECT_TRUE(took["fenced_gateway"].is_string()) << took.dump();  // gateway 1's client
  NbdHandle b = open_nbd(reader);
  ASSERT_TRUE(b) << nbd_get_error();
  const std::string mine = patterned(4096, 7);
  ASSERT_EQ(nbd_pwrite(b.get(), mine.data(), mine.size(), 40 * 4096ULL, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();

  // Gateway 1 resumes: every write it got while hung fails, and so does what follows.
  hung.reset();
  for (int64_t cookie : late) {
    int rc = 0;
    for (int i = 0; i < 3000 && (rc = nbd_aio_command_completed(a.get(), cookie)) == 0; ++i) {
      nbd_poll(a.get(), 10);
    }
    EXPECT_EQ(rc, -1) << "a write gateway 1 got while hung was acknowledged";
  }
  const std::string after = patterned(4096, 9);
  EXPECT_EQ(nbd_pwrite(a.get(), after.data(), after.size(), 41 * 4096ULL, 0), -1);

  for (int i = 0; i < kAcked; ++i) {
    EXPECT_TRUE(image_bytes(id, i * 4096ULL, 4096) == patterned(4096, 100 + i)) << "block " << i;
  }
  EXPECT_EQ(image_bytes(id, kAcked * 4096ULL, 16 * 4096), std::string(16 * 4096, '\0'));
  EXPECT_TRUE(image_bytes(id, 40 * 4096ULL, 4096) == mine);
  EXPECT_EQ(image_bytes(id, 41 * 4096ULL, 4096), std::string(4096, '\0'));
  a.reset();
  // Fenced, gateway 1 stops by itself (no signal sent here) with exit status 3, for its
  // service manager to start it again as a new client.
  EXPECT_EQ(gateway_[0]->stop(0), 3) << gateway_[0]->log();

  // Restarted (a new cluster client, not blocklisted), gateway 1 finds its writer taken over:
  // it stays attached without write access, and the volume has no writer there; so too when
  // the new writer has gone and left the image's lock free.
  b.reset();
  rpc_ok(socket(1), "attachment_delete", {{"attachment_id", reader["id"]}});
  gateway_[0] = start(0);
  const Json v = rpc_ok(socket(0), "volume_show", {{"volume_id", id}});
  EXPECT_TRUE(v["writer"].is_null()) << v.dump();
  const Json old = rpc_ok(socket(0), "attachment_show", {{"attachment_id", writer["id"]}});
  EXPECT_EQ(old["write_access"], false) << old.dump();
  for (auto& g : gateway_) EXPECT_EQ(g->stop(SIGTERM), 0) << g->log();
}

}  // namespace
}  // namespace shareblk::testing
