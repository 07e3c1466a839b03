// Backend I/O through the page cache (tmpfs, --buffered), and which thread each request runs on.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "tests/backend_fixture.h"

namespace shareblk::testing::backend_io {
namespace {

// --- tmpfs: no (real) O_DIRECT, no ZERO_RANGE ---

class TmpfsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(dir_.ok(), "no writable /dev/shm");
    path_ = dir_ / "volume.img";
    testing::make_file(path_, 2 * kSize, 0xcd);
    std::error_code ec;
    volume_ = Volume::open(path_, ec);
    ASSERT_TRUE(volume_) << ec.message();
    rw_ = Handle(volume_, AttachMode::ReadWrite);
    ring_ = std::make_unique<backend::Ring>(64, ec);
    ASSERT_FALSE(ec) << "io_uring: " << ec.message();
  }

  int run(RecordingRequest& r) {
    ring_->submit(rw_, &r);
    EXPECT_TRUE(pump(*ring_, {&r})) << "request did not complete";
    EXPECT_EQ(r.calls, 1);
    return r.err;
  }

  testing::TempDir dir_{"/dev/shm", std::nothrow};
  std::string path_;
  std::shared_ptr<Volume> volume_;
  Handle rw_;
  std::unique_ptr<backend::Ring> ring_;
};

TEST_F(TmpfsTest, OpensInMemoryWithoutDirect) {
  // Kernels before 6.6 refuse O_DIRECT on tmpfs, newer ones accept it and still copy through
  // the page cache: either way the volume uses the page cache, which is the storage here.
  EXPECT_TRUE(volume_->in_memory());
  EXPECT_FALSE(volume_->is_direct());
  EXPECT_EQ(volume_->size(), 2 * kSize);
  EXPECT_TRUE(volume_->writable());
  std::error_code ec;
  auto buffered = Volume::open(path_, ec, backend::OpenOptions{.direct = false});
  ASSERT_TRUE(buffered) << ec.message();
  EXPECT_FALSE(buffered->is_direct());
}

TEST_F(TmpfsTest, SyncAndRingIo) {
  const std::string data = pattern(20000, 30);
  ASSERT_EQ(rw_.write(data.data(), data.size(), 1234, backend::kFua), 0);
  EXPECT_EQ(pread_file(path_, 1234, data.size()), data);
  std::string back(data.size(), '\0');
  ASSERT_EQ(rw_.read(back.data(), back.size(), 1234), 0);
  EXPECT_EQ(back, data);

  AlignedBuffer buf(8192);
  std::memcpy(buf.data(), data.data(), 8192);
  RecordingRequest w = make_request(Op::Write, 64 * 1024, 8192, buf.data());
  ASSERT_EQ(run(w), 0);
  EXPECT_EQ(pread_file(path_, 64 * 1024, 8192), data.substr(0, 8192));
  std::memset(buf.data(), 0, 8192);
  RecordingRequest r = make_request(Op::Read, 64 * 1024 + 5, 8000, buf.data() + 5);
  ASSERT_EQ(run(r), 0);
  EXPECT_EQ(std::string(buf.data() + 5, 8000), data.substr(5, 8000));
}

// The io-wq threads a ring of the calling thread has started (named iou-wrk-TID).
int io_worker_threads() {
  const std::string name = "iou-wrk-" + std::to_string(::gettid());
  int count = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++count;
  }
  return count;
}

TEST_F(TmpfsTest, RingIoStaysOnTheCallingThread) {
  // shmem cannot do non-blocking I/O, so io_uring would punt every read and write to an io-wq
  // thread: a thread hop per request, about half of the server's CPU on a tmpfs volume.
  std::thread([this] {
    std::error_code ec;
    backend::Ring ring(64, ec);
    ASSERT_FALSE(ec) << ec.message();
    AlignedBuffer buf(64 * 4096);
    std::memset(buf.data(), 0x5a, 64 * 4096);
    std::vector<RecordingRequest> requests;
    requests.reserve(64);
    for (uint32_t i = 0; i < 64; ++i) {
      requests.push_back(make_request(i % 2 ? Op::Write : Op::Read, uint64_t{i} * 4096, 4096,
                                      buf.data() + size_t{i} * 4096,
                                      i % 4 == 1 ? uint32_t{backend::kFua} : 0u));
    }
    std::vector<RecordingRequest*> all;
    for (RecordingRequest& r : requests) {
      ring.submit(rw_, &r);
      all.push_back(&r);
    }
    ASSERT_TRUE(pump(ring, all));
    for (const RecordingRequest& r : requests) EXPECT_EQ(r.err, 0);
    EXPECT_EQ(io_worker_threads(), 0) << "tmpfs I/O went through io-wq worker threads";
    EXPECT_EQ(std::string(buf.data(), 4096), std::string(4096, '\xcd'));
  }).join();
  EXPECT_EQ(pread_file(path_, 4096, 4096), std::string(4096, '\x5a'));
}

// --buffered on a disk's file system: whole-page writes go into the page cache on the ring's
// thread. ext4 cannot write there without blocking, so io_uring would punt each one to a
// single io-wq thread for the file (4 KiB random writes: half the server's CPU on the hop).
// Partial pages and FUA may wait for the disk and stay on io_uring; all must land.
TEST_F(BackendTest, PageCacheWritesStayOnTheCallingThread) {
  std::error_code ec;
  auto buffered = Volume::open(path_, ec, backend::OpenOptions{.direct = false});
  ASSERT_TRUE(buffered) << ec.message();
  ASSERT_FALSE(buffered->is_direct());
  const Handle h(buffered, AttachMode::ReadWrite);
  const std::string data = pattern(kSize, 31);
  std::thread([&] {
    backend::Ring ring(64, ec);
    ASSERT_FALSE(ec) << ec.message();
    AlignedBuffer buf(kSize);
    std::memcpy(buf.data(), data.data(), kSize);
    std::vector<RecordingRequest> requests;
    requests.reserve(64);
    for (uint32_t i = 0; i < 64; ++i) {  // every other page, from the end: random-looking
      const uint64_t at = kSize - 8192 * uint64_t{i + 1};
      requests.push_back(make_request(Op::Write, at, 4096, buf.data() + at));
    }
    std::vector<RecordingRequest*> all;
    for (RecordingRequest& r : requests) {
      ring.submit(h, &r);
      all.push_back(&r);
    }
    ASSERT_TRUE(pump(ring, all));
    for (const RecordingRequest& r : requests) EXPECT_EQ(r.err, 0);
    EXPECT_EQ(io_worker_threads(), 0) << "page-cache writes went through io-wq worker threads";

    // A partial page and a FUA write (these may use io-wq), and a read of what landed.
    RecordingRequest partial = make_request(Op::Write, 4096 + 100, 1000, buf.data() + 4096 + 100);
    RecordingRequest fua = make_request(Op::Write, 8192, 8192, buf.data() + 8192, backend::kFua);
    ring.submit(h, &partial);
    ring.submit(h, &fua);
    ASSERT_TRUE(pump(ring, {&partial, &fua}));
    EXPECT_EQ(partial.err, 0);
    EXPECT_EQ(fua.err, 0);
    std::string expected(kSize, '\xab');
    for (uint32_t i = 0; i < 64; ++i) {
      const uint64_t at = kSize - 8192 * uint64_t{i + 1};
      expected.replace(at, 4096, data, at, 4096);
    }
    expected.replace(4096 + 100, 1000, data, 4096 + 100, 1000);
    expected.replace(8192, 8192, data, 8192, 8192);
    std::memset(buf.data(), 0, kSize);
    RecordingRequest back = make_request(Op::Read, 0, kSize, buf.data());
    ring.submit(h, &back);
    ASSERT_TRUE(pump(ring, {&back}));
    ASSERT_EQ(back.err, 0);
    EXPECT_TRUE(std::string(buf.data(), kSize) == expected) << "the volume's bytes differ";
  }).join();
  EXPECT_EQ(on_disk(kSize - 8192, 4096), data.substr(kSize - 8192, 4096));
}

// --buffered: a large read is copied out of the page cache on an io-wq thread, beside the
// ring's thread (which sends the replies before it); small reads stay on the ring's thread.
TEST_F(BackendTest, LargePageCacheReadsAreCopiedOffTheCallingThread) {
  std::error_code ec;
  auto buffered = Volume::open(path_, ec, backend::OpenOptions{.direct = false});
  ASSERT_TRUE(buffered) << ec.message();
  const Handle h(buffered, AttachMode::ReadOnly);
  const std::string data = pattern(kSize, 47);
  ASSERT_TRUE(pwrite_file(path_, data, 0));
  std::thread([&] {
    backend::Ring ring(64, ec);
    ASSERT_FALSE(ec) << ec.message();
    AlignedBuffer buf(kSize);
    std::vector<RecordingRequest> small;
    small.reserve(16);
    for (uint32_t i = 0; i < 16; ++i) {
      small.push_back(make_request(Op::Read, uint64_t{i} * 8192, 4096, buf.data() + i * 4096));
    }
    std::vector<RecordingRequest*> all;
    for (RecordingRequest& r : small) {
      ring.submit(h, &r);
      all.push_back(&r);
    }
    ASSERT_TRUE(pump(ring, all));
    for (uint32_t i = 0; i < 16; ++i) {
      EXPECT_EQ(small[i].err, 0);
      EXPECT_EQ(std::string(buf.data() + i * 4096, 4096), data.substr(i * 8192, 4096));
    }
    EXPECT_EQ(io_worker_threads(), 0) << "4 KiB page-cache reads went through io-wq";

    RecordingRequest large = make_request(Op::Read, 0, kSize, buf.data());
    ring.submit(h, &large);
    ASSERT_TRUE(pump(ring, {&large}));
    EXPECT_EQ(large.err, 0);
    EXPECT_TRUE(std::string(buf.data(), kSize) == data) << "the large read's bytes differ";
    EXPECT_GT(io_worker_threads(), 0) << "a 1 MiB page-cache read stayed on the ring's thread";
  }).join();
}

// A large page-cache write is copied on the ring's thread unless the frontend asks for it
// beside (IoRequest::copy_writes_beside, an NBD worker reading a Unix socket); either way
// the bytes land.
TEST_F(BackendTest, LargePageCacheWritesAreCopiedBesideWhenAsked) {
  std::error_code ec;
  auto buffered = Volume::open(path_, ec, backend::OpenOptions{.direct = false});
  ASSERT_TRUE(buffered) << ec.message();
  const Handle h(buffered, AttachMode::ReadWrite);
  std::thread([&] {
    backend::Ring ring(64, ec);
    ASSERT_FALSE(ec) << ec.message();
    AlignedBuffer buf(kSize);
    const std::string first = pattern(kSize, 48);
    std::memcpy(buf.data(), first.data(), kSize);
    RecordingRequest inline_write = make_request(Op::Write, 0, kSize, buf.data());
    ring.submit(h, &inline_write);
    ASSERT_TRUE(pump(ring, {&inline_write}));
    EXPECT_EQ(inline_write.err, 0);
    EXPECT_TRUE(pread_file(path_, 0, kSize) == first) << "the inline write's bytes differ";
    EXPECT_EQ(io_worker_threads(), 0) << "a 1 MiB page-cache write went through io-wq unasked";

    const std::string second = pattern(kSize, 49);
    std::memcpy(buf.data(), second.data(), kSize);
    RecordingRequest beside = make_request(Op::Write, 0, kSize, buf.data());
    beside.copy_writes_beside = true;
    ring.submit(h, &beside);
    ASSERT_TRUE(pump(ring, {&beside}));
    EXPECT_EQ(beside.err, 0);
    EXPECT_TRUE(pread_file(path_, 0, kSize) == second) << "the write beside left other bytes";
    EXPECT_GT(io_worker_threads(), 0) << "the write asked beside stayed on the ring's thread";
  }).join();
}

TEST_F(TmpfsTest, WriteZeroesWithNoHoleFallsBackToWriting) {
  // tmpfs has no FALLOC_FL_ZERO_RANGE, so the zeroes are written, more than one zero buffer's
  // worth here, with a ragged end.
  const uint32_t length = static_cast<uint32_t>(2 * kSize - 4096 - 3);
  RecordingRequest r = make_request(Op::WriteZeroes, 4096, length, nullptr, backend::kNoHole);
  ASSERT_EQ(run(r), 0);
  EXPECT_EQ(pread_file(path_, 4096, length), std::string(length, '\0'));
  EXPECT_EQ(pread_file(path_, 4095, 1), "\xcd");
  EXPECT_EQ(pread_file(path_, 2 * kSize - 3, 3), "\xcd\xcd\xcd");

  ASSERT_TRUE(pwrite_file(path_, "\xcd\xcd", 8192));
  ASSERT_EQ(rw_.write_zeroes(5000, 8000, backend::kNoHole | backend::kFua), 0);
  EXPECT_EQ(pread_file(path_, 8000, 5000), std::string(5000, '\0'));
}

TEST_F(TmpfsTest, FastZeroWithoutFallocateIsNotSupported) {
  const std::string before = pread_file(path_, 0, 8192);
  RecordingRequest r =
      make_request(Op::WriteZeroes, 0, 8192, nullptr, backend::kNoHole | backend::kFastZero);
  EXPECT_EQ(run(r), ENOTSUP);
  EXPECT_EQ(rw_.write_zeroes(8192, 0, backend::kNoHole | backend::kFastZero), ENOTSUP);
  EXPECT_EQ(pread_file(path_, 0, 8192), before);
}

TEST_F(TmpfsTest, TrimAndExtents) {
  RecordingRequest r = make_request(Op::Trim, 64 * 1024, 64 * 1024);
  ASSERT_EQ(run(r), 0);
  EXPECT_EQ(pread_file(path_, 64 * 1024, 64 * 1024), std::string(64 * 1024, '\0'));
  std::vector<Extent> extents;
  ASSERT_EQ(rw_.extents(0, 2 * kSize, 128, extents), 0);
  ASSERT_EQ(extents.size(), 3u) << extents_text(extents);
  EXPECT_FALSE(extents[0].hole);
  EXPECT_TRUE(extents[1].hole);
  EXPECT_EQ(extents[1].length, 64u * 1024);
  EXPECT_FALSE(extents[2].hole);
}

}  // namespace
}  // namespace shareblk::testing::backend_io
