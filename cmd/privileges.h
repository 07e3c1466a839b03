// shareblkd's --user and --group: started as root, the daemon binds its sockets and opens its
// state, gives what it made to that user, and then drops root for good (docs/install.md,
// "Hardening").
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

namespace shareblk::cmd {

// Who the daemon becomes.
struct Identity {
  std::string user;  // as given, for messages
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary: the user's groups in the group database, and gid
};

// Resolves --user (a name or a number, not root) and --group (a name or a number; default the
// user's primary group). False with `error` (one line, naming the option) when either names no
// one, or when --user is root.
bool resolve_identity(const std::string& user, const std::string& group, Identity& out,
                      std::string& error);

// Gives the directory `dir` and everything under it to `id`, without following a symlink (one
// put where a directory was is changed itself, never its target). Sockets keep their group
// (--nbd-socket-group, --control-socket-group). A missing `dir` is nothing to do. Needs root.
bool give_tree(const std::filesystem::path& dir, const Identity& id, std::string& error);

// Gives one file (a socket bound outside the state directory) to `id`'s user, keeping its
// group; a missing file is nothing to do. Needs root.
bool give_file(const std::filesystem::path& path, const Identity& id, std::string& error);

// Drops root in every thread: supplementary groups, group and user (real, effective and saved
// ids), then the capability sets (effective, permitted, inheritable, ambient). Then checks that
// it holds: the ids are `id`'s, setuid(0) fails and no thread keeps a capability. False with
// `error` when any step or check fails; the caller must then exit, not serve.
//
// The bounding set and no_new_privs are left as they are: the unit sets both
// (CapabilityBoundingSet=, NoNewPrivileges=). What needs root afterwards goes to the privileged
// helper (privsep/), started before the drop.
bool drop_to(const Identity& id, std::string& error);

}  // namespace shareblk::cmd
