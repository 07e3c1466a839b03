// The one dispatch and the one capability rule of the backend: the synchronous engine
// (Handle::execute) and the io_uring engine (Ring) run the same op sequences to the same
// results and the same bytes, on a file, a file in memory and a map of segments; and
// capabilities() says what admission enforces.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
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

// Bytes that differ at every offset, so that a transfer landing in the wrong place shows.
std::string pattern(size_t length, unsigned seed) {
  std::string s(length, '\0');
  for (size_t i = 0; i < length; ++i) s[i] = static_cast<char>((i * 151 + seed * 29) & 0xff);
  return s;
}

// Memory aligned for O_DIRECT, with room to offset into it for unaligned buffers.
struct Aligned {
  explicit Aligned(size_t size) {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, size + 4096) != 0) std::abort();
    std::memset(p, 0, size + 4096);
    data.reset(static_cast<char*>(p));
  }
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data;
};

struct RecordingRequest final : backend::IoRequest {
  int calls = 0;
  int err = -1;
  void done(int e) override {
    ++calls;
    err = e;
  }
};

// One request of a sequence: what, where, through which attachment, and from which memory.
struct Request {
  Op op;
  uint64_t offset;
  uint32_t length;
  uint32_t flags = 0;
  bool read_only = false;
  size_t misalign = 0;  // bytes past an aligned address for the buffer
  unsigned seed = 0;    // of a write's bytes
  int expect = -1;      // the result every volume gives, or -1 when it depends on the volume
};

std::string describe(const Request& r) {
  static const char* names[] = {"Read", "Write", "Flush", "Trim", "WriteZeroes", "Cache"};
  return std::string(names[static_cast<int>(r.op)]) + " " + std::to_string(r.offset) + "+" +
         std::to_string(r.length) + " flags " + std::to_string(r.flags) +
         (r.read_only ? " ro" : " rw") + " misalign " + std::to_string(r.misalign);
}

// What a request did: its result and, for a read, the bytes it read.
struct Outcome {
  int err;
  std::string data;
  bool operator==(const Outcome& o) const { return err == o.err && data == o.data; }
};

Outcome run_sync(const Handle& h, const Request& r) {
  Aligned buf(r.length);
  char* p = buf.data.get() + r.misalign;
  if (r.op == Op::Write) std::memcpy(p, pattern(r.length, r.seed).data(), r.length);
  const int err = h.execute(r.op, p, r.length, r.offset, r.flags);
  return {err, r.op == Op::Read && err == 0 ? std::string(p, r.length) : std::string()};
}

Outcome run_ring(backend::Ring& ring, const Handle& h, const Request& r) {
  Aligned buf(r.length);
  char* p = buf.data.get() + r.misalign;
  if (r.op == Op::Write) std::memcpy(p, pattern(r.length, r.seed).data(), r.length);
  RecordingRequest req;
  req.op = r.op;
  req.offset = r.offset;
  req.length = r.length;
  req.flags = r.flags;
  req.buf = p;
  ring.submit(h, &req);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (req.calls == 0 && std::chrono::steady_clock::now() < deadline) {
    if (ring.run_once(100) < 0) break;
  }
  EXPECT_EQ(req.calls, 1) << describe(r);
  return {req.err, r.op == Op::Read && req.err == 0 ? std::string(p, r.length) : std::string()};
}

// Two copies of one volume, one for each engine.
struct Pair {
  std::shared_ptr<Volume> sync;
  std::shared_ptr<Volume> ring;
};

// Runs `requests` through both engines, request by request, and compares each outcome, then
// the volumes' bytes and allocation.
void expect_same(const Pair& volumes, const std::vector<Request>& requests) {
  std::error_code ec;
  backend::Ring ring(64, ec);
  ASSERT_FALSE(ec) << "io_uring: " << ec.message();
  const Handle sync_rw(volumes.sync, AttachMode::ReadWrite);
  const Handle sync_ro(volumes.sync, AttachMode::ReadOnly);
  const Handle ring_rw(volumes.ring, AttachMode::ReadWrite);
  const Handle ring_ro(volumes.ring, AttachMode::ReadOnly);
  for (const Request& r : requests) {
    const Outcome s = run_sync(r.read_only ? sync_ro : sync_rw, r);
    const Outcome u = run_ring(ring, r.read_only ? ring_ro : ring_rw, r);
    EXPECT_EQ(s.err, u.err) << describe(r);
    if (r.expect >= 0) {
      EXPECT_EQ(s.err, r.expect) << describe(r);
    }
    EXPECT_TRUE(s.data == u.data) << describe(r) << ": the engines read different bytes";
  }
  const uint64_t size = volumes.sync->size();
  ASSERT_EQ(size, volumes.ring->size());
  std::string a(size, '\0');
  std::string b(size, '\0');
  ASSERT_EQ(sync_ro.read(a.data(), size, 0), 0);
  ASSERT_EQ(ring_ro.read(b.data(), size, 0), 0);
  EXPECT_TRUE(a == b) << "the engines left different bytes";
  std::vector<Extent> ea;
  std::vector<Extent> eb;
  ASSERT_EQ(sync_ro.extents(0, size, 1024, ea), 0);
  ASSERT_EQ(ring_ro.extents(0, size, 1024, eb), 0);
  ASSERT_EQ(ea.size(), eb.size()) << "the engines left different holes";
  for (size_t i = 0; i < ea.size(); ++i) {
    EXPECT_EQ(ea[i].length, eb[i].length) << "extent " << i;
    EXPECT_EQ(ea[i].hole, eb[i].hole) << "extent " << i;
  }
}

// Every op, every flag it takes, aligned and not, inside, at and past the end; `seam` is an
// offset where a mapped volume changes segment.
std::vector<Request> op_sequence(uint64_t size, uint64_t seam) {
  const uint32_t k4 = 4096;
  const uint32_t k64 = 64 * 1024;
  std::vector<Request> s = {
      {Op::Write, 0, k64, 0, false, 0, 1},
      {Op::Write, 777, 5000, 0, false, 3, 2},
      {Op::Write, 8 * k4, 8 * k4, backend::kFua, false, 0, 3},
      {Op::Write, 16 * k4, 4 * k4, 0, false, 1, 4},  // aligned range, unaligned memory
      {Op::Write, seam - 3 * k4, 6 * k4, backend::kFua, false, 0, 5},
      {Op::Write, seam - 100, 300, 0, false, 0, 6},
      {Op::Write, 300 * 1024, 2 * k64, 0, false, 0, 7},
      {Op::Read, 0, k64, 0, false, 0},
      {Op::Read, 701, 9000, 0, false, 5},
      {Op::Read, 16 * k4, 4 * k4, 0, false, 1},
      {Op::Read, seam - 3 * k4, 6 * k4, 0, true, 0},
      {Op::Read, seam - 100, 300, 0, true, 0},
      {Op::Trim, 32 * k4, k64, 0},
      {Op::Trim, seam - k4, 2 * k4, backend::kFua},
      {Op::WriteZeroes, 300 * 1024, k64, 0},
      {Op::WriteZeroes, 300 * 1024 + k64, 5000, backend::kNoHole},
      {Op::WriteZeroes, 3, 100, backend::kNoHole | backend::kFua},
      {Op::WriteZeroes, seam - 2 * k4, 4 * k4, backend::kFua},
      {Op::WriteZeroes, 40 * k4, 2 * k4, backend::kFastZero},
      {Op::WriteZeroes, 44 * k4, 2 * k4, backend::kFastZero | backend::kNoHole},
      {Op::WriteZeroes, 4093, static_cast<uint32_t>(size / 2 + 7), backend::kNoHole},
      {Op::Cache, 0, static_cast<uint32_t>(size)},
      {Op::Cache, seam - k4, 2 * k4},
      {Op::Flush, 0, 0},
      {Op::Read, 0, static_cast<uint32_t>(size), 0, true, 0},
      // Nothing to move.
      {Op::Read, size, 0, 0, false, 0, 0, 0},
      {Op::Write, size, 0, 0, false, 0, 0, 0},
      {Op::Trim, size, 0, 0, false, 0, 0, 0},
      {Op::WriteZeroes, size, 0, 0, false, 0, 0, 0},
      {Op::Cache, size, 0, 0, false, 0, 0, 0},
      // Past the end.
      {Op::Read, size - 100, 200, 0, false, 0, 0, EINVAL},
      {Op::Write, size - 100, 200, 0, false, 0, 8, ENOSPC},
      {Op::Trim, size, 1, 0, false, 0, 0, EINVAL},
      {Op::WriteZeroes, size - k4, 2 * k4, 0, false, 0, 0, ENOSPC},
      {Op::Cache, size, 1, 0, false, 0, 0, EINVAL},
      // Read-only.
      {Op::Write, 0, k4, 0, true, 0, 9, EPERM},
      {Op::Write, size, k4, 0, true, 0, 9, EPERM},  // EPERM before ENOSPC
      {Op::Trim, 0, k4, 0, true, 0, 0, EPERM},
      {Op::WriteZeroes, 0, k4, backend::kFastZero, true, 0, 0, EPERM},
      {Op::Flush, 0, 0, 0, true, 0, 0, 0},
      {Op::Cache, 0, k4, 0, true, 0, 0, 0},
      // FUA on any op (NBD allows it on every command; it asks nothing where nothing is
      // written)...
      {Op::Read, 0, k4, backend::kFua, false, 0, 0, 0},
      {Op::Flush, 0, 0, backend::kFua, false, 0, 0, 0},
      {Op::Cache, 0, k4, backend::kFua, false, 0, 0, 0},
      // ...but not flags an op does not take.
      {Op::Read, 0, k4, backend::kNoHole, false, 0, 0, EINVAL},
      {Op::Trim, 0, k4, backend::kNoHole, false, 0, 0, EINVAL},
      {Op::Write, 0, k4, backend::kFastZero, false, 0, 10, EINVAL},
      {Op::Flush, 0, 0, backend::kFastZero, false, 0, 0, EINVAL},
      {Op::Write, 0, k4, backend::kNoHole, true, 0, 10, EPERM},  // EPERM before EINVAL
      {Op::Read, 0, static_cast<uint32_t>(size), 0, false, 0, 0, 0},
  };
  return s;
}

std::shared_ptr<Volume> open_file(const std::string& path) {
  std::error_code ec;
  auto v = Volume::open(path, ec);
  EXPECT_TRUE(v) << path << ": " << ec.message();
  return v;
}

TEST(Dispatch, EnginesAgreeOnAFile) {
  testing::TempDir dir;
  testing::make_file(dir / "a", kSize, 0xab);
  testing::make_file(dir / "b", kSize, 0xab);
  Pair p{open_file(dir / "a"), open_file(dir / "b")};
  ASSERT_TRUE(p.sync && p.ring);
  expect_same(p, op_sequence(kSize, kSize / 2 + 512));
}

TEST(Dispatch, EnginesAgreeOnASparseFile) {
  testing::TempDir dir;
  testing::make_file(dir / "a", kSize);
  testing::make_file(dir / "b", kSize);
  Pair p{open_file(dir / "a"), open_file(dir / "b")};
  ASSERT_TRUE(p.sync && p.ring);
  expect_same(p, op_sequence(kSize, 3 * kSize / 4));
}

// tmpfs: no ZERO_RANGE (write-zeroes writes zero bytes, FAST_ZERO is ENOTSUP), the ring runs
// reads and writes inline.
TEST(Dispatch, EnginesAgreeInMemory) {
  testing::TempDir dir("/dev/shm", std::nothrow);
  SHAREBLK_REQUIRE(dir.ok(), "no writable /dev/shm");
  testing::make_file(dir / "a", kSize, 0xcd);
  testing::make_file(dir / "b", kSize, 0xcd);
  Pair p{open_file(dir / "a"), open_file(dir / "b")};
  ASSERT_TRUE(p.sync && p.ring);
  ASSERT_TRUE(p.sync->in_memory());
  expect_same(p, op_sequence(kSize, kSize / 2));
}

// A map over two files, its seam at an unaligned offset: every step stops at the seam.
TEST(Dispatch, EnginesAgreeOnAMap) {
  testing::TempDir dir;
  const uint64_t first = kSize / 2 + 512;
  auto open_map = [&](const std::string& prefix) {
    testing::make_file(dir / (prefix + "0"), 2 * kSize, 0x11);
    testing::make_file(dir / (prefix + "1"), 2 * kSize, 0x22);
    std::error_code ec;
    auto v = Volume::open_mapped(
        {{dir / (prefix + "0"), 4096, first}, {dir / (prefix + "1"), 8192, kSize - first}}, ec);
    EXPECT_TRUE(v) << ec.message();
    return v;
  };
  Pair p{open_map("a"), open_map("b")};
  ASSERT_TRUE(p.sync && p.ring);
  ASSERT_EQ(p.sync->device_count(), 2u);
  expect_same(p, op_sequence(kSize, first));
}

// --- capabilities() ---

TEST(Capabilities, ReadWriteMayDoEverything) {
  testing::TempDir dir;
  testing::make_file(dir / "v", kSize, 0);
  auto v = open_file(dir / "v");
  ASSERT_TRUE(v);
  const backend::Capabilities c = backend::capabilities(*v, AttachMode::ReadWrite);
  EXPECT_FALSE(c.read_only);
  EXPECT_TRUE(c.trim);
  EXPECT_TRUE(c.zero);
  EXPECT_TRUE(c.fast_zero);
  EXPECT_TRUE(c.flush);
  EXPECT_TRUE(c.fua);
  EXPECT_TRUE(c.multi_conn);
  EXPECT_TRUE(c.block_status);
  EXPECT_TRUE(c.cache);
  EXPECT_FALSE(Handle(v, AttachMode::ReadWrite).read_only());
}

TEST(Capabilities, ReadOnlyMayChangeNothing) {
  testing::TempDir dir;
  testing::make_file(dir / "v", kSize, 0);
  auto v = open_file(dir / "v");
  ASSERT_TRUE(v);
  const Handle h(v, AttachMode::ReadOnly);
  const backend::Capabilities c = h.capabilities();
  EXPECT_TRUE(c.read_only);
  EXPECT_FALSE(c.trim);
  EXPECT_FALSE(c.zero);
  EXPECT_FALSE(c.fast_zero);
  EXPECT_TRUE(c.flush);
  EXPECT_TRUE(c.fua);
  EXPECT_TRUE(c.multi_conn);
  EXPECT_TRUE(c.block_status);
  EXPECT_TRUE(c.cache);
  EXPECT_TRUE(h.read_only());
  // What the capabilities say is what admission enforces.
  EXPECT_EQ(h.admit(Op::Write, 0, 1), EPERM);
  EXPECT_EQ(h.admit(Op::Trim, 0, 1), EPERM);
  EXPECT_EQ(h.admit(Op::WriteZeroes, 0, 1), EPERM);
  EXPECT_EQ(h.admit(Op::Read, 0, 1), 0);
  EXPECT_EQ(h.admit(Op::Flush, 0, 0), 0);
  EXPECT_EQ(h.admit(Op::Cache, 0, 1), 0);
}

// A volume that could only be opened read-only makes a read-write attachment read-only, for
// every frontend. Handle::read_only() (FUSE's file mode) used to look at the mode alone.
TEST(Capabilities, AVolumeOpenedReadOnlyIsReadOnlyForEveryAttachment) {
  SHAREBLK_REQUIRE(testing::is_root(), "a read-only bind mount needs root");
  testing::TempDir dir;
  const std::string rw_dir = dir / "rw";
  const std::string ro_dir = dir / "ro";
  std::filesystem::create_directories(rw_dir);
  std::filesystem::create_directories(ro_dir);
  testing::make_file(rw_dir + "/v", kSize, 0x5a);
  const bool mounted =
      ::mount(rw_dir.c_str(), ro_dir.c_str(), nullptr, MS_BIND, nullptr) == 0 &&
      ::mount(nullptr, ro_dir.c_str(), nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY, nullptr) == 0;
  if (!mounted) ::umount2(ro_dir.c_str(), MNT_DETACH);
  SHAREBLK_REQUIRE(mounted, std::string("cannot bind-mount read-only: ") + std::strerror(errno));
  {
    auto v = open_file(ro_dir + "/v");
    ASSERT_TRUE(v);
    EXPECT_FALSE(v->writable());
    const Handle h(v, AttachMode::ReadWrite);
    EXPECT_TRUE(h.read_only());
    const backend::Capabilities c = h.capabilities();
    EXPECT_TRUE(c.read_only);
    EXPECT_FALSE(c.trim);
    EXPECT_FALSE(c.zero);
    EXPECT_FALSE(c.fast_zero);
    const std::string data(4096, 'x');
    EXPECT_EQ(h.write(data.data(), data.size(), 0, 0), EPERM);
  }
  ::umount2(ro_dir.c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace shareblk
