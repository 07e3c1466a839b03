// The control API's word for where a volume or a snapshot stands (docs/api.md, "Volume" and
// "Snapshot"): the one to_string and the one parse of it. The daemon derives and writes it;
// clients (the shareblk CLI) read it. Header only: both sides include it, neither links the
// other.
#pragma once

#include <array>
#include <optional>
#include <string_view>
#include <utility>

namespace shareblk::api {

// Cinder's volume statuses that shareblk shows. A snapshot is only ever Creating, Available,
// Deleting or Error.
enum class VolumeStatus {
  Creating,   // its store is being filled (volume_create's copy, a clone) or made
  Available,  // no live attachment
  Reserved,   // its most advanced attachment is reserved
  Attaching,
  InUse,  // an attachment is attached
  Detaching,
  Deleting,  // volume_delete's job is running
  Error,     // status_reason says why; only a delete is taken
};

inline constexpr std::array<std::pair<VolumeStatus, std::string_view>, 8> kVolumeStatusNames = {{
    {VolumeStatus::Creating, "creating"},
    {VolumeStatus::Available, "available"},
    {VolumeStatus::Reserved, "reserved"},
    {VolumeStatus::Attaching, "attaching"},
    {VolumeStatus::InUse, "in-use"},
    {VolumeStatus::Detaching, "detaching"},
    {VolumeStatus::Deleting, "deleting"},
    {VolumeStatus::Error, "error"},
}};

constexpr std::string_view to_string(VolumeStatus status) {
  for (const auto& [s, name] : kVolumeStatusNames) {
    if (s == status) return name;
  }
  return "error";
}

// Nullopt for any other text (a newer daemon's status, say): callers decide, never guess.
constexpr std::optional<VolumeStatus> parse_volume_status(std::string_view text) {
  for (const auto& [s, name] : kVolumeStatusNames) {
    if (name == text) return s;
  }
  return std::nullopt;
}

// A job of the daemon's is running on it: its status changes without a call (the CLI follows
// it until it ends).
constexpr bool is_job_running(VolumeStatus status) {
  return status == VolumeStatus::Creating || status == VolumeStatus::Deleting;
}

}  // namespace shareblk::api
