// The backend: the admission rule, synchronous I/O, allocation status, and the io_uring path,
// each checked against what pread(2) and fstat(2) see in the file afterwards.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "tests/support.h"

namespace shareblk {
namespace {

using backend::AttachMode;
using backend::Extent;
using backend::Handle;
using backend::Op;
using backend::Volume;

constexpr uint64_t kSize = 1 << 20;
constexpr uint64_t kMax = UINT64_MAX;

// A heap buffer aligned for O_DIRECT. Offsetting into it gives deliberately unaligned ones.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size) : size_(size) {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, size + 4096) != 0) std::abort();
    data_.reset(static_cast<char*>(p));
    std::memset(data_.get(), 0, size + 4096);
  }
  char* data() { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data_;
  size_t size_;
};

// Bytes that differ at every offset, so that a transfer landing in the wrong place shows.
std::string pattern(size_t length, unsigned seed) {
  std::string s(length, '\0');
  for (size_t i = 0; i < length; ++i)
    s[i] = static_cast<char>((i * 131 + seed * 17 + i / 251) & 0xff);
  return s;
}

// What the file holds, read through a descriptor of our own.
std::string pread_file(const std::string& path, uint64_t offset, size_t length) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "<cannot open>";
  std::string data(length, '\0');
  ssize_t n = ::pread(fd, data.data(), length, static_cast<off_t>(offset));
  ::close(fd);
  data.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return data;
}

// Writes `data` into the file behind the backend's back.
bool pwrite_file(const std::string& path, const std::string& data, uint64_t offset) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = ::pwrite(fd, data.data(), data.size(), static_cast<off_t>(offset));
  ::close(fd);
  return n == static_cast<ssize_t>(data.size());
}

uint64_t allocated_bytes(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

uint64_t file_size(const std::string& path) {
  return std::filesystem::file_size(path);
}

// Whether the file system holding `path` accepts O_DIRECT.
bool accepts_direct(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

std::string extents_text(const std::vector<Extent>& extents) {
  std::string s;
  for (const Extent& e : extents)
    s += (e.hole ? "hole:" : "data:") + std::to_string(e.length) + " ";
  return s;
}

// An IoRequest that records how it ended.
struct RecordingRequest final : backend::IoRequest {
  int calls = 0;
  int err = -1;
  void done(int e) override {
    ++calls;
    err = e;
  }
};

RecordingRequest make_request(Op op, uint64_t offset, uint32_t length, char* buf = nullptr,
                              uint32_t flags = 0) {
  RecordingRequest r;
  r.op = op;
  r.offset = offset;
  r.length = length;
  r.buf = buf;
  r.flags = flags;
  return r;
}

// Turns the ring until every request in `requests` is done; false on an engine error or after
// ten seconds.
bool pump(backend::Ring& ring, const std::vector<RecordingRequest*>& requests) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    bool all = true;
    for (const RecordingRequest* r : requests) all = all && r->calls > 0;
    if (all) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    if (ring.run_once(100) < 0) return false;
  }
}

// --- Fixture: a fully allocated 1 MiB file of 0xab bytes in the temp directory ---

class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_ / "volume.img";
    testing::make_file(path_, kSize, 0xab);
    std::error_code ec;
    volume_ = Volume::open(path_, ec);
    ASSERT_TRUE(volume_) << ec.message();
    rw_ = Handle(volume_, AttachMode::ReadWrite);
    ro_ = Handle(volume_, AttachMode::ReadOnly);
  }

  std::string on_disk(uint64_t offset, size_t length) { return pread_file(path_, offset, length); }

  testing::TempDir dir_;
  std::string path_;
  std::shared_ptr<Volume> volume_;
  Handle rw_;
  Handle ro_;
};

// --- Volume ---

TEST_F(BackendTest, OpenReportsTheFile) {
  EXPECT_EQ(volume_->path(), path_);
  EXPECT_EQ(volume_->size(), kSize);
  EXPECT_FALSE(volume_->is_block_device());
  EXPECT_TRUE(volume_->writable());
  EXPECT_FALSE(volume_->rotational());
  // A temp directory on tmpfs uses the page cache: there it is the storage (in_memory()).
  EXPECT_EQ(volume_->is_direct(), accepts_direct(path_) && !volume_->in_memory());
  const uint32_t align = volume_->direct_alignment();
  EXPECT_GE(align, 512u);
  EXPECT_EQ(align & (align - 1), 0u) << "alignment must be a power of two";
}

TEST_F(BackendTest, BlockDevicesAreNeverInMemory) {
  // A device node lives on devtmpfs, whose statfs says tmpfs: that must not make a disk look
  // like memory (no O_DIRECT, I/O inline on the worker).
  SHAREBLK_REQUIRE(testing::is_root(), "losetup needs root");
  testing::RunResult attached = testing::run({"losetup", "--find", "--show", path_});
  SHAREBLK_REQUIRE(attached.status == 0, "losetup failed: " + attached.output);
  const std::string device = attached.output.substr(0, attached.output.find('\n'));
  std::error_code ec;
  auto disk = Volume::open(device, ec);
  testing::run({"losetup", "-d", device});
  ASSERT_TRUE(disk) << ec.message();
  EXPECT_TRUE(disk->is_block_device());
  EXPECT_FALSE(disk->in_memory());
  EXPECT_TRUE(disk->is_direct());
}

TEST_F(BackendTest, OpenFailures) {
  std::error_code ec;
  EXPECT_FALSE(Volume::open(dir_ / "missing", ec));
  EXPECT_EQ(ec, std::errc::no_such_file_or_directory);
  ec.clear();
  EXPECT_FALSE(Volume::open(dir_.path().string(), ec));
  EXPECT_TRUE(ec);
  ec.clear();
  EXPECT_FALSE(Volume::open("/dev/null", ec));  // neither a regular file nor a block device
  EXPECT_EQ(ec, std::errc::invalid_argument);
}

TEST_F(BackendTest, BufferedOnlyWhenAsked) {
  std::error_code ec;
  auto buffered = Volume::open(path_, ec, backend::OpenOptions{.direct = false});
  ASSERT_TRUE(buffered) << ec.message();
  EXPECT_FALSE(buffered->is_direct());
  AlignedBuffer buf(4096);
  ASSERT_EQ(buffered->device_count(), 1u);
  EXPECT_EQ(buffered->locate(0, 4096, buf.data()).fd, buffered->device_fd(0));
}

TEST_F(BackendTest, DirectDescriptorOnlyForAlignedRequests) {
  SHAREBLK_REQUIRE(volume_->is_direct(), "the temp directory's file system has no O_DIRECT");
  const uint32_t align = volume_->direct_alignment();
  AlignedBuffer buf(2 * 4096);
  ASSERT_EQ(volume_->device_count(), 1u);
  const int buffered = volume_->device_fd(0);
  EXPECT_NE(volume_->locate(0, align, buf.data()).fd, buffered);
  EXPECT_NE(volume_->locate(align, 2 * align, buf.data()).fd, buffered);
  EXPECT_EQ(volume_->locate(1, align, buf.data()).fd, buffered);
  EXPECT_EQ(volume_->locate(0, align + 1, buf.data()).fd, buffered);
  EXPECT_EQ(volume_->locate(0, align, buf.data() + 1).fd, buffered);
  EXPECT_EQ(volume_->locate_buffered(0, align).fd, buffered);
  // A file is one piece: every byte is where its offset says, the whole range contiguous.
  const backend::Volume::Location at = volume_->locate(12345, 6789, buf.data());
  EXPECT_EQ(at.offset, 12345u);
  EXPECT_EQ(at.length, 6789u);
}

TEST_F(BackendTest, RefreshSizeSeesGrowth) {
  ASSERT_EQ(::truncate(path_.c_str(), 2 * kSize), 0);
  EXPECT_EQ(volume_->size(), kSize);  // cached until asked
  EXPECT_EQ(volume_->refresh_size(), 0);
  EXPECT_EQ(volume_->size(), 2 * kSize);
  EXPECT_EQ(rw_.admit(Op::Write, kSize, kSize), 0);
}

// --- Admission ---

TEST_F(BackendTest, ReadOnlyRefusesEveryWrite) {
  EXPECT_EQ(ro_.admit(Op::Write, 0, 4096), EPERM);
  EXPECT_EQ(ro_.admit(Op::Trim, 0, 4096), EPERM);
  EXPECT_EQ(ro_.admit(Op::WriteZeroes, 0, 4096), EPERM);
  EXPECT_EQ(ro_.admit(Op::Write, 0, 0), EPERM);
  // EPERM comes first, even for a range that is also out of bounds.
  EXPECT_EQ(ro_.admit(Op::Write, kSize, 1), EPERM);
  EXPECT_EQ(ro_.admit(Op::Trim, kMax, kMax), EPERM);
  EXPECT_EQ(ro_.admit(Op::Read, 0, kSize), 0);
  EXPECT_EQ(ro_.admit(Op::Cache, 0, kSize), 0);
  EXPECT_EQ(ro_.admit(Op::Flush, 0, 0), 0);
  EXPECT_TRUE(ro_.read_only());
  EXPECT_FALSE(rw_.read_only());
}

// A handle whose WriteAccess is revoked refuses every change as a read-only one does, reads
// on, and its capabilities still say read-write (a standby is advertised read-write).
TEST_F(BackendTest, WithoutWriteAccessEveryChangeIsRefused) {
  auto access = std::make_shared<backend::WriteAccess>(false);
  const Handle standby(volume_, AttachMode::ReadWrite, access);
  EXPECT_FALSE(standby.read_only());
  AlignedBuffer buf(4096);
  std::memset(buf.data(), 0x5a, 4096);
  EXPECT_EQ(standby.write(buf.data(), 4096, 0, 0), EPERM);
  EXPECT_EQ(standby.trim(4096, 0, 0), EPERM);
  EXPECT_EQ(standby.write_zeroes(4096, 0, 0), EPERM);
  EXPECT_EQ(standby.admit(Op::Write, 0, 0), EPERM);
  EXPECT_EQ(standby.read(buf.data(), 4096, 0), 0);
  EXPECT_EQ(standby.flush(), 0);
  EXPECT_EQ(on_disk(0, 4096), std::string(4096, '\xab'));
  access->grant();
  std::memset(buf.data(), 0x5a, 4096);
  EXPECT_EQ(standby.write(buf.data(), 4096, 0, 0), 0);
  EXPECT_EQ(on_disk(0, 4096), std::string(4096, '\x5a'));
  EXPECT_EQ(access->in_flight(), 0u);
}

// A paused gate holds changes instead of refusing them: the synchronous engine (FUSE, nbdkit)
// waits on its thread and then writes; pause() waits for the change in flight as revoke() does;
// a revoke during a pause still refuses.
TEST_F(BackendTest, APausedGateHoldsChangesUntilItResumes) {
  auto access = std::make_shared<backend::WriteAccess>(true);
  const Handle writer(volume_, AttachMode::ReadWrite, access);
  ASSERT_EQ(access->enter(), backend::WriteAccess::Entry::Entered);  // a change in flight
  std::atomic<bool> paused{false};
  std::thread pauser([&] {
    access->pause();
    paused = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(paused.load()) << "pause() returned with a change in flight";
  access->leave();
  pauser.join();
  EXPECT_TRUE(access->paused());
  EXPECT_EQ(access->enter(), backend::WriteAccess::Entry::Paused);
  EXPECT_EQ(writer.admit(Op::Write, 0, 4096), 0) << "a pause is not a refusal";

  std::atomic<int> result{-1};
  std::thread held([&] {
    AlignedBuffer buf(4096);
    std::memset(buf.data(), 0x77, 4096);
    result = writer.write(buf.data(), 4096, 0, 0);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(result.load(), -1) << "a write went through a paused gate";
  EXPECT_EQ(on_disk(0, 4096), std::string(4096, '\xab'));
  access->resume();
  held.join();
  EXPECT_EQ(result.load(), 0);
  EXPECT_EQ(on_disk(0, 4096), std::string(4096, '\x77'));

  access->pause();
  access->pause();  // pauses nest
  access->resume();
  EXPECT_TRUE(access->paused());
  access->revoke();
  EXPECT_EQ(access->enter(), backend::WriteAccess::Entry::Refused) << "a revoke wins";
  AlignedBuffer buf(4096);
  EXPECT_EQ(writer.write(buf.data(), 4096, 0, 0), EPERM) << "revoked while paused: refused";
  access->resume();
  EXPECT_FALSE(access->paused());
  EXPECT_EQ(access->in_flight(), 0u);
}

// revoke() returns only once the changes that entered have left; none enters after it.
TEST(WriteAccess, RevokeWaitsForTheChangesInFlight) {
  backend::WriteAccess access(true);
  ASSERT_EQ(access.enter(), backend::WriteAccess::Entry::Entered);
  ASSERT_EQ(access.enter(), backend::WriteAccess::Entry::Entered);
  std::atomic<bool> revoked{false};
  std::thread fence([&] {
    access.revoke();
    revoked = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(revoked.load()) << "revoke() returned with two changes in flight";
  EXPECT_EQ(access.enter(), backend::WriteAccess::Entry::Refused)
      << "a change entered a gate being revoked";
  access.leave();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(revoked.load());
  access.leave();
  fence.join();
  EXPECT_TRUE(revoked.load());
  EXPECT_EQ(access.in_flight(), 0u);
  EXPECT_FALSE(access.granted());
}

// Two attachments, write access moving between them as fast as it can while each hammers its
// gate: no change of one is ever admitted while a change of the other is in flight.
TEST(WriteAccess, TwoGatesAreNeverOpenTogether) {
  backend::WriteAccess a(true), b(false);
  std::atomic<int> active[2] = {0, 0};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> overlaps{0}, admitted{0};
  auto hammer = [&](backend::WriteAccess& gate, int me) {
    while (!stop.load(std::memory_order_relaxed)) {
      if (gate.enter() != backend::WriteAccess::Entry::Entered) continue;
      active[me].fetch_add(1);
      if (active[1 - me].load() != 0) overlaps.fetch_add(1);
      admitted.fetch_add(1, std::memory_order_relaxed);
      active[me].fetch_sub(1);
      gate.leave();
    }
  };
  std::thread ta(hammer, std::ref(a), 0), tb(hammer, std::ref(b), 1);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  uint64_t moves = 0;
  for (; std::chrono::steady_clock::now() < until || admitted.load() < 1000; ++moves) {
    // The takeover's order: revoke (and drain), then grant.
    backend::WriteAccess& from = moves % 2 == 0 ? a : b;
    backend::WriteAccess& to = moves % 2 == 0 ? b : a;
    from.revoke();
    to.grant();
  }
  stop = true;
  ta.join();
  tb.join();
  EXPECT_EQ(overlaps.load(), 0u) << "of " << admitted.load() << " changes, " << moves << " moves";
}

TEST_F(BackendTest, RangesInsideTheVolumeAreAdmitted) {
  for (Op op : {Op::Read, Op::Write, Op::Trim, Op::WriteZeroes, Op::Cache}) {
    EXPECT_EQ(rw_.admit(op, 0, kSize), 0);
    EXPECT_EQ(rw_.admit(op, kSize - 1, 1), 0);
    EXPECT_EQ(rw_.admit(op, 12345, 6789), 0);
    EXPECT_EQ(rw_.admit(op, kSize, 0), 0) << "zero length at the end";
    EXPECT_EQ(rw_.admit(op, 0, 0), 0);
  }
  EXPECT_EQ(rw_.admit(Op::Flush, 0, 0), 0);
}

TEST_F(BackendTest, PastTheEndWritesAreNoSpaceOthersInvalid) {
  EXPECT_EQ(rw_.admit(Op::Write, kSize - 1, 2), ENOSPC);
  EXPECT_EQ(rw_.admit(Op::Write, kSize, 1), ENOSPC);
  EXPECT_EQ(rw_.admit(Op::WriteZeroes, 0, kSize + 1), ENOSPC);
  EXPECT_EQ(rw_.admit(Op::Read, kSize - 1, 2), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Read, kSize, 1), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Trim, kSize - 4096, 8192), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Cache, 0, kSize + 1), EINVAL);
  // Past the end even with nothing to move.
  EXPECT_EQ(rw_.admit(Op::Read, kSize + 1, 0), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Write, kSize + 1, 0), ENOSPC);
}

TEST_F(BackendTest, AdmissionDoesNotOverflow) {
  // offset + length wraps around to a small number in each of these.
  EXPECT_EQ(rw_.admit(Op::Read, kMax, 1), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Read, kMax - 1, 4), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Read, 4096, kMax), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Read, 1, kMax), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Write, kMax - 4095, 8192), ENOSPC);
  EXPECT_EQ(rw_.admit(Op::Write, 1, kMax), ENOSPC);
  EXPECT_EQ(rw_.admit(Op::WriteZeroes, kMax, kMax), ENOSPC);
  EXPECT_EQ(rw_.admit(Op::Trim, kMax - 1, 2), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Cache, kMax, 0), EINVAL);
  EXPECT_EQ(rw_.admit(Op::Read, 0, kMax), EINVAL);
}

TEST(Admission, HandleWithoutVolumeAdmitsNothing) {
  Handle none;
  EXPECT_EQ(none.admit(Op::Read, 0, 0), EINVAL);
  EXPECT_EQ(none.admit(Op::Flush, 0, 0), EINVAL);
}

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

// --- The io_uring path ---

class RingTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    std::error_code ec;
    ring_ = std::make_unique<backend::Ring>(64, ec);
    ASSERT_FALSE(ec) << "io_uring: " << ec.message();
  }

  // Submits `r` through `h` and turns the ring until it is done; returns its result.
  int run(const Handle& h, RecordingRequest& r) {
    ring_->submit(h, &r);
    EXPECT_TRUE(pump(*ring_, {&r})) << "request did not complete";
    EXPECT_EQ(r.calls, 1);
    return r.err;
  }

  std::unique_ptr<backend::Ring> ring_;
};

TEST_F(RingTest, ReadAligned) {
  const std::string data = pattern(64 * 1024, 20);
  ASSERT_TRUE(pwrite_file(path_, data, 256 * 1024));
  AlignedBuffer buf(data.size());
  RecordingRequest r = make_request(Op::Read, 256 * 1024, 64 * 1024, buf.data());
  ASSERT_EQ(run(rw_, r), 0);
  EXPECT_EQ(std::string(buf.data(), data.size()), data);
}

TEST_F(RingTest, ReadUnaligned) {
  const std::string data = pattern(10000, 21);
  ASSERT_TRUE(pwrite_file(path_, data, 4097));
  AlignedBuffer buf(data.size());
  RecordingRequest r = make_request(Op::Read, 4097, 10000, buf.data() + 3);
  ASSERT_EQ(run(ro_, r), 0);
  EXPECT_EQ(std::string(buf.data() + 3, data.size()), data);
}

TEST_F(RingTest, ReadTheWholeVolume) {
  AlignedBuffer buf(kSize);
  RecordingRequest r = make_request(Op::Read, 0, kSize, buf.data());
  ASSERT_EQ(run(rw_, r), 0);
  EXPECT_EQ(std::string(buf.data(), kSize), std::string(kSize, '\xab'));
}

TEST_F(RingTest, WriteWithFua) {
  AlignedBuffer buf(16 * 1024);
  const std::string data = pattern(buf.size(), 22);
  std::memcpy(buf.data(), data.data(), data.size());
  RecordingRequest r = make_request(Op::Write, 32 * 1024, 16 * 1024, buf.data(), backend::kFua);
  ASSERT_EQ(run(rw_, r), 0);
  EXPECT_EQ(on_disk(32 * 1024, data.size()), data);
  EXPECT_EQ(on_disk(48 * 1024, 1), "\xab");

  RecordingRequest unaligned = make_request(Op::Write, 100, 1000, buf.data() + 1, backend::kFua);
  ASSERT_EQ(run(rw_, unaligned), 0);
  EXPECT_EQ(on_disk(100, 1000), data.substr(1, 1000));
  EXPECT_EQ(on_disk(99, 1), "\xab");
  EXPECT_EQ(on_disk(1100, 1), "\xab");
}

// Workers register their payload buffers: the same I/O must land in the same bytes, aligned
// (direct descriptor) or not (buffered), with or without FUA.
TEST_F(RingTest, RegisteredBuffersCarryReadsAndWrites) {
  AlignedBuffer buf(64 * 1024);
  const int index = ring_->register_buffer(buf.data(), buf.size());
  ASSERT_GE(index, 0) << "this kernel has sparse registered buffers (5.19+)";
  const std::string data = pattern(buf.size(), 24);
  std::memcpy(buf.data(), data.data(), data.size());

  RecordingRequest w = make_request(Op::Write, 128 * 1024, 32 * 1024, buf.data(), backend::kFua);
  w.buf_index = index;
  ASSERT_EQ(run(rw_, w), 0);
  RecordingRequest u = make_request(Op::Write, 777, 5000, buf.data() + 40000);
  u.buf_index = index;
  ASSERT_EQ(run(rw_, u), 0);
  EXPECT_EQ(on_disk(128 * 1024, 32 * 1024), data.substr(0, 32 * 1024));
  EXPECT_EQ(on_disk(777, 5000), data.substr(40000, 5000));
  EXPECT_EQ(on_disk(776, 1), "\xab");

  std::memset(buf.data(), 0, buf.size());
  RecordingRequest r = make_request(Op::Read, 128 * 1024, 32 * 1024, buf.data() + 32 * 1024);
  r.buf_index = index;
  ASSERT_EQ(run(ro_, r), 0);
  RecordingRequest ru = make_request(Op::Read, 777, 5000, buf.data() + 3);
  ru.buf_index = index;
  ASSERT_EQ(run(ro_, ru), 0);
  EXPECT_EQ(std::string(buf.data() + 32 * 1024, 32 * 1024), data.substr(0, 32 * 1024));
  EXPECT_EQ(std::string(buf.data() + 3, 5000), data.substr(40000, 5000));
  EXPECT_EQ(buf.data()[0], 0);
}

// A pool frees a buffer only after clearing its slot; the slot's next buffer must get the I/O,
// not the pages the slot held before.
TEST_F(RingTest, AReusedBufferSlotPointsAtTheNewBuffer) {
  AlignedBuffer first(4096);
  AlignedBuffer second(4096);
  const int index = ring_->register_buffer(first.data(), first.size());
  ASSERT_GE(index, 0);
  ring_->unregister_buffer(index);
  ASSERT_EQ(ring_->register_buffer(second.data(), second.size()), index);
  std::memset(first.data(), 0, first.size());
  std::memset(second.data(), 0, second.size());
  const std::string data = pattern(4096, 25);
  ASSERT_TRUE(pwrite_file(path_, data, 8192));
  RecordingRequest r = make_request(Op::Read, 8192, 4096, second.data());
  r.buf_index = index;
  ASSERT_EQ(run(ro_, r), 0);
  EXPECT_EQ(std::string(second.data(), 4096), data);
  EXPECT_EQ(std::string(first.data(), 4096), std::string(4096, '\0'));
}

TEST_F(RingTest, ManyRequestsInFlight) {
  constexpr int kCount = 32;
  AlignedBuffer buf(kCount * 4096);
  std::vector<RecordingRequest> requests;
  requests.reserve(kCount);
  const std::string data = pattern(buf.size(), 23);
  std::memcpy(buf.data(), data.data(), data.size());
  std::vector<RecordingRequest*> pending;
  for (int i = 0; i < kCount; ++i) {
    requests.push_back(make_request(Op::Write, uint64_t(i) * 8192, 4096, buf.data() + i * 4096));
  }
  for (RecordingRequest& r : requests) {
    ring_->submit(rw_, &r);
    pending.push_back(&r);
  }
  ASSERT_TRUE(pump(*ring_, pending));
  for (int i = 0; i < kCount; ++i) {
    EXPECT_EQ(requests[i].calls, 1);
    EXPECT_EQ(requests[i].err, 0);
    EXPECT_EQ(on_disk(uint64_t(i) * 8192, 4096), data.substr(size_t(i) * 4096, 4096));
    EXPECT_EQ(on_disk(uint64_t(i) * 8192 + 4096, 1), "\xab");
  }
}

TEST_F(RingTest, Flush) {
  RecordingRequest r = make_request(Op::Flush, 0, 0);
  EXPECT_EQ(run(rw_, r), 0);
  RecordingRequest ro = make_request(Op::Flush, 0, 0);
  EXPECT_EQ(run(ro_, ro), 0);
}

TEST_F(RingTest, TrimPunchesAHole) {
  const uint64_t allocated = allocated_bytes(path_);
  RecordingRequest r = make_request(Op::Trim, 128 * 1024, 64 * 1024, nullptr, backend::kFua);
  ASSERT_EQ(run(rw_, r), 0);
  EXPECT_EQ(on_disk(128 * 1024, 64 * 1024), std::string(64 * 1024, '\0'));
  EXPECT_EQ(on_disk(128 * 1024 - 1, 1), "\xab");
  EXPECT_EQ(on_disk(192 * 1024, 1), "\xab");
  EXPECT_EQ(allocated_bytes(path_), allocated - 64 * 1024);
  EXPECT_EQ(file_size(path_), kSize);
  std::vector<Extent> extents;
  ASSERT_EQ(rw_.extents(0, kSize, 128, extents), 0);
  ASSERT_EQ(extents.size(), 3u) << extents_text(extents);
  EXPECT_TRUE(extents[1].hole);
  EXPECT_EQ(extents[1].length, 64u * 1024);
}

TEST_F(RingTest, WriteZeroesMayPunch) {
  RecordingRequest r = make_request(Op::WriteZeroes, 64 * 1024, 64 * 1024);
  ASSERT_EQ(run(rw_, r), 0);
  EXPECT_EQ(on_disk(64 * 1024, 64 * 1024), std::string(64 * 1024, '\0'));
  EXPECT_EQ(on_disk(64 * 1024 - 1, 1), "\xab");
  EXPECT_EQ(on_disk(128 * 1024, 1), "\xab");
  EXPECT_EQ(file_size(path_), kSize);
}

TEST_F(RingTest, WriteZeroesWithNoHoleKeepsTheBlocks) {
  const uint64_t allocated = allocated_bytes(path_);
  RecordingRequest r = make_request(Op::WriteZeroes, 64 * 1024, 64 * 1024, nullptr,
                                    backend::kNoHole | backend::kFua);
  ASSERT_EQ(run(rw_, r), 0);
  EXPECT_EQ(on_disk(64 * 1024, 64 * 1024), std::string(64 * 1024, '\0'));
  EXPECT_EQ(on_disk(64 * 1024 - 1, 1), "\xab");
  EXPECT_EQ(on_disk(128 * 1024, 1), "\xab");
  EXPECT_EQ(allocated_bytes(path_), allocated);
  EXPECT_EQ(file_size(path_), kSize);
}

TEST_F(RingTest, Cache) {
  RecordingRequest r = make_request(Op::Cache, 0, kSize);
  EXPECT_EQ(run(ro_, r), 0);
  RecordingRequest past = make_request(Op::Cache, kSize, 1);
  EXPECT_EQ(run(ro_, past), EINVAL);
}

TEST_F(RingTest, ZeroLengthRequestsSucceed) {
  for (Op op : {Op::Read, Op::Write, Op::Trim, Op::WriteZeroes, Op::Cache}) {
    RecordingRequest r = make_request(op, kSize, 0);
    EXPECT_EQ(run(rw_, r), 0);
  }
  EXPECT_EQ(file_size(path_), kSize);
}

TEST_F(RingTest, ReadPastAShrunkFileIsAnIoError) {
  // The volume still believes its old size, so the request is admitted; the file then ends
  // inside it. The first read comes back short, the one resubmitted for the rest finds the end.
  ASSERT_EQ(::truncate(path_.c_str(), kSize / 2), 0);
  AlignedBuffer buf(8192);
  RecordingRequest straddling = make_request(Op::Read, kSize / 2 - 4096, 8192, buf.data());
  EXPECT_EQ(run(rw_, straddling), EIO);
  RecordingRequest beyond = make_request(Op::Read, kSize - 8192, 8192, buf.data());
  EXPECT_EQ(run(rw_, beyond), EIO);
  EXPECT_EQ(rw_.read(buf.data(), 8192, kSize / 2 - 4096), EIO);
}

TEST_F(RingTest, AdmissionErrorsCompleteAtSubmit) {
  const std::string before = on_disk(0, kSize);
  AlignedBuffer buf(4096);
  std::memset(buf.data(), 0x11, 4096);
  struct Case {
    const Handle* handle;
    Op op;
    uint64_t offset;
    uint32_t length;
    int err;
  };
  const Case cases[] = {
      {&ro_, Op::Write, 0, 4096, EPERM},
      {&ro_, Op::Trim, 0, 4096, EPERM},
      {&ro_, Op::WriteZeroes, 0, 4096, EPERM},
      {&rw_, Op::Write, kSize - 2048, 4096, ENOSPC},
      {&rw_, Op::WriteZeroes, kMax - 10, 4096, ENOSPC},
      {&rw_, Op::Read, kSize, 1, EINVAL},
      {&rw_, Op::Trim, kMax, 1, EINVAL},
  };
  for (const Case& c : cases) {
    RecordingRequest r = make_request(c.op, c.offset, c.length, buf.data());
    ring_->submit(*c.handle, &r);
    EXPECT_EQ(r.calls, 1) << "admission errors need no trip through the kernel";
    EXPECT_EQ(r.err, c.err);
  }
  EXPECT_EQ(on_disk(0, kSize), before);
  EXPECT_EQ(file_size(path_), kSize);
}

TEST_F(RingTest, ReadOnlyWriteThroughTheRingIsRefused) {
  const std::string before = on_disk(0, kSize);
  AlignedBuffer buf(8192);
  std::memset(buf.data(), 0x22, 8192);
  RecordingRequest r = make_request(Op::Write, 0, 8192, buf.data(), backend::kFua);
  EXPECT_EQ(run(ro_, r), EPERM);
  EXPECT_EQ(on_disk(0, kSize), before);
}

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
}  // namespace shareblk
