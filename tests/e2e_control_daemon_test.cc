// The attachment contract end to end: restart, options, stopping, concurrency, JSON-RPC framing.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>
#include <sys/stat.h>

#include <cerrno>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e_control_fixture.h"

namespace shareblk::testing::control_e2e {
namespace {

// --- Restart ---

TEST_P(ControlE2eTest, KillNineAndRestartKeepsEverything) {
  const std::string shared = create_volume("shared", 2 * kMiB, true)["id"];
  const std::string single = create_volume("single", kMiB, false)["id"];
  const std::string spare = create_volume("spare", kMiB, false)["id"];
  Json rw = attach(shared, "writer", "rw");
  Json ro_attaching =
      ok("attachment_create", {{"volume_id", shared},
                               {"instance_uuid", "reader"},
                               {"mode", "ro"},
                               {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  Json reserved = ok("attachment_create", {{"volume_id", single}, {"instance_uuid", "later"}});
  Json gone = attach(spare, "gone", "rw");
  ok("attachment_delete", {{"attachment_id", gone["id"]}});
  const Json volumes = ok("volume_list", Json::object());
  const Json attachments = ok("attachment_list", Json::object());

  const std::string data = pattern('\x9e', k64K);
  {
    NbdHandle writer = nbd_open(uri_of(rw));
    ASSERT_TRUE(writer) << nbd_get_error();
    ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), kMiB, LIBNBD_CMD_FLAG_FUA), 0);
    // Killed with the client still connected.
    EXPECT_EQ(daemon_->stop(SIGKILL), 128 + SIGKILL);
    start();
  }

  EXPECT_EQ(ok("volume_list", Json::object()), volumes);
  EXPECT_EQ(ok("attachment_list", Json::object()), attachments);
  Json rw_after = ok("attachment_show", {{"attachment_id", rw["id"]}});
  EXPECT_EQ(rw_after["attach_status"], "attached");
  EXPECT_EQ(export_of(rw_after), export_of(rw));
  EXPECT_EQ(uri_of(rw_after), uri_of(rw));

  // The exports serve again at the same names, with the same data.
  NbdHandle writer = nbd_open(uri_of(rw));
  ASSERT_TRUE(writer) << nbd_get_error();
  EXPECT_EQ(nbd_read(writer.get(), kMiB, k64K), data);
  NbdHandle reader = nbd_open(uri_of(ro_attaching));
  ASSERT_TRUE(reader) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(reader.get()), 1);
  EXPECT_EQ(nbd_read(reader.get(), kMiB, k64K), data);
  // The detached one stays dead, and the rules still hold.
  int err = 0;
  EXPECT_FALSE(nbd_open(uri_of(gone), &err));
  EXPECT_EQ(err, ENOENT);
  EXPECT_EQ(reason("attachment_create", {{"volume_id", single}, {"instance_uuid", "x"}}),
            "not_multiattach");
  EXPECT_EQ(reason("volume_delete", {{"volume_id", shared}}), "volume_in_use");
  ok("attachment_complete", {{"attachment_id", ro_attaching["id"]}});
  EXPECT_TRUE(wait_connections(rw["id"], 1));
}

// --- The daemon's configuration ---

// The control socket is its owner's alone unless the operator says otherwise
// (--control-socket-mode, --control-socket-group: e2e_access_test.cc).
TEST_P(ControlE2eTest, ControlSocketIsOwnerOnly) {
  struct stat st {};
  ASSERT_EQ(::stat(control_socket().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_TRUE(fs::exists(dir_ / "shareblk.db"));
  if (store() == "file") {
    EXPECT_TRUE(fs::is_directory(dir_ / "volumes"));
  }
}

TEST_P(ControlE2eTest, PolicyOptionsAreEnforced) {
  const std::string shared = create_volume("shared", kMiB, true)["id"];
  const std::string boot =
      ok("volume_create",
         {{"name", "boot"}, {"size", kMiB}, {"multiattach", true}, {"bootable", true}})["id"];
  start({"--allow-multiattach-bootable", "false"});
  attach(boot, "first", "rw");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", boot}, {"instance_uuid", "second"}}),
            "policy_denied");
  attach(shared, "first", "rw");
  attach(shared, "second", "ro");

  start({"--allow-multiattach", "false"});
  EXPECT_EQ(reason("volume_create", {{"name", "v"}, {"size", kMiB}, {"multiattach", true}}),
            "policy_denied");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", shared}, {"instance_uuid", "third"}}),
            "policy_denied");
  create_volume("plain", kMiB, false);
}

TEST_P(ControlE2eTest, StopsCleanlyWithClientsConnected) {
  const std::string vol = create_volume("busy", kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro", "tcp");
  NbdHandle writer = nbd_open(uri_of(rw));
  NbdHandle reader = nbd_open(uri_of(ro));
  ASSERT_TRUE(writer && reader) << nbd_get_error();
  RpcConnection idle(control_socket());
  EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  EXPECT_EQ(daemon_->log().find("Sanitizer"), std::string::npos) << daemon_->log();
  daemon_.reset();
  std::string buf(512, '\0');
  EXPECT_EQ(nbd_pread(writer.get(), buf.data(), buf.size(), 0, 0), -1);
}

// --- Concurrency ---

TEST_P(ControlE2eTest, ConcurrentCreatesYieldExactlyOneAttachment) {
  const std::string vol = create_volume("contended", kMiB, false)["id"];
  constexpr int kCallers = 50;
  std::vector<Json> replies(kCallers);
  std::latch ready(kCallers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back([&, i] {
      RpcConnection connection(control_socket());
      ready.arrive_and_wait();  // every caller connected, then all at once
      replies[i] =
          connection.call("attachment_create",
                          {{"volume_id", vol}, {"instance_uuid", "instance-" + std::to_string(i)}});
    });
  }
  for (auto& t : threads) t.join();
  int created = 0;
  int not_multiattach = 0;
  for (const Json& reply : replies) {
    if (reply.contains("result")) ++created;
    if (reason_of(reply) == "not_multiattach") ++not_multiattach;
  }
  EXPECT_EQ(created, 1);
  EXPECT_EQ(not_multiattach, kCallers - 1);
  EXPECT_EQ(ok("attachment_list", {{"volume_id", vol}}).size(), 1u);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["status"], "reserved");
}

// --- JSON-RPC on the socket ---

TEST_P(ControlE2eTest, MalformedRequestsLeaveTheConnectionUsable) {
  RpcConnection c(control_socket());
  auto expect_parse_error = [&](const std::string& what) {
    Json reply = c.read_reply();
    ASSERT_TRUE(reply.is_object()) << what;
    EXPECT_EQ(reply["error"]["code"], -32700) << what << ": " << reply;
    EXPECT_EQ(reply["id"], nullptr) << what;
  };

  ASSERT_TRUE(c.send_raw("garbage\n"));
  expect_parse_error("garbage");
  EXPECT_TRUE(c.call("volume_list", Json::object()).contains("result"));

  ASSERT_TRUE(
      c.send_raw("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"volume_create\",\"params\":"
                 "{\"name\":\"\xc3\x28\",\"size\":\"1M\"}}\n"));
  expect_parse_error("invalid UTF-8");
  ASSERT_TRUE(c.send_raw("\xff\xfe\xfd\n"));
  expect_parse_error("bytes that are no text");
  // Valid JSON that is no valid request.
  ASSERT_TRUE(c.send_raw(R"({"jsonrpc":2.0,"id":5,"method":"volume_list"})"
                         "\n"));
  Json invalid = c.read_reply();
  EXPECT_EQ(invalid["error"]["code"], -32600) << invalid;
  EXPECT_EQ(c.call("volume_list", Json::object())["result"], Json::array());

  // Over-long lines: one error each, and nothing else.
  for (size_t size : {size_t{2} << 20, size_t{5} << 20}) {
    const std::string line =
        R"({"jsonrpc":"2.0","id":77,"method":"volume_list","params":{"pad":")" +
        std::string(size, 'x') + "\"}}\n";
    ASSERT_TRUE(c.send_raw(line));
    expect_parse_error(std::to_string(size) + "-byte line");
    Json reply = c.call("volume_list", Json::object());
    EXPECT_TRUE(reply.contains("result")) << reply;
  }

  // A batch gets an array of answers.
  ASSERT_TRUE(c.send_raw(
      R"([{"jsonrpc":"2.0","id":"a","method":"volume_list"},)"
      R"({"jsonrpc":"2.0","id":"b","method":"volume_create","params":{"name":"v","size":0}},)"
      R"({"jsonrpc":"2.0","method":"volume_list"}])"
      "\n"));
  Json batch = c.read_reply();
  ASSERT_TRUE(batch.is_array()) << batch;
  ASSERT_EQ(batch.size(), 2u) << batch;
  EXPECT_EQ(batch[0]["id"], "a");
  EXPECT_TRUE(batch[0].contains("result"));
  EXPECT_EQ(batch[1]["id"], "b");
  EXPECT_EQ(reason_of(batch[1]), "invalid_params");

  // Blank lines and notifications get no reply; requests split over writes and several in
  // one write are answered in order.
  ASSERT_TRUE(c.send_raw("\n  \n{\"jsonrpc\":\"2.0\",\"method\":\"volume_list\"}\n"));
  ASSERT_TRUE(c.send_raw(R"({"jsonrpc":"2.0","id":101,)"));
  std::this_thread::sleep_for(milliseconds(20));
  ASSERT_TRUE(c.send_raw(R"("method":"volume_list"})"
                         "\n"
                         R"({"jsonrpc":"2.0","id":102,"method":"no_such_method"})"
                         "\n"));
  Json first = c.read_reply();
  Json second = c.read_reply();
  EXPECT_EQ(first["id"], 101) << first;
  EXPECT_TRUE(first.contains("result")) << first;
  EXPECT_EQ(second["id"], 102) << second;
  EXPECT_EQ(second["error"]["code"], -32601) << second;
  // Nothing else is pending.
  EXPECT_FALSE(c.read_line(milliseconds(200)).has_value());
}

}  // namespace
}  // namespace shareblk::testing::control_e2e
