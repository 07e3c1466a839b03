// What the control plane's in-process suite (control_unit_tests) shares: its ControlPlaneTest.
//
// The control plane in-process: the attachment state machine, the volume store and the JSON-RPC
// framing, driven through ControlPlane::handle() with no NBD server bound (so attachments have
// no connections and detach has none to close).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "control/control.h"
#include "store/volume_store.h"
#include "tests/support.h"

namespace shareblk::testing::control_unit {

namespace fs = std::filesystem;
using shareblk::control::ControlPlane;
using shareblk::control::Endpoints;
using shareblk::control::Policy;
using Json = nlohmann::json;

inline constexpr const char* kUnixSocket = "/run/shareblk-test/nbd.sock";
inline constexpr const char* kTcpEndpoint = "127.0.0.1:10809";

class ControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shareblk::store::StoreError error;
    store_ = shareblk::store::make_file_store(volumes_dir(), false, error);
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
  std::unique_ptr<shareblk::store::VolumeStore> store_;
  std::unique_ptr<ControlPlane> plane_;
  shareblk::control::Caller caller_{1234, 1000};
  int next_id_ = 1;
};

}  // namespace shareblk::testing::control_unit
