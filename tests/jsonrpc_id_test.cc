// JSON-RPC ids come back exactly as they were sent (docs/api.md, "Framing"): a client matches
// replies to its requests by id, and an id that a parse and a dump change (2^64 became
// 1.8446744073709552e+19, 1E+400 became null) is an id it cannot match.
#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "control/control.h"
#include "store/volume_store.h"
#include "tests/support.h"

namespace {

using Json = nlohmann::json;

class JsonRpcIdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shareblk::store::StoreError error;
    store_ = shareblk::store::make_file_store(dir_ / "volumes", false, error);
    ASSERT_TRUE(store_) << error.message;
    plane_ = std::make_unique<shareblk::control::ControlPlane>(dir_ / "shareblk.db", *store_,
                                                               shareblk::control::Policy{});
    plane_->bind(nullptr, {dir_ / "nbd.sock", ""});
  }

  std::string handle(const std::string& line) { return plane_->handle(line, caller_); }

  shareblk::testing::TempDir dir_;
  std::unique_ptr<shareblk::store::VolumeStore> store_;
  std::unique_ptr<shareblk::control::ControlPlane> plane_;
  shareblk::control::Caller caller_{1234, 1000};
};

// Numbers a parse and a dump would change, and some they would not.
const char* const kNumberIds[] = {
    "18446744073709551616",      // 2^64: past uint64_t
    "18446744073709551615",      // 2^64 - 1
    "-9223372036854775809",      // past int64_t
    "-99999999999999999999999",  // a big negative number
    "123456789012345678901234567890",
    "1.5",
    "1.50",
    "0.1",
    "1e3",
    "1E+300",
    "1e-400",  // below double: would come back as 0.0
    "-0",
    "0",
    "-1",
    "7",
};

std::string request(const std::string& id, const std::string& method = "volume_list") {
  return R"({"jsonrpc":"2.0","id":)" + id + R"(,"method":")" + method + R"("})";
}

TEST_F(JsonRpcIdTest, NumberIdsComeBackWithTheirOwnText) {
  for (const std::string id : kNumberIds) {
    const std::string reply = handle(request(id));
    EXPECT_NE(reply.find(R"("id":)" + id + ","), std::string::npos) << id << " -> " << reply;
    const Json parsed = Json::parse(reply, nullptr, false);
    ASSERT_TRUE(parsed.is_object()) << reply;
    EXPECT_TRUE(parsed.contains("result")) << reply;
    // The same for errors: an unknown method, bad params.
    const std::string unknown = handle(request(id, "volume_frobnicate"));
    EXPECT_NE(unknown.find(R"("id":)" + id + ","), std::string::npos) << id << " -> " << unknown;
    const std::string bad = handle(R"({"jsonrpc":"2.0","method":"volume_show","id":)" + id +
                                   R"(,"params":{"volume_id":7}})");
    EXPECT_NE(bad.find(R"("id":)" + id + ","), std::string::npos) << id << " -> " << bad;
    EXPECT_NE(bad.find("invalid_params"), std::string::npos) << bad;
  }
}

TEST_F(JsonRpcIdTest, ANumberPastADoubleIsNotRead) {
  // nlohmann::json refuses a number it cannot hold (RFC 8259 allows the limit): the line is a
  // parse error, answered with a null id, as docs/api.md says.
  const Json reply = Json::parse(handle(request("1E+400")), nullptr, false);
  EXPECT_EQ(reply["id"], nullptr) << reply;
  EXPECT_EQ(reply["error"]["code"], -32700) << reply;
}

TEST_F(JsonRpcIdTest, StringAndNullIdsComeBackEqual) {
  for (const std::string id : {R"("abc")", R"("")", R"("\u00e9t\u00e9")", R"("a\"b\\c\n")",
                               R"("18446744073709551616")", "null"}) {
    const Json reply = Json::parse(handle(request(id)), nullptr, false);
    ASSERT_TRUE(reply.is_object()) << id;
    EXPECT_EQ(reply["id"], Json::parse(id)) << id << " -> " << reply;
    EXPECT_TRUE(reply.contains("result")) << reply;
  }
}

TEST_F(JsonRpcIdTest, EachRequestOfABatchKeepsItsId) {
  std::string batch = "[";
  for (const std::string id : kNumberIds) batch += request(id) + ",";
  batch += request(R"("s")", "no_such_method") + "]";
  const std::string reply = handle(batch);
  const Json parsed = Json::parse(reply, nullptr, false);
  ASSERT_TRUE(parsed.is_array()) << reply;
  ASSERT_EQ(parsed.size(), std::size(kNumberIds) + 1) << reply;
  size_t at = 0;
  for (const std::string id : kNumberIds) {  // in order
    at = reply.find(R"("id":)" + id + ",", at);
    ASSERT_NE(at, std::string::npos) << id << " -> " << reply;
  }
  EXPECT_EQ(parsed.back()["id"], "s");
  EXPECT_EQ(parsed.back()["error"]["code"], -32601);
}

TEST_F(JsonRpcIdTest, OnlyTheRequestsOwnIdCounts) {
  // An "id" in params is a param (here an unknown one), not the request's id.
  const std::string nested = handle(
      R"({"jsonrpc":"2.0","id":2.50,"method":"volume_show","params":{"volume_id":"x","id":1e5}})");
  EXPECT_NE(nested.find(R"("id":2.50,)"), std::string::npos) << nested;
  EXPECT_EQ(nested.find("1e5"), std::string::npos) << nested;
  // A repeated "id": the last one, as for every other member.
  const Json twice = Json::parse(
      handle(R"({"jsonrpc":"2.0","id":1.5,"id":"last","method":"volume_list"})"), nullptr, false);
  EXPECT_EQ(twice["id"], "last") << twice;
  const std::string twice_number =
      handle(R"({"jsonrpc":"2.0","id":"first","id":1.0e0,"method":"volume_list"})");
  EXPECT_NE(twice_number.find(R"("id":1.0e0,)"), std::string::npos) << twice_number;
  // Ids of another type are still an invalid request answered with a null id.
  for (const std::string id : {"true", "[1.5]", R"({"n":1.5})"}) {
    const Json reply = Json::parse(handle(request(id)), nullptr, false);
    EXPECT_EQ(reply["id"], nullptr) << id << " -> " << reply;
    EXPECT_EQ(reply["error"]["code"], -32600) << reply;
  }
  // A notification stays unanswered, whatever its params hold.
  EXPECT_EQ(handle(R"({"jsonrpc":"2.0","method":"volume_list","params":{"id":1.5}})"), "");
}

TEST_F(JsonRpcIdTest, NestingUpToTheDocumentedDepthIsRead) {
  // The request is level 1, params level 2: 62 arrays more make 64 levels, one more is 65.
  auto line = [](int arrays) {
    return R"({"jsonrpc":"2.0","id":1,"method":"volume_list","params":{"x":)" +
           std::string(static_cast<size_t>(arrays), '[') +
           std::string(static_cast<size_t>(arrays), ']') + "}}";
  };
  const Json read = Json::parse(handle(line(62)), nullptr, false);
  EXPECT_EQ(read["error"]["data"]["reason"], "invalid_params") << read;
  EXPECT_NE(read["error"]["message"].get<std::string>().find("unknown parameter 'x'"),
            std::string::npos)
      << read;
  const Json refused = Json::parse(handle(line(63)), nullptr, false);
  EXPECT_EQ(refused["error"]["code"], -32600) << refused;
  EXPECT_EQ(refused["id"], nullptr) << refused;
}

}  // namespace
