// End-to-end: the transmission commands. Reads and writes of every size and alignment across
// connections, requests past the end, and malformed requests.
#include <cerrno>
#include <string>
#include <vector>

#include "tests/e2e_nbd_fixture.h"

namespace shareblk::testing::e2e {
namespace {

TEST_F(E2eTest, WriteFlushedOnOneConnectionIsReadOnEveryOther) {
  std::vector<Nbd> handles;
  for (int i = 0; i < 4; ++i) {
    handles.push_back(open_nbd(socket_, "disk"));
    ASSERT_TRUE(handles.back());
    EXPECT_EQ(nbd_can_multi_conn(handles.back().get()), 1);
    EXPECT_EQ(nbd_get_size(handles.back().get()), static_cast<int64_t>(kDiskSize));
  }
  // The read-only export of the same file sees the same bytes.
  handles.push_back(open_nbd(socket_, "ro"));
  ASSERT_TRUE(handles.back());
  EXPECT_EQ(nbd_can_multi_conn(handles.back().get()), 1);

  const std::string pattern = random_bytes(1 * kMiB, 1);
  ASSERT_TRUE(nbd_write(handles[0].get(), 3 * kMiB, pattern));
  ASSERT_EQ(nbd_flush(handles[0].get(), 0), 0) << nbd_get_error();
  for (size_t i = 1; i < handles.size(); ++i) {
    SCOPED_TRACE("handle " + std::to_string(i));
    EXPECT_TRUE(same_bytes(nbd_read(handles[i].get(), 3 * kMiB, pattern.size()), pattern));
  }
  // And it is in the file, where the next server to open it will find it.
  EXPECT_TRUE(same_bytes(read_file(disk_, 3 * kMiB, pattern.size()), pattern));
  // A cache hint is advertised and accepted, and changes nothing.
  EXPECT_EQ(nbd_can_cache(handles[1].get()), 1);
  EXPECT_EQ(nbd_cache(handles[1].get(), pattern.size(), 3 * kMiB, 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(handles[1].get(), 3 * kMiB, pattern.size()), pattern));
}

TEST_F(E2eTest, UnalignedWritesReadBackExactly) {
  Nbd writer = open_nbd(socket_, "disk");
  Nbd reader = open_nbd(socket_, "disk");
  ASSERT_TRUE(writer && reader);
  // Ones all around first, so that a write spilling over its range shows.
  std::string expected(64 * kKiB, '\x11');
  ASSERT_TRUE(nbd_write(writer.get(), 0, expected));

  struct Piece {
    uint64_t offset;
    size_t length;
  };
  const Piece pieces[] = {{1, 3}, {4095, 5000}, {12289, 1}, {20000, 12345}, {40959, 2}};
  uint64_t seed = 10;
  for (const Piece& piece : pieces) {
    const std::string data = random_bytes(piece.length, seed++);
    ASSERT_TRUE(nbd_write(writer.get(), piece.offset, data));
    expected.replace(piece.offset, piece.length, data);
  }
  ASSERT_EQ(nbd_flush(writer.get(), 0), 0) << nbd_get_error();
  for (const Piece& piece : pieces) {
    SCOPED_TRACE("offset " + std::to_string(piece.offset));
    EXPECT_TRUE(same_bytes(nbd_read(reader.get(), piece.offset, piece.length),
                           expected.substr(piece.offset, piece.length)));
  }
  // Unaligned reads that straddle the pieces and their neighbours.
  EXPECT_TRUE(same_bytes(nbd_read(reader.get(), 3, 9000), expected.substr(3, 9000)));
  EXPECT_TRUE(same_bytes(nbd_read(reader.get(), 0, expected.size()), expected));
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, expected.size()), expected));
}

TEST_F(E2eTest, MaximumSizedReadAndWrite) {
  Nbd h = open_nbd(socket_, "disk");
  Nbd other = open_nbd(socket_, "disk");
  ASSERT_TRUE(h && other);
  const int64_t maximum = nbd_get_block_size(h.get(), LIBNBD_SIZE_MAXIMUM);
  ASSERT_EQ(maximum, int64_t{nbd::kMaxPayload});
  const std::string data = random_bytes(static_cast<size_t>(maximum), 2);
  ASSERT_TRUE(nbd_write(h.get(), 16 * kMiB, data));
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 16 * kMiB, data.size()), data));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(nbd_read(other.get(), 16 * kMiB, data.size()), data));
  // Unaligned, too, so that it cannot go straight to O_DIRECT.
  const std::string shifted = random_bytes(static_cast<size_t>(maximum), 3);
  ASSERT_TRUE(nbd_write(h.get(), 7, shifted));
  EXPECT_TRUE(same_bytes(nbd_read(other.get(), 7, shifted.size()), shifted));
}

TEST_F(E2eTest, RequestsPastTheEndFailAndChangeNothing) {
  const std::string tail = random_bytes(1 * kMiB, 5);
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, kDiskSize - tail.size(), tail));
  Nbd h = open_nbd(socket_, "disk", {.strict = false});
  ASSERT_TRUE(h);
  EXPECT_EQ(nbd_get_strict_mode(h.get()) & (LIBNBD_STRICT_COMMANDS | LIBNBD_STRICT_BOUNDS), 0u);
  const std::string data = random_bytes(8192, 6);

  EXPECT_EQ(nbd_pwrite(h.get(), data.data(), 4096, kDiskSize - 2048, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ENOSPC) << nbd_get_error();
  EXPECT_EQ(nbd_pwrite(h.get(), data.data(), 1, kDiskSize, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ENOSPC) << nbd_get_error();
  EXPECT_EQ(nbd_pwrite(h.get(), data.data(), 4096, 1ull << 62, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ENOSPC) << nbd_get_error();
  EXPECT_EQ(nbd_zero(h.get(), 8192, kDiskSize - 4096, 0), -1);
  EXPECT_EQ(nbd_get_errno(), ENOSPC) << nbd_get_error();

  std::string buf(8192, '\0');
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), 4096, kDiskSize - 100, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), 1, kDiskSize, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();
  EXPECT_EQ(nbd_trim(h.get(), 8192, kDiskSize - 4096, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();

  // Nothing moved: the file neither grew nor changed, and the connection still works up to
  // the last byte.
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), kDiskSize - tail.size(), tail.size()), tail));
  EXPECT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  EXPECT_EQ(std::filesystem::file_size(disk_), kDiskSize);
  EXPECT_TRUE(same_bytes(read_file(disk_, kDiskSize - tail.size(), tail.size()), tail));
}

TEST_F(E2eTest, BadRequestMagicClosesTheConnection) {
  RawClient c(socket_);
  ASSERT_TRUE(handshake(c, "disk"));
  ASSERT_TRUE(send_request(c, nbd::kCmdRead, 1, 0, 4096, 0, 0x12345678));
  EXPECT_TRUE(c.closed_by_server());
  expect_serving();
}

TEST_F(E2eTest, InvalidRequestsGetErrorsAndTheConnectionGoesOn) {
  const std::string original = random_bytes(64 * kKiB, 18);
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, 0, original));
  RawClient c(socket_);
  const std::optional<ExportInfo> info = handshake(c, "disk");
  ASSERT_TRUE(info);
  EXPECT_EQ(info->size, kDiskSize);
  EXPECT_EQ(info->flags & nbd::kFlagReadOnly, 0);

  uint64_t cookie = 100;
  // After each refused request, a READ on the same connection gets the right bytes.
  auto expect_still_usable = [&] {
    const uint64_t read_cookie = ++cookie;
    ASSERT_TRUE(send_request(c, nbd::kCmdRead, read_cookie, 1000, 5000));
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, {{read_cookie, 5000}}));
    EXPECT_EQ(reply.cookie, read_cookie);
    EXPECT_EQ(reply.error, 0u);
    EXPECT_TRUE(same_bytes(reply.data, original.substr(1000, 5000)));
  };
  auto expect_error = [&](uint16_t type, uint16_t flags, uint64_t offset, uint32_t length,
                          uint32_t error, const std::string& payload = {}) {
    const uint64_t request_cookie = ++cookie;
    ASSERT_TRUE(send_request(c, type, request_cookie, offset, length, flags));
    ASSERT_TRUE(c.send_all(payload));
    std::map<uint64_t, uint32_t> read_lengths;
    if (type == nbd::kCmdRead) read_lengths[request_cookie] = length;
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, read_lengths));
    EXPECT_EQ(reply.cookie, request_cookie);
    EXPECT_EQ(reply.error, error);
    ASSERT_NO_FATAL_FAILURE(expect_still_usable());
  };

  {
    SCOPED_TRACE("unknown command");
    expect_error(0x77, 0, 0, 0, nbd::kEinval);
  }
  {
    SCOPED_TRACE("unknown command with a length");
    expect_error(0x78, 0, 0, 4096, nbd::kEinval);
  }
  {
    SCOPED_TRACE("READ with an unknown flag");
    expect_error(nbd::kCmdRead, 1 << 9, 0, 4096, nbd::kEinval);
  }
  {
    SCOPED_TRACE("READ with DF, which needs structured replies");
    expect_error(nbd::kCmdRead, nbd::kCmdFlagDf, 0, 4096, nbd::kEinval);
  }
  {
    SCOPED_TRACE("BLOCK_STATUS without a metadata context");
    expect_error(nbd::kCmdBlockStatus, 0, 0, 4096, nbd::kEinval);
  }
  {
    SCOPED_TRACE("READ whose end wraps around 2^64");
    expect_error(nbd::kCmdRead, 0, ~uint64_t{0} - 4095, 8192, nbd::kEinval);
  }
  {
    SCOPED_TRACE("WRITE whose end wraps around 2^64");
    expect_error(nbd::kCmdWrite, 0, ~uint64_t{0} - 4095, 8192, nbd::kEnospc,
                 requests_as_payload(8192));
  }
  {
    SCOPED_TRACE("READ larger than the maximum");
    expect_error(nbd::kCmdRead, 0, 0, nbd::kMaxPayload + 1, nbd::kEoverflow);
  }
  {
    SCOPED_TRACE("READ of 4 GiB - 1");
    expect_error(nbd::kCmdRead, 0, 0, 0xffffffff, nbd::kEoverflow);
  }
  {
    // Its payload is sent in full and must be skipped, not parsed as requests.
    SCOPED_TRACE("WRITE larger than the maximum");
    expect_error(nbd::kCmdWrite, 0, 0, nbd::kMaxPayload + 4096, nbd::kEoverflow,
                 requests_as_payload(nbd::kMaxPayload + 4096));
  }
  {
    SCOPED_TRACE("TRIM with an unknown flag");
    expect_error(nbd::kCmdTrim, 1 << 12, 0, 4096, nbd::kEinval);
  }

  // A clean disconnect, and nothing was written along the way.
  ASSERT_TRUE(send_request(c, nbd::kCmdDisc, ++cookie, 0, 0));
  EXPECT_TRUE(c.closed_by_server());
  stop_daemon();
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, original.size()), original));
}

}  // namespace
}  // namespace shareblk::testing::e2e
