// TLS on the NBD listeners: credentials, the STARTTLS handshake, and the record layer of the
// transmission phase in memory for the workers (target/tls.h).
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

namespace shareblk::target {

namespace {

// One recv from the client serves many TLS records.
constexpr size_t kInBufferSize = 64 * 1024;

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

ssize_t TlsConnection::take_received(void* buf, size_t size) {
  const size_t n = std::min(size, in_end_ - in_pos_);
  std::memcpy(buf, in_.get() + in_pos_, n);
  in_pos_ += n;
  return static_cast<ssize_t>(n);
}

ssize_t TlsConnection::pull(gnutls_transport_ptr_t self, void* buf, size_t size) {
  auto* c = static_cast<TlsConnection*>(self);
  while (c->in_pos_ == c->in_end_) {
    const ssize_t n = ::recv(c->fd_, c->in_.get(), kInBufferSize, MSG_DONTWAIT);
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
    if (!c->wait(POLLIN, c->deadline_)) {
      gnutls_transport_set_errno(c->session_, ETIMEDOUT);
      return -1;
    }
  }
  return c->take_received(buf, size);
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
    if (!c->wait(POLLOUT, c->deadline_)) {
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

// --- The transmission phase ---

void TlsConnection::begin_transmission() {
  gnutls_transport_set_pull_function(session_, &TlsConnection::memory_pull);
  gnutls_transport_set_vec_push_function(session_, &TlsConnection::memory_push);
  // GnuTLS waits through this only with a record timeout, which is never set; it must not
  // poll the socket the worker owns now.
  gnutls_transport_set_pull_timeout_function(session_,
                                             [](gnutls_transport_ptr_t self, unsigned int) -> int {
                                               const auto* c = static_cast<TlsConnection*>(self);
                                               return c->in_pos_ < c->in_end_ ? 1 : 0;
                                             });
}

ssize_t TlsConnection::memory_pull(gnutls_transport_ptr_t self, void* buf, size_t size) {
  auto* c = static_cast<TlsConnection*>(self);
  if (c->in_pos_ == c->in_end_) {
    gnutls_transport_set_errno(c->session_, EAGAIN);
    return -1;
  }
  return c->take_received(buf, size);
}

ssize_t TlsConnection::memory_push(gnutls_transport_ptr_t self, const giovec_t* iov, int count) {
  auto* c = static_cast<TlsConnection*>(self);
  // Behind what waits already (it may be in flight), or at the start of the emptied buffer.
  std::string& to = c->out_pos_ < c->out_.size() ? c->out_next_ : c->out_;
  if (&to == &c->out_) {
    c->out_.clear();
    c->out_pos_ = 0;
  }
  size_t total = 0;
  for (int i = 0; i < count; ++i) {
    to.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
    total += iov[i].iov_len;
  }
  return static_cast<ssize_t>(total);
}

char* TlsConnection::cipher_space(size_t& room) {
  if (in_pos_ == in_end_) {
    in_pos_ = in_end_ = 0;
  } else if (in_pos_ > 0) {
    std::memmove(in_.get(), in_.get() + in_pos_, in_end_ - in_pos_);
    in_end_ -= in_pos_;
    in_pos_ = 0;
  }
  room = kInBufferSize - in_end_;
  return in_.get() + in_end_;
}

void TlsConnection::cipher_received(size_t n) {
  in_end_ += n;
}

bool TlsConnection::readable() const {
  return in_pos_ < in_end_ || gnutls_record_check_pending(session_) > 0;
}

ssize_t TlsConnection::read(char* buf, size_t length) {
  for (;;) {
    const ssize_t n = gnutls_record_recv(session_, buf, length);
    if (n >= 0) return n;
    if (n == GNUTLS_E_INTERRUPTED) continue;
    return n == GNUTLS_E_AGAIN ? -EAGAIN : -EPROTO;
  }
}

int TlsConnection::write(const iovec* iov, int count) {
  // Corked: the replies of a batch leave in as few records as they fill, not one or two each.
  gnutls_record_cork(session_);
  for (int i = 0; i < count; ++i) {
    const char* p = static_cast<const char*>(iov[i].iov_base);
    size_t left = iov[i].iov_len;
    while (left > 0) {
      const ssize_t n = gnutls_record_send(session_, p, left);
      if (n == GNUTLS_E_INTERRUPTED || n == GNUTLS_E_AGAIN) continue;
      if (n <= 0) {
        gnutls_record_uncork(session_, 0);
        return -EIO;
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  int rc = 0;
  do {
    rc = gnutls_record_uncork(session_, GNUTLS_RECORD_WAIT);
  } while (rc == GNUTLS_E_AGAIN || rc == GNUTLS_E_INTERRUPTED);
  return rc < 0 ? -EIO : 0;
}

void TlsConnection::close_notify() {
  gnutls_bye(session_, GNUTLS_SHUT_WR);
}

std::string_view TlsConnection::output() {
  return {out_.data() + out_pos_, out_.size() - out_pos_};
}

void TlsConnection::sent(size_t n) {
  out_pos_ += n;
  if (out_pos_ < out_.size()) return;
  out_.clear();
  out_pos_ = 0;
  // What came meanwhile goes next. Only then do the buffers trade places: out_ keeps the room
  // a batch needs, and out_next_ stays small.
  if (!out_next_.empty()) out_.swap(out_next_);
}

}  // namespace shareblk::target
