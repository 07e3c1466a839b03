// The state rules on their own: the attachment lifecycle's whole (state, event) table, the
// one parse of modes and volume statuses, and the status a volume derives -- with no socket,
// no SQLite and no volume store.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "control/api_error.h"
#include "control/attachment_state.h"
#include "control/service.h"

namespace {

using shareblk::control::AttachEvent;
using shareblk::control::AttachStatus;
using S = AttachStatus;
using E = AttachEvent;

constexpr S kStates[] = {S::Reserved, S::Attaching, S::Attached, S::Detaching, S::Detached};
constexpr E kEvents[] = {E::Connect,    E::Complete,  E::Detach,  E::Finish,
                         E::ChangeMode, E::ChangeQos, E::TakeOver};

// What each event does from each state; nullopt: refused with invalid_state.
std::optional<S> expected(S from, E event) {
  switch (event) {
    case E::Connect:  // a connector only before the host has the volume in use
      if (from == S::Reserved || from == S::Attaching) return S::Attaching;
      return std::nullopt;
    case E::Complete:  // needs a connector; a retried complete is a no-op
      if (from == S::Attaching || from == S::Attached) return S::Attached;
      return std::nullopt;
    case E::Detach:  // from anywhere; detached stays detached
      return from == S::Detached ? S::Detached : S::Detaching;
    case E::Finish:
      if (from == S::Detaching) return S::Detached;
      return std::nullopt;
    case E::ChangeMode:  // not once the detach has begun: its connections are being closed
    case E::TakeOver:
      if (from == S::Detaching || from == S::Detached) return std::nullopt;
      return from;
    case E::ChangeQos:  // its connections run until the detach finishes
      if (from == S::Detached) return std::nullopt;
      return from;
  }
  return std::nullopt;
}

TEST(AttachmentState, TheTableIsTheLifecycle) {
  int allowed = 0;
  for (S from : kStates) {
    for (E event : kEvents) {
      SCOPED_TRACE(std::string(to_string(from)) + " + " + std::string(to_string(event)));
      EXPECT_EQ(shareblk::control::next_status(from, event), expected(from, event));
      allowed += expected(from, event).has_value();
    }
  }
  EXPECT_EQ(allowed, 20);
}

TEST(AttachmentState, AnIllegalTransitionIsInvalidStateNamingTheAttachment) {
  for (S from : kStates) {
    for (E event : kEvents) {
      if (expected(from, event)) {
        EXPECT_EQ(shareblk::control::transition("a-1", from, event), *expected(from, event));
        continue;
      }
      try {
        shareblk::control::transition("a-1", from, event);
        ADD_FAILURE() << to_string(from) << " + " << to_string(event) << " was allowed";
      } catch (const shareblk::control::ApiError& e) {
        EXPECT_EQ(e.reason, "invalid_state");
        const std::string message = e.what();
        EXPECT_NE(message.find("a-1"), std::string::npos) << message;
        EXPECT_NE(message.find(std::string(to_string(from))), std::string::npos) << message;
      }
    }
  }
}

TEST(AttachmentState, NamesRoundTripAndNothingElseParses) {
  for (S s : kStates) EXPECT_EQ(shareblk::control::parse_attach_status(to_string(s)), s);
  EXPECT_EQ(to_string(S::Reserved), "reserved");
  EXPECT_EQ(to_string(S::Detached), "detached");
  for (const char* bad : {"", "in-use", "Attached", "available", "attached "}) {
    EXPECT_FALSE(shareblk::control::parse_attach_status(bad).has_value()) << bad;
  }
}

TEST(AttachmentState, WriteAccessAndDetachingFollowTheTable) {
  using shareblk::control::is_detaching;
  using shareblk::control::may_hold_write_access;
  for (S s : {S::Reserved, S::Attaching, S::Attached}) EXPECT_TRUE(may_hold_write_access(s));
  EXPECT_FALSE(may_hold_write_access(S::Detaching) || may_hold_write_access(S::Detached));
  for (S s : kStates) EXPECT_EQ(is_detaching(s), s == S::Detaching);
}

// One text for a mode everywhere (API, database, shared records, nbdkit): anything else is no
// mode, which nobody may take as read-write.
TEST(AttachModeText, RoundTripsAndNothingElseParses) {
  using shareblk::backend::AttachMode;
  using shareblk::backend::parse_attach_mode;
  for (AttachMode m : {AttachMode::ReadWrite, AttachMode::ReadOnly}) {
    EXPECT_EQ(parse_attach_mode(shareblk::backend::to_string(m)), m);
  }
  EXPECT_EQ(shareblk::backend::to_string(AttachMode::ReadWrite), "rw");
  EXPECT_EQ(shareblk::backend::to_string(AttachMode::ReadOnly), "ro");
  for (const char* bad : {"", "RW", "read-write", "w", "rw ", "rwx", "ro\n"}) {
    EXPECT_FALSE(parse_attach_mode(bad).has_value()) << bad;
  }
  // A default-made row (a record that named no mode) is read-only.
  EXPECT_EQ(shareblk::control::AttachmentRow{}.mode, AttachMode::ReadOnly);
}

TEST(VolumeStatusText, RoundTripsAndNothingElseParses) {
  using shareblk::api::VolumeStatus;
  for (const auto& [status, name] : shareblk::api::kVolumeStatusNames) {
    EXPECT_EQ(shareblk::api::to_string(status), name);
    EXPECT_EQ(shareblk::api::parse_volume_status(name), status);
  }
  EXPECT_EQ(shareblk::api::to_string(VolumeStatus::InUse), "in-use");
  for (const char* bad : {"", "in_use", "Available", "attached", "detached"}) {
    EXPECT_FALSE(shareblk::api::parse_volume_status(bad).has_value()) << bad;
  }
  EXPECT_TRUE(shareblk::api::is_job_running(VolumeStatus::Creating));
  EXPECT_TRUE(shareblk::api::is_job_running(VolumeStatus::Deleting));
  EXPECT_FALSE(shareblk::api::is_job_running(VolumeStatus::Error));
}

// docs/api.md, "Volume": an error first, then a job, then the most advanced attachment.
TEST(VolumeStatusText, IsDerivedFromErrorJobAndAttachments) {
  using shareblk::api::VolumeStatus;
  using shareblk::control::AttachmentRow;
  using shareblk::control::derive_status;
  using shareblk::control::IntentAction;
  using shareblk::control::IntentRow;
  auto rows = [](std::initializer_list<S> states) {
    std::vector<AttachmentRow> out;
    for (S s : states) out.push_back(AttachmentRow{.attach_status = s});
    return out;
  };
  EXPECT_EQ(derive_status(false, std::nullopt, {}), VolumeStatus::Available);
  EXPECT_EQ(derive_status(false, std::nullopt, rows({S::Detached})), VolumeStatus::Available);
  EXPECT_EQ(derive_status(false, std::nullopt, rows({S::Detaching, S::Reserved})),
            VolumeStatus::Reserved);
  EXPECT_EQ(derive_status(false, std::nullopt, rows({S::Reserved, S::Attaching})),
            VolumeStatus::Attaching);
  EXPECT_EQ(derive_status(false, std::nullopt, rows({S::Attaching, S::Attached, S::Detaching})),
            VolumeStatus::InUse);
  EXPECT_EQ(derive_status(false, std::nullopt, rows({S::Detaching})), VolumeStatus::Detaching);
  IntentRow deleting;
  deleting.action = IntentAction::Delete;
  IntentRow creating;
  creating.action = IntentAction::Create;
  EXPECT_EQ(derive_status(false, deleting, rows({S::Attached})), VolumeStatus::Deleting);
  EXPECT_EQ(derive_status(false, creating, {}), VolumeStatus::Creating);
  EXPECT_EQ(derive_status(true, deleting, rows({S::Attached})), VolumeStatus::Error);
}

TEST(AttachmentState, LiveAndServingFollowTheStates) {
  using shareblk::control::is_live;
  using shareblk::control::is_serving;
  EXPECT_TRUE(is_live(S::Reserved) && is_live(S::Detaching));
  EXPECT_FALSE(is_live(S::Detached));
  EXPECT_TRUE(is_serving(S::Attaching) && is_serving(S::Attached));
  EXPECT_FALSE(is_serving(S::Reserved) || is_serving(S::Detaching) || is_serving(S::Detached));
}

}  // namespace
