// The steady state of the I/O path allocates nothing (issue #5): once a connection has served
// its first requests, its reads, writes, flushes, trims and zeroes run on recycled requests
// and pooled buffers. This binary counts every heap allocation of the process to check that;
// it is a binary of its own because it takes over the allocator's entry points.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "target/nbd_proto.h"
#include "tests/support.h"
#include "tests/worker_fixture.h"

namespace {

std::atomic<bool> counting{false};
std::atomic<uint64_t> allocations{0};

void note_allocation() {
  if (counting.load(std::memory_order_relaxed)) {
    allocations.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace

#ifdef SHAREBLK_SANITIZER_MALLOC  // tests/CMakeLists.txt: under SHAREBLK_SANITIZE(_THREAD)
// The sanitizer (ASan, TSan) owns malloc and calls these for every allocation, operator new
// included; replacing malloc under it crashes the runtime at start-up.
// Declared here: the runtime exports it, but GCC 12 ships no <sanitizer/allocator_interface.h>.
// NOLINTNEXTLINE(bugprone-reserved-identifier)
extern "C" int __sanitizer_install_malloc_and_free_hooks(void (*malloc_hook)(const volatile void*,
                                                                             size_t),
                                                         void (*free_hook)(const volatile void*));

namespace {
void on_malloc(const volatile void* /*ptr*/, size_t /*size*/) {
  note_allocation();
}
void on_free(const volatile void* /*ptr*/) {}
[[maybe_unused]] const int hooks_installed =
    __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free);
}  // namespace
#else
// glibc lets a program replace malloc by defining these functions (glibc manual, "Replacing
// malloc"); each counts and forwards to glibc's own allocator, which it exports as __libc_*.
// operator new, std::aligned_alloc and posix_memalign all end here.
// NOLINTBEGIN(bugprone-reserved-identifier)
extern "C" {
void* __libc_malloc(size_t size);
void* __libc_calloc(size_t count, size_t size);
void* __libc_realloc(void* ptr, size_t size);
void* __libc_memalign(size_t alignment, size_t size);
void* __libc_valloc(size_t size);
void* __libc_pvalloc(size_t size);
void __libc_free(void* ptr);

void* malloc(size_t size) noexcept {
  note_allocation();
  return __libc_malloc(size);
}
void* calloc(size_t count, size_t size) noexcept {
  note_allocation();
  return __libc_calloc(count, size);
}
void* realloc(void* ptr, size_t size) noexcept {
  note_allocation();
  return __libc_realloc(ptr, size);
}
void* memalign(size_t alignment, size_t size) noexcept {
  note_allocation();
  return __libc_memalign(alignment, size);
}
void* aligned_alloc(size_t alignment, size_t size) noexcept {
  note_allocation();
  return __libc_memalign(alignment, size);
}
int posix_memalign(void** ptr, size_t alignment, size_t size) noexcept {
  note_allocation();
  void* p = __libc_memalign(alignment, size);
  if (p == nullptr) return ENOMEM;
  *ptr = p;
  return 0;
}
void* valloc(size_t size) noexcept {
  note_allocation();
  return __libc_valloc(size);
}
void* pvalloc(size_t size) noexcept {
  note_allocation();
  return __libc_pvalloc(size);
}
void free(void* ptr) noexcept {
  __libc_free(ptr);
}
}
// NOLINTEND(bugprone-reserved-identifier)
#endif

namespace shareblk::testing {
namespace {

constexpr uint64_t kVolumeSize = 64 << 20;
constexpr uint32_t kLarge = 64 << 10;
constexpr int kBatch = 32;

struct Step {
  uint16_t type;
  uint32_t length;
};
// One batch is four rounds of a mix, all in flight at once, as a guest's queue would be. With
// structured replies one small read becomes a BLOCK_STATUS, as a copying client's would be.
constexpr int kMixSize = 8;
using Mix = std::array<Step, kMixSize>;
constexpr Mix kSimpleMix = {{
    {nbd::kCmdRead, 4096},
    {nbd::kCmdWrite, 4096},
    {nbd::kCmdRead, kLarge},
    {nbd::kCmdWrite, kLarge},
    {nbd::kCmdWriteZeroes, kLarge},
    {nbd::kCmdRead, 4096},
    {nbd::kCmdTrim, kLarge},
    {nbd::kCmdFlush, 0},
}};
constexpr Mix with_block_status(Mix mix) {
  mix[5] = {nbd::kCmdBlockStatus, kLarge};
  return mix;
}
constexpr Mix kStructuredMix = with_block_status(kSimpleMix);

// A client whose buffers all exist before counting starts: sending and receiving allocate
// nothing on this side either.
class PipelinedClient {
 public:
  PipelinedClient(int fd, const Mix& mix)
      : fd_(fd), mix_(mix), payload_(kLarge, 'p'), reply_(kLarge + 64) {
    const timeval wait{10, 0};  // a reply that never comes fails the test, not the suite's timeout
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  }

  // Sends one batch and takes every reply; false (with a failure recorded) if any of them
  // failed or did not come.
  bool run_batch(uint64_t batch) {
    for (int i = 0; i < kBatch; ++i) {
      const Step& step = mix_[static_cast<size_t>(i % kMixSize)];
      const uint64_t slot = (batch * kBatch + static_cast<uint64_t>(i)) % (kVolumeSize / kLarge);
      const uint64_t offset = step.type == nbd::kCmdFlush ? 0 : slot * kLarge;
      if (!send_request(fd_, step.type, static_cast<uint64_t>(i), offset, step.length)) {
        return false;
      }
      if (step.type == nbd::kCmdWrite && !send_all(fd_, payload_.data(), step.length)) {
        return false;
      }
    }
    for (int done = 0; done < kBatch; ++done) {
      if (!take_reply()) return false;
    }
    return true;
  }

 private:
  bool recv_exact(void* buf, size_t n) {
    return n == 0 || ::recv(fd_, buf, n, MSG_WAITALL) == static_cast<ssize_t>(n);
  }

  // One whole reply: a simple one, or structured chunks up to the one flagged done.
  bool take_reply() {
    uint8_t head[20];
    for (;;) {
      if (!recv_exact(head, 4)) return false;
      const uint32_t magic = nbd::get32(head);
      if (magic == nbd::kSimpleReplyMagic) {
        if (!recv_exact(head + 4, 12)) return false;
        EXPECT_EQ(nbd::get32(head + 4), 0u) << "a request failed";
        const Step& step = mix_[nbd::get64(head + 8) % kMixSize];
        return step.type != nbd::kCmdRead || recv_exact(reply_.data(), step.length);
      }
      EXPECT_EQ(magic, nbd::kStructuredReplyMagic);
      if (magic != nbd::kStructuredReplyMagic || !recv_exact(head + 4, 16)) return false;
      const uint16_t type = nbd::get16(head + 6);
      const uint32_t length = nbd::get32(head + 16);
      EXPECT_EQ(type & 0x8000, 0) << "an error chunk";
      if (length > reply_.size() || !recv_exact(reply_.data(), length)) return false;
      if (nbd::get16(head + 4) & nbd::kReplyFlagDone) return true;
    }
  }

  int fd_;
  const Mix& mix_;
  std::string payload_;
  std::vector<char> reply_;
};

// Serves `batches` batches after a warm-up and returns how many allocations the process
// made meanwhile.
uint64_t allocations_while_serving(bool structured_replies, int batches) {
  WorkerOnAFile w(kVolumeSize);
  EXPECT_TRUE(w.started());
  make_file(w.path(), kVolumeSize, 'a');  // data, not holes; same inode: the volume sees it
  const int fd = w.connect(backend::AttachMode::ReadWrite, structured_replies,
                           /*base_allocation=*/structured_replies);
  EXPECT_GE(fd, 0);
  PipelinedClient client(fd, structured_replies ? kStructuredMix : kSimpleMix);
  uint64_t batch = 0;
  for (; batch < 50; ++batch) {  // the pool and the request free list fill up here
    if (!client.run_batch(batch)) ADD_FAILURE() << "warm-up batch " << batch << " failed";
  }
  allocations.store(0);
  counting.store(true);
  bool served = true;
  for (const uint64_t end = batch + static_cast<uint64_t>(batches); batch < end && served;
       ++batch) {
    served = client.run_batch(batch);
  }
  counting.store(false);
  EXPECT_TRUE(served) << "batch " << batch << " failed";
  w.worker().stop();
  ::close(fd);
  return allocations.load();
}

TEST(SteadyStateTest, ServingRequestsAllocatesNothing) {
  EXPECT_EQ(allocations_while_serving(false, 200), 0u)
      << "heap allocations while serving 6,400 requests (simple replies)";
}

// Structured replies, with holes: the trims make the reads look for them, and BLOCK_STATUS
// reports them.
TEST(SteadyStateTest, ServingRequestsWithStructuredRepliesAllocatesNothing) {
  EXPECT_EQ(allocations_while_serving(true, 200), 0u)
      << "heap allocations while serving 6,400 requests (structured replies)";
}

// The counter itself: a test that could never fail would prove nothing.
TEST(SteadyStateTest, TheCounterSeesAnAllocation) {
  allocations.store(0);
  counting.store(true);
  auto* p = new std::vector<int>(1000);
  counting.store(false);
  delete p;
  EXPECT_GE(allocations.load(), 1u);
}

}  // namespace
}  // namespace shareblk::testing
