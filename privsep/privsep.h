// privsep: the privileged helper. The daemon that parses NBD, TLS, JSON-RPC and HTTP runs as its
// own user (shareblkd --user, the packaged unit's `shareblk`); the few steps that need root are
// asked of this small helper, which acts on a request only after checking it against its own
// configuration, and logs each one. The model is OpenSSH's monitor and oslo.privsep: the
// unprivileged side names what it wants, the privileged side decides.
//
// What the helper does (docs/security.md, "The privileged helper"):
//   lvm      one of lvm2's tools, if lvm::check_lvm2_request() allows it for its volume group;
//            it adds the operator's --config itself (a request never carries one);
//   open     a device: a physical volume of its group or /dev/VG/volume-<uuid>
//            (lvm::check_lvm2_device()), with the store's open flags; the descriptor goes back;
//   mount    a FUSE connection on a directory strictly below its mount root
//            (fuse::mount_fuse(), owned by the peer's uid), the /dev/fuse descriptor goes back;
//   unmount  a FUSE mount of shareblk's strictly below its mount root (fuse::unmount_fuse()).
// Nothing else: no path outside those, no argument it did not check, no shell.
//
// The channel is a Unix stream socket: a socketpair when shareblkd starts the helper itself
// (run as root with --user), or the socket of the shareblk-helper unit, which answers only its
// configured user (SO_PEERCRED). Each message is a 4-byte little-endian length and that many
// bytes of JSON; a descriptor rides with the reply it belongs to (SCM_RIGHTS).
#pragma once

#include <sys/types.h>

#include <memory>
#include <mutex>
#include <string>

#include "fuse/local_attach.h"
#include "lvm/lvm2.h"

namespace shareblk::privsep {

struct HelperConfig {
  std::string vg;          // the LVM store's volume group; empty: no lvm or open requests
  std::string lvm_config;  // the operator's lvm2 --config text (shareblkd --lvm-config)
  std::string fuse_mount_root = "/run/shareblk/mounts";
};

// The helper's side of one connection: answers requests on `fd` until the peer closes it (or
// sends a message that is not a request: the connection is then closed). `peer_uid` and
// `peer_gid` own the FUSE mounts made for it. Logs every request with its outcome.
void serve(int fd, const HelperConfig& config, uid_t peer_uid, gid_t peer_gid);

// The daemon's side: one connection to the helper, shared by every thread (one request at a
// time). Each call is one request; a failure of the channel itself is EPIPE.
class Helper : public std::enable_shared_from_this<Helper> {
 public:
  // Takes `fd`, a connected socket.
  explicit Helper(int fd);
  ~Helper();
  Helper(const Helper&) = delete;
  Helper& operator=(const Helper&) = delete;

  // Connects to the helper's socket at `path`. nullptr with `error` on failure. A helper that
  // went away (its service restarted) is connected to again by the next request.
  static std::shared_ptr<Helper> connect(const std::string& path, std::string& error);
  // Starts `program` (shareblk-helper) as a child of this process, root as this process is, on
  // one end of a socketpair, configured with `config`, to serve `uid`:`gid` (the user this
  // process becomes: its FUSE mounts are that user's); it exits when this process closes its
  // end (or dies). nullptr with `error` on failure.
  static std::shared_ptr<Helper> start(const std::string& program, const HelperConfig& config,
                                       uid_t uid, gid_t gid, std::string& error);

  // What the helper serves: the volume group (empty: none) and whether device-mapper answers
  // there. 0 or errno.
  int hello(std::string& vg, bool& device_mapper, std::string& error);

  // lvm2 through the helper: its run, open_device and device_mapper for lvm::make_lvm_store().
  lvm::Lvm2 lvm2(bool device_mapper);
  // FUSE mounts through the helper, for fuse::use_mounter().
  std::shared_ptr<fuse::Mounter> mounter();

  // The requests themselves (what lvm2() and mounter() use). 0 or errno, with `error`.
  int run_lvm(const std::vector<std::string>& argv, store::CommandResult& out, std::string& error);
  int open_device(const std::string& path, int flags, int& fd, std::string& error);
  int mount(const std::string& mountpoint, int& fuse_fd, std::string& resolved, std::string& error);
  int unmount(const std::string& resolved, bool& lazily, std::string& error);

 private:
  struct Reply;
  int call(const std::string& request, Reply& reply, std::string& error);

  int fd_;
  std::string path_;  // connect()'s, to connect again; empty for start()'s socketpair
  pid_t child_ = -1;  // the helper started by start(), reaped by the destructor
  std::mutex mutex_;  // one request at a time on the channel
};

}  // namespace shareblk::privsep
