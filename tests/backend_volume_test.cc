// The backend's volumes and the admission rule: opening them, their descriptors, what is admitted.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "tests/backend_fixture.h"

namespace shareblk::testing::backend_io {
namespace {

// Whether the file system holding `path` accepts O_DIRECT.
bool accepts_direct(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

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

}  // namespace
}  // namespace shareblk::testing::backend_io
