// QosLimiter's token buckets on a clock the test moves (target.h).
#include <gtest/gtest.h>

#include <chrono>
#include <utility>

#include "target/target.h"

namespace shareblk::target {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::nanoseconds;
using Dir = QosLimiter::Dir;

QosSpec spec_of(QosSpec::Key key, uint64_t rate, uint64_t burst = 0) {
  QosSpec s;
  s.rate[key] = rate;
  s.burst[key] = burst;
  return s;
}

// A client that always has a request ready: how many start in `seconds` of simulated time,
// each at its turn, as the connection's timer would start it. The last one asked has its turn
// at or after the end, and is charged.
uint64_t run_greedy(QosLimiter& q, Dir dir, uint64_t bytes, Clock::time_point& now,
                    double seconds) {
  const Clock::time_point end =
      now + std::chrono::duration_cast<nanoseconds>(std::chrono::duration<double>(seconds));
  uint64_t went = 0;
  for (;;) {
    now += q.admit(dir, bytes, now);
    if (now >= end) return went;
    ++went;
  }
}

TEST(QosLimiter, NoSpecIsNotEngagedAndNeverWaits) {
  auto q = QosLimiter::make({});
  EXPECT_FALSE(q->engaged());
  EXPECT_FALSE(QosLimiter::unlimited().engaged());
  EXPECT_EQ(q->admit(Dir::Read, 1 << 20, Clock::now()).count(), 0);
}

TEST(QosLimiter, AnIopsRateHoldsOverTenSeconds) {
  auto q = QosLimiter::make(spec_of(QosSpec::TotalIops, 2000));
  ASSERT_TRUE(q->engaged());
  Clock::time_point now = Clock::now();
  const uint64_t went = run_greedy(*q, Dir::Read, 4096, now, 10.0);
  // The full bucket (a tenth of a second) at the start, then the rate.
  EXPECT_NEAR(static_cast<double>(went), 2000 * 10 + 200, 2);
}

TEST(QosLimiter, ABurstIsTheMaxKeyAndABytesRateCountsLength) {
  auto q = QosLimiter::make(spec_of(QosSpec::ReadBytes, 1 << 20, 4 << 20));
  Clock::time_point now = Clock::now();
  // 4 MiB of burst, then 1 MiB/s: 64 KiB reads.
  const uint64_t went = run_greedy(*q, Dir::Read, 65536, now, 4.0);
  EXPECT_NEAR(static_cast<double>(went), 64 + 4 * 16, 1);
  // Writes are not read_bytes_sec's.
  EXPECT_EQ(q->admit(Dir::Write, 65536, now).count(), 0);
}

TEST(QosLimiter, ARequestLargerThanTheBucketStillGoes) {
  auto q = QosLimiter::make(spec_of(QosSpec::TotalBytes, 1000));  // bucket: 100 bytes
  Clock::time_point now = Clock::now();
  EXPECT_EQ(q->admit(Dir::Write, 1 << 20, now).count(), 0);  // into debt
  const nanoseconds wait = q->admit(Dir::Write, 1, now);
  // About 1 MiB / 1000 B/s until the debt is paid.
  EXPECT_NEAR(std::chrono::duration<double>(wait).count(), (1 << 20) / 1000.0, 1.0);
}

TEST(QosLimiter, TheVolumeLimitIsSharedByItsAttachments) {
  auto volume = QosLimiter::make(spec_of(QosSpec::TotalIops, 1000));
  auto a = QosLimiter::make({}, volume);
  auto b = QosLimiter::make({}, volume);
  EXPECT_TRUE(a->engaged());
  EXPECT_TRUE(b->engaged());
  // Two clients that each hold one turn at a time, as connections do; the earlier turn goes
  // first (of two at the same time, the one asked first), and its client asks again at once.
  Clock::time_point now = Clock::now();
  const Clock::time_point end = now + std::chrono::seconds(5);
  uint64_t asked = 0;
  std::pair turn_a{now + a->admit(Dir::Read, 4096, now), asked++};
  std::pair turn_b{now + b->admit(Dir::Write, 4096, now), asked++};
  uint64_t went_a = 0;
  uint64_t went_b = 0;
  for (;;) {
    const bool first = turn_a < turn_b;
    now = first ? turn_a.first : turn_b.first;
    if (now >= end) break;
    if (first) {
      ++went_a;
      turn_a = {now + a->admit(Dir::Read, 4096, now), asked++};
    } else {
      ++went_b;
      turn_b = {now + b->admit(Dir::Write, 4096, now), asked++};
    }
  }
  EXPECT_NEAR(static_cast<double>(went_a + went_b), 1000 * 5 + 100, 3);
  // First come, first served: they alternate, and neither is starved.
  EXPECT_NEAR(static_cast<double>(went_a), static_cast<double>(went_b), 1);
}

TEST(QosLimiter, TurnsGoInTheOrderTheyAreAsked) {
  auto volume = QosLimiter::make(spec_of(QosSpec::TotalIops, 1000, 1));
  auto a = QosLimiter::make({}, volume);
  auto b = QosLimiter::make({}, volume);
  const Clock::time_point now = Clock::now();
  // A full bucket of one: two may start now (the second takes it into debt).
  EXPECT_EQ(a->admit(Dir::Read, 0, now).count(), 0);
  EXPECT_EQ(b->admit(Dir::Read, 0, now).count(), 0);
  // Then, asked at the same moment: turns a millisecond apart, in order, each charged.
  EXPECT_EQ(a->admit(Dir::Read, 0, now), milliseconds(1));
  EXPECT_EQ(b->admit(Dir::Read, 0, now), milliseconds(2));
  EXPECT_EQ(a->admit(Dir::Read, 0, now), milliseconds(3));
}

TEST(QosLimiter, EveryChangeOfItsOwnOrItsVolumesLimitsIsSeen) {
  auto volume = QosLimiter::make({});
  auto a = QosLimiter::make({}, volume);
  const uint64_t before = a->generation();
  a->set(spec_of(QosSpec::ReadIops, 10));
  EXPECT_NE(a->generation(), before);
  const uint64_t own = a->generation();
  volume->set(spec_of(QosSpec::ReadIops, 10));
  EXPECT_NE(a->generation(), own);
}

TEST(QosLimiter, ChangesReachTheAttachmentsEngagedFlag) {
  auto volume = QosLimiter::make({});
  auto a = QosLimiter::make({}, volume);
  EXPECT_FALSE(a->engaged());
  volume->set(spec_of(QosSpec::WriteIops, 10));
  EXPECT_TRUE(a->engaged());
  a->set(spec_of(QosSpec::ReadIops, 10));
  volume->set({});
  EXPECT_TRUE(a->engaged());
  a->set({});
  EXPECT_FALSE(a->engaged());
  EXPECT_EQ(a->spec(), QosSpec{});
}

TEST(QosLimiter, ARaisedLimitTakesEffectAtOnce) {
  auto q = QosLimiter::make(spec_of(QosSpec::TotalIops, 100));
  Clock::time_point now = Clock::now();
  run_greedy(*q, Dir::Read, 0, now, 1.0);
  q->set(spec_of(QosSpec::TotalIops, 1000));
  const uint64_t went = run_greedy(*q, Dir::Read, 0, now, 2.0);
  // set() refills by the real clock, which is behind this test's: the old rate's last wait
  // (10 ms at most) is credited at the new rate.
  EXPECT_NEAR(static_cast<double>(went), 2000, 12);
}

TEST(QosLimiter, UnlimitedKindsNeverWait) {
  auto q = QosLimiter::make(spec_of(QosSpec::TotalIops, 1));
  const Clock::time_point now = Clock::now();
  while (q->admit(Dir::Read, 0, now).count() == 0) {
  }
  EXPECT_GT(q->admit(Dir::Write, 0, now).count(), 0);
  EXPECT_EQ(q->admit(Dir::None, 4096, now).count(), 0);
}

}  // namespace
}  // namespace shareblk::target
