// End-to-end: read-only exports. Every change is refused with EPERM before any other check, its
// payload is skipped, and the connection goes on.
#include <cerrno>
#include <set>
#include <string>
#include <vector>

#include "tests/e2e_nbd_fixture.h"

namespace shareblk::testing::e2e {
namespace {

TEST_F(E2eTest, ReadOnlyExportRefusesChangesAndStaysInSync) {
  const std::string original = random_bytes(2 * kMiB, 4);
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, 0, original));
  Nbd h = open_nbd(socket_, "ro", {.strict = false});
  ASSERT_TRUE(h);
  EXPECT_EQ(nbd_is_read_only(h.get()), 1);
  EXPECT_EQ(nbd_can_multi_conn(h.get()), 1);

  // Payloads from a few bytes to more than one receive buffer: each must be read and dropped,
  // or the next request would be parsed from the middle of it.
  const std::string payload = requests_as_payload(1 * kMiB + 3);
  const size_t lengths[] = {4096, 3, 200 * kKiB, 1 * kMiB + 3};
  for (size_t length : lengths) {
    SCOPED_TRACE("write of " + std::to_string(length) + " bytes");
    EXPECT_EQ(nbd_pwrite(h.get(), payload.data(), length, 1, 0), -1);
    EXPECT_EQ(nbd_get_errno(), EPERM) << nbd_get_error();
  }
  EXPECT_EQ(nbd_pwrite(h.get(), payload.data(), 4096, 0, LIBNBD_CMD_FLAG_FUA), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM) << nbd_get_error();
  EXPECT_EQ(nbd_trim(h.get(), 64 * kKiB, 0, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM) << nbd_get_error();
  EXPECT_EQ(nbd_zero(h.get(), 64 * kKiB, 0, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM) << nbd_get_error();

  // The same connection still reads, and reads what was there.
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 0, original.size()), original));
  EXPECT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, original.size()), original));
}

// libnbd drops the connection ("no matching cookie") when a reply arrives while it is still
// sending that request's payload, so a refused WRITE is answered only once its payload is in.
TEST_F(E2eTest, RefusedWritesLeaveALibnbdConnectionUsable) {
  const std::string original = random_bytes(1 * kMiB, 7);
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, 0, original));
  Nbd h = open_nbd(socket_, "disk", {.strict = false});
  ASSERT_TRUE(h);
  const std::string payload = random_bytes(nbd::kMaxPayload + 4096, 8);
  for (int i = 0; i < 10; ++i) {
    SCOPED_TRACE("round " + std::to_string(i));
    EXPECT_EQ(nbd_pwrite(h.get(), payload.data(), 1 * kMiB, 0, LIBNBD_CMD_FLAG_REQ_ONE), -1);
    EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();
    EXPECT_EQ(nbd_pwrite(h.get(), payload.data(), payload.size(), 0, 0), -1);
    EXPECT_EQ(nbd_get_errno(), EOVERFLOW) << nbd_get_error();
    ASSERT_EQ(nbd_aio_is_ready(h.get()), 1) << "the connection was lost";
  }
  EXPECT_TRUE(same_bytes(nbd_read(h.get(), 0, original.size()), original));
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, original.size()), original));
}

TEST_F(E2eTest, RefusedWritePayloadIsSkippedOnReadOnlyExport) {
  RawClient c(socket_);
  const std::optional<ExportInfo> info = handshake(c, "ro");
  ASSERT_TRUE(info);
  EXPECT_NE(info->flags & nbd::kFlagReadOnly, 0);
  // Payloads that look like requests, small and larger than a receive buffer, pipelined.
  const uint32_t lengths[] = {28, 4096, 300 * 1024, 2 * 1024 * 1024 + 5};
  uint64_t cookie = 1;
  for (uint32_t length : lengths) {
    ASSERT_TRUE(send_request(c, nbd::kCmdWrite, cookie++, 0, length));
    ASSERT_TRUE(c.send_all(requests_as_payload(length)));
  }
  ASSERT_TRUE(send_request(c, nbd::kCmdTrim, cookie++, 0, 4096));
  ASSERT_TRUE(send_request(c, nbd::kCmdWriteZeroes, cookie++, 0, 4096));
  const uint64_t read_cookie = cookie++;
  ASSERT_TRUE(send_request(c, nbd::kCmdRead, read_cookie, 4096, 4096));

  std::set<uint64_t> answered;
  for (uint64_t i = 1; i < cookie; ++i) {
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, {{read_cookie, 4096}}));
    ASSERT_NE(reply.cookie, kBogusCookie) << "a payload was parsed as requests";
    EXPECT_TRUE(answered.insert(reply.cookie).second) << "cookie " << reply.cookie;
    if (reply.cookie == read_cookie) {
      EXPECT_EQ(reply.error, 0u);
      EXPECT_TRUE(same_bytes(reply.data, std::string(4096, '\0')));
    } else {
      EXPECT_EQ(reply.error, nbd::kEperm) << "cookie " << reply.cookie;
    }
  }
  EXPECT_EQ(answered.size(), cookie - 1);
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, 4 * kMiB), std::string(4 * kMiB, '\0')));
}

// A change from a read-only attachment is refused with EPERM whatever else is wrong with it:
// the client learns the one thing that matters (it may not write here), and the payload of an
// oversized or badly flagged WRITE is still skipped rather than parsed as requests.
TEST_F(E2eTest, ReadOnlyExportAnswersEpermBeforeAnyOtherError) {
  RawClient c(socket_);
  const std::optional<ExportInfo> info = handshake(c, "ro");
  ASSERT_TRUE(info);
  ASSERT_NE(info->flags & nbd::kFlagReadOnly, 0);
  struct Case {
    const char* what;
    uint16_t type;
    uint16_t flags;
    uint64_t offset;
    uint32_t length;
  };
  const Case cases[] = {
      {"WRITE with an unknown flag", nbd::kCmdWrite, 1 << 9, 0, 4096},
      {"WRITE with REQ_ONE", nbd::kCmdWrite, nbd::kCmdFlagReqOne, 0, 4096},
      {"WRITE larger than the maximum", nbd::kCmdWrite, 0, 0, nbd::kMaxPayload + 4096},
      {"WRITE past the end", nbd::kCmdWrite, 0, kDiskSize, 4096},
      {"TRIM with NO_HOLE", nbd::kCmdTrim, nbd::kCmdFlagNoHole, 0, 4096},
      {"WRITE_ZEROES with an unknown flag", nbd::kCmdWriteZeroes, 1 << 12, 0, 4096},
  };
  uint64_t cookie = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    ASSERT_TRUE(send_request(c, k.type, ++cookie, k.offset, k.length, k.flags));
    if (k.type == nbd::kCmdWrite) {
      ASSERT_TRUE(c.send_all(requests_as_payload(k.length)));
    }
    SimpleReply reply;
    ASSERT_TRUE(read_simple_reply(c, reply, {}));
    ASSERT_NE(reply.cookie, kBogusCookie) << "a payload was parsed as requests";
    EXPECT_EQ(reply.cookie, cookie);
    EXPECT_EQ(reply.error, nbd::kEperm);
  }
  // The connection is still in step: a READ gets its bytes.
  ASSERT_TRUE(send_request(c, nbd::kCmdRead, ++cookie, 4096, 4096));
  SimpleReply reply;
  ASSERT_TRUE(read_simple_reply(c, reply, {{cookie, 4096}}));
  EXPECT_EQ(reply.cookie, cookie);
  EXPECT_EQ(reply.error, 0u);
  EXPECT_TRUE(same_bytes(read_file(disk_, 0, 4 * kMiB), std::string(4 * kMiB, '\0')));
}

}  // namespace
}  // namespace shareblk::testing::e2e
