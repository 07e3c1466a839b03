// The op → syscall mapping of every volume request (see dispatch.h).
#include "backend/dispatch.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace shareblk::backend {

namespace {

// A request's stages: the operation itself, then (write-zeroes only) writing zero bytes where
// fallocate could not, then (FUA on trim and write-zeroes) a data sync of every device.
enum Stage : uint8_t { kMain = 0, kZeroFill = 1, kSync = 2 };

bool syncing(const Work& work, const DispatchCursor& cursor) {
  return cursor.stage == kSync || (cursor.stage == kMain && work.op == Op::Flush);
}

// The fallocate(2) mode that carries out a trim or write-zeroes on this volume.
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

}  // namespace

const char* zero_buffer() {
  static char* zeroes = [] {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, kZeroBufferSize) != 0) std::abort();
    std::memset(p, 0, kZeroBufferSize);
    return static_cast<char*>(p);
  }();
  return zeroes;
}

int begin(const Handle& handle, const Work& work, DispatchCursor& cursor) {
  if (int err = handle.admit(work.op, work.offset, work.length, work.flags)) return err;
  // Nothing to move; and fallocate and fadvise would read a length of 0 as "to EOF".
  if (work.length == 0 && work.op != Op::Flush) return 0;
  cursor = DispatchCursor{};
  return kMoreSteps;
}

int next_step(Volume& volume, const Work& work, DispatchCursor& cursor, Step& step) {
  const uint64_t offset = work.offset + cursor.progress;
  const uint64_t remaining = work.length - cursor.progress;
  step = Step{};
  if (syncing(work, cursor)) {
    step.call = Syscall::Fdatasync;
    step.fd = volume.device_fd(cursor.progress);  // progress counts devices synced
    return 0;
  }
  Volume::Location at{};
  if (cursor.stage == kZeroFill) {
    step.call = Syscall::Write;
    step.data = const_cast<char*>(zero_buffer());  // only ever written from
    at = volume.locate(offset, std::min<uint64_t>(remaining, kZeroBufferSize), step.data);
  } else if (work.op == Op::Read || work.op == Op::Write) {
    step.call = work.op == Op::Read ? Syscall::Read : Syscall::Write;
    step.in_request_buffer = true;
    step.data = work.buf + cursor.progress;
    at = volume.locate(offset, remaining, step.data);
    if (work.op == Op::Write && (work.flags & kFua)) step.mode = RWF_DSYNC;
  } else if (work.op == Op::Cache) {
    step.call = Syscall::Fadvise;
    at = volume.locate_buffered(offset, remaining);
  } else {  // Trim, WriteZeroes
    step.call = Syscall::Fallocate;
    step.mode = fallocate_mode(volume, work.op, work.flags);
    if (step.mode & FALLOC_FL_PUNCH_HOLE) volume.note_holes();
    at = volume.locate_buffered(offset, remaining);
    cursor.chunk = at.length;  // fallocate does all of a piece or fails
  }
  if (at.fd < 0) return EIO;
  step.fd = at.fd;
  step.offset = at.offset;
  step.length = at.length;
  return 0;
}

int advance(const Volume& volume, const Work& work, DispatchCursor& cursor, int64_t result) {
  if (result == -EAGAIN || result == -EINTR) return kMoreSteps;  // nothing happened: again
  if (result < 0) {
    if (cursor.stage == kMain && result == -EOPNOTSUPP && work.op == Op::WriteZeroes) {
      if (work.flags & kFastZero) return ENOTSUP;
      cursor.stage = kZeroFill;  // no fallocate here: write the zeroes, from where it stopped
      return kMoreSteps;
    }
    if (cursor.stage == kMain && result == -EOPNOTSUPP && work.op == Op::Trim) {
      result = 0;  // trim is a hint: a device that cannot discard ignores it
    } else {
      return static_cast<int>(-result);
    }
  }
  bool more = false;
  if (syncing(work, cursor)) {
    cursor.progress += 1;
    more = cursor.progress < volume.device_count();
  } else if (work.op == Op::Cache) {
    more = false;  // a hint: the first piece is enough
  } else if (cursor.stage == kZeroFill || work.op == Op::Read || work.op == Op::Write) {
    if (result == 0) return EIO;                       // end of file inside the volume: it shrank
    cursor.progress += static_cast<uint64_t>(result);  // a short transfer or a seam: go on
    more = cursor.progress < work.length;
  } else {  // Trim, WriteZeroes
    cursor.progress += cursor.chunk;
    more = cursor.progress < work.length;
  }
  if (more) return kMoreSteps;
  if ((work.flags & kFua) && (work.op == Op::Trim || work.op == Op::WriteZeroes) &&
      cursor.stage != kSync) {
    cursor.stage = kSync;
    cursor.progress = 0;
    return kMoreSteps;
  }
  return 0;
}

}  // namespace shareblk::backend
