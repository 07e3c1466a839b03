// The control plane's small objects on their own: what copies hold (control/copy_holds.h) and
// the roll-backs of failed creates kept for later (control/roll_backs.h).
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "control/api_error.h"
#include "control/copy_holds.h"
#include "control/roll_backs.h"

namespace {

using shareblk::backend::WriteAccess;
using shareblk::control::ApiError;
using shareblk::control::CopyHolds;
using shareblk::control::RollBacks;

TEST(CopyHolds, AQuiescedVolumesWritesWaitUntilTheHoldGoes) {
  CopyHolds holds;
  auto first = std::make_shared<WriteAccess>(true);
  auto second = std::make_shared<WriteAccess>(true);
  std::shared_ptr<void> hold = holds.quiesce("v", {first, second});
  EXPECT_TRUE(holds.quiesced("v"));
  EXPECT_EQ(first->enter(), WriteAccess::Entry::Paused);
  EXPECT_EQ(second->enter(), WriteAccess::Entry::Paused);
  hold.reset();
  EXPECT_FALSE(holds.quiesced("v"));
  EXPECT_FALSE(first->paused());
  EXPECT_EQ(second->enter(), WriteAccess::Entry::Entered);
  second->leave();
}

TEST(CopyHolds, OneCopyOfAVolumeAtATime) {
  CopyHolds holds;
  std::shared_ptr<void> hold = holds.quiesce("v", {});
  try {
    holds.quiesce("v", {});
    FAIL() << "a second quiesce of one volume was let through";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.reason, "volume_busy");
  }
  std::shared_ptr<void> other = holds.quiesce("w", {});  // another volume may be copied
  hold.reset();
  EXPECT_NO_THROW(hold = holds.quiesce("v", {}));
}

TEST(CopyHolds, AnAttachmentMadeDuringACopyStartsHeldAndIsResumedWithTheRest) {
  CopyHolds holds;
  auto late = std::make_shared<WriteAccess>(true);
  std::shared_ptr<void> hold = holds.quiesce("v", {});
  holds.hold_if_quiesced("v", late);
  holds.hold_if_quiesced("w", std::make_shared<WriteAccess>(true));  // not held: no effect
  EXPECT_TRUE(late->paused());
  hold.reset();
  EXPECT_FALSE(late->paused());
}

TEST(CopyHolds, ASourceStaysInUseUntilItsLastCopyEnds) {
  CopyHolds holds;
  std::shared_ptr<void> one = holds.read_by_copy("s");
  std::shared_ptr<void> two = holds.hold_for_copy("s", {});
  EXPECT_TRUE(holds.is_copy_source("s"));
  one.reset();
  EXPECT_TRUE(holds.is_copy_source("s"));
  EXPECT_TRUE(holds.quiesced("s"));
  two.reset();
  EXPECT_FALSE(holds.is_copy_source("s"));
  EXPECT_FALSE(holds.quiesced("s"));
}

TEST(RollBacks, AFailedUndoIsKeptAndTriedAgainUntilItSucceeds) {
  std::map<std::string, int> calls;
  bool store_answers = false;
  RollBacks roll_backs([&](const std::string& id) -> std::optional<std::string> {
    ++calls[id];
    if (!store_answers) return "the store does not answer";
    return std::nullopt;
  });
  EXPECT_FALSE(roll_backs.run_or_keep("a"));
  EXPECT_FALSE(roll_backs.run_or_keep("b"));
  EXPECT_EQ(roll_backs.pending(), 2u);
  roll_backs.retry();  // still failing: kept
  EXPECT_EQ(roll_backs.pending(), 2u);
  store_answers = true;
  roll_backs.retry();
  EXPECT_EQ(roll_backs.pending(), 0u);
  EXPECT_EQ(calls["a"], 3);
  roll_backs.retry();  // nothing left: no more calls
  EXPECT_EQ(calls["b"], 3);
  EXPECT_TRUE(roll_backs.run_or_keep("c"));
  EXPECT_EQ(roll_backs.pending(), 0u);
}

}  // namespace
