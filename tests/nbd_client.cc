#include "tests/nbd_client.h"

#include <algorithm>
#include <cerrno>
#include <stdexcept>

namespace shareblk::testing {

NbdHandle new_handle() {
  NbdHandle h(nbd_create(), &nbd_close);
  if (!h) throw std::runtime_error(std::string("nbd_create: ") + nbd_get_error());
  return h;
}

NbdHandle nbd_connect(const std::string& uri, int* errnum, NbdOptions options) {
  NbdHandle h = new_handle();
  if (!options.strict) nbd_set_strict_mode(h.get(), 0);
  if (options.base_allocation) nbd_add_meta_context(h.get(), LIBNBD_CONTEXT_BASE_ALLOCATION);
  if (nbd_connect_uri(h.get(), uri.c_str()) == -1) {
    if (errnum) *errnum = nbd_get_errno();
    return NbdHandle(nullptr, &nbd_close);
  }
  return h;
}

std::string nbd_read(nbd_handle* h, uint64_t offset, size_t length) {
  std::string data(length, '\0');
  if (nbd_pread(h, data.data(), length, offset, 0) == -1) {
    ADD_FAILURE() << "nbd_pread: " << nbd_get_error();
    return {};
  }
  return data;
}

void expect_every_write_refused(nbd_handle* h, const std::vector<ByteRange>& ranges) {
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

void expect_reader_sees_writer(nbd_handle* writer, nbd_handle* reader) {
  constexpr uint64_t kMiB = 1 << 20;
  constexpr size_t k64K = 64 * 1024;
  EXPECT_EQ(nbd_is_read_only(writer), 0);
  EXPECT_EQ(nbd_get_size(writer), static_cast<int64_t>(4 * kMiB));
  const std::string first = pattern('\xab', k64K);
  const std::string second = pattern('\xcd', 4096);
  ASSERT_EQ(nbd_pwrite(writer, first.data(), first.size(), 0, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_pwrite(writer, second.data(), second.size(), 3 * kMiB + 512, 0), 0)
      << nbd_get_error();
  ASSERT_EQ(nbd_flush(writer, 0), 0) << nbd_get_error();

  EXPECT_EQ(nbd_is_read_only(reader), 1);
  EXPECT_EQ(nbd_get_size(reader), static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(nbd_read(reader, 0, k64K), first);
  EXPECT_EQ(nbd_read(reader, 3 * kMiB + 512, 4096), second);
  EXPECT_EQ(nbd_read(reader, k64K, 4096), pattern('\0', 4096));
}

}  // namespace shareblk::testing
