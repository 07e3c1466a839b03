#include "control/attachment_state.h"

#include <array>
#include <utility>

#include "control/api_error.h"

namespace shareblk::control {

namespace {

using S = AttachStatus;
using E = AttachEvent;

struct Row {
  S from;
  E event;
  S to;
};

// Every allowed (state, event); anything else is invalid_state.
constexpr std::array kTable = {
    Row{S::Reserved, E::Connect, S::Attaching},
    Row{S::Attaching, E::Connect, S::Attaching},  // a new connector replaces the old one
    Row{S::Attaching, E::Complete, S::Attached},
    Row{S::Attached, E::Complete, S::Attached},  // a retried complete
    Row{S::Reserved, E::Detach, S::Detaching},
    Row{S::Attaching, E::Detach, S::Detaching},
    Row{S::Attached, E::Detach, S::Detaching},
    Row{S::Detaching, E::Detach, S::Detaching},  // a detach that failed half way, retried
    Row{S::Detached, E::Detach, S::Detached},    // a retried detach returns it as it is
    Row{S::Detaching, E::Finish, S::Detached},
    Row{S::Reserved, E::ChangeMode, S::Reserved},
    Row{S::Attaching, E::ChangeMode, S::Attaching},
    Row{S::Attached, E::ChangeMode, S::Attached},
    Row{S::Reserved, E::TakeOver, S::Reserved},
    Row{S::Attaching, E::TakeOver, S::Attaching},
    Row{S::Attached, E::TakeOver, S::Attached},
    Row{S::Reserved, E::ChangeQos, S::Reserved},
    Row{S::Attaching, E::ChangeQos, S::Attaching},
    Row{S::Attached, E::ChangeQos, S::Attached},
    Row{S::Detaching, E::ChangeQos, S::Detaching},  // its connections still run meanwhile
};

constexpr std::array<std::pair<S, std::string_view>, 5> kNames = {{
    {S::Reserved, "reserved"},
    {S::Attaching, "attaching"},
    {S::Attached, "attached"},
    {S::Detaching, "detaching"},
    {S::Detached, "detached"},
}};

}  // namespace

std::string_view to_string(AttachStatus status) {
  for (const auto& [s, name] : kNames) {
    if (s == status) return name;
  }
  return "unknown";
}

std::string_view to_string(AttachEvent event) {
  switch (event) {
    case E::Connect:
      return "connect";
    case E::Complete:
      return "complete";
    case E::Detach:
      return "detach";
    case E::Finish:
      return "finish detaching";
    case E::ChangeMode:
      return "change its mode";
    case E::ChangeQos:
      return "change its QoS";
    case E::TakeOver:
      return "take over as the writer";
  }
  return "unknown";
}

std::optional<AttachStatus> parse_attach_status(std::string_view text) {
  for (const auto& [s, name] : kNames) {
    if (name == text) return s;
  }
  return std::nullopt;
}

std::optional<AttachStatus> next_status(AttachStatus from, AttachEvent event) {
  for (const Row& row : kTable) {
    if (row.from == from && row.event == event) return row.to;
  }
  return std::nullopt;
}

AttachStatus transition(const std::string& attachment_id, AttachStatus from, AttachEvent event) {
  if (auto to = next_status(from, event)) return *to;
  std::string message = "attachment " + attachment_id + " is " + std::string(to_string(from)) +
                        "; cannot " + std::string(to_string(event));
  if (event == E::Complete && from == S::Reserved) {
    message += ": it needs a connector first (attachment_update)";
  }
  throw ApiError("invalid_state", message);
}

}  // namespace shareblk::control
