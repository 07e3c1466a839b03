// The request counters (target/io_stats.cc): which latency bucket, which figures, and how the
// workers' counts add up (docs/metrics.md).
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>

#include "target/worker.h"

namespace {

using shareblk::target::GroupCounters;
using shareblk::target::IoStats;
using std::chrono::nanoseconds;

IoStats totals(const GroupCounters& counters) {
  IoStats out;
  counters.add_to(out);
  return out;
}

TEST(IoStats, LatencyBucketsAreUpperBoundsInPowersOfTwoMicroseconds) {
  GroupCounters c;
  c.record(IoStats::Read, 4096, 0, nanoseconds(0));            // <= 1 us
  c.record(IoStats::Read, 4096, 0, nanoseconds(1000));         // <= 1 us
  c.record(IoStats::Read, 4096, 0, nanoseconds(1001));         // <= 2 us
  c.record(IoStats::Read, 4096, 0, nanoseconds(3000));         // <= 4 us
  c.record(IoStats::Read, 4096, 0, nanoseconds(1'000'000));    // <= 1024 us
  c.record(IoStats::Read, 4096, 0, std::chrono::seconds(60));  // past the last bound
  const IoStats s = totals(c);
  const auto& latency = s.ops[IoStats::Read].latency;
  EXPECT_EQ(latency[0], 2u);
  EXPECT_EQ(latency[1], 1u);
  EXPECT_EQ(latency[2], 1u);
  EXPECT_EQ(latency[10], 1u);
  EXPECT_EQ(latency[IoStats::kBuckets - 1], 1u);
  EXPECT_EQ(s.ops[IoStats::Read].requests, 6u);
  EXPECT_EQ(s.ops[IoStats::Read].bytes, 6u * 4096);
  EXPECT_EQ(s.ops[IoStats::Read].time_ns, 60'001'005'001u);
}

TEST(IoStats, ErrorsCountByKindAndErrnoAndRefusedChangesAreEperm) {
  GroupCounters c;
  c.record(IoStats::Write, 4096, EPERM, nanoseconds(10));
  c.record(IoStats::Trim, 4096, EPERM, nanoseconds(10));
  c.record(IoStats::Read, 4096, EPERM, nanoseconds(10));  // not a change: not refused
  c.record(IoStats::Write, 4096, EIO, nanoseconds(10));
  c.record(IoStats::kKinds, 0, EINVAL, nanoseconds(10));  // an unknown command
  const IoStats s = totals(c);
  EXPECT_EQ(s.refused_writes, 2u);
  EXPECT_EQ(s.ops[IoStats::Write].errors, 2u);
  EXPECT_EQ(s.ops[IoStats::Write].bytes, 0u);  // only successful requests move bytes
  EXPECT_EQ(s.ops[IoStats::Read].errors, 1u);
  const std::vector<std::pair<int, uint64_t>> by_errno{{EPERM, 3}, {EIO, 1}, {EINVAL, 1}};
  EXPECT_EQ(s.errors, by_errno);  // ascending errno: EPERM 1, EIO 5, EINVAL 22
}

TEST(IoStats, WorkersAddUp) {
  GroupCounters a;
  GroupCounters b;
  a.record(IoStats::Flush, 0, 0, nanoseconds(5));
  b.record(IoStats::Flush, 0, 0, nanoseconds(7));
  b.record(IoStats::Write, 512, EIO, nanoseconds(7));
  IoStats sum;
  a.add_to(sum);
  b.add_to(sum);
  EXPECT_EQ(sum.ops[IoStats::Flush].requests, 2u);
  EXPECT_EQ(sum.ops[IoStats::Flush].time_ns, 12u);
  ASSERT_EQ(sum.errors.size(), 1u);
  EXPECT_EQ(sum.errors[0], std::make_pair(EIO, uint64_t{1}));
  EXPECT_STREQ(IoStats::kind_name(IoStats::WriteZeroes), "write_zeroes");
}

}  // namespace
