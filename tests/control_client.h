// A JSON-RPC client of shareblkd's control socket, for tests.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace shareblk::testing {

// Sends one call and returns the whole response object ({"result": ...} or {"error": ...}).
// Throws std::runtime_error when the socket cannot be reached or answers garbage.
nlohmann::json rpc(const std::string& socket, const std::string& method,
                   const nlohmann::json& params = nlohmann::json::object());

// The result of a call that must succeed; a refusal fails the calling test with its reason.
nlohmann::json rpc_ok(const std::string& socket, const std::string& method,
                      const nlohmann::json& params = nlohmann::json::object());

// data.reason of a call that must fail ("" if it succeeded).
std::string rpc_reason(const std::string& socket, const std::string& method,
                       const nlohmann::json& params = nlohmann::json::object());

}  // namespace shareblk::testing
