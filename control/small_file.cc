#include "control/small_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

namespace shareblk::control {

int replace_small_file(const std::string& path, const std::string& data, mode_t mode) {
  const std::string temp = path + ".new";
  const int out = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (out < 0) return errno;
  int err = ::write(out, data.data(), data.size()) == static_cast<ssize_t>(data.size()) ? 0
            : errno != 0                                                                ? errno
                                                                                        : EIO;
  if (err == 0 && ::fsync(out) != 0) err = errno;
  ::close(out);
  if (err == 0 && ::rename(temp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(temp.c_str());
    return err;
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  const int d = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d < 0) return errno;
  if (::fsync(d) != 0) err = errno;
  ::close(d);
  return err;
}

}  // namespace shareblk::control
