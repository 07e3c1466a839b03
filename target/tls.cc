// TLS on the NBD listeners: credentials, the STARTTLS handshake and the relay of the
// transmission phase (target/tls.h says why a relay).
#include "target/tls.h"

#include <gnutls/x509.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <thread>

namespace shareblk::target {

namespace {

// One recv from the client serves many TLS records; a relay writes at most this much at once.
constexpr size_t kInBufferSize = 64 * 1024;
constexpr size_t kRelayBufferSize = 256 * 1024;
constexpr size_t kMaxRecord = 16 * 1024 + 256;
constexpr size_t kGatherBelow = 64 * 1024;  // one record's plaintext, with room to spare

// Server order wins (%SERVER_PRECEDENCE) and AES-GCM comes first: the AES instructions make it
// several times faster than ChaCha20-Poly1305, which GnuTLS otherwise may pick (and qemu-nbd's
// default priority does pick here). PSK with
// (EC)DHE keeps forward secrecy; plain PSK is there for clients that offer nothing else.
constexpr const char* kPriority =
    "NORMAL:-CIPHER-ALL:+AES-128-GCM:+AES-256-GCM:+CHACHA20-POLY1305:+AES-256-CBC:+AES-128-CBC:"
    "+ECDHE-PSK:+DHE-PSK:+PSK:%SERVER_PRECEDENCE";

bool hex_decode(const std::string& hex, std::string& out) {
  if (hex.empty() || hex.size() % 2 != 0) return false;
  out.clear();
  for (size_t i = 0; i < hex.size(); i += 2) {
    auto nibble = [](char c) {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int hi = nibble(hex[i]);
    const int lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return true;
}

bool send_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t sent = ::send(fd, p, n, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    p += sent;
    n -= static_cast<size_t>(sent);
  }
  return true;
}

// Set on the relay's sending thread while it flushes a batch of records: push() then gathers
// them here and the thread sends them with one sendmsg, instead of one per 16 KiB record.
// Thread-local because the receiving thread may push too (a TLS 1.3 key update's answer).
thread_local std::string* gathered_records = nullptr;

bool readable_file(const std::string& path) {
  return ::access(path.c_str(), R_OK) == 0;
}

}  // namespace

// The haggling after STARTTLS, over the TLS session.
class TlsConnection::Stream final : public ByteStream {
 public:
  explicit Stream(gnutls_session_t session) : session_(session) {}
  bool read_exact(void* buf, size_t length) override {
    auto* p = static_cast<char*>(buf);
    while (length > 0) {
      const ssize_t n = gnutls_record_recv(session_, p, length);
      if (n == GNUTLS_E_AGAIN || n == GNUTLS_E_INTERRUPTED) continue;
      if (n <= 0) return false;
      p += n;
      length -= static_cast<size_t>(n);
    }
    return true;
  }
  bool write_all(const void* buf, size_t length) override {
    const auto* p = static_cast<const char*>(buf);
    while (length > 0) {
      const ssize_t n = gnutls_record_send(session_, p, length);
      if (n == GNUTLS_E_AGAIN || n == GNUTLS_E_INTERRUPTED) continue;
      if (n <= 0) return false;
      p += n;
      length -= static_cast<size_t>(n);
    }
    return true;
  }

 private:
  gnutls_session_t session_;
};

std::unique_ptr<TlsContext> TlsContext::create(const TlsOptions& options,
                                               std::shared_ptr<ExportCatalog> catalog,
                                               std::string& error) {
  std::unique_ptr<TlsContext> c(new TlsContext());
  c->mode_ = options.mode;
  c->catalog_ = std::move(catalog);
  if (!options.psk_file.empty()) {
    std::ifstream in(options.psk_file);
    if (!in) {
      error = "cannot read the PSK file " + options.psk_file;
      return nullptr;
    }
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      if (line.empty() || line[0] == '#') continue;
      const size_t colon = line.find(':');
      std::string key;
      if (colon == std::string::npos || colon == 0 || !hex_decode(line.substr(colon + 1), key)) {
        error = options.psk_file + " line " + std::to_string(number) +
                ": not `identity:hexkey` (as psktool writes)";
        return nullptr;
      }
      c->file_keys_[line.substr(0, colon)] = key;
    }
  }
  int rc = gnutls_psk_allocate_server_credentials(&c->psk_);
  if (rc == 0) {
    gnutls_psk_set_server_credentials_function2(c->psk_, &TlsContext::psk_key);
    rc = gnutls_psk_set_server_known_dh_params(c->psk_, GNUTLS_SEC_PARAM_MEDIUM);
  }
  if (rc != 0) {
    error = std::string("PSK credentials: ") + gnutls_strerror(rc);
    return nullptr;
  }
  if (!options.x509_dir.empty()) {
    const std::string dir = options.x509_dir + "/";
    const std::string ca = dir + "ca-cert.pem";
    const std::string crl = dir + "ca-crl.pem";
    const std::string cert = dir + "server-cert.pem";
    const std::string key = dir + "server-key.pem";
    rc = gnutls_certificate_allocate_credentials(&c->x509_);
    if (rc == 0)
      rc = std::min(
          0, gnutls_certificate_set_x509_trust_file(c->x509_, ca.c_str(), GNUTLS_X509_FMT_PEM));
    if (rc < 0) {
      error = ca + ": " + gnutls_strerror(rc);
      return nullptr;
    }
    if (readable_file(crl)) {
      rc = gnutls_certificate_set_x509_crl_file(c->x509_, crl.c_str(), GNUTLS_X509_FMT_PEM);
      if (rc < 0) {
        error = crl + ": " + gnutls_strerror(rc);
        return nullptr;
      }
    }
    rc = gnutls_certificate_set_x509_key_file(c->x509_, cert.c_str(), key.c_str(),
                                              GNUTLS_X509_FMT_PEM);
    if (rc < 0) {
      error = cert + " / " + key + ": " + gnutls_strerror(rc);
      return nullptr;
    }
    gnutls_certificate_set_known_dh_params(c->x509_, GNUTLS_SEC_PARAM_MEDIUM);
  }
  const char* where = nullptr;
  rc = gnutls_priority_init(&c->priority_, kPriority, &where);
  if (rc != 0) {
    error = std::string("TLS priority string: ") + gnutls_strerror(rc);
    return nullptr;
  }
  return c;
}

TlsContext::~TlsContext() {
  if (priority_ != nullptr) gnutls_priority_deinit(priority_);
  if (x509_ != nullptr) gnutls_certificate_free_credentials(x509_);
  if (psk_ != nullptr) gnutls_psk_free_server_credentials(psk_);
}

bool TlsContext::kernel_tls_available() {
  std::ifstream in("/proc/sys/net/ipv4/tcp_available_ulp");
  std::string ulp;
  while (in >> ulp) {
    if (ulp == "tls") return true;
  }
  return false;
}

int TlsContext::psk_key(gnutls_session_t session, const gnutls_datum_t* identity,
                        gnutls_datum_t* key) {
  auto* conn = static_cast<TlsConnection*>(gnutls_session_get_ptr(session));
  TlsContext& c = conn->context_;
  const std::string name(reinterpret_cast<const char*>(identity->data), identity->size);
  std::optional<std::string> found;
  if (auto it = c.file_keys_.find(name); it != c.file_keys_.end()) {
    found = it->second;
  } else if (c.catalog_) {
    found = c.catalog_->psk_key(name);
  }
  if (!found || found->empty()) return -1;  // an unknown identity fails the handshake
  key->data = static_cast<unsigned char*>(gnutls_malloc(found->size()));
  if (key->data == nullptr) return -1;
  std::memcpy(key->data, found->data(), found->size());
  key->size = static_cast<unsigned>(found->size());
  return 0;
}

TlsConnection::TlsConnection(std::shared_ptr<TlsContext> context, int fd,
                             std::chrono::steady_clock::time_point deadline)
    : owner_(std::move(context)),
      context_(*owner_),
      fd_(fd),
      deadline_(deadline),
      in_(new char[kInBufferSize]) {}

TlsConnection::~TlsConnection() {
  stream_.reset();
  if (session_ != nullptr) gnutls_deinit(session_);
}

bool TlsConnection::wait(short events, std::chrono::steady_clock::time_point deadline) const {
  for (;;) {
    int timeout = -1;
    if (deadline != std::chrono::steady_clock::time_point::max()) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left <= std::chrono::milliseconds(0)) return false;
      timeout = static_cast<int>(std::min<int64_t>(left.count(), INT_MAX));
    }
    pollfd p{fd_, events, 0};
    const int rc = ::poll(&p, 1, timeout);
    if (rc > 0) return true;  // ready, or an error the next call reports
    if (rc < 0 && errno != EINTR) return false;
  }
}

ssize_t TlsConnection::pull(gnutls_transport_ptr_t self, void* buf, size_t size) {
  auto* c = static_cast<TlsConnection*>(self);
  while (c->in_pos_ == c->in_end_) {
    // In the relay a read waits as long as the client stays: a blocking recv, no poll.
    const ssize_t n = ::recv(c->fd_, c->in_.get(), kInBufferSize, c->relaying_ ? 0 : MSG_DONTWAIT);
    if (n >= 0) {
      if (n == 0) return 0;
      c->in_pos_ = 0;
      c->in_end_ = static_cast<size_t>(n);
      break;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN) {
      gnutls_transport_set_errno(c->session_, errno);
      return -1;
    }
    const auto deadline =
        c->relaying_ ? std::chrono::steady_clock::time_point::max() : c->deadline_;
    if (!c->wait(POLLIN, deadline)) {
      gnutls_transport_set_errno(c->session_, ETIMEDOUT);
      return -1;
    }
  }
  const size_t n = std::min(size, c->in_end_ - c->in_pos_);
  std::memcpy(buf, c->in_.get() + c->in_pos_, n);
  c->in_pos_ += n;
  return static_cast<ssize_t>(n);
}

int TlsConnection::pull_timeout(gnutls_transport_ptr_t self, unsigned int ms) {
  auto* c = static_cast<TlsConnection*>(self);
  if (c->in_pos_ < c->in_end_) return 1;
  pollfd p{c->fd_, POLLIN, 0};
  const int timeout = ms == GNUTLS_INDEFINITE_TIMEOUT ? -1 : static_cast<int>(ms);
  return ::poll(&p, 1, timeout);
}

ssize_t TlsConnection::push(gnutls_transport_ptr_t self, const giovec_t* iov, int count) {
  auto* c = static_cast<TlsConnection*>(self);
  if (gathered_records != nullptr) {
    size_t total = 0;
    for (int i = 0; i < count; ++i) {
      gathered_records->append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
      total += iov[i].iov_len;
    }
    return static_cast<ssize_t>(total);
  }
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(reinterpret_cast<const iovec*>(iov));
  msg.msg_iovlen = static_cast<size_t>(count);
  for (;;) {
    const ssize_t n = ::sendmsg(c->fd_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    if (errno != EAGAIN) {
      gnutls_transport_set_errno(c->session_, errno);
      return -1;
    }
    auto deadline = c->deadline_;
    if (c->relaying_) {
      deadline = c->send_timeout_.count() > 0 ? std::chrono::steady_clock::now() + c->send_timeout_
                                              : std::chrono::steady_clock::time_point::max();
    }
    if (!c->wait(POLLOUT, deadline)) {
      gnutls_transport_set_errno(c->session_, ETIMEDOUT);
      return -1;
    }
  }
}

ByteStream* TlsConnection::start(TlsPeer& proved) {
  int rc = gnutls_init(&session_, GNUTLS_SERVER);
  if (rc == 0) rc = gnutls_priority_set(session_, context_.priority_);
  if (rc == 0) rc = gnutls_credentials_set(session_, GNUTLS_CRD_PSK, context_.psk_);
  if (rc == 0 && context_.x509_ != nullptr) {
    rc = gnutls_credentials_set(session_, GNUTLS_CRD_CERTIFICATE, context_.x509_);
    // A client with a certificate must have one the CA signed, checked during the handshake.
    gnutls_certificate_server_set_request(session_, GNUTLS_CERT_REQUIRE);
    gnutls_session_set_verify_cert(session_, nullptr, 0);
  }
  if (rc != 0) {
    failure_ = gnutls_strerror(rc);
    return nullptr;
  }
  gnutls_session_set_ptr(session_, this);
  gnutls_transport_set_ptr(session_, this);
  gnutls_transport_set_pull_function(session_, &TlsConnection::pull);
  gnutls_transport_set_pull_timeout_function(session_, &TlsConnection::pull_timeout);
  gnutls_transport_set_vec_push_function(session_, &TlsConnection::push);
  gnutls_handshake_set_timeout(session_, 0);  // the connection's own deadline rules
  do {
    rc = gnutls_handshake(session_);
  } while (rc < 0 && gnutls_error_is_fatal(rc) == 0);
  if (rc < 0) {
    failure_ = gnutls_strerror(rc);
    return nullptr;
  }
  if (gnutls_auth_get_type(session_) == GNUTLS_CRD_PSK) {
    gnutls_datum_t name{};
    if (gnutls_psk_server_get_username2(session_, &name) == 0 && name.data != nullptr) {
      proved.psk_identity.assign(reinterpret_cast<const char*>(name.data), name.size);
    }
  } else if (gnutls_auth_get_type(session_) == GNUTLS_CRD_CERTIFICATE) {
    unsigned count = 0;
    const gnutls_datum_t* certs = gnutls_certificate_get_peers(session_, &count);
    gnutls_x509_crt_t crt = nullptr;
    gnutls_datum_t dn{};
    if (count > 0 && gnutls_x509_crt_init(&crt) == 0) {
      if (gnutls_x509_crt_import(crt, &certs[0], GNUTLS_X509_FMT_DER) == 0 &&
          gnutls_x509_crt_get_dn3(crt, &dn, 0) == 0) {
        proved.x509_dn.assign(reinterpret_cast<const char*>(dn.data), dn.size);
        gnutls_free(dn.data);
      }
      gnutls_x509_crt_deinit(crt);
    }
    if (proved.x509_dn.empty()) {
      failure_ = "no client certificate";
      return nullptr;
    }
  }
  stream_ = std::make_unique<Stream>(session_);
  return stream_.get();
}

std::string TlsConnection::description() const {
  if (session_ == nullptr) return "no TLS";
  std::string text = gnutls_protocol_get_name(gnutls_protocol_get_version(session_));
  text += ' ';
  text += gnutls_cipher_get_name(gnutls_cipher_get(session_));
  return text;
}

void TlsConnection::cut_off() {
  ::shutdown(fd_, SHUT_RDWR);
}

void TlsConnection::relay(int plain_fd, std::chrono::milliseconds send_timeout) {
  send_timeout_ = send_timeout;
  relaying_ = true;
  std::thread to_client;
  try {
    to_client = std::thread([this, plain_fd] { relay_to_client(plain_fd); });
  } catch (const std::system_error&) {
    ::shutdown(plain_fd, SHUT_RDWR);  // no thread to answer: the worker sees the client gone
    return;
  }
  // From the client to the worker: every record already here goes in one write.
  std::unique_ptr<char[]> buf(new char[kRelayBufferSize]);
  for (bool open = true; open;) {
    size_t have = 0;
    while (have + kMaxRecord <= kRelayBufferSize) {
      const ssize_t n = gnutls_record_recv(session_, buf.get() + have, kRelayBufferSize - have);
      if (n == GNUTLS_E_INTERRUPTED || n == GNUTLS_E_AGAIN) continue;
      if (n <= 0) {  // the client's close_notify or end, or a bad record
        open = false;
        break;
      }
      have += static_cast<size_t>(n);
      // More without waiting only when a whole record is decrypted or buffered already.
      if (gnutls_record_check_pending(session_) == 0 && in_pos_ == in_end_) break;
    }
    if (have > 0 && !send_all(plain_fd, buf.get(), have)) break;
  }
  ::shutdown(plain_fd, SHUT_WR);  // the worker reads the client's end, answers, and closes
  to_client.join();
}

bool TlsConnection::send_gathered(const std::string& records) {
  giovec_t v{const_cast<char*>(records.data()), records.size()};
  size_t sent = 0;
  while (sent < records.size()) {
    v.iov_base = const_cast<char*>(records.data()) + sent;
    v.iov_len = records.size() - sent;
    const ssize_t n = push(this, &v, 1);
    if (n < 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

void TlsConnection::relay_to_client(int plain_fd) {
  std::unique_ptr<char[]> buf(new char[kRelayBufferSize]);
  std::string records;
  records.reserve(kRelayBufferSize + kRelayBufferSize / 8);
  bool clean_end = false;
  for (;;) {
    const ssize_t n = ::recv(plain_fd, buf.get(), kRelayBufferSize, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      clean_end = n == 0;
      break;
    }
    // Corked: the replies of one read leave in as few records and one sendmsg.
    gnutls_record_cork(session_);
    size_t sent = 0;
    bool ok = true;
    while (ok && sent < static_cast<size_t>(n)) {
      const ssize_t w =
          gnutls_record_send(session_, buf.get() + sent, static_cast<size_t>(n) - sent);
      if (w == GNUTLS_E_AGAIN || w == GNUTLS_E_INTERRUPTED) continue;
      ok = w > 0;
      if (ok) sent += static_cast<size_t>(w);
    }
    int rc = 0;
    records.clear();
    // Small replies gathered into one sendmsg; large ones go a 16 KiB record per sendmsg,
    // which costs less than copying them once more.
    if (static_cast<size_t>(n) < kGatherBelow) gathered_records = &records;
    do {
      rc = gnutls_record_uncork(session_, GNUTLS_RECORD_WAIT);
    } while (rc == GNUTLS_E_AGAIN || rc == GNUTLS_E_INTERRUPTED);
    gathered_records = nullptr;
    if (!ok || rc < 0 || !send_gathered(records)) break;
  }
  // The worker closed (after a disconnect, a revocation, a stop): close_notify, then end the
  // other direction too. A failed send means the client is gone: the worker learns at once.
  if (clean_end) gnutls_bye(session_, GNUTLS_SHUT_WR);
  ::shutdown(plain_fd, SHUT_RDWR);
  ::shutdown(fd_, SHUT_RDWR);
}

}  // namespace shareblk::target
