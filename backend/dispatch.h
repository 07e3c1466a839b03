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
//   - short transfers going on from where they stopped, and a transfer of 0 bytes (the file
//     shrank under us) being EIO.
#pragma once

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

// Admission (Handle::admit, the only one) and the requests that need no step. Returns kMoreSteps
// when the request has steps to run, else its result (0 or errno). Resets `cursor`.
inline constexpr int kMoreSteps = -1;
int begin(const Handle& handle, const Work& work, DispatchCursor& cursor);

// The next step of `work` at `cursor`. Returns 0, or EIO when the range is past the map (which
// admission makes unreachable). Notes possible holes on `volume` before a step punches one.
int next_step(Volume& volume, const Work& work, DispatchCursor& cursor, Step& step);

// Takes the result of the step next_step() gave (bytes moved, 0, or -errno). Returns kMoreSteps,
// or the request's result: 0 or a positive errno.
int advance(const Volume& volume, const Work& work, DispatchCursor& cursor, int64_t result);

}  // namespace shareblk::backend
