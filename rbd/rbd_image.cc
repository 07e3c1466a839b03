// One open RBD image: requests as librbd's asynchronous calls, their ends told through an
// eventfd (rbd_set_image_notification) and collected by the ring's thread with
// rbd_poll_io_events; the synchronous engine's calls; allocation from rbd_diff_iterate2.
#include "rbd/rbd_image.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>

namespace shareblk::rbd {

using backend::Op;

Cluster::~Cluster() {
  if (io) rados_ioctx_destroy(io);
  if (rados) rados_shutdown(rados);
}

void Cluster::note(int rc) {
  // ESHUTDOWN is librados' EBLOCKLISTED.
  if (rc == -ESHUTDOWN && on_fenced && !fenced.exchange(true)) on_fenced();
}

int to_errno(int rc) {
  const int err = -rc;
  // ESHUTDOWN is librados' EBLOCKLISTED.
  if (err == ETIMEDOUT || err == ESHUTDOWN || err <= 0) return EIO;
  return err;
}

int RbdImage::open(std::shared_ptr<Cluster> cluster, const std::string& name,
                   std::shared_ptr<RbdImage>& out) {
  std::shared_ptr<RbdImage> image(new RbdImage());
  image->cluster_ = std::move(cluster);
  // Blocking on our side: only the ring's read of it waits, and librbd only writes it.
  image->event_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (image->event_fd_ < 0) return errno;
  if (int rc = rbd_open(image->cluster_->io, name.c_str(), &image->image_, nullptr); rc < 0) {
    image->image_ = nullptr;
    return -rc;
  }
  if (int rc = rbd_set_image_notification(image->image_, image->event_fd_, EVENT_TYPE_EVENTFD);
      rc < 0) {
    return -rc;
  }
  out = std::move(image);
  return 0;
}

RbdImage::~RbdImage() {
  if (image_) rbd_close(image_);
  if (event_fd_ >= 0) ::close(event_fd_);
}

int RbdImage::start(Op op, uint32_t flags, uint64_t offset, uint64_t length, char* buf, void* tag) {
  // A fast zero that must also allocate would write every byte: not fast (NBD_CMD_FLAG_FAST_ZERO).
  if (op == Op::WriteZeroes && (flags & backend::kFastZero) && (flags & backend::kNoHole)) {
    return ENOTSUP;
  }
  rbd_completion_t c = nullptr;
  // No callback: the end is told through the image's eventfd and collected by poll().
  if (int rc = rbd_aio_create_completion(tag, nullptr, &c); rc < 0) return -rc;
  int rc = 0;
  const auto len = static_cast<size_t>(length);
  switch (op) {
    case Op::Read:
      rc = rbd_aio_read(image_, offset, len, buf, c);
      break;
    case Op::Write:
      rc = rbd_aio_write(image_, offset, len, buf, c);
      break;
    case Op::Trim:
      rc = rbd_aio_discard(image_, offset, length, c);
      break;
    case Op::WriteZeroes:
      rc = rbd_aio_write_zeroes(
          image_, offset, len, c,
          (flags & backend::kNoHole) ? RBD_WRITE_ZEROES_FLAG_THICK_PROVISION : 0, 0);
      break;
    case Op::Flush:  // the engines answer these themselves (backend.h, RemoteImage)
    case Op::Cache:
      rc = -EINVAL;
      break;
  }
  if (rc < 0) {
    rbd_aio_release(c);
    return failed(rc);
  }
  return 0;
}

int RbdImage::failed(int rc) const {
  cluster_->note(rc);
  return to_errno(rc);
}

size_t RbdImage::poll(Completed* out, size_t max) {
  constexpr size_t kBatch = 64;
  rbd_completion_t ended[kBatch];
  const int n = rbd_poll_io_events(image_, ended, static_cast<int>(std::min(max, kBatch)));
  if (n <= 0) return 0;
  for (int i = 0; i < n; ++i) {
    const ssize_t rc = rbd_aio_get_return_value(ended[i]);
    out[i] = Completed{rbd_aio_get_arg(ended[i]), rc < 0 ? failed(static_cast<int>(rc)) : 0};
    rbd_aio_release(ended[i]);
  }
  return static_cast<size_t>(n);
}

void RbdImage::orphan() {
  orphaned_.store(true, std::memory_order_release);
  ::eventfd_write(event_fd_, 1);
}

int RbdImage::execute(Op op, uint32_t flags, uint64_t offset, uint64_t length, char* buf) {
  const auto len = static_cast<size_t>(length);
  int64_t rc = 0;
  switch (op) {
    case Op::Read:
      rc = rbd_read(image_, offset, len, buf);
      break;
    case Op::Write:
      rc = rbd_write(image_, offset, len, buf);
      break;
    case Op::Flush:  // every write was acknowledged once durable (backend.h, RemoteImage)
    case Op::Cache:
      return 0;
    case Op::Trim:
      rc = rbd_discard(image_, offset, length);
      break;
    case Op::WriteZeroes:
      if ((flags & backend::kFastZero) && (flags & backend::kNoHole)) return ENOTSUP;
      rc = rbd_write_zeroes(image_, offset, len,
                            (flags & backend::kNoHole) ? RBD_WRITE_ZEROES_FLAG_THICK_PROVISION : 0,
                            0);
      break;
  }
  if (rc < 0) return failed(static_cast<int>(rc));
  // A read or write moves all of it or fails; anything short would be a librbd bug.
  if ((op == Op::Read || op == Op::Write) && static_cast<uint64_t>(rc) != length) return EIO;
  return 0;
}

namespace {

struct ExtentWalk {
  uint64_t pos;  // the next byte not yet described
  size_t max;
  std::vector<backend::Extent>* out;

  void add(uint64_t length, bool hole) {
    if (length == 0) return;
    if (!out->empty() && out->back().hole == hole) {
      out->back().length += length;
    } else {
      out->push_back({length, hole});
    }
    pos += length;
  }
};

// rbd_diff_iterate2 tells the changed extents of [offset, offset+length) against the image's
// creation: `exists` is data, else a discarded range; what it does not mention was never
// written, so reads as zeroes too.
int on_extent(uint64_t offset, size_t length, int exists, void* arg) {
  auto* walk = static_cast<ExtentWalk*>(arg);
  if (offset > walk->pos) walk->add(offset - walk->pos, true);
  if (offset + length <= walk->pos) return 0;  // already covered
  const uint64_t from = std::max<uint64_t>(offset, walk->pos);
  walk->add(offset + length - from, exists == 0);
  // Stop early once the list is full; one more extent than asked may merge into the last.
  return walk->out->size() > walk->max ? -ECANCELED : 0;
}

}  // namespace

int RbdImage::extents(uint64_t offset, uint64_t length, size_t max_extents,
                      std::vector<backend::Extent>& out) {
  out.clear();
  ExtentWalk walk{offset, max_extents, &out};
  // whole_object: with the fast-diff object map this is answered from memory; without it
  // librbd asks the OSDs which objects exist, which is still one request per object.
  const int rc = rbd_diff_iterate2(image_, nullptr, offset, length, 1, 1, on_extent, &walk);
  if (rc < 0 && rc != -ECANCELED) {
    out.clear();  // "all data" is always a true answer
    out.push_back({length, false});
    return 0;
  }
  if (walk.pos < offset + length && out.size() <= max_extents) {
    walk.add(offset + length - walk.pos, true);
  }
  // Whole objects may reach past the range asked about.
  uint64_t covered = 0;
  size_t keep = 0;
  for (; keep < out.size() && keep < max_extents && covered < length; ++keep) {
    out[keep].length = std::min(out[keep].length, length - covered);
    covered += out[keep].length;
  }
  out.resize(keep);
  return 0;
}

int RbdImage::size(uint64_t& out) {
  const int rc = rbd_get_size(image_, &out);
  return rc < 0 ? failed(rc) : 0;
}

// The image's exclusive lock, taken by hand: librbd then keeps it, and refuses the requests
// of other clients for it (EROFS), where it would otherwise pass it to any client that writes.
// Asking librbd for a lock that another client holds would have it break the lock itself
// once that client's watch has timed out (a hung gateway): a fence that only a takeover may
// decide. So a lock held elsewhere is not asked for.
int RbdImage::claim_writer() {
  std::vector<std::string> owners;
  if (int rc = owners_elsewhere(owners); rc < 0) return failed(rc);
  if (!owners.empty()) return EBUSY;
  const int rc = rbd_lock_acquire(image_, RBD_LOCK_MODE_EXCLUSIVE);
  if (rc == -EROFS || rc == -EBUSY) return EBUSY;  // another client holds it by hand
  return rc < 0 ? -rc : 0;                         // EINVAL: the image has no exclusive-lock
}

int RbdImage::holders(std::vector<std::string>& out) {
  out.clear();
  rbd_lock_mode_t mode{};
  std::array<char*, 4> owners{};
  size_t count = owners.size();
  const int rc = rbd_lock_get_owners(image_, &mode, owners.data(), &count);
  if (rc == -ENOENT) return 0;  // nobody holds it
  if (rc < 0) return rc;
  out.assign(owners.begin(), owners.begin() + static_cast<std::ptrdiff_t>(count));
  rbd_lock_get_owners_cleanup(owners.data(), count);
  return 0;
}

int RbdImage::owners_elsewhere(std::vector<std::string>& out) {
  out.clear();
  int owner = 0;
  if (int rc = rbd_is_exclusive_lock_owner(image_, &owner); rc < 0) return rc;
  return owner != 0 ? 0 : holders(out);
}

// rbd_lock_break with rbd_blocklist_on_break_lock (forced on by the store) follows Ceph's
// order (doc/rbd/rbd-exclusive-locks.rst): the holder's client instance is blocklisted, the
// OSD map carrying that is awaited, and only then is its lock removed. From then on the OSDs
// refuse every request of the old holder, including those it sent before and those a hung
// process sends when it resumes.
int RbdImage::fence_writer(std::string& fenced, const std::string& only) {
  std::vector<std::string> owners;
  if (int rc = owners_elsewhere(owners); rc < 0) return failed(rc);
  if (!only.empty() && !owners.empty() && owners != std::vector<std::string>{only}) return EBUSY;
  // rbd_lock_break refuses (EBUSY) when the lock has changed hands since it was read.
  for (const std::string& owner : owners) {
    const int rc = rbd_lock_break(image_, RBD_LOCK_MODE_EXCLUSIVE, owner.c_str());
    if (rc < 0 && rc != -ENOENT) return failed(rc);  // not fenced: no write access here
    fenced += (fenced.empty() ? "" : ", ") + owner;
  }
  return claim_writer();
}

int RbdImage::lock_owner(std::string& out) {
  out.clear();
  int owner = 0;
  if (int rc = rbd_is_exclusive_lock_owner(image_, &owner); rc < 0) return failed(rc);
  if (owner == 0) return 0;
  std::vector<std::string> all;
  if (int rc = holders(all); rc < 0) return failed(rc);
  if (!all.empty()) out = all.front();
  return 0;
}

void RbdImage::release_writer() {
  int owner = 0;
  if (rbd_is_exclusive_lock_owner(image_, &owner) == 0 && owner != 0) rbd_lock_release(image_);
}

}  // namespace shareblk::rbd
