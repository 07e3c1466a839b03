// Takeover and fencing end to end (docs/fencing.md): a single-writer volume, libnbd clients on
// the daemon's Unix socket, and volume_takeover / attachment_update while a client writes.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e_nbd_fixture.h"
#include "tests/managed_daemon.h"
#include "tests/nbd_client.h"
#include "tests/takeover_writer.h"

namespace shareblk::testing {
namespace {

class FencingTest : public ManagedDaemonTest {
 protected:
  void SetUp() override { start(); }

  std::string create_single(const std::string& size) {
    return rpc_ok(
        control(), "volume_create",
        {{"name", "v"}, {"size", size}, {"multiattach", true}, {"writer_policy", "single"}})["id"];
  }
  Json attach_unix(const std::string& volume, const std::string& instance,
                   const std::string& mode = "rw") {
    return rpc_ok(control(), "attachment_create",
                  {{"volume_id", volume},
                   {"instance_uuid", instance},
                   {"mode", mode},
                   {"connector", {{"host", instance}, {"transport", "unix"}}}});
  }
  NbdHandle connect(const Json& attachment) {
    NbdHandle h = nbd_connect(attachment["connection_info"]["data"]["uri"]);
    EXPECT_TRUE(h) << nbd_get_error();
    return h;
  }
  Json volume(const std::string& id) {
    return rpc_ok(control(), "volume_show", {{"volume_id", id}});
  }
};

// The issue's test: a writer at QD32 on one attachment, volume_takeover to the other while it
// writes, at a random moment. After the call returns no block holds a write the old writer
// sent after it, every such write failed with EPERM, every write it saw acknowledged is intact,
// and the new writer writes at once on its open connection. 200 runs, alternating direction.
TEST_F(FencingTest, ATakeoverFencesAWriterAtQueueDepth32) {
  const std::string vol = create_single("4M");
  const Json a = attach_unix(vol, "node-a");
  const Json b = attach_unix(vol, "node-b");
  NbdHandle ha = connect(a);
  NbdHandle hb = connect(b);
  ASSERT_TRUE(ha && hb);
  EXPECT_EQ(nbd_is_read_only(hb.get()), 0) << "a standby is advertised read-write";
  struct Side {
    std::string id;
    nbd_handle* h;
  };
  Side writer{a["id"], ha.get()};
  Side standby{b["id"], hb.get()};
  ASSERT_EQ(volume(vol)["writer"], writer.id);
  const uint64_t generation = volume(vol)["fencing_generation"];

  std::mt19937 random(20261125);
  TakeoverFigures f;
  for (int run = 1; run <= 200; ++run) {
    takeover_run(control(), vol, standby.id, writer.h, standby.h, run, EPERM, random, f);
    std::swap(writer, standby);
  }
  f.print("takeover under a QD32 writer (NBD)");
  EXPECT_EQ(volume(vol)["fencing_generation"], generation + 200);
  EXPECT_EQ(f.violations, 0u);
  EXPECT_GT(f.refused, 0u) << "the old writer never met the fence";
}

// 50 volume_takeover calls at once, each naming another attachment: they are serialized, so
// each one that took effect moved write access from the writer before it to its own; the log's
// chain of takeovers has no gap (at no moment two writers), the generation rose by exactly the
// number that took effect, and the one writer at the end is the last of them.
TEST_F(FencingTest, FiftyConcurrentTakeoversLeaveOneWriter) {
  const std::string vol = create_single("1M");
  std::vector<std::string> ids;
  for (int i = 0; i < 50; ++i) ids.push_back(attach_unix(vol, "node-" + std::to_string(i))["id"]);
  const Json before = volume(vol);
  ASSERT_EQ(before["writer"], ids[0]);
  const uint64_t generation = before["fencing_generation"];

  std::barrier start_line(50);
  std::vector<Json> replies(50);
  std::vector<std::thread> callers;
  for (int i = 0; i < 50; ++i) {
    callers.emplace_back([&, i] {
      start_line.arrive_and_wait();
      replies[i] =
          rpc(control(), "volume_takeover", {{"volume_id", vol}, {"attachment_id", ids[i]}});
    });
  }
  for (auto& t : callers) t.join();
  uint64_t took_effect = 0, last = 0;
  std::string last_writer;
  for (int i = 0; i < 50; ++i) {
    if (replies[i].contains("result")) {
      ++took_effect;
      const uint64_t g = replies[i]["result"]["fencing_generation"];
      if (g > last) {
        last = g;
        last_writer = replies[i]["result"]["writer"];
      }
    } else {
      EXPECT_EQ(replies[i]["error"]["data"]["reason"], "already_writer") << replies[i];
    }
  }
  const Json after = volume(vol);
  EXPECT_EQ(after["fencing_generation"].get<uint64_t>(), generation + took_effect);
  EXPECT_EQ(after["writer"], last_writer);
  int writers = 0;
  for (const Json& att : after["attachments"]) writers += att["write_access"].get<bool>();
  EXPECT_EQ(writers, 1);

  // The log, in generation order: each takeover took write access from the one before.
  std::ifstream log(daemon_->log_path());
  const std::regex line(R"(takeover: writer (\S+) -> (\S+) \(generation (\d+)\))");
  std::map<uint64_t, std::pair<std::string, std::string>> chain;
  for (std::string l; std::getline(log, l);) {
    std::smatch m;
    if (std::regex_search(l, m, line)) chain[std::stoull(m[3])] = {m[1], m[2]};
  }
  ASSERT_EQ(chain.size(), took_effect);
  std::string holder = ids[0];
  for (const auto& [g, change] : chain) {
    EXPECT_EQ(change.first, holder) << "generation " << g << " took over from a non-writer";
    holder = change.second;
  }
  EXPECT_EQ(holder, last_writer);
}

// Every refusal names its reason and changes nothing.
TEST_F(FencingTest, ATakeoverThatCannotBeIsRefusedWithItsReason) {
  const std::string vol = create_single("1M");
  const std::string writer = attach_unix(vol, "node-a")["id"];
  const std::string reader = attach_unix(vol, "node-b", "ro")["id"];
  const std::string gone = attach_unix(vol, "node-c")["id"];
  rpc_ok(control(), "attachment_delete", {{"attachment_id", gone}});
  const std::string multi = create_volume("1M");
  const std::string elsewhere =
      attach(multi, "node-d", {{"host", "d"}, {"transport", "unix"}})["id"];
  const Json before = volume(vol);

  auto reason = [&](const std::string& v, const std::string& a) {
    return rpc_reason(control(), "volume_takeover", {{"volume_id", v}, {"attachment_id", a}});
  };
  EXPECT_EQ(reason(vol, reader), "invalid_state");
  EXPECT_EQ(reason(vol, gone), "invalid_state");
  EXPECT_EQ(reason(vol, "00000000-0000-4000-8000-000000000000"), "not_found");
  EXPECT_EQ(reason(vol, elsewhere), "not_found");
  EXPECT_EQ(reason(multi, elsewhere), "not_single_writer");
  EXPECT_EQ(reason(vol, writer), "already_writer");
  EXPECT_EQ(rpc_reason(control(), "volume_takeover", {{"volume_id", vol}}), "invalid_params");
  EXPECT_EQ(rpc_reason(control(), "volume_takeover",
                       {{"volume_id", vol}, {"attachment_id", writer}, {"force", true}}),
            "invalid_params");
  const Json after = volume(vol);
  EXPECT_EQ(after["writer"], before["writer"]);
  EXPECT_EQ(after["fencing_generation"], before["fencing_generation"]);
}

// A standby is advertised read-write and refused every change until it takes over; the old
// writer is refused from then on, on the connections it keeps.
TEST_F(FencingTest, AStandbyWritesOnlyAfterItTakesOver) {
  const std::string vol = create_single("4M");
  const Json a = attach_unix(vol, "node-a");
  const Json b = attach_unix(vol, "node-b");
  EXPECT_TRUE(a["write_access"].get<bool>());
  EXPECT_FALSE(b["write_access"].get<bool>());
  EXPECT_TRUE(b["write_access_since"].is_null());
  NbdHandle ha = connect(a), hb = connect(b);
  ASSERT_TRUE(ha && hb);
  EXPECT_EQ(nbd_is_read_only(hb.get()), 0);
  const std::string data = pattern('s', 4096);
  EXPECT_EQ(nbd_pwrite(ha.get(), data.data(), data.size(), 0, 0), 0);
  expect_every_write_refused(hb.get(), {{0, 4096}, {1 << 20, 65536}});

  rpc_ok(control(), "volume_takeover", {{"volume_id", vol}, {"attachment_id", b["id"]}});
  const Json shown = rpc_ok(control(), "attachment_show", {{"attachment_id", b["id"]}});
  EXPECT_TRUE(shown["write_access"].get<bool>());
  EXPECT_FALSE(shown["write_access_since"].is_null());
  EXPECT_EQ(nbd_pwrite(hb.get(), data.data(), data.size(), 8192, 0), 0) << nbd_get_error();
  expect_every_write_refused(ha.get(), {{0, 4096}, {1 << 20, 65536}});
  EXPECT_EQ(nbd_read(ha.get(), 8192, 4096), data) << "the old writer still reads";
  const Json v = volume(vol);
  EXPECT_EQ(v["writer"], b["id"]);
  EXPECT_FALSE(v["writer_since"].is_null());
}

// The same over TCP: the standby's connection writes once it takes over, the old writer's
// stops, and over the same connections.
TEST_F(FencingTest, ATakeoverOverTcp) {
  const std::string vol = create_single("4M");
  auto attach_tcp = [&](const std::string& instance) {
    return rpc_ok(control(), "attachment_create",
                  {{"volume_id", vol},
                   {"instance_uuid", instance},
                   {"connector", {{"host", instance}, {"transport", "tcp"}}}});
  };
  const Json a = attach_tcp("node-a"), b = attach_tcp("node-b");
  ASSERT_EQ(a["connection_info"]["data"]["uri"].get<std::string>().rfind("nbd://", 0), 0u);
  NbdHandle ha = connect(a), hb = connect(b);
  ASSERT_TRUE(ha && hb);
  const std::string data = pattern('t', 4096);
  EXPECT_EQ(nbd_pwrite(ha.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
  expect_every_write_refused(hb.get(), {{0, 4096}});
  rpc_ok(control(), "volume_takeover", {{"volume_id", vol}, {"attachment_id", b["id"]}});
  expect_every_write_refused(ha.get(), {{0, 4096}});
  EXPECT_EQ(nbd_pwrite(hb.get(), data.data(), data.size(), 4096, 0), 0) << nbd_get_error();
  rpc_ok(control(), "attachment_update", {{"attachment_id", b["id"]}, {"mode", "ro"}});
  expect_every_write_refused(hb.get(), {{0, 4096}});
}

// rw -> ro takes effect on the open connection; ro -> rw closes it so that the client
// negotiates read-write again; the writer of a single volume demoted leaves it without one.
TEST_F(FencingTest, ALiveModeChangeRefusesOrReconnects) {
  const std::string vol = create_single("4M");
  const Json a = attach_unix(vol, "node-a");
  NbdHandle h = connect(a);
  ASSERT_TRUE(h);
  const std::string data = pattern('m', 4096);
  ASSERT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 0, 0), 0);

  const Json ro =
      rpc_ok(control(), "attachment_update", {{"attachment_id", a["id"]}, {"mode", "ro"}});
  EXPECT_EQ(ro["mode"], "ro");
  EXPECT_FALSE(ro["write_access"].get<bool>());
  expect_every_write_refused(h.get(), {{0, 4096}});
  EXPECT_EQ(nbd_read(h.get(), 0, 4096), data);
  Json v = volume(vol);
  EXPECT_TRUE(v["writer"].is_null());
  EXPECT_EQ(v["fencing_generation"], 2);  // made writer, then none
  // The same mode again changes nothing.
  EXPECT_EQ(
      rpc_ok(control(), "attachment_update", {{"attachment_id", a["id"]}, {"mode", "ro"}})["mode"],
      "ro");
  EXPECT_EQ(volume(vol)["fencing_generation"], 2);

  const Json rw =
      rpc_ok(control(), "attachment_update", {{"attachment_id", a["id"]}, {"mode", "rw"}});
  EXPECT_TRUE(rw["write_access"].get<bool>()) << "the volume had no writer: it is the writer";
  EXPECT_EQ(volume(vol)["writer"], a["id"]);
  // The old connection was closed: its next request fails; a new one writes.
  char byte = 0;
  EXPECT_EQ(nbd_pread(h.get(), &byte, 1, 0, 0), -1);
  NbdHandle again = connect(rw);
  ASSERT_TRUE(again);
  EXPECT_EQ(nbd_is_read_only(again.get()), 0);
  EXPECT_EQ(nbd_pwrite(again.get(), data.data(), data.size(), 4096, 0), 0) << nbd_get_error();

  EXPECT_EQ(rpc_reason(control(), "attachment_update", {{"attachment_id", a["id"]}}),
            "invalid_params");
  EXPECT_EQ(
      rpc_reason(control(), "attachment_update",
                 {{"attachment_id", a["id"]}, {"mode", "rw"}, {"connector", {{"host", "x"}}}}),
      "invalid_params");
  EXPECT_EQ(
      rpc_reason(control(), "attachment_update", {{"attachment_id", a["id"]}, {"mode", "wo"}}),
      "invalid_params");
  rpc_ok(control(), "attachment_delete", {{"attachment_id", a["id"]}});
  EXPECT_EQ(
      rpc_reason(control(), "attachment_update", {{"attachment_id", a["id"]}, {"mode", "ro"}}),
      "invalid_state");
  EXPECT_TRUE(volume(vol)["writer"].is_null());
}

// A write queued on an attachment's old connection (its header received, its payload stalled:
// the client's socket paused, as a host that timed the request out and reconnected leaves it)
// never runs after a newer connection of that attachment was served: the new connection's
// handshake closes the old one first (ydb-platform/nbs#7070). The newer data stays.
TEST_F(FencingTest, AStaleWriteOfAnOldConnectionNeverLandsAfterAReconnect) {
  const std::string vol = create_single("4M");
  const Json a = attach_unix(vol, "node-a");
  e2e::RawClient old(nbd_socket());
  ASSERT_TRUE(e2e::handshake(old, a["connection_info"]["data"]["export_name"]));
  ASSERT_TRUE(e2e::send_request(old, nbd::kCmdWrite, 1, 0, 4096));
  const std::string stale = pattern('O', 4096);
  ASSERT_TRUE(old.send_all(stale.data(), 2048));  // then the socket stalls
  std::this_thread::sleep_for(std::chrono::milliseconds(50));

  NbdHandle fresh = connect(a);
  ASSERT_TRUE(fresh);
  const std::string newer = pattern('N', 4096);
  ASSERT_EQ(nbd_pwrite(fresh.get(), newer.data(), newer.size(), 0, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_flush(fresh.get(), 0), 0);
  old.send_all(stale.data() + 2048, 2048);  // the rest arrives late (or finds it closed)
  EXPECT_TRUE(old.closed_by_server());
  EXPECT_EQ(nbd_read(fresh.get(), 0, 4096), newer);
  EXPECT_EQ(rpc_ok(control(), "attachment_show", {{"attachment_id", a["id"]}})["connections"], 1);
}

// A reconnect replaces the older connection, which then fails; a connector with multi_conn
// keeps several at once and advertises NBD_FLAG_CAN_MULTI_CONN.
TEST_F(FencingTest, OneConnectionPerAttachmentUnlessMultiConn) {
  const std::string vol = create_volume("4M");
  const Json a = attach_unix(vol, "node-a");
  NbdHandle first = connect(a);
  ASSERT_TRUE(first);
  EXPECT_EQ(nbd_can_multi_conn(first.get()), 0);
  char byte = 0;
  EXPECT_EQ(nbd_pread(first.get(), &byte, 1, 0, 0), 0) << nbd_get_error();
  NbdHandle second = connect(a);
  ASSERT_TRUE(second);
  // The new one is served once the older one is closed; from then on the older one fails.
  EXPECT_EQ(nbd_pread(second.get(), &byte, 1, 0, 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_pread(first.get(), &byte, 1, 0, 0), -1) << "the older connection still serves";

  const Json m =
      attach(vol, "node-m", {{"host", "m"}, {"transport", "unix"}, {"multi_conn", true}});
  NbdHandle one = connect(m), two = connect(m);
  ASSERT_TRUE(one && two);
  EXPECT_EQ(nbd_can_multi_conn(one.get()), 1);
  EXPECT_EQ(nbd_pread(one.get(), &byte, 1, 0, 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_pread(two.get(), &byte, 1, 0, 0), 0) << nbd_get_error();
  EXPECT_EQ(rpc_reason(control(), "attachment_create",
                       {{"volume_id", vol},
                        {"instance_uuid", "node-f"},
                        {"connector",
                         {{"host", "f"},
                          {"transport", "fuse"},
                          {"mountpoint", "/mnt/x"},
                          {"multi_conn", true}}}}),
            "invalid_params");
}

// Writer, policy and generation survive kill -9: after the restart the same attachment is the
// writer and the standby is still refused.
TEST_F(FencingTest, TheWriterSurvivesAKill) {
  const std::string vol = create_single("4M");
  const Json a = attach_unix(vol, "node-a");
  const Json b = attach_unix(vol, "node-b");
  rpc_ok(control(), "volume_takeover", {{"volume_id", vol}, {"attachment_id", b["id"]}});
  const Json before = volume(vol);
  daemon_->stop(SIGKILL);
  daemon_.reset();
  start();
  const Json after = volume(vol);
  EXPECT_EQ(after["writer"], b["id"]);
  EXPECT_EQ(after["writer_policy"], "single");
  EXPECT_EQ(after["fencing_generation"], before["fencing_generation"]);
  NbdHandle ha = connect(a), hb = connect(b);
  ASSERT_TRUE(ha && hb);
  const std::string data = pattern('k', 4096);
  EXPECT_EQ(nbd_pwrite(hb.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
  expect_every_write_refused(ha.get(), {{0, 4096}});
}

// kill -9 in the middle of a takeover: after the fence but before the record, the old writer
// is the writer again after the restart (the call never returned); after the record, the new
// one. Either way exactly one of the two writes, from the restart on.
TEST_F(FencingTest, AKillInTheMiddleOfATakeoverLeavesOneWriter) {
  SHAREBLK_REQUIRE_TEST_HOOKS();
  for (const char* point : {"volume_takeover:fenced", "volume_takeover:recorded"}) {
    SCOPED_TRACE(point);
    const std::string vol = create_single("4M");
    const Json a = attach_unix(vol, std::string("a-") + point);
    const Json b = attach_unix(vol, std::string("b-") + point);
    daemon_->stop(SIGTERM);
    daemon_.reset();
    std::vector<std::string> args{
        "--state-dir",  dir_.path().string(), "--listen-unix", nbd_socket(),
        "--listen-tcp", "127.0.0.1:0",        "--workers",     "1"};
    daemon_ = std::make_unique<Daemon>(
        args, control(),
        std::vector<std::string>{"env", std::string("SHAREBLK_TEST_KILL_AT=") + point});
    EXPECT_THROW(
        rpc(control(), "volume_takeover", {{"volume_id", vol}, {"attachment_id", b["id"]}}),
        std::runtime_error);
    EXPECT_EQ(daemon_->stop(SIGKILL), 128 + SIGKILL);
    daemon_.reset();
    start();
    const bool recorded = std::string(point) == "volume_takeover:recorded";
    const Json v = volume(vol);
    EXPECT_EQ(v["writer"], recorded ? b["id"] : a["id"]);
    EXPECT_EQ(v["fencing_generation"], recorded ? 2 : 1);
    NbdHandle ha = connect(a), hb = connect(b);
    ASSERT_TRUE(ha && hb);
    const std::string data = pattern('w', 4096);
    nbd_handle* writer = recorded ? hb.get() : ha.get();
    nbd_handle* other = recorded ? ha.get() : hb.get();
    EXPECT_EQ(nbd_pwrite(writer, data.data(), data.size(), 0, 0), 0) << nbd_get_error();
    expect_every_write_refused(other, {{0, 4096}});
  }
}

// The writer's detach leaves the volume without one; standbys do not promote themselves.
TEST_F(FencingTest, DetachingTheWriterLeavesNoWriter) {
  const std::string vol = create_single("1M");
  const Json a = attach_unix(vol, "node-a");
  const Json b = attach_unix(vol, "node-b");
  rpc_ok(control(), "attachment_delete", {{"attachment_id", a["id"]}});
  Json v = volume(vol);
  EXPECT_TRUE(v["writer"].is_null());
  EXPECT_EQ(v["fencing_generation"], 2);
  EXPECT_FALSE(rpc_ok(control(), "attachment_show", {{"attachment_id", b["id"]}})["write_access"]
                   .get<bool>());
  EXPECT_EQ(rpc_ok(control(), "volume_takeover",
                   {{"volume_id", vol}, {"attachment_id", b["id"]}})["fencing_generation"],
            3);
  // writer_policy changes only while the volume is available.
  EXPECT_EQ(
      rpc_reason(control(), "volume_update", {{"volume_id", vol}, {"writer_policy", "multi"}}),
      "volume_in_use");
  EXPECT_EQ(rpc_reason(control(), "volume_create",
                       {{"name", "x"}, {"size", "1M"}, {"writer_policy", "one"}}),
            "invalid_params");
}

}  // namespace
}  // namespace shareblk::testing
