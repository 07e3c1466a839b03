// Internal to target/: TLS on the NBD listeners, with GnuTLS (the library QEMU, nbdkit and
// libnbd use).
//
// The handshake upgrades a connection in place on NBD_OPT_STARTTLS. The transmission phase
// stays on the io_uring workers, which see plaintext only: a TLS connection's worker socket is
// one end of a socketpair, and a relay (two threads: one decrypts what the client sends, one
// encrypts what the worker answers) carries the bytes between it and the client. The kernel's
// TLS (kTLS) would let the worker use the client's socket directly; it needs the kernel's
// "tls" module, and where that is missing the relay is the way (docs/nbd.md, "TLS").
#pragma once

#include <gnutls/gnutls.h>

#include <chrono>
#include <memory>
#include <string>
#include <system_error>
#include <unordered_map>

#include "target/handshake.h"
#include "target/target.h"

namespace shareblk::target {

// The server's credentials, loaded once and shared (read-only) by every connection.
class TlsContext {
 public:
  // Loads the x509 files and the PSK file the options name. On failure, `error` says which.
  static std::unique_ptr<TlsContext> create(const TlsOptions& options,
                                            std::shared_ptr<ExportCatalog> catalog,
                                            std::string& error);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  bool required() const { return mode_ == TlsOptions::Mode::Require; }
  // Whether the kernel offers TLS offload (a "tls" upper-layer protocol), for the log.
  static bool kernel_tls_available();

 private:
  friend class TlsConnection;
  TlsContext() = default;
  // gnutls_psk_server_credentials_function2: the key of `identity`.
  static int psk_key(gnutls_session_t session, const gnutls_datum_t* identity, gnutls_datum_t* key);

  TlsOptions::Mode mode_ = TlsOptions::Mode::Off;
  std::shared_ptr<ExportCatalog> catalog_;
  std::unordered_map<std::string, std::string> file_keys_;  // from TlsOptions::psk_file
  gnutls_psk_server_credentials_t psk_ = nullptr;
  gnutls_certificate_credentials_t x509_ = nullptr;
  gnutls_priority_t priority_ = nullptr;
};

// One client's TLS, from NBD_OPT_STARTTLS to the end of the connection.
class TlsConnection final : public TlsUpgrade {
 public:
  // `deadline`: the handshake's; the TLS handshake must finish before it too.
  // The connection keeps `context` alive: a reload (Server::reload_tls) may replace the
  // server's while this session still uses the old credentials.
  TlsConnection(std::shared_ptr<TlsContext> context, int fd,
                std::chrono::steady_clock::time_point deadline);
  ~TlsConnection();
  TlsConnection(const TlsConnection&) = delete;
  TlsConnection& operator=(const TlsConnection&) = delete;

  bool required() const override { return context_.required(); }
  ByteStream* start(TlsPeer& proved) override;
  bool started() const { return stream_ != nullptr; }
  // Why start() failed, for the log (never a key).
  const std::string& failure() const { return failure_; }
  // The negotiated protocol and cipher, e.g. "TLS1.3 AES-256-GCM", for the log.
  std::string description() const;

  // Carries the transmission phase between the client and `plain_fd` (the worker's side of a
  // socketpair) until either side ends; blocks, on two threads. A client that takes none of
  // its replies for `send_timeout` (0 = never) is cut off, as the workers cut off their own.
  void relay(int plain_fd, std::chrono::milliseconds send_timeout);
  // Ends a relay from another thread (shutting the client's socket down).
  void cut_off();

 private:
  friend class TlsContext;  // psk_key() finds the context through the session
  class Stream;
  static ssize_t pull(gnutls_transport_ptr_t self, void* buf, size_t size);
  static ssize_t push(gnutls_transport_ptr_t self, const giovec_t* iov, int count);
  static int pull_timeout(gnutls_transport_ptr_t self, unsigned int ms);
  // Waits until fd_ is ready for `events`, at most until `deadline`; false when it passed.
  bool wait(short events, std::chrono::steady_clock::time_point deadline) const;
  void relay_to_client(int plain_fd);
  // Sends what push() gathered, waiting for room as push() does.
  bool send_gathered(const std::string& records);

  std::shared_ptr<TlsContext> owner_;
  TlsContext& context_;  // *owner_
  int fd_;
  // The handshake's deadline holds for every read and write until the relay starts; then
  // reads wait as long as the client stays (its socket's peer timeout ends a dead one), and a
  // write waits at most send_timeout_ for room.
  std::chrono::steady_clock::time_point deadline_;
  bool relaying_ = false;
  std::chrono::milliseconds send_timeout_{0};
  gnutls_session_t session_ = nullptr;
  std::unique_ptr<Stream> stream_;
  std::string failure_;
  // Bytes received from the client and not yet taken by GnuTLS: one recv serves many records.
  std::unique_ptr<char[]> in_;
  size_t in_pos_ = 0;
  size_t in_end_ = 0;
};

}  // namespace shareblk::target
