// Log lines a client can cause come at most once a second per reason (target/rate_limited_log.h).
#include <gtest/gtest.h>

#include <chrono>

#include "target/rate_limited_log.h"

namespace {

using shareblk::target::RateLimitedLog;
using std::chrono::milliseconds;

TEST(RateLimitedLog, OneLinePerIntervalPerReasonThenTheCountLeftOut) {
  RateLimitedLog log(milliseconds(1000));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(log.note("too many", t0).log);
  for (int i = 1; i <= 500; ++i) EXPECT_FALSE(log.note("too many", t0 + milliseconds(i)).log);
  EXPECT_TRUE(log.note("other reason", t0 + milliseconds(10)).log);  // reasons are apart
  RateLimitedLog::Outcome next = log.note("too many", t0 + milliseconds(1000));
  EXPECT_TRUE(next.log);
  EXPECT_EQ(next.suppressed, 500u);
  EXPECT_EQ(log.note("too many", t0 + milliseconds(2500)).suppressed, 0u);
}

}  // namespace
