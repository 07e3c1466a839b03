// Opening volumes, the capability and admission rules, and allocation status.
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>

#include "backend/backend.h"

namespace shareblk::backend {

namespace {

// Read-write where allowed, else read-only. Sets errno on failure, as open(2) does.
int open_fd(const DeviceOpener& opener, const std::string& path, int extra, bool& writable) {
  const auto open_one = [&](int flags) {
    if (!opener) return ::open(path.c_str(), flags);
    const int fd = opener(path, flags);
    if (fd < 0) errno = -fd;
    return fd < 0 ? -1 : fd;
  };
  int fd = open_one(O_RDWR | O_CLOEXEC | extra);
  if (fd < 0 && (errno == EACCES || errno == EROFS || errno == EPERM)) {
    fd = open_one(O_RDONLY | O_CLOEXEC | extra);
    if (fd >= 0) writable = false;
  }
  return fd;
}

// A regular file on tmpfs or ramfs: the page cache is the only copy of its bytes. Only a
// regular file: a device node sits on devtmpfs, which statfs also reports as tmpfs.
bool in_memory_file(const std::string& path) {
  struct stat st {};
  struct statfs fs {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (::statfs(path.c_str(), &fs) != 0) return false;
  return fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC;
}

bool read_rotational(dev_t rdev) {
  std::ifstream f("/sys/dev/block/" + std::to_string(major(rdev)) + ":" +
                  std::to_string(minor(rdev)) + "/queue/rotational");
  int v = 0;
  return (f >> v) && v == 1;
}

}  // namespace

// Opens `path` for I/O (buffered, and O_DIRECT when asked and possible) as device `index`.
int Volume::add_device(const std::string& path, bool direct, uint32_t& index) {
  const size_t n = device_count_.load(std::memory_order_relaxed);
  if (n == kMaxDevices) return EMFILE;
  Device& d = devices_[n];
  bool writable = true;
  d.path = path;
  d.buffered_fd = open_fd(open_device_, path, 0, writable);
  if (d.buffered_fd < 0) return errno;
  writable_ = writable_ && writable;
  d.direct_fd = d.buffered_fd;
  if (direct) {
    bool direct_writable = true;
    int fd = open_fd(open_device_, path, O_DIRECT, direct_writable);
    if (fd >= 0) {
      d.direct_fd = fd;
    } else if (errno != EINVAL) {  // EINVAL: the file system has no O_DIRECT (tmpfs)
      int err = errno;
      ::close(d.buffered_fd);
      return err;
    }
  }
  index = static_cast<uint32_t>(n);
  device_count_.store(n + 1, std::memory_order_release);
  return 0;
}

std::shared_ptr<Volume> Volume::open(const std::string& path, std::error_code& ec,
                                     const OpenOptions& options) {
  std::shared_ptr<Volume> v(new Volume());
  v->path_ = path;
  v->open_device_ = options.open_device;
  v->in_memory_ = !options.open_device && in_memory_file(path);
  uint32_t index = 0;
  if (int err = v->add_device(path, options.direct && !v->in_memory_, index)) {
    ec.assign(err, std::generic_category());
    return nullptr;
  }
  const Device& d = v->devices_[0];
  v->direct_ = d.direct_fd != d.buffered_fd;
  struct stat st {};
  if (::fstat(d.buffered_fd, &st) != 0) {
    ec.assign(errno, std::generic_category());
    return nullptr;
  }
  if (S_ISBLK(st.st_mode)) {
    uint64_t bytes = 0;
    int lbs = 512;
    if (::ioctl(d.buffered_fd, BLKGETSIZE64, &bytes) != 0 ||
        ::ioctl(d.buffered_fd, BLKSSZGET, &lbs) != 0) {
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
    if (::statx(d.buffered_fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align != 0) {
      v->direct_align_ = std::max({sx.stx_dio_offset_align, sx.stx_dio_mem_align, 512u});
    }
    off_t hole = ::lseek(d.buffered_fd, 0, SEEK_HOLE);
    v->may_have_holes_ = hole < 0 || static_cast<uint64_t>(hole) < v->size();
  } else {
    ec = std::make_error_code(std::errc::invalid_argument);
    return nullptr;
  }
  return v;
}

std::shared_ptr<Volume> Volume::open_mapped(const std::vector<MappedSegment>& segments,
                                            std::error_code& ec, const OpenOptions& options) {
  std::shared_ptr<Volume> v(new Volume());
  v->mapped_ = true;
  v->open_device_ = options.open_device;
  v->block_device_ = true;
  v->may_have_holes_ = false;
  v->direct_ = options.direct;
  v->direct_align_ = 512;
  v->path_ = segments.empty() ? std::string() : segments.front().path;
  if (int err = v->remap(segments)) {
    ec.assign(err, std::generic_category());
    return nullptr;
  }
  return v;
}

int Volume::remap(const std::vector<MappedSegment>& segments) {
  if (!mapped_) return EINVAL;
  size_t count = segment_count_.load(std::memory_order_relaxed);
  if (segments.size() < count || segments.size() > kMaxSegments) return EINVAL;
  uint64_t start = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const MappedSegment& m = segments[i];
    // Existing segments must stay where they are; only the last may grow in place.
    if (i < count) {
      const Segment& old = segments_[i];
      const uint64_t old_length = old.length.load(std::memory_order_relaxed);
      if (devices_[old.device].path != m.path || old.device_offset != m.offset ||
          old.start != start || m.length < old_length ||
          (i + 1 < count && m.length != old_length)) {
        return EINVAL;
      }
      if (m.length != old_length) segments_[i].length.store(m.length, std::memory_order_relaxed);
    } else {
      uint32_t device = UINT32_MAX;
      for (size_t d = 0; d < device_count(); ++d) {
        if (devices_[d].path == m.path) device = static_cast<uint32_t>(d);
      }
      if (device == UINT32_MAX) {
        if (int err = add_device(m.path, direct_, device)) return err;
        int lbs = 512;
        if (::ioctl(devices_[device].buffered_fd, BLKSSZGET, &lbs) == 0) {
          direct_align_ = std::max<uint32_t>(direct_align_, static_cast<uint32_t>(lbs));
        }
      }
      Segment& seg = segments_[i];
      seg.start = start;
      seg.device_offset = m.offset;
      seg.device = device;
      seg.length.store(m.length, std::memory_order_relaxed);
    }
    start += m.length;
  }
  segment_count_.store(segments.size(), std::memory_order_release);
  size_.store(start, std::memory_order_release);
  return 0;
}

std::shared_ptr<Volume> Volume::open_remote(std::shared_ptr<RemoteImage> image,
                                            const std::string& name, uint64_t size) {
  std::shared_ptr<Volume> v(new Volume());
  v->path_ = name;
  v->writable_ = image->writable();
  v->may_have_holes_ = false;  // reads never scan for holes: extents() asks the store
  v->size_ = size;
  v->remote_ = std::move(image);
  return v;
}

unsigned Volume::home_worker(unsigned worker) {
  if (!remote_) return worker;
  int home = -1;
  if (home_worker_.compare_exchange_strong(home, static_cast<int>(worker))) return worker;
  return static_cast<unsigned>(home);
}

Volume::~Volume() {
  // No request is left (each holds the volume through its Handle): the ring reading the
  // image's eventfd may let it go.
  if (remote_) remote_->orphan();
  for (size_t i = 0; i < device_count(); ++i) {
    Device& d = devices_[i];
    if (d.direct_fd >= 0 && d.direct_fd != d.buffered_fd) ::close(d.direct_fd);
    if (d.buffered_fd >= 0) ::close(d.buffered_fd);
  }
}

int Volume::refresh_size() {
  if (remote_) {
    uint64_t bytes = 0;
    if (int err = remote_->size(bytes)) return err;
    size_.store(bytes, std::memory_order_release);
    return 0;
  }
  if (mapped_) return 0;  // a map grows through remap()
  const int fd = devices_[0].buffered_fd;
  uint64_t bytes = 0;
  if (block_device_) {
    if (::ioctl(fd, BLKGETSIZE64, &bytes) != 0) return errno;
  } else {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return errno;
    bytes = static_cast<uint64_t>(st.st_size);
  }
  size_.store(bytes, std::memory_order_release);
  return 0;
}

std::vector<MappedSegment> Volume::layout() const {
  if (remote_) return {};
  if (!mapped_) return {{path_, 0, size()}};
  std::vector<MappedSegment> out;
  const size_t count = segment_count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < count; ++i) {
    const Segment& seg = segments_[i];
    out.push_back(
        {devices_[seg.device].path, seg.device_offset, seg.length.load(std::memory_order_relaxed)});
  }
  return out;
}

Volume::Location Volume::locate(uint64_t offset, uint64_t length, const void* buf) const {
  uint64_t at = offset;
  const Device* device = &devices_[0];
  if (mapped_) {
    // Segments are sorted by start: find the last one starting at or before `offset`.
    const size_t count = segment_count_.load(std::memory_order_acquire);
    size_t lo = 0;
    size_t hi = count;
    while (hi - lo > 1) {
      size_t mid = (lo + hi) / 2;
      if (segments_[mid].start <= offset) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    if (count == 0) return {-1, 0, 0};
    const Segment& seg = segments_[lo];
    const uint64_t seg_length = seg.length.load(std::memory_order_relaxed);
    if (offset < seg.start || offset - seg.start >= seg_length) return {-1, 0, 0};
    length = std::min(length, seg.start + seg_length - offset);
    at = seg.device_offset + (offset - seg.start);
    device = &devices_[seg.device];
  }
  const uint64_t mask = direct_align_ - 1;
  const bool aligned =
      buf != nullptr && direct_ && ((at | length | reinterpret_cast<uintptr_t>(buf)) & mask) == 0;
  return {aligned ? device->direct_fd : device->buffered_fd, at, length};
}

void WriteAccess::revoke() {
  granted_.store(false, std::memory_order_seq_cst);
  wait_drained();
}

void WriteAccess::pause() {
  pauses_.fetch_add(1, std::memory_order_seq_cst);
  wait_drained();
}

void WriteAccess::resume() {
  if (pauses_.fetch_sub(1, std::memory_order_seq_cst) == 1) pauses_.notify_all();
}

void WriteAccess::wait_resumed() const {
  for (uint32_t n = pauses_.load(std::memory_order_seq_cst); n != 0;
       n = pauses_.load(std::memory_order_seq_cst)) {
    pauses_.wait(n, std::memory_order_seq_cst);
  }
}

void WriteAccess::wait_drained() {
  for (uint32_t n = in_flight_.load(std::memory_order_seq_cst); n != 0;
       n = in_flight_.load(std::memory_order_seq_cst)) {
    in_flight_.wait(n, std::memory_order_seq_cst);
  }
}

int Handle::admit(Op op, uint64_t offset, uint64_t length, uint32_t flags) const {
  if (!volume_) return EINVAL;
  const uint64_t size = volume_->size();
  const bool in_range = offset <= size && length <= size - offset;
  // Per op: the read-only rule (capabilities()), then the flags it takes, then the range.
  const bool may_change = !read_only() && (!access_ || access_->granted());
  switch (op) {
    case Op::Write:
      if (!may_change) return EPERM;
      if (flags & ~uint32_t{kFua}) return EINVAL;
      return in_range ? 0 : ENOSPC;
    case Op::WriteZeroes:
      if (!may_change) return EPERM;
      if (flags & ~uint32_t{kFua | kNoHole | kFastZero}) return EINVAL;
      return in_range ? 0 : ENOSPC;
    case Op::Trim:
      if (!may_change) return EPERM;
      if (flags & ~uint32_t{kFua}) return EINVAL;
      return in_range ? 0 : EINVAL;
    // FUA is allowed on every command (NBD proto.md, "Command flags"); where nothing is
    // written it asks for nothing.
    case Op::Read:
    case Op::Cache:
      if (flags & ~uint32_t{kFua}) return EINVAL;
      return in_range ? 0 : EINVAL;
    case Op::Flush:
      return (flags & ~uint32_t{kFua}) ? EINVAL : 0;
  }
  return EINVAL;
}

int Handle::extents(uint64_t offset, uint64_t length, size_t max_extents,
                    std::vector<Extent>& out) const {
  out.clear();
  if (int err = admit(Op::Read, offset, length)) return err;
  const uint64_t end = offset + length;
  if (length == 0 || max_extents == 0) return 0;
  if (volume_->remote()) return volume_->remote()->extents(offset, length, max_extents, out);
  if (!volume_->may_have_holes()) {
    out.push_back({length, false});
    return 0;
  }
  const int fd = volume_->device_fd(0);  // only files have holes, and a file is one device
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

}  // namespace shareblk::backend
