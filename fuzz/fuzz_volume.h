// A small scratch volume for the fuzzers: a temporary file that is unlinked as soon as it is
// open, so that no run leaves files behind (the volume keeps its descriptors).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <system_error>

#include "backend/backend.h"

namespace shareblk::fuzz {

// `size` bytes: data in the first half, a hole in the second, so that reads and block status
// see both kinds of extent.
inline std::shared_ptr<backend::Volume> scratch_volume(uint64_t size) {
  const char* tmp = std::getenv("TMPDIR");
  std::string path =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/shareblk-fuzz-XXXXXX";
  int fd = ::mkstemp(path.data());
  if (fd < 0) {
    std::perror("mkstemp");
    std::abort();
  }
  std::string data(size / 2, '\x5a');
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      ::pwrite(fd, data.data(), data.size(), 0) != static_cast<ssize_t>(data.size())) {
    std::perror("scratch volume");
    std::abort();
  }
  ::close(fd);
  std::error_code ec;
  std::shared_ptr<backend::Volume> volume = backend::Volume::open(path, ec);
  ::unlink(path.c_str());
  if (!volume) {
    std::fprintf(stderr, "Volume::open(%s): %s\n", path.c_str(), ec.message().c_str());
    std::abort();
  }
  return volume;
}

}  // namespace shareblk::fuzz
