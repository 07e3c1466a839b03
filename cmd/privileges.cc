#include "cmd/privileges.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <pwd.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace shareblk::cmd {

namespace {

// A whole number of at most 10 digits (ids are 32-bit), or false.
bool parse_id(const std::string& text, unsigned long& id) {
  if (text.empty() || text.size() > 10 || text.find_first_not_of("0123456789") != text.npos) {
    return false;
  }
  id = std::strtoul(text.c_str(), nullptr, 10);
  return id < 0xffffffffUL;  // (uid_t)-1 means "unchanged" to chown and setresuid
}

std::string why(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

// Every capability set of the calling thread (the raw system call: libcap is not linked).
bool capabilities_empty(std::string& error) {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &header, data) != 0) {
    error = why("capget");
    return false;
  }
  for (const auto& d : data) {
    if (d.effective != 0 || d.permitted != 0 || d.inheritable != 0) {
      error = "capabilities remain after the drop";
      return false;
    }
  }
  return true;
}

// Every thread's ids and capabilities as the kernel reports them in /proc/self/task/*/status:
// a thread that missed the drop would keep root. Threads that end meanwhile are skipped.
bool every_thread_dropped(const Identity& id, std::string& error) {
  DIR* tasks = ::opendir("/proc/self/task");
  if (tasks == nullptr) return true;  // no /proc: the calling thread's checks stand alone
  bool ok = true;
  while (const dirent* e = ::readdir(tasks)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream status(std::string("/proc/self/task/") + e->d_name + "/status");
    std::string line;
    while (ok && std::getline(status, line)) {
      std::istringstream fields(line);
      std::string key;
      fields >> key;
      if (key == "Uid:" || key == "Gid:") {
        const unsigned long want = key == "Uid:" ? id.uid : id.gid;
        unsigned long v = 0;
        for (int i = 0; i < 4 && fields >> v; ++i) ok = ok && v == want;
      } else if (key == "CapInh:" || key == "CapPrm:" || key == "CapEff:" || key == "CapAmb:") {
        std::string hex;
        fields >> hex;
        ok = hex.find_first_not_of('0') == std::string::npos;
      }
      if (!ok) error = "thread " + std::string(e->d_name) + " kept " + line;
    }
  }
  ::closedir(tasks);
  return ok;
}

// give_tree's walk, by descriptor: `dir` is open, `depth` bounds the descriptors held.
bool give_at(int dir, const std::string& shown, const Identity& id, int depth, std::string& error) {
  if (depth > 32) {
    error = shown + ": nested more than 32 directories deep";
    return false;
  }
  const int listing = ::dup(dir);
  DIR* d = listing < 0 ? nullptr : ::fdopendir(listing);
  if (d == nullptr) {
    if (listing >= 0) ::close(listing);
    error = why("cannot list " + shown);
    return false;
  }
  bool ok = true;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    std::string path = shown;
    path += '/';
    path += name;
    struct stat st {};
    if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // gone since
    if (S_ISDIR(st.st_mode)) {
      const int sub = ::openat(dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub < 0) {
        error = why("cannot open " + path);
        ok = false;
        break;
      }
      ok = give_at(sub, path, id, depth + 1, error);
      ::close(sub);
      if (!ok) break;
      continue;
    }
    const gid_t group = S_ISSOCK(st.st_mode) ? static_cast<gid_t>(-1) : id.gid;
    if (::fchownat(dir, name.c_str(), id.uid, group, AT_SYMLINK_NOFOLLOW) != 0 && errno != ENOENT) {
      error = why("cannot give " + path + " to " + id.user);
      ok = false;
      break;
    }
  }
  ::closedir(d);
  if (ok && ::fchown(dir, id.uid, id.gid) != 0) {
    error = why("cannot give " + shown + " to " + id.user);
    ok = false;
  }
  return ok;
}

}  // namespace

bool resolve_identity(const std::string& user, const std::string& group, Identity& out,
                      std::string& error) {
  out = Identity{};
  out.user = user;
  unsigned long id = 0;
  const passwd* pw = ::getpwnam(user.c_str());
  if (pw == nullptr && parse_id(user, id)) pw = ::getpwuid(static_cast<uid_t>(id));
  if (pw != nullptr) {
    out.uid = pw->pw_uid;
    out.gid = pw->pw_gid;
  } else if (parse_id(user, id)) {
    out.uid = static_cast<uid_t>(id);  // a uid without a name: its own group, unless --group
    out.gid = static_cast<gid_t>(id);
  } else {
    error = "--user: no user '" + user + "'";
    return false;
  }
  if (out.uid == 0) {
    error = "--user must name a user other than root (without --user, shareblkd keeps root)";
    return false;
  }
  if (!group.empty()) {
    const struct group* gr = ::getgrnam(group.c_str());
    if (gr != nullptr) {
      out.gid = gr->gr_gid;
    } else if (parse_id(group, id)) {
      out.gid = static_cast<gid_t>(id);
    } else {
      error = "--group: no group '" + group + "'";
      return false;
    }
  }
  // The user's groups, so that membership the operator gave it (disk, for --export of a
  // device) still counts; without a name in the user database, the group alone.
  if (pw != nullptr) {
    int n = 64;
    out.groups.resize(static_cast<size_t>(n));
    while (::getgrouplist(pw->pw_name, out.gid, out.groups.data(), &n) < 0) {
      out.groups.resize(static_cast<size_t>(n));
    }
    out.groups.resize(static_cast<size_t>(n));
  } else {
    out.groups = {out.gid};
  }
  return true;
}

bool give_tree(const std::filesystem::path& dir, const Identity& id, std::string& error) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return true;
    error = why("cannot open " + dir.string());
    return false;
  }
  const bool ok = give_at(fd, dir.string(), id, 0, error);
  ::close(fd);
  return ok;
}

bool give_file(const std::filesystem::path& path, const Identity& id, std::string& error) {
  if (::lchown(path.c_str(), id.uid, static_cast<gid_t>(-1)) != 0 && errno != ENOENT) {
    error = why("cannot give " + path.string() + " to " + id.user);
    return false;
  }
  return true;
}

bool drop_to(const Identity& id, std::string& error) {
  // glibc makes each of the id calls in every thread of the process; the ambient set and the
  // capset below are the calling thread's, which the checks at the end cover for the others.
  if (::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL) {
    error = why("cannot clear the ambient capabilities");
    return false;
  }
  if (::setgroups(id.groups.size(), id.groups.data()) != 0) {
    error = why("setgroups");
    return false;
  }
  if (::setresgid(id.gid, id.gid, id.gid) != 0) {
    error = why("setresgid(" + std::to_string(id.gid) + ")");
    return false;
  }
  // With every uid non-zero the kernel clears the permitted, effective and ambient sets.
  if (::setresuid(id.uid, id.uid, id.uid) != 0) {
    error = why("setresuid(" + std::to_string(id.uid) + ")");
    return false;
  }
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct none[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capset, &header, none) != 0) {
    error = why("capset");
    return false;
  }
  uid_t ruid = 0, euid = 0, suid = 0;
  gid_t rgid = 0, egid = 0, sgid = 0;
  if (::getresuid(&ruid, &euid, &suid) != 0 || ::getresgid(&rgid, &egid, &sgid) != 0 ||
      ruid != id.uid || euid != id.uid || suid != id.uid || rgid != id.gid || egid != id.gid ||
      sgid != id.gid) {
    error = "the user and group ids are not " + std::to_string(id.uid) + ":" +
            std::to_string(id.gid) + " after the drop";
    return false;
  }
  if (::setuid(0) == 0 || ::seteuid(0) == 0) {
    error = "setuid(0) still succeeds after the drop";
    return false;
  }
  return capabilities_empty(error) && every_thread_dropped(id, error);
}

}  // namespace shareblk::cmd
