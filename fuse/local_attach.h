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
  // Mounts at `mountpoint` (which must exist). A stale FUSE mount left there by a daemon that
  // was killed is detached first. Returns nullptr with `error` set on failure.
  static std::unique_ptr<LocalAttach> mount(const std::string& mountpoint, backend::Handle handle,
                                            std::string& error);
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

// Detaches whatever FUSE mount is at `mountpoint` (one a killed daemon left). True if it did.
bool clear_stale_mount(const std::string& mountpoint);

}  // namespace shareblk::fuse
