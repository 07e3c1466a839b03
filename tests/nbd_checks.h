// Checks shared by the end-to-end suites that drive a server through libnbd.
#pragma once

#include <gtest/gtest.h>
#include <libnbd.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace shareblk::testing {

struct ByteRange {
  uint64_t offset;
  uint64_t length;
};

// Every write, trim and write-zeroes through `h` over each of `ranges`, with every flag a client
// may send on them, fails with EPERM: the read-only rule, whatever the client advertised.
inline void expect_every_write_refused(nbd_handle* h, const std::vector<ByteRange>& ranges) {
  uint64_t longest = 0;
  for (const ByteRange& r : ranges) longest = std::max(longest, r.length);
  const std::string junk(longest, '\x01');
  for (const ByteRange& r : ranges) {
    for (uint32_t flags : {0u, LIBNBD_CMD_FLAG_FUA}) {
      EXPECT_EQ(nbd_pwrite(h, junk.data(), r.length, r.offset, flags), -1);
      EXPECT_EQ(nbd_get_errno(), EPERM) << "write " << r.offset << "+" << r.length << " flags "
                                        << flags << ": " << nbd_get_error();
      EXPECT_EQ(nbd_trim(h, r.length, r.offset, flags), -1);
      EXPECT_EQ(nbd_get_errno(), EPERM) << "trim " << r.offset << "+" << r.length << " flags "
                                        << flags << ": " << nbd_get_error();
    }
    for (uint32_t flags :
         {0u, LIBNBD_CMD_FLAG_FUA, LIBNBD_CMD_FLAG_NO_HOLE, LIBNBD_CMD_FLAG_FAST_ZERO,
          LIBNBD_CMD_FLAG_FUA | LIBNBD_CMD_FLAG_NO_HOLE}) {
      EXPECT_EQ(nbd_zero(h, r.length, r.offset, flags), -1);
      EXPECT_EQ(nbd_get_errno(), EPERM) << "zero " << r.offset << "+" << r.length << " flags "
                                        << flags << ": " << nbd_get_error();
    }
  }
}

}  // namespace shareblk::testing
