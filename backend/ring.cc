// The io_uring engine: one ring per thread; a volume request's steps (dispatch.h) as SQEs.
#include <fcntl.h>
#include <liburing.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <iterator>
#include <memory>

#include "backend/backend.h"
#include "backend/dispatch.h"

namespace shareblk::backend {

namespace {

// Registered-buffer slots per ring. A worker's pool keeps about 2,000 small buffers at most;
// the ones past the table's end work unregistered.
constexpr unsigned kBufferSlots = 4096;

}  // namespace

// Reads a remote image's eventfd on the ring and hands what ended to its requests, on the
// ring's thread (RemoteImage). Lets the image go once its volume is gone.
class Ring::RemoteReaper final : public Completion {
 public:
  RemoteReaper(Ring& ring, std::shared_ptr<RemoteImage> image)
      : ring_(ring), image_(std::move(image)) {}
  const RemoteImage* image() const { return image_.get(); }
  void arm() { ring_.read(image_->event_fd(), &count_, sizeof count_, this); }

  void complete(int res) override {
    // Poll whatever the read says, even a failed one: the count only wakes us.
    RemoteImage::Completed done[64];
    size_t n = 0;
    while ((n = image_->poll(done, std::size(done))) > 0) {
      for (size_t i = 0; i < n; ++i) {
        ring_.finish_remote(static_cast<IoRequest*>(done[i].tag), done[i].err);
      }
    }
    if (image_->orphaned() || (res < 0 && res != -EAGAIN && res != -EINTR)) {
      ring_.drop_reaper(this);  // deletes this
      return;
    }
    arm();
  }

 private:
  Ring& ring_;
  std::shared_ptr<RemoteImage> image_;
  uint64_t count_ = 0;
};

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
    // COOP_TASKRUN came with POLL_FIRST (5.19); an older kernel refuses the flag it does not know.
    poll_first_ = flags != 0;
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
  if (ring_) io_uring_queue_exit(ring_.get());  // cancels the reapers' reads
  reapers_.clear();
}

io_uring_sqe* Ring::next_sqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  while (sqe == nullptr) {  // the submission queue is full: hand it to the kernel
    io_uring_submit(ring_.get());
    sqe = io_uring_get_sqe(ring_.get());
  }
  return sqe;
}

void Ring::recv(int fd, void* buf, size_t length, Completion* done, bool once_readable) {
  io_uring_sqe* sqe = next_sqe();
  io_uring_prep_recv(sqe, fd, buf, length, 0);
  if (once_readable && poll_first_) sqe->ioprio |= IORING_RECVSEND_POLL_FIRST;
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

namespace {
Work work_of(const IoRequest& r) {
  return Work{r.op, r.flags, r.offset, r.length, r.buf};
}

// Steps that are a copy between the request's buffer and the page cache which io_uring cannot
// do without blocking, and would hand to an io-wq thread: a hop there and back per step. Those
// that cannot wait for a device are cheaper run here, on the ring's thread:
//   - every read and write of a volume in memory (see Volume::in_memory(); tmpfs 4 KiB reads:
//     the hop cost about half of the server's CPU per request);
//   - whole-page writes without FUA to the page cache (--buffered). ext4 has no non-blocking
//     buffered write, so io_uring punts every one, and to a single io-wq thread per file
//     (writes to one inode are serialized there): with the hop, 4 KiB random writes took
//     1.5-2.2x the server's CPU and ran at 0.56-0.66x the speed (bench/PROFILE.md,
//     "Page-cache mode, 1 MiB sequential"). A partial page may have to be read from the disk
//     first, and FUA waits for it: those stay on io_uring.
//     What may still wait here is the kernel's dirty-page throttling while a writer outruns
//     the disk: on io-wq it held that file's writes, here it holds the worker's other
//     connections too (README, "The page cache").
// Page-cache reads stay on io_uring, which copies what is cached without a thread and waits
// for the rest without one. Large copies of either kind: see copies_on_io_wq().
bool copies_inline(const Volume& v, const Step& step) {
  if (!step.in_request_buffer) return false;
  if (v.in_memory()) return true;
  static const uint64_t page_mask = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)) - 1;
  return !v.is_direct() && step.call == Syscall::Write && step.mode == 0 &&
         ((step.offset | step.length) & page_mask) == 0;
}

// Large page-cache copies (--buffered, 256 KiB and more) that go to an io-wq thread at once,
// to run beside the ring's thread instead of in turn with its other work. Small ones stay
// where they are: the hop would cost more than the copy.
//   - Reads: the ring's thread meanwhile sends the replies before it; 1 MiB sequential reads
//     over TCP went 1.1-1.4x as fast (bench/PROFILE.md, "Page-cache 1 MiB reads with the
//     cache warm").
//   - Writes, when the frontend asks (IoRequest::copy_writes_beside): over a Unix socket the
//     worker receives a 1 MiB payload in many small pieces, as fast as the client's small
//     send buffer lets it, and is the slower side; with the copy beside it, 1 MiB writes
//     went 1.05-1.18x as fast. Over TCP the client is the slower side and the hop cost
//     0.81-0.87x (bench/PROFILE.md, "Page-cache 1 MiB writes over TCP").
bool copies_on_io_wq(const Volume& v, const Step& step, const IoRequest& r) {
  if (v.is_direct() || v.in_memory() || step.length < (256U << 10)) return false;
  return step.call == Syscall::Read || (step.call == Syscall::Write && r.copy_writes_beside);
}
}  // namespace

void Ring::submit(const Handle& handle, IoRequest* request) {
  const int started = begin(handle, work_of(*request), request->cursor_);
  if (started != kMoreSteps) {
    request->done(started);
    return;
  }
  request->ring_ = this;
  request->handle_ = &handle;
  if (handle.volume()->remote()) {
    start_remote(request);
  } else {
    start(request);
  }
}

bool Ring::reap(const std::shared_ptr<RemoteImage>& image) {
  for (const auto& r : reapers_) {
    if (r->image() == image.get()) return true;
  }
  if (image->orphaned()) return false;
  reapers_.push_back(std::make_unique<RemoteReaper>(*this, image));
  reapers_.back()->arm();
  return true;
}

void Ring::drop_reaper(const RemoteReaper* reaper) {
  auto it = std::find_if(reapers_.begin(), reapers_.end(),
                         [reaper](const auto& r) { return r.get() == reaper; });
  if (it != reapers_.end()) reapers_.erase(it);
}

void Ring::start_remote(IoRequest* r) {
  // A hint with nothing to warm, and a flush with nothing to wait for: the store acknowledged
  // each write once it was durable (RemoteImage).
  if (r->op == Op::Cache || r->op == Op::Flush) {
    finish_remote(r, 0);
    return;
  }
  const std::shared_ptr<RemoteImage>& image = r->handle_->volume()->remote();
  int err = reap(image) ? 0 : EIO;
  if (err == 0) err = image->start(r->op, r->flags, r->offset, r->length, r->buf, r);
  if (err != 0) finish_remote(r, err);
}

void Ring::finish_remote(IoRequest* r, int err) {
  end(*r->handle_, work_of(*r));
  r->done(err);
}

// Queues the next step of `r` (dispatch.h says which).
void Ring::start(IoRequest* r) {
  Volume& v = *r->handle_->volume();
  Step step{};
  if (int err = next_step(v, work_of(*r), r->cursor_, step)) {
    end(*r->handle_, work_of(*r));
    r->done(err);
    return;
  }
  const auto length = static_cast<unsigned>(step.length);  // a request is at most 4 GiB
  const bool beside = copies_on_io_wq(v, step, *r);
  if (!beside && copies_inline(v, step)) {
    const iovec iov{step.data, length};
    const auto pos = static_cast<off_t>(step.offset);
    const ssize_t n = step.call == Syscall::Read ? ::preadv2(step.fd, &iov, 1, pos, 0)
                                                 : ::pwritev2(step.fd, &iov, 1, pos, step.mode);
    r->complete(n < 0 ? -errno : static_cast<int>(n));
    return;
  }
  io_uring_sqe* sqe = next_sqe();
  const bool fixed = step.in_request_buffer && r->buf_index >= 0;
  switch (step.call) {
    case Syscall::Read:
      if (fixed) {
        io_uring_prep_read_fixed(sqe, step.fd, step.data, length, step.offset, r->buf_index);
      } else {
        io_uring_prep_read(sqe, step.fd, step.data, length, step.offset);
      }
      if (beside) sqe->flags |= IOSQE_ASYNC;
      break;
    case Syscall::Write:
      if (fixed) {
        io_uring_prep_write_fixed(sqe, step.fd, step.data, length, step.offset, r->buf_index);
      } else {
        io_uring_prep_write(sqe, step.fd, step.data, length, step.offset);
      }
      sqe->rw_flags = step.mode;
      if (beside) sqe->flags |= IOSQE_ASYNC;
      break;
    case Syscall::Fallocate:
      io_uring_prep_fallocate(sqe, step.fd, step.mode, step.offset, step.length);
      break;
    case Syscall::Fdatasync:
      io_uring_prep_fsync(sqe, step.fd, IORING_FSYNC_DATASYNC);
      break;
    case Syscall::Fadvise:
      io_uring_prep_fadvise(sqe, step.fd, step.offset, static_cast<off_t>(length),
                            POSIX_FADV_WILLNEED);
      break;
  }
  io_uring_sqe_set_data(sqe, static_cast<Completion*>(r));
}

void IoRequest::complete(int res) {
  const int result = advance(*handle_->volume(), work_of(*this), cursor_, res);
  if (result == kMoreSteps) {
    ring_->start(this);
  } else {
    end(*handle_, work_of(*this));
    done(result);
  }
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
