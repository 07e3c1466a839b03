// fuse: local attach. An attachment served as one file, `disk`, in a FUSE file system, for
// hosts without the kernel's nbd module: `losetup` on that file gives them a block device.
//
// Every read, write, flush and trim goes through the attachment's backend::Handle, so the
// read-only rule is the same one the NBD target obeys; the file's mode and the requests refused
// here come from backend::capabilities(), as the NBD handshake's flags do.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

namespace shareblk::fuse {

class LocalAttach {
 public:
  // Mounts at `mountpoint`, which must resolve to a directory strictly below `root` (see
  // resolve_below). The mount goes onto the very directory that was checked, opened once and
  // mounted through its descriptor, so a symlink swapped in meanwhile cannot move it; the file
  // system is mounted nosuid, nodev and noexec. A stale FUSE mount left there by a daemon that
  // was killed is detached first. Returns nullptr with `error` set on failure.
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
  std::unique_ptr<Session> session_;
};

// Puts in `target` the path `mountpoint` names, every symlink and `..` resolved, and returns 0
// when it lies strictly below `root` (itself resolved); EACCES when it does not, or the errno
// value of the failed resolution, with `error` saying why. A caller chooses mountpoints: this is
// what keeps them off /etc and every other directory (docs/security.md).
int resolve_below(const std::string& mountpoint, const std::string& root, std::string& target,
                  std::string& error);

// Detaches whatever FUSE mount is at `mountpoint` (one a killed daemon left). True if it did.
bool clear_stale_mount(const std::string& mountpoint);

}  // namespace shareblk::fuse
