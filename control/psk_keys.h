// Internal to control/: the TLS-PSK keys of attachments (docs/state.md, "tls-psk.secret").
//
// Each TLS-only attachment has its own key, derived from one secret of the daemon's and the
// attachment's id (its PSK identity): HMAC-SHA256(secret, "shareblk-psk:" + id). The database
// then holds no keys, a key can be shown again by attachment_show, and it is worthless once
// its attachment is gone: the handshake asks for the key of a live attachment only.
#pragma once

#include <string>

namespace shareblk::control {

class PskKeys {
 public:
  PskKeys() = default;  // no secret: no keys
  // Reads the secret at `path`, or creates it there (32 random bytes, mode 0600) when there is
  // none. Throws std::runtime_error naming the file.
  explicit PskKeys(const std::string& path);

  bool enabled() const { return !secret_.empty(); }
  // The 32-byte key of `identity`; "" when disabled.
  std::string key(const std::string& identity) const;

 private:
  std::string secret_;
};

}  // namespace shareblk::control
