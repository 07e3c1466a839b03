// Internal to target/: TLS on the NBD listeners, with GnuTLS (the library QEMU, nbdkit and
// libnbd use).
//
// The handshake upgrades a connection in place on NBD_OPT_STARTTLS, on the handshake's thread
// with blocking I/O. The transmission phase runs on the connection's io_uring worker like any
// other: the worker receives and sends the ciphertext on the client's socket itself, and the
// session turns it into plaintext and back in memory (no thread or socketpair per connection;
// docs/nbd.md, "TLS"). The kernel's TLS (kTLS) would move the record layer into the kernel; it
// needs the kernel's "tls" module, which these machines lack.
#pragma once

#include <gnutls/gnutls.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>

#include "target/handshake.h"
#include "target/server.h"

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

  // --- The transmission phase, on the connection's worker thread only ---
  // From here on the session reads from and writes to memory; the worker moves the bytes.
  void begin_transmission();
  // Where the next ciphertext from the client is to be received, and how much fits.
  char* cipher_space(size_t& room);
  void cipher_received(size_t n);
  // True when read() has bytes to give without more ciphertext.
  bool readable() const;
  // Decrypts into `buf`: the bytes given (> 0), 0 at the client's close_notify, -EAGAIN when a
  // whole record has not arrived yet, or -EPROTO for a record that fails (a bad MAC, a
  // renegotiation): the connection cannot go on.
  ssize_t read(char* buf, size_t length);
  // Encrypts the bytes of `iov` into records (as few as fit) that wait to be sent; 0 or -errno.
  int write(const iovec* iov, int count);
  // Appends close_notify to what waits to be sent.
  void close_notify();
  // Ciphertext that waits to be sent. It stays where it is until sent() has taken all of it:
  // a send in flight may point into it, and what GnuTLS writes meanwhile (a TLS 1.3 key
  // update's answer) queues behind it.
  bool has_output() const { return out_pos_ < out_.size() || !out_next_.empty(); }
  std::string_view output();
  void sent(size_t n);

 private:
  friend class TlsContext;  // psk_key() finds the context through the session
  class Stream;
  static ssize_t pull(gnutls_transport_ptr_t self, void* buf, size_t size);
  static ssize_t push(gnutls_transport_ptr_t self, const giovec_t* iov, int count);
  static int pull_timeout(gnutls_transport_ptr_t self, unsigned int ms);
  static ssize_t memory_pull(gnutls_transport_ptr_t self, void* buf, size_t size);
  static ssize_t memory_push(gnutls_transport_ptr_t self, const giovec_t* iov, int count);
  // Gives GnuTLS up to `size` of the bytes received and not yet taken (both pulls' one copy).
  ssize_t take_received(void* buf, size_t size);
  // Waits until fd_ is ready for `events`, at most until `deadline`; false when it passed.
  bool wait(short events, std::chrono::steady_clock::time_point deadline) const;

  std::shared_ptr<TlsContext> owner_;
  TlsContext& context_;  // *owner_
  int fd_;
  // The handshake's deadline holds for every read and write of the handshake.
  std::chrono::steady_clock::time_point deadline_;
  gnutls_session_t session_ = nullptr;
  std::unique_ptr<Stream> stream_;
  std::string failure_;
  // Bytes received from the client and not yet taken by GnuTLS: one recv serves many records.
  std::unique_ptr<char[]> in_;
  size_t in_pos_ = 0;
  size_t in_end_ = 0;
  // Ciphertext to send: out_[out_pos_..] may be in flight; out_next_ collects what comes
  // meanwhile.
  std::string out_;
  size_t out_pos_ = 0;
  std::string out_next_;
};

}  // namespace shareblk::target
