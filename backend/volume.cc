// Opening volumes, the admission rule, allocation status, and synchronous I/O.
#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "backend/backend.h"
#include "backend/internal.h"

namespace shareblk::backend {

namespace {

int open_fd(const std::string& path, int extra, bool& writable) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | extra);
  if (fd < 0 && (errno == EACCES || errno == EROFS || errno == EPERM)) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | extra);
    if (fd >= 0) writable = false;
  }
  return fd;
}

bool read_rotational(dev_t rdev) {
  std::ifstream f("/sys/dev/block/" + std::to_string(major(rdev)) + ":" +
                  std::to_string(minor(rdev)) + "/queue/rotational");
  int v = 0;
  return (f >> v) && v == 1;
}

}  // namespace

std::shared_ptr<Volume> Volume::open(const std::string& path, std::error_code& ec,
                                     OpenOptions options) {
  std::shared_ptr<Volume> v(new Volume());
  v->path_ = path;
  bool writable = true;
  v->buffered_fd_ = open_fd(path, 0, writable);
  if (v->buffered_fd_ < 0) {
    ec.assign(errno, std::generic_category());
    return nullptr;
  }
  v->writable_ = writable;
  struct stat st {};
  if (::fstat(v->buffered_fd_, &st) != 0) {
    ec.assign(errno, std::generic_category());
    return nullptr;
  }
  if (S_ISBLK(st.st_mode)) {
    uint64_t bytes = 0;
    int lbs = 512;
    if (::ioctl(v->buffered_fd_, BLKGETSIZE64, &bytes) != 0 ||
        ::ioctl(v->buffered_fd_, BLKSSZGET, &lbs) != 0) {
      ec.assign(errno, std::generic_category());
      return nullptr;
    }
    v->block_device_ = true;
    v->size_ = bytes;
    v->direct_align_ = static_cast<uint32_t>(std::max(lbs, 512));
    v->rotational_ = read_rotational(st.st_rdev);
    v->may_have_holes_ = false;
  } else if (S_ISREG(st.st_mode)) {
    v->size_ = static_cast<uint64_t>(st.st_size);
    struct statx sx {};
    if (::statx(v->buffered_fd_, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align != 0) {
      v->direct_align_ = std::max({sx.stx_dio_offset_align, sx.stx_dio_mem_align, 512u});
    }
    off_t hole = ::lseek(v->buffered_fd_, 0, SEEK_HOLE);
    v->may_have_holes_ = hole < 0 || static_cast<uint64_t>(hole) < v->size();
  } else {
    ec = std::make_error_code(std::errc::invalid_argument);
    return nullptr;
  }

  v->direct_fd_ = v->buffered_fd_;
  if (options.direct) {
    bool direct_writable = true;
    int fd = open_fd(path, O_DIRECT, direct_writable);
    if (fd >= 0) {
      v->direct_fd_ = fd;
      v->direct_ = true;
    } else if (errno != EINVAL) {  // EINVAL: the file system has no O_DIRECT (tmpfs)
      ec.assign(errno, std::generic_category());
      return nullptr;
    }
  }
  return v;
}

Volume::~Volume() {
  if (direct_fd_ >= 0 && direct_fd_ != buffered_fd_) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
}

int Volume::refresh_size() {
  uint64_t bytes = 0;
  if (block_device_) {
    if (::ioctl(buffered_fd_, BLKGETSIZE64, &bytes) != 0) return errno;
  } else {
    struct stat st {};
    if (::fstat(buffered_fd_, &st) != 0) return errno;
    bytes = static_cast<uint64_t>(st.st_size);
  }
  size_.store(bytes, std::memory_order_release);
  return 0;
}

int Volume::fd_for(uint64_t offset, uint64_t length, const void* buf) const {
  const uint64_t mask = direct_align_ - 1;
  if (direct_ && ((offset | length | reinterpret_cast<uintptr_t>(buf)) & mask) == 0) {
    return direct_fd_;
  }
  return buffered_fd_;
}

int Handle::admit(Op op, uint64_t offset, uint64_t length) const {
  if (!volume_) return EINVAL;
  const uint64_t size = volume_->size();
  const bool in_range = offset <= size && length <= size - offset;
  switch (op) {
    case Op::Write:
    case Op::WriteZeroes:
      if (mode_ == AttachMode::ReadOnly || !volume_->writable()) return EPERM;
      return in_range ? 0 : ENOSPC;
    case Op::Trim:
      if (mode_ == AttachMode::ReadOnly || !volume_->writable()) return EPERM;
      return in_range ? 0 : EINVAL;
    case Op::Read:
    case Op::Cache:
      return in_range ? 0 : EINVAL;
    case Op::Flush:
      return 0;
  }
  return EINVAL;
}

int Handle::extents(uint64_t offset, uint64_t length, size_t max_extents,
                    std::vector<Extent>& out) const {
  out.clear();
  if (int err = admit(Op::Read, offset, length)) return err;
  const uint64_t end = offset + length;
  if (length == 0 || max_extents == 0) return 0;
  if (!volume_->may_have_holes()) {
    out.push_back({length, false});
    return 0;
  }
  const int fd = volume_->buffered_fd();
  uint64_t pos = offset;
  while (pos < end && out.size() < max_extents) {
    off_t data = ::lseek(fd, static_cast<off_t>(pos), SEEK_DATA);
    if (data < 0) {
      // ENXIO: no data from pos to EOF. Anything else: say "data", which is always safe.
      out.push_back({end - pos, errno == ENXIO});
      break;
    }
    if (static_cast<uint64_t>(data) > pos) {
      uint64_t stop = std::min<uint64_t>(static_cast<uint64_t>(data), end);
      out.push_back({stop - pos, true});
      pos = stop;
      continue;
    }
    off_t hole = ::lseek(fd, static_cast<off_t>(pos), SEEK_HOLE);
    uint64_t stop = hole < 0 ? end : std::min<uint64_t>(static_cast<uint64_t>(hole), end);
    if (stop <= pos) stop = end;  // defensive: never loop without progress
    out.push_back({stop - pos, false});
    pos = stop;
  }
  return 0;
}

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

int Handle::read(void* buf, uint64_t length, uint64_t offset) const {
  if (int err = admit(Op::Read, offset, length)) return err;
  auto* p = static_cast<char*>(buf);
  uint64_t done = 0;
  while (done < length) {
    int fd = volume_->fd_for(offset + done, length - done, p + done);
    ssize_t n = ::pread(fd, p + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;  // the file shrank under us
    done += static_cast<uint64_t>(n);
  }
  return 0;
}

namespace {
int write_all(const Volume& v, const char* p, uint64_t length, uint64_t offset, int rwflags) {
  uint64_t done = 0;
  while (done < length) {
    iovec iov{const_cast<char*>(p + done), length - done};
    int fd = v.fd_for(offset + done, length - done, p + done);
    ssize_t n = ::pwritev2(fd, &iov, 1, static_cast<off_t>(offset + done), rwflags);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    done += static_cast<uint64_t>(n);
  }
  return 0;
}

int write_zero_bytes(const Volume& v, uint64_t length, uint64_t offset) {
  const char* zeroes = zero_buffer();
  for (uint64_t done = 0; done < length;) {
    uint64_t n = std::min<uint64_t>(length - done, kZeroBufferSize);
    if (int err = write_all(v, zeroes, n, offset + done, 0)) return err;
    done += n;
  }
  return 0;
}
}  // namespace

int Handle::write(const void* buf, uint64_t length, uint64_t offset, uint32_t flags) const {
  if (int err = admit(Op::Write, offset, length)) return err;
  return write_all(*volume_, static_cast<const char*>(buf), length, offset,
                   (flags & kFua) ? RWF_DSYNC : 0);
}

int Handle::flush() const {
  if (int err = admit(Op::Flush, 0, 0)) return err;
  return ::fdatasync(volume_->buffered_fd()) == 0 ? 0 : errno;
}

int Handle::trim(uint64_t length, uint64_t offset, uint32_t flags) const {
  if (int err = admit(Op::Trim, offset, length)) return err;
  if (length == 0) return 0;
  volume_->note_holes();
  int mode = fallocate_mode(*volume_, Op::Trim, flags);
  if (::fallocate(volume_->buffered_fd(), mode, static_cast<off_t>(offset),
                  static_cast<off_t>(length)) != 0 &&
      errno != EOPNOTSUPP) {  // trim is a hint: a device that cannot discard ignores it
    return errno;
  }
  return (flags & kFua) ? flush() : 0;
}

int Handle::write_zeroes(uint64_t length, uint64_t offset, uint32_t flags) const {
  if (int err = admit(Op::WriteZeroes, offset, length)) return err;
  if (length == 0) return 0;
  int mode = fallocate_mode(*volume_, Op::WriteZeroes, flags);
  if (mode & FALLOC_FL_PUNCH_HOLE) volume_->note_holes();
  if (::fallocate(volume_->buffered_fd(), mode, static_cast<off_t>(offset),
                  static_cast<off_t>(length)) != 0) {
    if (errno != EOPNOTSUPP) return errno;
    if (flags & kFastZero) return ENOTSUP;
    if (int err = write_zero_bytes(*volume_, length, offset)) return err;
  }
  return (flags & kFua) ? flush() : 0;
}

}  // namespace shareblk::backend
