// A one-file FUSE file system over libfuse3's low-level API.
// 3.12: the loop configuration API below (fuse_loop_cfg_*). Under an older version
// fuse_session_loop_mt reads the configuration as the old two-field struct, and took garbage
// for its idle-thread limit: a new thread per request.
#define FUSE_USE_VERSION 312
#include "fuse/local_attach.h"

#include <fcntl.h>
#include <fuse3/fuse_lowlevel.h>
#include <linux/falloc.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

namespace shareblk::fuse {

namespace {

constexpr fuse_ino_t kDisk = 2;
constexpr char kDiskName[] = "disk";
constexpr size_t kMaxIo = 1 << 20;
constexpr unsigned kLoopThreads = 8;  // requests served at once per mount

// The device number of our mount (file system type fuse.shareblk) at `mountpoint`, from
// /proc/self/mountinfo (proc(5): its third field), without asking the file system; 0 when
// there is none. The last one listed is the one on top.
dev_t our_mount(const std::string& mountpoint) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  dev_t found = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string id, parent, dev, root, point;
    fields >> id >> parent >> dev >> root >> point;
    unsigned major_number = 0;
    unsigned minor_number = 0;
    if (point == mountpoint && line.find(" - fuse.shareblk ") != std::string::npos &&
        std::sscanf(dev.c_str(), "%u:%u", &major_number, &minor_number) == 2) {
      found = makedev(major_number, minor_number);
    }
  }
  return found;
}

// Detaches whatever mount of ours is at `mountpoint` (one a killed daemon left).
void clear_stale_mount(const std::string& mountpoint) {
  if (our_mount(mountpoint) == 0) return;
  if (::umount2(mountpoint.c_str(), MNT_DETACH) != 0) {
    spdlog::warn("fuse: cannot detach the stale mount at {}: {}", mountpoint, std::strerror(errno));
    return;
  }
  spdlog::info("fuse: detached a stale mount at {}", mountpoint);
}

class DirectMounter final : public Mounter {
 public:
  int mount(const std::string& mountpoint, const std::string& root, int& fuse_fd,
            std::string& resolved, std::string& error) override {
    return mount_fuse(mountpoint, root, ::getuid(), ::getgid(), fuse_fd, resolved, error);
  }
  int unmount(const std::string& resolved, const std::string& root, bool& lazily,
              std::string& error) override {
    return unmount_fuse(resolved, root, lazily, error);
  }
};

std::mutex mounter_mutex;
std::shared_ptr<Mounter> mounter_in_use;  // null: direct

std::shared_ptr<Mounter> current_mounter() {
  std::lock_guard lock(mounter_mutex);
  return mounter_in_use ? mounter_in_use : direct_mounter();
}

// Aborting the connection fails every request still to come, even through a mount that
// outlives our unmount: a lazily detached one a loop device keeps alive, a bind mount, a copy
// in another mount namespace. After detach, no byte moves. The control files live in fusectl,
// which containers often leave unmounted.
bool abort_connection(dev_t dev) {
  const std::string dir = "/sys/fs/fuse/connections";
  const std::string connection = dir + "/" + std::to_string(minor(dev));
  const std::string file = connection + "/abort";
  if (::access(file.c_str(), W_OK) != 0) {
    ::mount("fusectl", dir.c_str(), "fusectl", 0, nullptr);
  }
  // fusectl's magic (fs/fuse/control.c). With fusectl there, a missing entry means the
  // connection has already ended (the last mount went away): nothing left to abort.
  constexpr long kFuseCtlMagic = 0x65735543;
  struct statfs fs {};
  if (::access(connection.c_str(), F_OK) != 0 && ::statfs(dir.c_str(), &fs) == 0 &&
      fs.f_type == kFuseCtlMagic) {
    return true;
  }
  std::ofstream abort(file);
  abort << "1";
  abort.flush();
  if (!abort) {
    spdlog::error("fuse: cannot abort the connection behind a detached mount ({})", file);
    return false;
  }
  return true;
}

}  // namespace

struct LocalAttach::Session {
  backend::Handle handle;
  // What the attachment may do (backend::capabilities, as the NBD handshake and the nbdkit
  // plugin say it): the file's mode, and which requests are refused here.
  backend::Capabilities can{};
  fuse_session* se = nullptr;
  std::thread loop;

  static Session& of(fuse_req_t req) { return *static_cast<Session*>(fuse_req_userdata(req)); }

  struct stat attributes(fuse_ino_t ino) const {
    struct stat st {};
    st.st_ino = ino;
    st.st_uid = ::getuid();
    st.st_gid = ::getgid();
    if (ino == kDisk) {
      st.st_mode = S_IFREG | (can.read_only ? 0444 : 0644);
      st.st_nlink = 1;
      st.st_size = static_cast<off_t>(handle.volume()->size());
      st.st_blksize = 4096;
      st.st_blocks = st.st_size / 512;
    } else {
      st.st_mode = S_IFDIR | 0755;
      st.st_nlink = 2;
    }
    return st;
  }
};

namespace {

using Session = LocalAttach::Session;

void op_lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (parent != FUSE_ROOT_ID || std::strcmp(name, kDiskName) != 0) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  fuse_entry_param e{};
  e.ino = kDisk;
  e.attr = Session::of(req).attributes(kDisk);
  fuse_reply_entry(req, &e);  // timeouts 0: the size may grow (volume_extend)
}

void op_getattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info* /*fi*/) {
  struct stat st = Session::of(req).attributes(ino);
  fuse_reply_attr(req, &st, 0);
}

void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set,
                fuse_file_info* /*fi*/) {
  Session& s = Session::of(req);
  const int times = FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_ATIME_NOW |
                    FUSE_SET_ATTR_MTIME_NOW | FUSE_SET_ATTR_CTIME;
  if (to_set & FUSE_SET_ATTR_SIZE) {
    // A volume's size changes only through volume_extend; truncating to its own size is
    // harmless (O_TRUNC is refused in open for read-only attachments).
    if (s.can.read_only) {
      fuse_reply_err(req, EROFS);
      return;
    }
    if (static_cast<uint64_t>(attr->st_size) != s.handle.volume()->size()) {
      fuse_reply_err(req, EPERM);
      return;
    }
  } else if (to_set & ~times) {
    fuse_reply_err(req, EPERM);
    return;
  }
  struct stat st = s.attributes(ino);
  fuse_reply_attr(req, &st, 0);
}

void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* /*fi*/) {
  if (ino != FUSE_ROOT_ID) {
    fuse_reply_err(req, ENOTDIR);
    return;
  }
  Session& s = Session::of(req);
  char buf[512];
  size_t used = 0;
  const char* names[] = {".", "..", kDiskName};
  for (off_t i = off; i < 3; ++i) {
    struct stat st = s.attributes(i == 2 ? kDisk : FUSE_ROOT_ID);
    size_t n =
        fuse_add_direntry(req, buf + used, std::min(size, sizeof buf) - used, names[i], &st, i + 1);
    if (n > std::min(size, sizeof buf) - used) break;
    used += n;
  }
  fuse_reply_buf(req, buf, used);
}

void op_open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (ino != kDisk) {
    fuse_reply_err(req, EISDIR);
    return;
  }
  Session& s = Session::of(req);
  if (s.can.read_only && ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC))) {
    fuse_reply_err(req, EROFS);
    return;
  }
  // No page cache for the file: another attachment of a shared volume may change the bytes,
  // so every read must come here (the hypervisor rule for shareable disks).
  fi->direct_io = 1;
  fi->keep_cache = 0;
  fuse_reply_open(req, fi);
}

void op_read(fuse_req_t req, fuse_ino_t /*ino*/, size_t size, off_t off, fuse_file_info* /*fi*/) {
  Session& s = Session::of(req);
  const uint64_t volume_size = s.handle.volume()->size();
  if (off < 0 || static_cast<uint64_t>(off) >= volume_size) {
    fuse_reply_buf(req, nullptr, 0);  // end of file
    return;
  }
  const size_t n = static_cast<size_t>(
      std::min<uint64_t>({size, volume_size - static_cast<uint64_t>(off), kMaxIo}));
  // Aligned, so that aligned reads can take the O_DIRECT path.
  thread_local std::unique_ptr<char, decltype(&std::free)> buffer(
      static_cast<char*>(std::aligned_alloc(4096, kMaxIo)), &std::free);
  if (int err = s.handle.read(buffer.get(), n, static_cast<uint64_t>(off))) {
    fuse_reply_err(req, err);
    return;
  }
  fuse_reply_buf(req, buffer.get(), n);
}

void op_write(fuse_req_t req, fuse_ino_t /*ino*/, const char* buf, size_t size, off_t off,
              fuse_file_info* fi) {
  Session& s = Session::of(req);
  const uint32_t flags = (fi->flags & (O_DSYNC | O_SYNC)) ? uint32_t{backend::kFua} : 0u;
  if (int err = s.handle.write(buf, size, static_cast<uint64_t>(off), flags)) {
    fuse_reply_err(req, err);
    return;
  }
  fuse_reply_write(req, size);
}

void op_fsync(fuse_req_t req, fuse_ino_t /*ino*/, int /*datasync*/, fuse_file_info* /*fi*/) {
  const Session& s = Session::of(req);
  fuse_reply_err(req, s.can.flush ? s.handle.flush() : EOPNOTSUPP);
}

void op_flush(fuse_req_t req, fuse_ino_t /*ino*/, fuse_file_info* /*fi*/) {
  fuse_reply_err(req, 0);  // close(2) is not a durability point; fsync is
}

void op_release(fuse_req_t req, fuse_ino_t /*ino*/, fuse_file_info* /*fi*/) {
  fuse_reply_err(req, 0);
}

void op_fallocate(fuse_req_t req, fuse_ino_t /*ino*/, int mode, off_t offset, off_t length,
                  fuse_file_info* /*fi*/) {
  const Session& s = Session::of(req);
  const backend::Handle& h = s.handle;
  const auto off = static_cast<uint64_t>(offset);
  const auto len = static_cast<uint64_t>(length);
  const bool zeroes = mode == (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE) ||
                      mode == FALLOC_FL_ZERO_RANGE ||
                      mode == (FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE);
  int err;
  if (zeroes && !s.can.zero) {
    // Read-only: the admission rule's answer; otherwise the attachment cannot zero at all.
    err = s.can.read_only ? EPERM : EOPNOTSUPP;
  } else if (mode == (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)) {
    // A punched range must read back as zeroes, which a bare discard does not promise on
    // every device: write-zeroes punches where it can and writes zeroes where it cannot.
    err = h.write_zeroes(len, off, 0);
  } else if (mode == FALLOC_FL_ZERO_RANGE || mode == (FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE)) {
    err = h.write_zeroes(len, off, backend::kNoHole);
  } else if (mode == 0 || mode == FALLOC_FL_KEEP_SIZE) {
    err = h.admit(backend::Op::Write, off, len);  // every byte of a volume is already there
  } else {
    err = EOPNOTSUPP;
  }
  fuse_reply_err(req, err);
}

void op_statfs(fuse_req_t req, fuse_ino_t /*ino*/) {
  struct statvfs st {};
  st.f_bsize = 4096;
  st.f_frsize = 4096;
  st.f_blocks = Session::of(req).handle.volume()->size() / 4096;
  st.f_files = 1;
  st.f_namemax = 255;
  fuse_reply_statfs(req, &st);
}

fuse_lowlevel_ops make_ops() {
  fuse_lowlevel_ops ops{};
  ops.lookup = op_lookup;
  ops.getattr = op_getattr;
  ops.setattr = op_setattr;
  ops.readdir = op_readdir;
  ops.open = op_open;
  ops.read = op_read;
  ops.write = op_write;
  ops.fsync = op_fsync;
  ops.flush = op_flush;
  ops.release = op_release;
  ops.fallocate = op_fallocate;
  ops.statfs = op_statfs;
  return ops;
}

}  // namespace

std::shared_ptr<Mounter> direct_mounter() {
  return std::make_shared<DirectMounter>();
}

void use_mounter(std::shared_ptr<Mounter> mounter) {
  std::lock_guard lock(mounter_mutex);
  mounter_in_use = std::move(mounter);
}

int resolve_below(const std::string& mountpoint, const std::string& root, std::string& target,
                  std::string& error) {
  char* real_root = ::realpath(root.c_str(), nullptr);
  if (real_root == nullptr) {
    const int err = errno;
    error =
        "the FUSE mount root " + root + " (--fuse-mount-root) is not there: " + std::strerror(err);
    return err;
  }
  std::string base(real_root);
  std::free(real_root);
  char* real = ::realpath(mountpoint.c_str(), nullptr);
  if (real == nullptr) {
    const int err = errno;
    error = "mountpoint " + mountpoint + ": " + std::strerror(err);
    return err;
  }
  target = real;
  std::free(real);
  if (base != "/") base += '/';
  if (target.size() <= base.size() || target.compare(0, base.size(), base) != 0) {
    error = "mountpoint " + mountpoint + " (" + target + ") is not below the FUSE mount root " +
            root + " (--fuse-mount-root)";
    return EACCES;
  }
  return 0;
}

int mount_fuse(const std::string& mountpoint, const std::string& root, uid_t owner, gid_t group,
               int& fuse_fd, std::string& resolved, std::string& error) {
  std::string checked;
  if (const int err = resolve_below(mountpoint, root, checked, error)) return err;
  // Before the open below, which would otherwise find the stale mount's root.
  clear_stale_mount(checked);
  // The directory is opened once; what it is, and where, is read back from the descriptor.
  const int dir = ::open(checked.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) {
    const int err = errno;
    error = "mountpoint " + mountpoint + " is not a directory";
    return err;
  }
  const std::string through = "/proc/self/fd/" + std::to_string(dir);
  std::string opened;
  if (resolve_below(through, root, opened, error) != 0 || opened != checked) {
    ::close(dir);
    error = "mountpoint " + mountpoint + " changed while it was checked; try again";
    return EAGAIN;
  }
  const int device = ::open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (device < 0) {
    const int err = errno;
    ::close(dir);
    error = std::string("cannot open /dev/fuse: ") + std::strerror(err);
    return err;
  }
  // The options libfuse's own mount passes (fd, rootmode, user_id, group_id); the file system
  // type and source make it "fuse.shareblk" in mountinfo, which our_mount() looks for.
  const std::string options = "fd=" + std::to_string(device) +
                              ",rootmode=40000,user_id=" + std::to_string(owner) +
                              ",group_id=" + std::to_string(group) + ",allow_other";
  const int mounted = ::mount("shareblk", through.c_str(), "fuse.shareblk",
                              MS_NOSUID | MS_NODEV | MS_NOEXEC, options.c_str());
  const int err = errno;
  ::close(dir);
  if (mounted != 0) {
    ::close(device);
    error = "cannot mount FUSE at " + checked + ": " + std::strerror(err);
    return err;
  }
  fuse_fd = device;
  resolved = checked;
  return 0;
}

int unmount_fuse(const std::string& resolved, const std::string& root, bool& lazily,
                 std::string& error) {
  lazily = false;
  std::string checked;
  if (const int err = resolve_below(resolved, root, checked, error)) return err;
  const dev_t dev = our_mount(checked);
  if (dev == 0) {
    error = "no FUSE mount of shareblk's at " + checked;
    return ENOENT;
  }
  if (::umount2(checked.c_str(), UMOUNT_NOFOLLOW) != 0) {
    lazily = true;  // busy: a loop device or an open file still holds it
    if (::umount2(checked.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0) {
      const int err = errno;
      error = "cannot unmount " + checked + ": " + std::strerror(err);
      return err;
    }
  }
  return abort_connection(dev) ? 0 : EIO;
}

std::unique_ptr<LocalAttach> LocalAttach::mount(const std::string& mountpoint,
                                                const std::string& root, backend::Handle handle,
                                                std::string& error) {
  std::shared_ptr<Mounter> mounter = current_mounter();
  int device = -1;
  std::string checked;
  if (mounter->mount(mountpoint, root, device, checked, error) != 0) return nullptr;
  std::unique_ptr<LocalAttach> attach(new LocalAttach());
  attach->mountpoint_ = checked;
  attach->root_ = root;
  attach->mounter_ = mounter;
  attach->session_ = std::make_unique<Session>();
  Session& s = *attach->session_;
  s.handle = std::move(handle);
  s.can = s.handle.capabilities();

  const char* argv[] = {"shareblkd"};
  fuse_args args = FUSE_ARGS_INIT(1, const_cast<char**>(argv));
  static const fuse_lowlevel_ops ops = make_ops();
  s.se = fuse_session_new(&args, &ops, sizeof ops, &s);
  fuse_opt_free_args(&args);
  // The connection is mounted already: libfuse takes its descriptor ("/dev/fd/N") and owns it
  // from here on.
  const std::string connection = "/dev/fd/" + std::to_string(device);
  if (s.se == nullptr || fuse_session_mount(s.se, connection.c_str()) != 0) {
    if (s.se != nullptr) fuse_session_destroy(s.se);
    s.se = nullptr;
    ::close(device);
    bool lazily = false;
    std::string ignored;
    mounter->unmount(checked, root, lazily, ignored);
    error = "cannot serve the FUSE mount at " + checked;
    return nullptr;
  }
  s.loop = std::thread([&s] {
    fuse_loop_config* config = fuse_loop_cfg_create();
    // Threads that go idle stay for the next request instead of ending (thread churn).
    fuse_loop_cfg_set_max_threads(config, kLoopThreads);
    fuse_loop_cfg_set_idle_threads(config, kLoopThreads);
    fuse_session_loop_mt(s.se, config);
    fuse_loop_cfg_destroy(config);
  });
  return attach;
}

bool LocalAttach::unmount() {
  Session& s = *session_;
  if (s.se == nullptr) return false;
  bool lazy = false;
  std::string error;
  if (mounter_->unmount(mountpoint_, root_, lazy, error) != 0) {
    // The connection goes on (the privileged helper is gone, say), so the loop would never
    // end: it and its session are left to the process, whose exit ends the connection; the
    // next mount at this place detaches what is left of it.
    spdlog::error("fuse: cannot unmount {}: {}; it stays until shareblkd exits", mountpoint_,
                  error);
    s.loop.detach();
    static_cast<void>(session_.release());
    return false;
  }
  fuse_session_exit(s.se);
  if (s.loop.joinable()) s.loop.join();
  // libfuse frees its copy of the mountpoint only in fuse_session_unmount(), which also
  // unmounts that path (lazily) unless the connection has ended. The connection has ended once
  // the unmount or the abort above went through (the device then polls POLLERR); only then is
  // that call harmless.
  pollfd device{fuse_session_fd(s.se), 0, 0};
  if (::poll(&device, 1, 0) == 1 && (device.revents & POLLERR)) fuse_session_unmount(s.se);
  fuse_session_destroy(s.se);
  s.se = nullptr;
  return lazy;
}

LocalAttach::~LocalAttach() {
  if (session_) unmount();
}

}  // namespace shareblk::fuse
