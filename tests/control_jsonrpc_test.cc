// The control plane in-process, its JSON-RPC framing: errors, notifications, batches and bounds.
#include <gtest/gtest.h>

#include <string>

#include "control/params.h"
#include "tests/control_fixture.h"

namespace shareblk::testing::control_unit {
namespace {

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

}  // namespace
}  // namespace shareblk::testing::control_unit
