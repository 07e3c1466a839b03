// The one op → syscall mapping, shared by the synchronous engine (sync.cc) and the io_uring
// engine (ring.cc); internal to backend/.
//
// A request is carried out as a sequence of steps, each one system call. next_step() says what
// the next call is, from the request and its cursor; the engine makes the call (pread, or an
// SQE) and hands its result to advance(), which moves the cursor on and says whether there is a
// step more or what the request's result is. Neither allocates, and neither blocks, so the ring
// can call them on its hot path. What lives here, and nowhere else:
//   - which descriptor and where (Volume::locate; a step never crosses a segment seam);
//   - the fallocate(2) mode of trim and write-zeroes (NO_HOLE, FAST_ZERO, file or device);
//   - write-zeroes writing zero bytes where fallocate says EOPNOTSUPP, and FAST_ZERO then
//     failing with ENOTSUP instead;
//   - trim being a hint (EOPNOTSUPP is success);
//   - FUA: RWF_DSYNC on writes, a data sync of every device after trim and write-zeroes;
//   - CACHE as posix_fadvise(WILLNEED) of its first piece;
//   - short transfers going on from where they stopped, a transfer of 0 bytes (the file
//     shrank under us) being EIO, and EAGAIN or EINTR running the same step again.
// How a step is run stays with each engine: the bounce buffer for unaligned memory (sync.cc),
// registered buffers and inline copies for volumes in memory (ring.cc).
#pragma once

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/uio.h>  // RWF_DSYNC

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>

#include "backend/backend.h"

namespace shareblk::backend {

inline constexpr size_t kZeroBufferSize = 1 << 20;

// kZeroBufferSize zero bytes, aligned for O_DIRECT; for write-zeroes where fallocate cannot.
const char* zero_buffer();

// What a request asks for, as the engines hold it.
struct Work {
  Op op;
  uint32_t flags;
  uint64_t offset;
  uint64_t length;
  char* buf;  // Read, Write
};

enum class Syscall : uint8_t { Read, Write, Fallocate, Fdatasync, Fadvise };

// One system call of a request.
struct Step {
  Syscall call;
  bool in_request_buffer;  // Read, Write: `data` lies in Work::buf (a registered buffer's)
  int fd;
  int mode;         // Fallocate: its mode; Write: RWF_* flags
  uint64_t offset;  // on `fd`
  uint64_t length;
  char* data;  // Read, Write
};

// Inline from here on: the ring runs these for every request.

// Admission (Handle::admit, the only one) and the requests that need no step. Returns kMoreSteps
// when the request has steps to run, else its result (0 or errno). Resets `cursor`.
inline constexpr int kMoreSteps = -1;

// A request that begin() started (kMoreSteps) must be ended with end() once it has its result.
inline int begin(const Handle& handle, const Work& work, DispatchCursor& cursor) {
  if (int err = handle.admit(work.op, work.offset, work.length, work.flags)) return err;
  // Nothing to move; and fallocate and fadvise would read a length of 0 as "to EOF".
  if (work.length == 0 && work.op != Op::Flush) return 0;
  switch (handle.enter(work.op)) {
    case WriteAccess::Entry::Entered:
      break;
    case WriteAccess::Entry::Refused:  // write access revoked since admit()
      return EPERM;
    case WriteAccess::Entry::Paused:
      return kPaused;
  }
  cursor = DispatchCursor{};
  return kMoreSteps;
}

inline void end(const Handle& handle, const Work& work) {
  handle.leave(work.op);
}

// The fallocate(2) mode that carries out a trim or write-zeroes on this volume.
int fallocate_mode(const Volume& volume, Op op, uint32_t flags);

// A request's stages: the operation itself, then (write-zeroes only) writing zero bytes where
// fallocate could not, then (FUA on trim and write-zeroes) a data sync of every device.
enum DispatchStage : uint8_t { kStageMain = 0, kStageZeroFill = 1, kStageSync = 2 };

inline bool syncing(const Work& work, const DispatchCursor& cursor) {
  return cursor.stage == kStageSync || (cursor.stage == kStageMain && work.op == Op::Flush);
}

// The next step of `work` at `cursor`. Returns 0, or EIO when the range is past the map (which
// admission makes unreachable). Notes possible holes on `volume` before a step punches one.
[[gnu::always_inline]] inline int next_step(Volume& volume, const Work& work,
                                            DispatchCursor& cursor, Step& step) {
  const uint64_t offset = work.offset + cursor.progress;
  const uint64_t remaining = work.length - cursor.progress;
  step = Step{};
  if (syncing(work, cursor)) {
    step.call = Syscall::Fdatasync;
    step.fd = volume.device_fd(cursor.progress);  // progress counts devices synced
    return 0;
  }
  Volume::Location at{};
  if (cursor.stage == kStageZeroFill) {
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

// Takes the result of the step next_step() gave (bytes moved, 0, or -errno). Returns kMoreSteps,
// or the request's result: 0 or a positive errno.
[[gnu::always_inline]] inline int advance(const Volume& volume, const Work& work,
                                          DispatchCursor& cursor, int64_t result) {
  if (result == -EAGAIN || result == -EINTR) return kMoreSteps;  // nothing happened: again
  if (result < 0) {
    if (cursor.stage == kStageMain && result == -EOPNOTSUPP && work.op == Op::WriteZeroes) {
      if (work.flags & kFastZero) return ENOTSUP;
      cursor.stage = kStageZeroFill;  // no fallocate here: write the zeroes, from where it stopped
      return kMoreSteps;
    }
    if (cursor.stage == kStageMain && result == -EOPNOTSUPP && work.op == Op::Trim) {
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
  } else if (cursor.stage == kStageZeroFill || work.op == Op::Read || work.op == Op::Write) {
    if (result == 0) return EIO;                       // end of file inside the volume: it shrank
    cursor.progress += static_cast<uint64_t>(result);  // a short transfer or a seam: go on
    more = cursor.progress < work.length;
  } else {  // Trim, WriteZeroes
    cursor.progress += cursor.chunk;
    more = cursor.progress < work.length;
  }
  if (more) return kMoreSteps;
  if ((work.flags & kFua) && (work.op == Op::Trim || work.op == Op::WriteZeroes) &&
      cursor.stage != kStageSync) {
    cursor.stage = kStageSync;
    cursor.progress = 0;
    return kMoreSteps;
  }
  return 0;
}

}  // namespace shareblk::backend
