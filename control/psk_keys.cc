#include "control/psk_keys.h"

#include <fcntl.h>
#include <gnutls/crypto.h>
#include <gnutls/gnutls.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

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
    // Written under a temporary name and renamed: a crash never leaves a short secret.
    const std::string temp = path + ".new";
    if (gnutls_rnd(GNUTLS_RND_KEY, buf, sizeof buf) != 0) fail(path, "no random bytes");
    const int out = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (out < 0) fail(temp, std::strerror(errno));
    const bool written =
        ::write(out, buf, sizeof buf) == static_cast<ssize_t>(sizeof buf) && ::fsync(out) == 0;
    const int saved = errno;
    ::close(out);
    if (!written || ::rename(temp.c_str(), path.c_str()) != 0) {
      ::unlink(temp.c_str());
      fail(path, std::strerror(written ? errno : saved));
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

std::string PskKeys::hex(const std::string& key) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : key) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

}  // namespace shareblk::control
