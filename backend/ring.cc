// The io_uring engine: one ring per thread, volume requests as small state machines.
#include <fcntl.h>
#include <liburing.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>

#include "backend/backend.h"
#include "backend/internal.h"

namespace shareblk::backend {

namespace {

// IoRequest stages: the operation itself, then (write-zeroes only) writing zero bytes where
// fallocate could not, then (FUA on trim/zero) a data sync.
enum Stage : uint8_t { kMain = 0, kZeroFill = 1, kSync = 2 };

// Registered-buffer slots per ring. A worker's pool keeps about 2,000 small buffers at most;
// the ones past the table's end work unregistered.
constexpr unsigned kBufferSlots = 4096;

}  // namespace

Ring::Ring(unsigned entries, std::error_code& ec) : ring_(std::make_unique<io_uring>()) {
  // Newest flags first: one submitting thread, completions run when we wait (fewer
  // interrupts). Older kernels refuse them with EINVAL; fall back step by step.
  const unsigned flag_sets[] = {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
                                IORING_SETUP_COOP_TASKRUN, 0};
  int rc = -EINVAL;
  for (unsigned flags : flag_sets) {
    io_uring_params params{};
    params.flags = flags | IORING_SETUP_CQSIZE;
    params.cq_entries = entries * 4;
    rc = io_uring_queue_init_params(entries, ring_.get(), &params);
    if (rc != -EINVAL) break;
  }
  if (rc < 0) {
    ec.assign(-rc, std::generic_category());
    ring_.reset();
    return;
  }
  // A sparse table (Linux 5.19+) is filled buffer by buffer; without one, nothing registers.
  if (io_uring_register_buffers_sparse(ring_.get(), kBufferSlots) == 0) {
    free_buffer_slots_.reserve(kBufferSlots);
    for (unsigned i = kBufferSlots; i > 0; --i)
      free_buffer_slots_.push_back(static_cast<int>(i - 1));
  }
}

int Ring::register_buffer(void* buf, size_t length) {
  if (free_buffer_slots_.empty()) return -1;
  const int index = free_buffer_slots_.back();
  iovec iov{buf, length};
  const __u64 tag = 0;
  if (io_uring_register_buffers_update_tag(ring_.get(), static_cast<unsigned>(index), &iov, &tag,
                                           1) != 1) {
    return -1;  // e.g. ENOMEM past RLIMIT_MEMLOCK; the next buffer may be smaller and fit
  }
  free_buffer_slots_.pop_back();
  return index;
}

void Ring::unregister_buffer(int index) {
  if (index < 0) return;
  // An empty entry clears the slot; requests still using the old buffer keep it until done.
  iovec iov{nullptr, 0};
  const __u64 tag = 0;
  io_uring_register_buffers_update_tag(ring_.get(), static_cast<unsigned>(index), &iov, &tag, 1);
  free_buffer_slots_.push_back(index);
}

Ring::~Ring() {
  if (ring_) io_uring_queue_exit(ring_.get());
}

io_uring_sqe* Ring::next_sqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  while (sqe == nullptr) {  // the submission queue is full: hand it to the kernel
    io_uring_submit(ring_.get());
    sqe = io_uring_get_sqe(ring_.get());
  }
  return sqe;
}

void Ring::recv(int fd, void* buf, size_t length, Completion* done) {
  io_uring_sqe* sqe = next_sqe();
  io_uring_prep_recv(sqe, fd, buf, length, 0);
  io_uring_sqe_set_data(sqe, done);
}

void Ring::sendmsg(int fd, const msghdr* msg, Completion* done) {
  io_uring_sqe* sqe = next_sqe();
  io_uring_prep_sendmsg(sqe, fd, msg, MSG_NOSIGNAL);
  io_uring_sqe_set_data(sqe, done);
}

void Ring::read(int fd, void* buf, size_t length, Completion* done) {
  io_uring_sqe* sqe = next_sqe();
  io_uring_prep_read(sqe, fd, buf, static_cast<unsigned>(length), 0);
  io_uring_sqe_set_data(sqe, done);
}

void Ring::submit(const Handle& handle, IoRequest* request) {
  if (int err = handle.admit(request->op, request->offset, request->length)) {
    request->done(err);
    return;
  }
  if (request->length == 0 && request->op != Op::Flush) {  // nothing to move (fallocate and
    request->done(0);                                      // fadvise read 0 as "to EOF")
    return;
  }
  request->ring_ = this;
  request->handle_ = &handle;
  request->progress_ = 0;
  request->stage_ = kMain;
  start(request);
}

// Queues the next step of `r` according to its stage and progress. A step never crosses a
// segment seam of a mapped volume: locate() clamps it, and completion goes on from there.
void Ring::start(IoRequest* r) {
  const Volume& v = *r->handle_->volume();
  const uint64_t offset = r->offset + r->progress_;
  const uint32_t remaining = r->length - r->progress_;
  const bool sync = r->stage_ == kSync || (r->stage_ == kMain && r->op == Op::Flush);
  Volume::Location at{};
  char* data = r->buf + r->progress_;
  if (sync) {
    at.fd = v.device_fd(r->progress_);  // progress counts devices synced
  } else if (r->stage_ == kZeroFill) {
    data = const_cast<char*>(zero_buffer());
    at = v.locate(offset, std::min<uint32_t>(remaining, kZeroBufferSize), data);
  } else if (r->op == Op::Read || r->op == Op::Write) {
    at = v.locate(offset, remaining, data);
  } else {
    at = v.locate_buffered(offset, remaining);
  }
  if (at.fd < 0) {  // past the map: admission makes this unreachable, but never submit it
    r->done(EIO);
    return;
  }
  const auto length = static_cast<unsigned>(at.length);
  if (v.in_memory() && r->stage_ == kMain && (r->op == Op::Read || r->op == Op::Write)) {
    // See Volume::in_memory(): a copy here beats a hop to an io-wq thread and back (tmpfs
    // 4 KiB reads: that hop cost about half of the server's CPU per request).
    const iovec iov{data, length};
    const auto pos = static_cast<off_t>(at.offset);
    const ssize_t n = r->op == Op::Read
                          ? ::preadv2(at.fd, &iov, 1, pos, 0)
                          : ::pwritev2(at.fd, &iov, 1, pos, (r->flags & kFua) ? RWF_DSYNC : 0);
    r->complete(n < 0 ? -errno : static_cast<int>(n));
    return;
  }
  io_uring_sqe* sqe = next_sqe();
  io_uring_sqe_set_data(sqe, static_cast<Completion*>(r));
  if (sync) {
    io_uring_prep_fsync(sqe, at.fd, IORING_FSYNC_DATASYNC);
  } else if (r->stage_ == kZeroFill) {
    io_uring_prep_write(sqe, at.fd, data, length, at.offset);
  } else if (r->op == Op::Write) {
    if (r->buf_index >= 0) {
      io_uring_prep_write_fixed(sqe, at.fd, data, length, at.offset, r->buf_index);
    } else {
      io_uring_prep_write(sqe, at.fd, data, length, at.offset);
    }
    if (r->flags & kFua) sqe->rw_flags = RWF_DSYNC;
  } else if (r->op == Op::Read) {
    if (r->buf_index >= 0) {
      io_uring_prep_read_fixed(sqe, at.fd, data, length, at.offset, r->buf_index);
    } else {
      io_uring_prep_read(sqe, at.fd, data, length, at.offset);
    }
  } else if (r->op == Op::Cache) {
    io_uring_prep_fadvise(sqe, at.fd, at.offset, static_cast<off_t>(length), POSIX_FADV_WILLNEED);
  } else {  // Trim, WriteZeroes
    int mode = fallocate_mode(v, r->op, r->flags);
    if (mode & FALLOC_FL_PUNCH_HOLE) r->handle_->volume()->note_holes();
    r->chunk_ = length;
    io_uring_prep_fallocate(sqe, at.fd, mode, at.offset, length);
  }
}

void IoRequest::complete(int res) {
  Ring* ring = ring_;
  if (res == -EAGAIN || res == -EINTR) {  // nothing happened; try the same step again
    ring->start(this);
    return;
  }
  const Volume& v = *handle_->volume();
  const bool sync = stage_ == kSync || (stage_ == kMain && op == Op::Flush);
  if (res < 0) {
    if (stage_ == kMain && res == -EOPNOTSUPP && op == Op::WriteZeroes) {
      if (flags & kFastZero) return done(ENOTSUP);
      stage_ = kZeroFill;  // no fallocate here: write the zeroes, from where it stopped
      ring->start(this);
      return;
    }
    if (stage_ == kMain && res == -EOPNOTSUPP && op == Op::Trim) {
      res = 0;  // trim is a hint: a device that cannot discard ignores it
    } else {
      return done(-res);
    }
  }
  bool more = false;
  if (sync) {
    progress_ += 1;
    more = progress_ < v.device_count();
  } else if (op == Op::Cache) {
    more = false;  // a hint: the first piece is enough
  } else if (stage_ == kZeroFill || op == Op::Read || op == Op::Write) {
    if (res == 0) return done(EIO);           // end of file inside the volume: it shrank under us
    progress_ += static_cast<uint32_t>(res);  // a short transfer or a seam: go on from there
    more = progress_ < length;
  } else {  // Trim, WriteZeroes: fallocate does all of a piece or fails
    progress_ += chunk_;
    more = progress_ < length;
  }
  if (more) {
    ring->start(this);
    return;
  }
  if ((flags & kFua) && (op == Op::Trim || op == Op::WriteZeroes) && stage_ != kSync) {
    stage_ = kSync;
    progress_ = 0;
    ring->start(this);
    return;
  }
  done(0);
}

int Ring::run_once(int timeout_ms) {
  io_uring_cqe* cqe = nullptr;
  int rc;
  if (timeout_ms < 0) {
    rc = io_uring_submit_and_wait(ring_.get(), 1);
  } else {
    __kernel_timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
    rc = io_uring_submit_and_wait_timeout(ring_.get(), &cqe, 1, &ts, nullptr);
  }
  if (rc < 0 && rc != -ETIME && rc != -EINTR && rc != -EBUSY) return rc;
  int count = 0;
  // Completions may queue new operations (and free their objects), so read each CQE's
  // fields and mark it seen before calling out.
  while (io_uring_peek_cqe(ring_.get(), &cqe) == 0) {
    auto* done = static_cast<Completion*>(io_uring_cqe_get_data(cqe));
    int res = cqe->res;
    io_uring_cqe_seen(ring_.get(), cqe);
    if (done != nullptr) done->complete(res);
    ++count;
  }
  return count;
}

}  // namespace shareblk::backend
