// fuse: local attach. An attachment served as one file, `disk`, in a FUSE file system, for
// hosts without the kernel's nbd module: `losetup` on that file gives them a block device.
//
// Every read, write, flush and trim goes through the attachment's backend::Handle, so the
// read-only rule is the same one the NBD target obeys; the file's mode and the requests refused
// here come from backend::capabilities(), as the NBD handshake's flags do.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "backend/backend.h"

namespace shareblk::fuse {

// The steps of a FUSE mount that need root (mount(2), umount2(2), fusectl). A daemon that is
// root makes them itself (direct_mounter); one that runs as its own user asks its privileged
// helper (privsep/), which makes them with mount_fuse() and unmount_fuse() below.
class Mounter {
 public:
  virtual ~Mounter() = default;
  // mount_fuse() for this process's user. `root` is the daemon's --fuse-mount-root; the
  // helper checks against its own.
  virtual int mount(const std::string& mountpoint, const std::string& root, int& fuse_fd,
                    std::string& resolved, std::string& error) = 0;
  // unmount_fuse() of a mount this Mounter made.
  virtual int unmount(const std::string& resolved, const std::string& root, bool& lazily,
                      std::string& error) = 0;
};

// The Mounter that calls mount_fuse() and unmount_fuse() in this process.
std::shared_ptr<Mounter> direct_mounter();

// Which Mounter LocalAttach::mount uses: direct_mounter() until this is called, once, at start
// and before any mount (shareblkd does when it keeps a privileged helper).
void use_mounter(std::shared_ptr<Mounter> mounter);

// Mounts a new FUSE connection, owned by `owner`:`group`, on `mountpoint`, which must resolve
// to a directory strictly below `root` (see resolve_below). The mount goes onto the very
// directory that was checked, opened once and mounted through its descriptor, so a symlink
// swapped in meanwhile cannot move it; it is nosuid, nodev and noexec (whatever bytes a caller
// wrote into the volume never become a set-uid program, a device or an executable) and
// allow_other (the host's losetup opens it). A stale mount of ours left there by a daemon that
// was killed is detached first. Puts the connection's /dev/fuse descriptor in `fuse_fd` and
// the checked path in `resolved`; returns 0, or errno with `error` saying why.
int mount_fuse(const std::string& mountpoint, const std::string& root, uid_t owner, gid_t group,
               int& fuse_fd, std::string& resolved, std::string& error);

// Unmounts the FUSE mount of ours (fuse.shareblk) at `resolved`, strictly below `root`: lazily
// when it is busy (a loop device holds it; then `lazily`), and aborts its connection, so that
// no request goes through a copy of it that outlives the unmount. Returns 0 or errno.
int unmount_fuse(const std::string& resolved, const std::string& root, bool& lazily,
                 std::string& error);

class LocalAttach {
 public:
  // Serves `handle` as the file `disk` of a FUSE file system mounted at `mountpoint`, through
  // the Mounter in use (mount_fuse() has the rules). Returns nullptr with `error` set on
  // failure.
  static std::unique_ptr<LocalAttach> mount(const std::string& mountpoint, const std::string& root,
                                            backend::Handle handle, std::string& error);
  ~LocalAttach();  // unmounts
  LocalAttach(const LocalAttach&) = delete;
  LocalAttach& operator=(const LocalAttach&) = delete;

  const std::string& mountpoint() const { return mountpoint_; }
  std::string device_path() const { return mountpoint_ + "/disk"; }

  // Unmounts; when the file is busy (a loop device still holds it) the mount is detached
  // lazily and this returns true, so that the caller can say so.
  bool unmount();

  struct Session;

 private:
  LocalAttach() = default;
  std::string mountpoint_;
  std::string root_;
  std::shared_ptr<Mounter> mounter_;  // the one that mounted it unmounts it
  std::unique_ptr<Session> session_;
};

// Puts in `target` the path `mountpoint` names, every symlink and `..` resolved, and returns 0
// when it lies strictly below `root` (itself resolved); EACCES when it does not, or the errno
// value of the failed resolution, with `error` saying why. A caller chooses mountpoints: this is
// what keeps them off /etc and every other directory (docs/security.md).
int resolve_below(const std::string& mountpoint, const std::string& root, std::string& target,
                  std::string& error);

}  // namespace shareblk::fuse
