// A JSON-RPC client of shareblkd's control socket, for tests.
#pragma once

#include <cstddef>
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

// Waits up to 10 s for attachment_show to count WANT NBD connections of the attachment. The
// server counts a connection once its handshake is done, which may be a moment after the
// client saw the handshake end.
bool wait_connections(const std::string& socket, const std::string& attachment_id, size_t want);

}  // namespace shareblk::testing
