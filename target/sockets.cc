// Sockets: listeners, accepting, options of accepted sockets and who is at the other end.
#include "target/sockets.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <memory>

#include "text/printable.h"

namespace shareblk::target {

void size_send_buffer(int fd, bool tcp, unsigned tcp_bytes) {
  if (tcp && tcp_bytes == 0) return;
  const int bytes = tcp ? static_cast<int>(std::min<unsigned>(tcp_bytes, 1U << 30)) : 4 << 20;
  if (::setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &bytes, sizeof bytes) != 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);  // capped by wmem_max
  }
}

bool is_tcp(int fd) {
  int domain = 0;
  socklen_t len = sizeof domain;
  if (::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0) return false;
  return domain == AF_INET || domain == AF_INET6;
}

void wake_reader_at(int fd, int bytes) {
  ::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof bytes);
}

int unread_bytes(int fd) {
  int n = 0;
  return ::ioctl(fd, FIONREAD, &n) == 0 ? n : 0;
}

void drop_silent_peers_after(int fd, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) return;
  const int seconds = std::max(1, static_cast<int>(timeout.count() / 1000));
  const int one = 1;
  const int idle = std::max(1, seconds / 2);
  const int interval = std::max(1, seconds / 10);
  const int probes = 10;
  const auto user_timeout = static_cast<unsigned>(timeout.count());  // set from an unsigned
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout);
}

std::string tcp_endpoint_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  char text[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
    return "[" + std::string(text) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  auto* a = reinterpret_cast<sockaddr_in*>(&ss);
  ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
  return std::string(text) + ":" + std::to_string(ntohs(a->sin_port));
}

std::error_code inspect_listener(int fd, bool& tcp, std::string& where) {
  int type = 0;
  int listening = 0;
  socklen_t size = sizeof type;
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &size) != 0)
    return {errno, std::generic_category()};
  size = sizeof listening;
  if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) != 0) {
    return {errno, std::generic_category()};
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
    return {errno, std::generic_category()};
  }
  if (type != SOCK_STREAM || listening == 0)
    return std::make_error_code(std::errc::invalid_argument);
  if (ss.ss_family == AF_INET || ss.ss_family == AF_INET6) {
    tcp = true;
    where = tcp_endpoint_of(fd);
    return {};
  }
  if (ss.ss_family != AF_UNIX) return std::make_error_code(std::errc::invalid_argument);
  tcp = false;
  const auto* un = reinterpret_cast<const sockaddr_un*>(&ss);
  const size_t path_len = len - offsetof(sockaddr_un, sun_path);
  // An abstract socket's name starts with a NUL: shown with '@', as ss(8) does.
  where = path_len > 0 && un->sun_path[0] == '\0'
              ? "@" + std::string(un->sun_path + 1, path_len - 1)
              : std::string(un->sun_path, strnlen(un->sun_path, path_len));
  return {};
}

std::error_code listen_tcp(const std::string& endpoint, int& out, std::string& bound) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos) return std::make_error_code(std::errc::invalid_argument);
  std::string host = endpoint.substr(0, colon);
  const std::string port = endpoint.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res) != 0) {
    return std::make_error_code(std::errc::invalid_argument);
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, ::freeaddrinfo);
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return {errno, std::generic_category()};
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    std::error_code ec(errno, std::generic_category());
    ::close(fd);
    return ec;
  }
  bound = tcp_endpoint_of(fd);
  out = fd;
  return {};
}

Peer peer_of(int fd, bool tcp) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  Peer peer;
  if (!tcp) {
    ucred cred{};
    socklen_t cred_len = sizeof cred;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) == 0) {
      peer.uid = cred.uid;
      peer.pid = cred.pid;
    }
    return peer;
  }
  peer.transport = Peer::Transport::Tcp;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return peer;
  char text[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
    peer.address = text;
    peer.port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    peer.port = ntohs(a->sin6_port);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {
      ::inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], text, sizeof text);
    } else {
      ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
    }
    peer.address = text;
  }
  return peer;
}

std::string peer_key(int fd, bool tcp) {
  Peer peer = peer_of(fd, tcp);
  if (tcp) return "tcp " + peer.address;
  return peer.uid ? "uid " + std::to_string(*peer.uid) : std::string("unix");
}

std::error_code listen_unix(const std::string& path, const SocketAccess& access, int& out) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path)
    return std::make_error_code(std::errc::filename_too_long);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(path.c_str());
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return {errno, std::generic_category()};
  // bind() creates the file with the umask's mode: narrowed to `access` there is no moment in
  // which a client it does not admit could connect. The umask is the process's; listeners are
  // bound at start-up, before anything else creates files.
  const mode_t old_umask = ::umask(~access.mode & 0777);
  const int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::umask(old_umask);
  if (bound != 0 ||
      (access.group && ::chown(path.c_str(), static_cast<uid_t>(-1), *access.group) != 0) ||
      ::chmod(path.c_str(), access.mode) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    std::error_code ec(errno, std::generic_category());
    ::close(fd);
    if (bound == 0) ::unlink(path.c_str());
    return ec;
  }
  out = fd;
  return {};
}

int accept_or_stop(int listen_fd, int stop_fd) {
  for (;;) {
    pollfd fds[2] = {{listen_fd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (fds[1].revents != 0) {
      errno = ECANCELED;
      return -1;
    }
    // Non-blocking, or a client gone between poll() and here would leave it blocked where
    // stop_fd cannot wake it. (A passed listener shares O_NONBLOCK with systemd's descriptor;
    // systemd only polls it.)
    const int flags = ::fcntl(listen_fd, F_GETFL);
    if (flags >= 0 && (flags & O_NONBLOCK) == 0) ::fcntl(listen_fd, F_SETFL, flags | O_NONBLOCK);
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0 || errno != EAGAIN) return fd;
  }
}

namespace {
std::string describe(const Peer& peer, bool with_port) {
  std::string text;
  if (peer.transport == Peer::Transport::Tcp) {
    text = "tcp " + peer.address;
    if (with_port) {
      const bool v6 = peer.address.find(':') != std::string::npos;
      text =
          "tcp " + (v6 ? "[" + peer.address + "]" : peer.address) + ":" + std::to_string(peer.port);
    }
  } else if (!peer.uid) {
    text = "unix (no credentials)";
  } else {
    text = "unix pid " + std::to_string(peer.pid) + " uid " + std::to_string(*peer.uid);
  }
  // Who TLS says it is: an identity or a DN is no secret (a key never comes here). Either
  // may hold any bytes: escaped, so that it cannot forge a log line.
  if (peer.tls && !peer.tls->psk_identity.empty()) {
    text += " (TLS PSK identity " + printable(peer.tls->psk_identity) + ")";
  } else if (peer.tls) {
    text += " (TLS certificate " + printable(peer.tls->x509_dn) + ")";
  }
  return text;
}
}  // namespace

std::string describe(const Peer& peer) {
  return describe(peer, false);
}

std::string describe_endpoint(const Peer& peer) {
  return describe(peer, true);
}

}  // namespace shareblk::target
