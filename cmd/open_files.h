// shareblkd's descriptor budget: every NBD connection, control connection, volume and
// metrics scrape takes descriptors, and the soft RLIMIT_NOFILE a shell or service manager
// hands down (often 1024) is far below what the hard limit allows.
#pragma once

#include <sys/resource.h>

#include <cerrno>

namespace shareblk::cmd {

struct OpenFilesLimit {
  rlim_t before = 0;  // the soft limit the daemon was started with
  rlim_t now = 0;     // the soft limit it runs with: the hard limit, unless raising failed
  int error = 0;      // errno of a failed getrlimit or setrlimit, else 0
};

// Raises the soft RLIMIT_NOFILE to the hard one, once, at start (before any thread starts).
inline OpenFilesLimit raise_open_files_limit() {
  OpenFilesLimit result;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    result.error = errno;
    return result;
  }
  result.before = result.now = limit.rlim_cur;
  if (limit.rlim_cur == limit.rlim_max) return result;
  limit.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    result.error = errno;
    return result;
  }
  result.now = limit.rlim_max;
  return result;
}

}  // namespace shareblk::cmd
