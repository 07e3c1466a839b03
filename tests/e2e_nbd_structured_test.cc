// End-to-end: structured replies and block status. Zeroing, trimming and holes as
// base:allocation describes them, reads split into data and hole chunks, and the simple replies a
// client without structured replies gets.
#include <cerrno>
#include <string>
#include <vector>

#include "tests/e2e_nbd_fixture.h"

namespace shareblk::testing::e2e {
namespace {

TEST_F(E2eTest, ZeroTrimAndBlockStatus) {
  Nbd h = open_nbd(socket_, "disk", {.base_allocation = true});
  ASSERT_TRUE(h);
  ASSERT_EQ(nbd_can_meta_context(h.get(), LIBNBD_CONTEXT_BASE_ALLOCATION), 1);
  EXPECT_EQ(nbd_can_trim(h.get()), 1);
  EXPECT_EQ(nbd_can_zero(h.get()), 1);

  // A fresh sparse file is all hole, and reads as zeroes.
  const std::string zeroes(64 * kKiB, '\0');
  std::vector<Extent> extents = block_status(h.get(), 0, 1 * kMiB);
  EXPECT_NE(status_at(extents, 0) & LIBNBD_STATE_HOLE, 0u);
  EXPECT_NE(status_at(extents, 1 * kMiB - 1) & LIBNBD_STATE_HOLE, 0u);

  // Written bytes are data; their neighbours stay holes.
  const std::string data = random_bytes(64 * kKiB, 7);
  ASSERT_TRUE(nbd_write(h.get(), 256 * kKiB, data));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  extents = block_status(h.get(), 0, 1 * kMiB);
  EXPECT_NE(status_at(extents, 0) & LIBNBD_STATE_HOLE, 0u);
  EXPECT_EQ(status_at(extents, 256 * kKiB), 0u);
  EXPECT_EQ(status_at(extents, 320 * kKiB - 1), 0u);
  EXPECT_NE(status_at(extents, 512 * kKiB) & LIBNBD_STATE_HOLE, 0u);

  // Write-zeroes reads back as zeroes and, on a sparse file, leaves a hole.
  ASSERT_EQ(nbd_zero(h.get(), data.size(), 256 * kKiB, 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 256 * kKiB, data.size()), zeroes));
  extents = block_status(h.get(), 256 * kKiB, data.size());
  EXPECT_EQ(status_at(extents, 256 * kKiB) & (LIBNBD_STATE_HOLE | LIBNBD_STATE_ZERO),
            LIBNBD_STATE_HOLE | LIBNBD_STATE_ZERO);

  // Trim too; what block status calls zero must read as zero.
  ASSERT_TRUE(nbd_write(h.get(), 256 * kKiB, data));
  ASSERT_EQ(nbd_trim(h.get(), data.size(), 256 * kKiB, 0), 0) << nbd_get_error();
  extents = block_status(h.get(), 256 * kKiB, data.size());
  const uint32_t trimmed = status_at(extents, 256 * kKiB);
  EXPECT_NE(trimmed & LIBNBD_STATE_HOLE, 0u);
  if (trimmed & LIBNBD_STATE_ZERO) {
    EXPECT_TRUE(same_bytes(nbd_read(h.get(), 256 * kKiB, data.size()), zeroes));
  }

  // Unaligned write-zeroes inside data, with FUA and with NO_HOLE: exactly that range turns
  // to zeroes.
  std::string expected = random_bytes(64 * kKiB, 8);
  ASSERT_TRUE(nbd_write(h.get(), 2 * kMiB, expected));
  ASSERT_EQ(nbd_zero(h.get(), 1000, 2 * kMiB + 17, LIBNBD_CMD_FLAG_FUA), 0) << nbd_get_error();
  expected.replace(17, 1000, 1000, '\0');
  ASSERT_EQ(nbd_zero(h.get(), 8 * kKiB, 2 * kMiB + 16 * kKiB, LIBNBD_CMD_FLAG_NO_HOLE), 0)
      << nbd_get_error();
  expected.replace(16 * kKiB, 8 * kKiB, 8 * kKiB, '\0');
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 2 * kMiB, expected.size()), expected));
  EXPECT_EQ(status_at(block_status(h.get(), 2 * kMiB, expected.size()), 2 * kMiB + 40 * kKiB), 0u);

  // A fast zero is advertised, and on a file it is fast: it succeeds.
  EXPECT_EQ(nbd_can_fast_zero(h.get()), 1);
  ASSERT_EQ(nbd_zero(h.get(), 4 * kKiB, 2 * kMiB + 48 * kKiB, LIBNBD_CMD_FLAG_FAST_ZERO), 0)
      << nbd_get_error();
  expected.replace(48 * kKiB, 4 * kKiB, 4 * kKiB, '\0');
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 2 * kMiB, expected.size()), expected));

  // REQ_ONE asks for a single extent, and gets one that starts where asked.
  std::vector<Extent> one;
  ASSERT_EQ(nbd_block_status(h.get(), 1 * kMiB, 2 * kMiB,
                             nbd_extent_callback{collect_extents, &one, nullptr},
                             LIBNBD_CMD_FLAG_REQ_ONE),
            0)
      << nbd_get_error();
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].offset, 2 * kMiB);
  EXPECT_EQ(one[0].flags, 0u);
  EXPECT_LE(one[0].length, 1 * kMiB);
}

TEST_F(E2eTest, ReadsAcrossHolesAndDataReturnTheRightBytes) {
  Nbd h = open_nbd(socket_, "disk");
  ASSERT_TRUE(h);
  // 40 data blocks with holes between them: more pieces than one structured read reply
  // describes as separate chunks.
  const uint64_t base = 4 * kMiB;
  std::string expected(80 * 4 * kKiB, '\0');
  for (uint64_t i = 0; i < 40; ++i) {
    const std::string block = random_bytes(4 * kKiB, 100 + i);
    ASSERT_TRUE(nbd_write(h.get(), base + i * 8 * kKiB, block));
    expected.replace(i * 8 * kKiB, block.size(), block);
  }
  Chunks whole;
  EXPECT_TRUE(same_bytes(nbd_read_chunks(h.get(), base, expected.size(), 0, whole), expected));
  EXPECT_GT(whole.holes, 0) << "the server sent no hole chunk: this test covers less than meant";
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), base + 5, expected.size() - 9),
                         expected.substr(5, expected.size() - 9)));
  // With DF the server may not fragment the reply: one data chunk, the same bytes.
  EXPECT_EQ(nbd_can_df(h.get()), 1);
  Chunks unfragmented;
  EXPECT_TRUE(same_bytes(
      nbd_read_chunks(h.get(), base + 3 * kKiB, 64 * kKiB, LIBNBD_CMD_FLAG_DF, unfragmented),
      expected.substr(3 * kKiB, 64 * kKiB)));
  EXPECT_EQ(unfragmented.data, 1);
  EXPECT_EQ(unfragmented.holes, 0);
}

TEST_F(E2eTest, ClientWithoutStructuredReplies) {
  Nbd h = open_nbd(socket_, "disk", {.strict = false, .structured_replies = false});
  Nbd structured = open_nbd(socket_, "disk");
  ASSERT_TRUE(h && structured);
  EXPECT_EQ(nbd_get_structured_replies_negotiated(h.get()), 0);

  const std::string data = random_bytes(1 * kMiB, 9);
  ASSERT_TRUE(nbd_write(h.get(), 5 * kMiB + 3, data));
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 5 * kMiB + 3, data.size()), data));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(structured.get(), 5 * kMiB + 3, data.size()), data));
  // Holes are zeroes in a simple reply too.
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 7 * kMiB, 64 * kKiB), std::string(64 * kKiB, '\0')));

  const std::string big = random_bytes(nbd::kMaxPayload, 10);
  ASSERT_TRUE(nbd_write(structured.get(), 24 * kMiB, big));
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 24 * kMiB, big.size()), big));

  // An error reply carries no data: the stream stays in step.
  std::string buf(4096, '\0');
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), buf.size(), kDiskSize - 1, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();
  ASSERT_EQ(nbd_zero(h.get(), 4096, 5 * kMiB + 3, 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 5 * kMiB + 3, 8192),
                         std::string(4096, '\0') + data.substr(4096, 4096)));
}

}  // namespace
}  // namespace shareblk::testing::e2e
