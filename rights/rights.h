// rights: acting on a path with a caller's rights instead of the daemon's.
//
// The daemon may run as root; a control-socket caller may not be. Whenever a caller names a
// path (an image to read, a file to write a backup to), the daemon touches it only through a
// child process that holds the caller's user, group and supplementary groups and nothing else,
// so the kernel makes every permission decision as it would for the caller itself: a file the
// caller cannot read stays unread, a directory it cannot write stays unwritten. A daemon that
// is not root cannot take on another user's rights: it then acts only for callers of its own
// user, and refuses everyone else (EPERM), rather than lending them its own rights.
#pragma once

#include <sys/types.h>

#include <functional>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

namespace shareblk::rights {

// Who a caller is, as the kernel saw it when the caller connected (SO_PEERCRED, SO_PEERGROUPS).
struct Credentials {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups
};

// The credentials of the peer of a connected Unix socket; nullopt when the kernel does not say
// (the caller is then treated as no one).
std::optional<Credentials> peer_of(int fd);

// True when `who` is root, has `gid` as primary group, or has it among its groups.
bool in_group(const Credentials& who, gid_t gid);

// Runs `step` in a child process holding `who`'s rights (and no capability beyond them) and
// returns what it returned: 0, or an errno value. `step` runs after fork(): it may use only
// system calls and must not allocate or lock (prepare every path before the call). Descriptors
// open here are inherited, so `step` can read a file the daemon opened and write one the caller
// may create. EPERM when this process cannot take on `who`'s rights (it is not root and `who`
// is another user); ECHILD when the child died without an answer.
int run_as(const Credentials& who, const std::function<int()>& step);

// Opens `path` as `who` would (open(2) with `flags` and `mode`), and returns the descriptor in
// `fd`, or the errno value the caller would have got. O_CLOEXEC is added.
int open_as(const Credentials& who, const std::string& path, int flags, mode_t mode, int& fd);

// A short text for a refusal: "uid 1000 may not read /etc/shadow (Permission denied)".
std::string refusal(const Credentials& who, const std::string& what, const std::string& path,
                    int err);

}  // namespace shareblk::rights
