#include "control/psk_keys.h"

#include <fcntl.h>
#include <gnutls/crypto.h>
#include <gnutls/gnutls.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "control/small_file.h"

namespace shareblk::control {

namespace {

constexpr size_t kSecretBytes = 32;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("TLS PSK secret " + path + ": " + what);
}

}  // namespace

PskKeys::PskKeys(const std::string& path) {
  char buf[kSecretBytes];
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0 && errno == ENOENT) {
    // A crash never leaves a short secret.
    if (gnutls_rnd(GNUTLS_RND_KEY, buf, sizeof buf) != 0) fail(path, "no random bytes");
    if (const int err = replace_small_file(path, std::string(buf, sizeof buf), 0600)) {
      fail(path, std::strerror(err));
    }
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  }
  if (fd < 0) fail(path, std::strerror(errno));
  struct stat st {};
  const bool ok = ::fstat(fd, &st) == 0 && ::read(fd, buf, sizeof buf) == sizeof buf;
  ::close(fd);
  if (!ok) fail(path, "not a 32-byte secret");
  if ((st.st_mode & 077) != 0) fail(path, "readable by others than its owner (chmod 600 it)");
  secret_.assign(buf, sizeof buf);
}

std::string PskKeys::key(const std::string& identity) const {
  if (secret_.empty()) return {};
  const std::string text = "shareblk-psk:" + identity;
  unsigned char digest[32];
  if (gnutls_hmac_fast(GNUTLS_MAC_SHA256, secret_.data(), secret_.size(), text.data(), text.size(),
                       digest) != 0) {
    return {};
  }
  return std::string(reinterpret_cast<const char*>(digest), sizeof digest);
}

}  // namespace shareblk::control
