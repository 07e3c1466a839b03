#include "tests/control_client.h"

#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <thread>

#include "rpc/client.h"

namespace shareblk::testing {

namespace {

// One call on a connection of its own. No answer at all is an exception: the tests' edge.
shareblk::rpc::Outcome call(const std::string& socket, const std::string& method,
                            const nlohmann::json& params) {
  shareblk::rpc::Client client;
  if (const std::error_code ec = client.connect(socket, shareblk::rpc::kWaitForever)) {
    throw std::runtime_error("cannot connect to " + socket + ": " + ec.message());
  }
  shareblk::rpc::Outcome outcome = client.call(method, params);
  if (outcome.error && outcome.error->link) {
    throw std::runtime_error(method + ": no valid reply from " + socket + ": " +
                             outcome.error->describe());
  }
  return outcome;
}

}  // namespace

nlohmann::json rpc(const std::string& socket, const std::string& method,
                   const nlohmann::json& params) {
  const shareblk::rpc::Outcome outcome = call(socket, method, params);
  if (outcome.ok()) return nlohmann::json{{"result", outcome.result}};
  nlohmann::json error{{"code", outcome.error->code}, {"message", outcome.error->message}};
  if (!outcome.error->data.is_null()) error["data"] = outcome.error->data;
  return nlohmann::json{{"error", error}};
}

nlohmann::json rpc_ok(const std::string& socket, const std::string& method,
                      const nlohmann::json& params) {
  const shareblk::rpc::Outcome outcome = call(socket, method, params);
  EXPECT_TRUE(outcome.ok()) << method << ": " << outcome.error->describe();
  return outcome.result;
}

std::string rpc_reason(const std::string& socket, const std::string& method,
                       const nlohmann::json& params) {
  const shareblk::rpc::Outcome outcome = call(socket, method, params);
  return outcome.ok() ? "" : outcome.error->reason;
}

bool wait_connections(const std::string& socket, const std::string& attachment_id, size_t want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    const nlohmann::json shown =
        rpc_ok(socket, "attachment_show", {{"attachment_id", attachment_id}});
    if (shown.value("connections", size_t{9999}) == want) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace shareblk::testing
