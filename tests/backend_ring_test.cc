// The backend's io_uring path: reads, writes, registered buffers, trim, zeroes, admission errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "tests/backend_fixture.h"

namespace shareblk::testing::backend_io {
namespace {

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

}  // namespace
}  // namespace shareblk::testing::backend_io
