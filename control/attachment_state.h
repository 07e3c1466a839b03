// Internal to control/: the attachment lifecycle, in one place.
//
//   reserved --connect--> attaching --complete--> attached
//      |                   |    ^ connect            | complete (no change)
//      |                   +----+                    |
//      +------- detach ----+-------- detach ---------+--> detaching --finish--> detached
//
// Three events keep the state: a mode change and a takeover need an attachment not yet
// detaching; a QoS change one not yet detached.
//
// Every change of an attachment's state anywhere in control/ goes through transition(); an
// event that the table does not allow is refused there with the reason `invalid_state`. The
// table is the whole rule: nothing else compares states to decide what may happen (the
// predicates below read it; views.cc only derives the volume's status from them). The states
// and their meaning follow Cinder's volume_attachment.attach_status (docs/state.md).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace shareblk::control {

enum class AttachStatus { Reserved, Attaching, Attached, Detaching, Detached };

enum class AttachEvent {
  Connect,     // a connector arrives (attachment_create with one, or attachment_update)
  Complete,    // the host says the volume is in use (attachment_complete)
  Detach,      // attachment_delete or volume_detach begins: the export is refused from now on
  Finish,      // its connections are closed: the detach is done (or a restart completes it)
  ChangeMode,  // attachment_update's mode (rw <-> ro)
  ChangeQos,   // attachment_qos
  TakeOver,    // volume_takeover makes it the volume's writer
};

// The name stored in the database and shown by the API ("reserved", ...).
std::string_view to_string(AttachStatus status);
std::string_view to_string(AttachEvent event);
// The inverse of to_string(AttachStatus); nullopt for any other text.
std::optional<AttachStatus> parse_attach_status(std::string_view text);

// The table: the state `event` leads to from `from`, or nullopt when it is not allowed.
// Detach of a detached attachment is allowed and changes nothing (a retry returns it as is).
std::optional<AttachStatus> next_status(AttachStatus from, AttachEvent event);

// The one transition function: the new state, or throws ApiError("invalid_state") naming the
// attachment, its state and what was asked.
AttachStatus transition(const std::string& attachment_id, AttachStatus from, AttachEvent event);

// Not yet detached: it counts against multiattach and blocks volume_delete.
inline bool is_live(AttachStatus s) {
  return s != AttachStatus::Detached;
}
// May write (its mode and the volume's writer permitting): what may still take over.
inline bool may_hold_write_access(AttachStatus s) {
  return next_status(s, AttachEvent::TakeOver).has_value();
}
// A detach has begun and not finished: what a restart finishes.
inline bool is_detaching(AttachStatus s) {
  return next_status(s, AttachEvent::Finish).has_value();
}
// Its export name admits clients and it has connection_info.
inline bool is_serving(AttachStatus s) {
  return s == AttachStatus::Attaching || s == AttachStatus::Attached;
}

}  // namespace shareblk::control
