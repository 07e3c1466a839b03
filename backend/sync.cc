// The synchronous engine: a request's steps (dispatch.h) as blocking system calls on the
// calling thread, for the frontends that run on threads of their own (FUSE, nbdkit).
#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "backend/backend.h"
#include "backend/dispatch.h"

namespace shareblk::backend {

namespace {

// The step's system call: bytes moved, 0, or -errno, as io_uring reports it.
int64_t call(const Step& step) {
  const auto at = static_cast<off_t>(step.offset);
  ssize_t n = 0;
  switch (step.call) {
    case Syscall::Read:
      n = ::pread(step.fd, step.data, step.length, at);
      break;
    case Syscall::Write: {
      const iovec iov{step.data, step.length};
      n = ::pwritev2(step.fd, &iov, 1, at, step.mode);
      break;
    }
    case Syscall::Fallocate:
      n = ::fallocate(step.fd, step.mode, at, static_cast<off_t>(step.length));
      break;
    case Syscall::Fdatasync:
      n = ::fdatasync(step.fd);
      break;
    case Syscall::Fadvise:  // returns the error number rather than setting errno
      return -::posix_fadvise(step.fd, at, static_cast<off_t>(step.length), POSIX_FADV_WILLNEED);
  }
  return n < 0 ? -errno : n;
}

// Runs the steps of an admitted request to its end.
int run(Volume& volume, const Work& work) {
  DispatchCursor cursor{};
  for (;;) {
    Step step{};
    if (int err = next_step(volume, work, cursor, step)) return err;
    const int result = advance(volume, work, cursor, call(step));
    if (result != kMoreSteps) return result;
  }
}

// O_DIRECT wants the memory aligned as well as the range. The synchronous callers pass the
// buffers their library hands them (nbdkit's malloc, libfuse's request buffer), so an aligned
// range in unaligned memory goes through this thread's aligned buffer: otherwise it would take
// the buffered descriptor and leave the volume's bytes in this host's page cache.
// 256 KiB: a multiple of any direct-I/O alignment, and little memory for each of the many
// threads nbdkit and libfuse run.
constexpr uint64_t kBounceSize = 256 << 10;

char* bounce_for(const Volume& v, const void* buf, uint64_t length, uint64_t offset) {
  const uint64_t mask = v.direct_alignment() - 1;
  if (!v.is_direct() || ((offset | length) & mask) != 0 ||
      (reinterpret_cast<uintptr_t>(buf) & mask) == 0) {
    return nullptr;
  }
  thread_local std::unique_ptr<char, decltype(&std::free)> bounce(nullptr, &std::free);
  thread_local uint64_t bounce_align = 0;
  const uint64_t align = std::max<uint64_t>(4096, v.direct_alignment());
  if (!bounce || bounce_align < align) {
    bounce.reset(static_cast<char*>(std::aligned_alloc(align, kBounceSize)));
    bounce_align = bounce ? align : 0;
  }
  return bounce.get();  // nullptr when out of memory: then the page cache it is
}

}  // namespace

int Handle::execute(Op op, void* buf, uint64_t length, uint64_t offset, uint32_t flags) const {
  Work work{op, flags, offset, length, static_cast<char*>(buf)};
  DispatchCursor cursor{};
  int started = begin(*this, work, cursor);
  while (started == kPaused) {  // this thread is the frontend's own: it may wait here
    access_->wait_resumed();
    started = begin(*this, work, cursor);
  }
  if (started != kMoreSteps) return started;
  Volume& volume = *volume_;
  if (volume.remote()) {
    const int err = volume.remote()->execute(op, flags, offset, length, static_cast<char*>(buf));
    end(*this, work);
    return err;
  }
  char* bounce =
      (op == Op::Read || op == Op::Write) ? bounce_for(volume, buf, length, offset) : nullptr;
  int err = 0;
  if (bounce == nullptr) {
    err = run(volume, work);
  } else {
    // The same request in bounce-sized pieces, each admitted above as part of the whole.
    for (uint64_t done = 0; done < length && err == 0;) {
      const uint64_t n = std::min(length - done, kBounceSize);
      char* p = static_cast<char*>(buf) + done;
      if (op == Op::Write) std::memcpy(bounce, p, n);
      err = run(volume, Work{op, flags, offset + done, n, bounce});
      if (err == 0 && op == Op::Read) std::memcpy(p, bounce, n);
      done += n;
    }
  }
  end(*this, work);
  return err;
}

}  // namespace shareblk::backend
