// Internal to control/: how a refused call travels from where it is refused to the JSON-RPC
// reply. The control plane throws ApiError at any depth; the method table turns it into a
// JSON-RPC error whose data.reason is `reason` (the list in docs/api.md).
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace shareblk::control {

// `reason` is one of: invalid_params, not_found, volume_in_use, not_multiattach,
// attachment_id_required, duplicate_attachment, policy_denied, invalid_state, no_space,
// volume_error, not_single_writer, already_writer, volume_busy, volume_has_snapshots,
// not_supported, forbidden, internal.
struct ApiError : std::runtime_error {
  ApiError(std::string why, const std::string& message, nlohmann::json more = nullptr)
      : std::runtime_error(message), reason(std::move(why)), data(std::move(more)) {}
  std::string reason;
  // Members the reply's error.data carries beside `reason` (an object), or null for none.
  nlohmann::json data;
};

[[noreturn]] inline void invalid(const std::string& message) {
  throw ApiError("invalid_params", message);
}

}  // namespace shareblk::control
