// The backend's synchronous I/O: aligned or not, direct and buffered, trim, zeroes, extents.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "tests/backend_fixture.h"

namespace shareblk::testing::backend_io {
namespace {

// --- Synchronous I/O ---

TEST_F(BackendTest, SyncWriteAndReadAligned) {
  AlignedBuffer buf(64 * 1024);
  const std::string data = pattern(buf.size(), 1);
  std::memcpy(buf.data(), data.data(), data.size());
  ASSERT_EQ(rw_.write(buf.data(), data.size(), 128 * 1024, 0), 0);
  EXPECT_EQ(on_disk(128 * 1024, data.size()), data);
  EXPECT_EQ(on_disk(128 * 1024 - 1, 1), "\xab");
  EXPECT_EQ(on_disk(192 * 1024, 1), "\xab");

  AlignedBuffer back(data.size());
  ASSERT_EQ(rw_.read(back.data(), data.size(), 128 * 1024), 0);
  EXPECT_EQ(std::string(back.data(), data.size()), data);
  EXPECT_EQ(file_size(path_), kSize);
}

TEST_F(BackendTest, SyncUnalignedIoOnDirectVolume) {
  SHAREBLK_REQUIRE(volume_->is_direct(), "the temp directory's file system has no O_DIRECT");
  AlignedBuffer buf(3 * 4096);
  struct Case {
    uint64_t offset;
    size_t length;
    size_t buffer_skew;
  };
  const Case cases[] = {{1, 4096, 0},      {4095, 2, 0},   {4096, 4096, 7}, {1000, 9000, 3},
                        {kSize - 3, 3, 0}, {8192, 511, 0}, {0, 1, 1}};
  unsigned seed = 10;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "offset " << c.offset << " length " << c.length);
    const std::string data = pattern(c.length, seed++);
    char* p = buf.data() + c.buffer_skew;
    std::memcpy(p, data.data(), c.length);
    ASSERT_EQ(rw_.write(p, c.length, c.offset, 0), 0);
    EXPECT_EQ(on_disk(c.offset, c.length), data);
    std::memset(p, 0, c.length);
    ASSERT_EQ(rw_.read(p, c.length, c.offset), 0);
    EXPECT_EQ(std::string(p, c.length), data);
  }
}

// Pages of `path` in [offset, offset+length) that are in the page cache.
size_t cached_pages(const std::string& path, uint64_t offset, size_t length) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return SIZE_MAX;
  void* map = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(offset));
  ::close(fd);
  if (map == MAP_FAILED) return SIZE_MAX;
  const size_t pages = (length + 4095) / 4096;
  std::vector<unsigned char> resident(pages);
  size_t count = SIZE_MAX;
  if (::mincore(map, length, resident.data()) == 0) {
    count = 0;
    for (unsigned char r : resident) count += r & 1;
  }
  ::munmap(map, length);
  return count;
}

TEST_F(BackendTest, SyncAlignedRangesInUnalignedMemoryStayDirect) {
  // nbdkit and libfuse hand the synchronous path buffers at any address. An aligned range
  // must still bypass the page cache, as it does through the NBD listener.
  SHAREBLK_REQUIRE(volume_->is_direct(), "the temp directory's file system has no O_DIRECT");
  ASSERT_EQ(::fdatasync(volume_->device_fd(0)), 0);  // dirty pages would stay cached
  ASSERT_EQ(::posix_fadvise(volume_->device_fd(0), 0, 0, POSIX_FADV_DONTNEED), 0);
  ASSERT_EQ(cached_pages(path_, 0, 512 * 1024), 0u);
  std::vector<char> memory(512 * 1024 + 64);
  char* p = memory.data() + 3;                       // never 4096-aligned
  const std::string data = pattern(320 * 1024, 21);  // more than one bounce
  std::memcpy(p, data.data(), data.size());
  ASSERT_EQ(rw_.write(p, data.size(), 64 * 1024, backend::kFua), 0);
  std::memset(p, 0, data.size());
  ASSERT_EQ(rw_.read(p, data.size(), 64 * 1024), 0);
  EXPECT_EQ(std::string(p, data.size()), data);
  ASSERT_EQ(rw_.read(p, 512 * 1024, 0), 0);
  EXPECT_EQ(std::string(p + 64 * 1024, data.size()), data);
  EXPECT_EQ(std::string(p, 4096), std::string(4096, '\xab'));
  EXPECT_EQ(cached_pages(path_, 0, 512 * 1024), 0u) << "the bytes went through the page cache";
}

TEST_F(BackendTest, SyncDirectAndBufferedStayCoherent) {
  SHAREBLK_REQUIRE(volume_->is_direct(), "the temp directory's file system has no O_DIRECT");
  // Unaligned write (page cache), aligned read over it (O_DIRECT), and the other way round.
  const std::string small = pattern(100, 3);
  ASSERT_EQ(rw_.write(small.data(), small.size(), 4096 + 50, 0), 0);
  AlignedBuffer buf(8192);
  ASSERT_EQ(rw_.read(buf.data(), 8192, 0), 0);
  EXPECT_EQ(std::string(buf.data() + 4146, 100), small);
  EXPECT_EQ(static_cast<uint8_t>(buf.data()[4145]), 0xab);

  const std::string page = pattern(4096, 4);
  std::memcpy(buf.data(), page.data(), page.size());
  ASSERT_EQ(rw_.write(buf.data(), 4096, 4096, 0), 0);
  std::string back(10, '\0');
  ASSERT_EQ(rw_.read(back.data(), 10, 4096 + 7), 0);
  EXPECT_EQ(back, page.substr(7, 10));
}

TEST_F(BackendTest, SyncFuaWriteAndFlush) {
  const std::string data = pattern(5000, 5);
  ASSERT_EQ(rw_.write(data.data(), data.size(), 777, backend::kFua), 0);
  EXPECT_EQ(on_disk(777, data.size()), data);
  EXPECT_EQ(rw_.flush(), 0);
  EXPECT_EQ(ro_.flush(), 0);
}

TEST_F(BackendTest, SyncRefusalsLeaveTheFileAlone) {
  const std::string before = on_disk(0, kSize);
  const std::string data = pattern(4096, 6);
  EXPECT_EQ(ro_.write(data.data(), data.size(), 0, 0), EPERM);
  EXPECT_EQ(ro_.trim(4096, 0, 0), EPERM);
  EXPECT_EQ(ro_.write_zeroes(4096, 0, 0), EPERM);
  EXPECT_EQ(rw_.write(data.data(), data.size(), kSize - 100, 0), ENOSPC);
  EXPECT_EQ(rw_.write_zeroes(8192, kSize - 4096, 0), ENOSPC);
  EXPECT_EQ(rw_.trim(8192, kSize - 4096, 0), EINVAL);
  EXPECT_EQ(on_disk(0, kSize), before);
  EXPECT_EQ(file_size(path_), kSize);

  std::string buf(10, 'x');
  EXPECT_EQ(rw_.read(buf.data(), 10, kSize - 5), EINVAL);
  EXPECT_EQ(buf, std::string(10, 'x'));
  EXPECT_EQ(rw_.read(buf.data(), 0, kSize), 0);
}

TEST_F(BackendTest, SyncTrimPunchesAHole) {
  const uint64_t allocated = allocated_bytes(path_);
  ASSERT_EQ(rw_.trim(64 * 1024, 64 * 1024, 0), 0);
  EXPECT_EQ(on_disk(64 * 1024, 64 * 1024), std::string(64 * 1024, '\0'));
  EXPECT_EQ(on_disk(64 * 1024 - 1, 1), "\xab");
  EXPECT_EQ(on_disk(128 * 1024, 1), "\xab");
  EXPECT_EQ(allocated_bytes(path_), allocated - 64 * 1024);
  EXPECT_TRUE(volume_->may_have_holes());
  EXPECT_EQ(file_size(path_), kSize);
  EXPECT_EQ(rw_.trim(0, 0, 0), 0);
  EXPECT_EQ(rw_.trim(4096, 0, backend::kFua), 0);
}

TEST_F(BackendTest, ExtentsAfterPunchingAHole) {
  std::vector<Extent> extents;
  ASSERT_EQ(rw_.extents(0, kSize, 128, extents), 0);
  ASSERT_EQ(extents.size(), 1u) << extents_text(extents);
  EXPECT_EQ(extents[0].length, kSize);
  EXPECT_FALSE(extents[0].hole);

  ASSERT_EQ(rw_.trim(64 * 1024, 64 * 1024, 0), 0);
  ASSERT_EQ(rw_.extents(0, kSize, 128, extents), 0);
  ASSERT_EQ(extents.size(), 3u) << extents_text(extents);
  EXPECT_EQ(extents[0].length, 64u * 1024);
  EXPECT_FALSE(extents[0].hole);
  EXPECT_EQ(extents[1].length, 64u * 1024);
  EXPECT_TRUE(extents[1].hole);
  EXPECT_EQ(extents[2].length, kSize - 128 * 1024);
  EXPECT_FALSE(extents[2].hole);

  // At most max_extents, starting where asked.
  ASSERT_EQ(rw_.extents(0, kSize, 1, extents), 0);
  ASSERT_EQ(extents.size(), 1u);
  EXPECT_EQ(extents[0].length, 64u * 1024);
  EXPECT_FALSE(extents[0].hole);

  // Ranges starting and ending inside the hole are clipped to the request.
  ASSERT_EQ(rw_.extents(70000, 1000, 128, extents), 0);
  ASSERT_EQ(extents.size(), 1u) << extents_text(extents);
  EXPECT_EQ(extents[0].length, 1000u);
  EXPECT_TRUE(extents[0].hole);
  ASSERT_EQ(rw_.extents(60000, 80000, 128, extents), 0);
  ASSERT_EQ(extents.size(), 3u) << extents_text(extents);
  EXPECT_EQ(extents[0].length, 64u * 1024 - 60000);
  EXPECT_EQ(extents[1].length, 64u * 1024);
  EXPECT_EQ(extents[2].length, 60000u + 80000 - 128 * 1024);

  // A read-only attachment sees the same; beyond the end is refused.
  ASSERT_EQ(ro_.extents(64 * 1024, 64 * 1024, 128, extents), 0);
  ASSERT_EQ(extents.size(), 1u);
  EXPECT_TRUE(extents[0].hole);
  EXPECT_EQ(rw_.extents(kSize - 1, 2, 128, extents), EINVAL);
  EXPECT_TRUE(extents.empty());
}

TEST_F(BackendTest, ExtentsOfASparseFile) {
  testing::make_file(dir_ / "sparse.img", kSize);
  std::error_code ec;
  auto sparse = Volume::open(dir_ / "sparse.img", ec);
  ASSERT_TRUE(sparse) << ec.message();
  EXPECT_TRUE(sparse->may_have_holes());
  Handle h(sparse, AttachMode::ReadWrite);
  std::vector<Extent> extents;
  ASSERT_EQ(h.extents(0, kSize, 128, extents), 0);
  ASSERT_EQ(extents.size(), 1u) << extents_text(extents);
  EXPECT_TRUE(extents[0].hole);
  EXPECT_EQ(extents[0].length, kSize);

  const std::string data = pattern(4096, 7);
  ASSERT_EQ(h.write(data.data(), data.size(), 8192, 0), 0);
  ASSERT_EQ(h.extents(0, kSize, 128, extents), 0);
  ASSERT_EQ(extents.size(), 3u) << extents_text(extents);
  EXPECT_TRUE(extents[0].hole);
  EXPECT_EQ(extents[0].length, 8192u);
  EXPECT_FALSE(extents[1].hole);
  EXPECT_EQ(extents[1].length, 4096u);
  EXPECT_TRUE(extents[2].hole);
  EXPECT_EQ(extents[2].length, kSize - 12288);
}

TEST_F(BackendTest, SyncWriteZeroes) {
  const uint64_t allocated = allocated_bytes(path_);
  // Allocation kept: the zeroes are written (or the blocks zeroed in place).
  ASSERT_EQ(rw_.write_zeroes(64 * 1024, 0, backend::kNoHole), 0);
  EXPECT_EQ(on_disk(0, 64 * 1024), std::string(64 * 1024, '\0'));
  EXPECT_EQ(on_disk(64 * 1024, 1), "\xab");
  EXPECT_EQ(allocated_bytes(path_), allocated);
  // Without NO_HOLE a file may be punched instead.
  ASSERT_EQ(rw_.write_zeroes(64 * 1024, 256 * 1024, backend::kFua), 0);
  EXPECT_EQ(on_disk(256 * 1024, 64 * 1024), std::string(64 * 1024, '\0'));
  EXPECT_EQ(on_disk(256 * 1024 - 1, 1), "\xab");
  EXPECT_EQ(on_disk(320 * 1024, 1), "\xab");
  EXPECT_LE(allocated_bytes(path_), allocated);
  // Unaligned edges.
  ASSERT_EQ(rw_.write_zeroes(3000, 512 * 1024 + 100, 0), 0);
  EXPECT_EQ(on_disk(512 * 1024 + 99, 3002), "\xab" + std::string(3000, '\0') + "\xab");
  EXPECT_EQ(rw_.write_zeroes(0, kSize, 0), 0);
  EXPECT_EQ(file_size(path_), kSize);
}

}  // namespace
}  // namespace shareblk::testing::backend_io
