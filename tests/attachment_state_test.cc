// The attachment lifecycle on its own: the whole (state, event) table, with no socket, no
// SQLite and no volume store.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "control/api_error.h"
#include "control/attachment_state.h"

namespace {

using shareblk::control::AttachEvent;
using shareblk::control::AttachStatus;
using S = AttachStatus;
using E = AttachEvent;

constexpr S kStates[] = {S::Reserved, S::Attaching, S::Attached, S::Detaching, S::Detached};
constexpr E kEvents[] = {E::Connect, E::Complete, E::Detach, E::Finish};

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
  EXPECT_EQ(allowed, 10);
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

TEST(AttachmentState, LiveAndServingFollowTheStates) {
  using shareblk::control::is_live;
  using shareblk::control::is_serving;
  EXPECT_TRUE(is_live(S::Reserved) && is_live(S::Detaching));
  EXPECT_FALSE(is_live(S::Detached));
  EXPECT_TRUE(is_serving(S::Attaching) && is_serving(S::Attached));
  EXPECT_FALSE(is_serving(S::Reserved) || is_serving(S::Detaching) || is_serving(S::Detached));
}

}  // namespace
