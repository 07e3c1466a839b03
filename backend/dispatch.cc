// The parts of the op → syscall mapping (dispatch.h) that are not on every request's path.
#include "backend/dispatch.h"

#include <fcntl.h>
#include <linux/falloc.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace shareblk::backend {

int fallocate_mode(const Volume& volume, Op op, uint32_t flags) {
  if (op == Op::Trim) return FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
  // Write-zeroes. On a block device, PUNCH_HOLE is the kernel's zero-out without a slow
  // fallback (so it is the fast-zero test) and ZERO_RANGE may fall back to writing zeroes.
  // On a file, PUNCH_HOLE leaves a hole that reads as zeroes unless the client wants the
  // blocks allocated (NBD_CMD_FLAG_NO_HOLE).
  if (volume.is_block_device()) {
    return (flags & kFastZero) ? FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
                               : FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE;
  }
  return (flags & kNoHole) ? FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE
                           : FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
}

const char* zero_buffer() {
  static char* zeroes = [] {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, kZeroBufferSize) != 0) std::abort();
    std::memset(p, 0, kZeroBufferSize);
    return static_cast<char*>(p);
  }();
  return zeroes;
}

}  // namespace shareblk::backend
