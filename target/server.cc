// Listeners, handshakes and the registry of live connections.
//
// Each accepted client gets a short-lived thread for its handshake (blocking, with a deadline),
// then its socket moves to an io_uring worker for the transmission phase. Handshakes are rare
// and small; keeping them off the workers keeps a slow or hostile client from stalling I/O.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "target/rate_limited_log.h"
#include "target/target.h"
#include "target/tls.h"
#include "target/worker.h"
#include "text/printable.h"

namespace shareblk::target {

namespace {

// The handshake's socket, with one deadline for the whole handshake. A per-call timeout
// (SO_RCVTIMEO) is no deadline: it restarts with every byte, so a client trickling one byte
// every few seconds would hold its thread and a max_connections slot forever.
class SocketStream final : public ByteStream {
 public:
  SocketStream(int fd, std::chrono::steady_clock::time_point deadline)
      : fd_(fd), deadline_(deadline) {}
  bool read_exact(void* buf, size_t length) override {
    auto* p = static_cast<char*>(buf);
    while (length > 0) {
      if (!wait_until_ready(POLLIN)) return false;
      ssize_t n = ::recv(fd_, p, length, MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) return false;  // closed or reset
      p += n;
      length -= static_cast<size_t>(n);
    }
    return true;
  }
  bool write_all(const void* buf, size_t length) override {
    const auto* p = static_cast<const char*>(buf);
    while (length > 0) {
      if (!wait_until_ready(POLLOUT)) return false;
      ssize_t n = ::send(fd_, p, length, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) return false;
      p += n;
      length -= static_cast<size_t>(n);
    }
    return true;
  }

 private:
  // Waits for `events` for at most the time left; false (errno ETIMEDOUT) once it is up.
  bool wait_until_ready(short events) {
    for (;;) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(
          deadline_ - std::chrono::steady_clock::now());
      if (left <= std::chrono::milliseconds(0)) {
        errno = ETIMEDOUT;
        return false;
      }
      pollfd p{fd_, events, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), INT_MAX)));
      if (rc > 0) return true;  // ready, or an error or hangup the next call reports
      if (rc < 0 && errno != EINTR) return false;
    }
  }

  int fd_;
  std::chrono::steady_clock::time_point deadline_;
};

// Room for several maximum-size replies in the socket: with the default (about 208 KiB on
// Unix sockets) a 1 MiB read reply needs several round trips through the send queue.
void enlarge_send_buffer(int fd) {
  const int bytes = 4 << 20;
  if (::setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &bytes, sizeof bytes) != 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);  // capped by wmem_max
  }
}

// A TCP client whose host dies sends no FIN or RST: without these its connection would stay
// established for ever when idle (keepalive off), or for ~15 min of retransmissions when a
// reply is unacknowledged (tcp_retries2). Both are bounded by `timeout` (tcp(7):
// TCP_USER_TIMEOUT also decides when failed keepalive probes end the connection). A live
// peer answers the probes, and zero-window probes, however long it does not read.
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

// "HOST:PORT" ("[HOST]:PORT" for IPv6) of a bound TCP socket.
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

// A passed-in socket (socket activation) as a listener: whether it is TCP, and its endpoint or
// path. EINVAL for anything but a listening stream socket of AF_UNIX, AF_INET or AF_INET6.
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

// What the per-peer handshake limit counts by: the client's address over TCP, its uid over a
// Unix socket ("" when unknown: all such clients count as one).
std::string peer_key(int fd, bool tcp) {
  Peer peer = peer_of(fd, tcp);
  if (tcp) return "tcp " + peer.address;
  return peer.uid ? "uid " + std::to_string(*peer.uid) : std::string("unix");
}

}  // namespace

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

struct Server::Impl final : ConnectionRegistry {
  struct Listener {
    int fd = -1;
    bool tcp = false;
    std::string path;  // unix sockets we bound: removed at stop (passed ones are not)
    std::thread thread;
  };

  ServerOptions options;
  std::shared_ptr<ExportCatalog> catalog;
  std::vector<std::unique_ptr<Worker>> workers;
  std::vector<Listener> listeners;
  std::vector<std::string> tcp_bound;
  std::vector<std::string> unix_bound;
  int stop_event = -1;  // an eventfd: written at stop, ends the accept loops' wait

  mutable std::mutex mutex;
  std::condition_variable changed;
  bool running = false;
  bool stopping = false;
  size_t next_worker = 0;
  size_t open_connections = 0;  // handshaking + transmitting, for max_connections
  size_t handshakes = 0;
  std::unordered_set<int> handshake_fds;
  std::unordered_map<std::string, size_t> handshakes_by_peer;  // see peer_key()
  RateLimitedLog refusals;
  // group -> the serials of its transmitting connections
  std::unordered_map<std::string, std::set<uint64_t>> live;
  // group -> serial -> who and since when, for stats() and the disconnect line
  std::unordered_map<std::string, std::map<uint64_t, LiveConnection>> peers;
  // group -> the last serial given; kept while the group may get connections (Export::exclusive
  // compares against it), dropped when the group is closed for good.
  std::unordered_map<std::string, uint64_t> last_serial;
  std::unordered_set<std::string> closed_groups;
  std::shared_ptr<TlsContext> tls;  // null: NOTLS; reload_tls() replaces it

  void accept_loop(Listener& listener);
  void handshake(int fd, bool tcp, const std::string& key);
  // Waits until the group has no connection older than `serial`, draining them (then, past
  // the grace period, cutting them off). Called without the lock.
  void supersede(const std::string& group, uint64_t serial);
  void connection_closed(const std::string& group, uint64_t serial) override {
    std::lock_guard lock(mutex);
    auto it = live.find(group);
    if (it != live.end()) {
      it->second.erase(serial);
      if (it->second.empty()) live.erase(it);
    }
    if (auto p = peers.find(group); p != peers.end()) {
      if (auto c = p->second.find(serial); c != p->second.end()) {
        spdlog::info("nbd: {} disconnected from {}", c->second.peer, group);
        p->second.erase(c);
      }
      if (p->second.empty()) peers.erase(p);
    }
    --open_connections;
    changed.notify_all();
  }
};

void Server::Impl::accept_loop(Listener& listener) {
  for (;;) {
    int fd = accept_or_stop(listener.fd, stop_event);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        spdlog::warn("nbd: accept: {}; retrying", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      return;  // stopping (ECANCELED), or the listener failed
    }
    const std::string key = peer_key(fd, listener.tcp);
    std::unique_lock lock(mutex);
    const char* refusal = nullptr;
    if (stopping) {
      refusal = "shutting down";
    } else if (open_connections >= options.max_connections) {
      refusal = "too many connections (--max-connections)";
    } else if (handshakes >= options.max_handshakes) {
      refusal = "too many connections in their handshake (--max-handshakes)";
    } else if (handshakes_by_peer[key] >= options.max_handshakes_per_peer) {
      refusal = "too many handshakes from one peer (--max-handshakes-per-peer)";
    }
    if (refusal != nullptr) {
      if (handshakes_by_peer[key] == 0) handshakes_by_peer.erase(key);
      lock.unlock();
      refusals.warn(refusal, key);
      ::close(fd);
      continue;
    }
    // Started under the lock, which the handshake takes only at its end: the connection is
    // counted before that, and only once its thread exists.
    try {
      std::thread([this, fd, tcp = listener.tcp, key] { handshake(fd, tcp, key); }).detach();
    } catch (const std::system_error& e) {  // out of threads (pids limit, memory)
      if (handshakes_by_peer[key] == 0) handshakes_by_peer.erase(key);
      lock.unlock();
      refusals.warn("cannot start its handshake", e.what());
      ::close(fd);
      continue;
    }
    ++handshakes_by_peer[key];
    ++open_connections;
    ++handshakes;
    handshake_fds.insert(fd);
  }
}

void Server::Impl::handshake(int fd, bool tcp, const std::string& key) {
  if (tcp) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    drop_silent_peers_after(fd, options.peer_timeout);
  }
  const auto deadline = std::chrono::steady_clock::now() + options.handshake_timeout;
  SocketStream stream(fd, deadline);
  std::unique_ptr<TlsConnection> secure;
  std::shared_ptr<TlsContext> credentials;
  {
    std::lock_guard lock(mutex);
    credentials = tls;
  }
  if (credentials) secure = std::make_unique<TlsConnection>(std::move(credentials), fd, deadline);
  const Peer peer = peer_of(fd, tcp);
  std::optional<Session> session = negotiate(stream, *catalog, peer, secure.get());
  if (session) {
    // Its place among the group's connections, taken as soon as the client has its answer
    // (before it goes to a worker): a client can have used this connection and given up on
    // it only after this, so a connection it opened later always has a higher serial.
    std::lock_guard lock(mutex);
    session->serial = ++last_serial[session->exp.group];
  }
  if (secure && !secure->failure().empty()) {
    refusals.warn("TLS handshake failed: " + secure->failure(), describe(peer));
  }
  // A TLS session goes to the worker with the socket: the worker reads and writes its records.
  if (session && secure && secure->started()) {
    spdlog::debug("nbd: {} uses {}", describe(peer), secure->description());
  } else {
    secure.reset();
  }
  enlarge_send_buffer(fd);

  {
    std::unique_lock lock(mutex);
    handshake_fds.erase(fd);
    --handshakes;
    if (auto it = handshakes_by_peer.find(key);
        it != handshakes_by_peer.end() && --it->second == 0) {
      handshakes_by_peer.erase(it);
    }
    auto refuse = [&] {  // under the lock
      --open_connections;
      secure.reset();
      ::close(fd);
      changed.notify_all();
    };
    // Checked under the lock that close_group() takes: an attachment deleted while this client
    // negotiated never gets a live connection.
    if (!session || stopping || closed_groups.count(session->exp.group) != 0) {
      refuse();
      return;
    }
    const std::string group = session->exp.group;
    const uint64_t serial = session->serial;
    if (session->exp.exclusive) {
      lock.unlock();
      supersede(group, serial);
      lock.lock();
      // Detached, stopping, or a newer connection of the group came meanwhile: the newest wins.
      auto last = last_serial.find(group);
      if (stopping || closed_groups.count(group) != 0 || last == last_serial.end() ||
          last->second != serial) {
        refuse();
        return;
      }
    }
    live[group].insert(serial);
    LiveConnection& shown = peers[group][serial];
    shown.peer = describe_endpoint(peer);
    shown.since = std::chrono::system_clock::now();
    shown.serial = serial;
    spdlog::info("nbd: {} connected to {}", shown.peer, group);
    // Posted under the lock, so a close_group() that follows is queued after it. A remote
    // volume's connections all go to the worker that reaps its image's completions.
    const auto worker = static_cast<unsigned>(next_worker++ % workers.size());
    const std::shared_ptr<backend::Volume>& volume = session->exp.volume;
    workers[volume ? volume->home_worker(worker) : worker]->adopt(fd, std::move(*session),
                                                                  std::move(secure));
    changed.notify_all();
  }
}

Server::Server(ServerOptions options, std::shared_ptr<ExportCatalog> catalog)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->catalog = std::move(catalog);
}

Server::~Server() {
  stop();
}

std::error_code Server::start(std::string& what) {
  Impl& s = *impl_;
  unsigned count = s.options.workers ? s.options.workers : std::thread::hardware_concurrency();
  count = std::max(1u, count);
  uint64_t memory = s.options.payload_memory;
  if (memory == 0) {
    memory = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
             static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)) / 4;
  }
  for (unsigned i = 0; i < count; ++i) {
    auto w = std::make_unique<Worker>(s, memory / count, s.options.send_timeout,
                                      s.options.payload_timeout);
    if (std::error_code ec = w->start()) {
      // Each ring is locked memory: under a small RLIMIT_MEMLOCK the first rings fit and the
      // next do not. Fewer workers still serve every connection. (The ones that run keep
      // their share of the payload memory: together less than asked for, never more.)
      if (ec == std::errc::not_enough_memory && !s.workers.empty()) {
        spdlog::warn(
            "nbd: running {} of {} io_uring workers: the next ring does not fit in the "
            "locked-memory limit (RLIMIT_MEMLOCK); raise it to run them all",
            s.workers.size(), count);
        break;
      }
      what = "io_uring worker";
      return ec;
    }
    s.workers.push_back(std::move(w));
  }
  for (const std::string& path : s.options.listen_unix) {
    Impl::Listener l;
    if (std::error_code ec = listen_unix(path, s.options.unix_access, l.fd)) {
      what = "unix socket " + path;
      return ec;
    }
    l.path = path;
    s.unix_bound.push_back(path);
    s.listeners.push_back(std::move(l));
  }
  for (const std::string& endpoint : s.options.listen_tcp) {
    Impl::Listener l;
    l.tcp = true;
    std::string bound;
    if (std::error_code ec = listen_tcp(endpoint, l.fd, bound)) {
      what = "tcp " + endpoint;
      return ec;
    }
    s.tcp_bound.push_back(bound);
    s.listeners.push_back(std::move(l));
  }
  for (const int fd : s.options.listen_fds) {
    Impl::Listener l;
    std::string where;
    if (std::error_code ec = inspect_listener(fd, l.tcp, where)) {
      what = "passed socket (descriptor " + std::to_string(fd) + ")";
      return ec;
    }
    l.fd = fd;
    (l.tcp ? s.tcp_bound : s.unix_bound).push_back(where);
    s.listeners.push_back(std::move(l));
  }
  s.stop_event = ::eventfd(0, EFD_CLOEXEC);
  if (s.stop_event < 0) {
    what = "eventfd";
    return {errno, std::generic_category()};
  }
  if (s.options.tls.mode != TlsOptions::Mode::Off) {
    std::string error;
    s.tls = TlsContext::create(s.options.tls, s.catalog, error);
    if (!s.tls) {
      what = "tls: " + error;
      return std::make_error_code(std::errc::invalid_argument);
    }
    spdlog::info("nbd: TLS {} ({}); records are encrypted in user space by the workers: {}",
                 s.options.tls.mode == TlsOptions::Mode::Require ? "required" : "offered",
                 s.options.tls.x509_dir.empty() ? "PSK" : "PSK and x509",
                 TlsContext::kernel_tls_available()
                     ? "the kernel offers kTLS, which shareblk does not use yet"
                     : "this kernel offers no kTLS (no \"tls\" upper-layer protocol)");
  }
  s.running = true;
  for (auto& l : s.listeners) {
    l.thread = std::thread([&s, &l] { s.accept_loop(l); });
  }
  return {};
}

void Server::stop() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    if (s.stopping) return;
    s.stopping = true;
  }
  if (s.stop_event >= 0) {
    const uint64_t one = 1;
    (void)!::write(s.stop_event, &one, sizeof one);  // wakes every accept loop
  }
  for (auto& l : s.listeners) {
    if (l.thread.joinable()) l.thread.join();
    ::close(l.fd);
    if (!l.path.empty()) ::unlink(l.path.c_str());
  }
  s.listeners.clear();
  if (s.stop_event >= 0) ::close(s.stop_event);
  s.stop_event = -1;
  {
    std::unique_lock lock(s.mutex);
    for (int fd : s.handshake_fds) ::shutdown(fd, SHUT_RDWR);
    s.changed.wait(lock, [&] { return s.handshakes == 0; });
  }
  for (auto& w : s.workers) w->stop();
  {
    std::lock_guard lock(s.mutex);  // stats() reads the workers under it
    s.workers.clear();
  }
}

std::error_code Server::reload_tls(std::string& error) {
  Impl& s = *impl_;
  if (s.options.tls.mode == TlsOptions::Mode::Off) return {};
  std::shared_ptr<TlsContext> fresh = TlsContext::create(s.options.tls, s.catalog, error);
  if (!fresh) return std::make_error_code(std::errc::invalid_argument);
  std::lock_guard lock(s.mutex);
  s.tls = std::move(fresh);
  return {};
}

std::vector<std::string> Server::tcp_endpoints() const {
  return impl_->tcp_bound;
}

std::vector<std::string> Server::unix_paths() const {
  return impl_->unix_bound;
}

void Server::close_group(const std::string& group) {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->closed_groups.insert(group);
    impl_->last_serial.erase(group);
  }
  drain_group(group);
  std::lock_guard lock(impl_->mutex);
  for (auto& w : impl_->workers) w->forget_counters(group);
}

void Server::Impl::supersede(const std::string& group, uint64_t serial) {
  auto none_older = [&] {
    auto it = live.find(group);
    return it == live.end() || *it->second.begin() >= serial;
  };
  std::unique_lock lock(mutex);
  if (none_older()) return;
  spdlog::info("nbd: a new connection of {} replaces its older ones; draining them", group);
  lock.unlock();
  for (auto& w : workers) w->close_group(group, false, serial);
  lock.lock();
  if (!changed.wait_for(lock, options.close_grace, none_older)) {
    spdlog::warn("nbd: older connections of {} did not finish within the grace period; cutting off",
                 group);
    lock.unlock();
    for (auto& w : workers) w->close_group(group, true, serial);
    lock.lock();
    changed.wait(lock, none_older);
  }
}

// Closed while its connections drain, so that the wait cannot be outrun by clients that
// reconnect at once; those are closed after their handshake and connect again.
void Server::close_connections(const std::string& group) {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    if (!s.closed_groups.insert(group).second) return;  // closed for good already
  }
  drain_group(group);
  std::lock_guard lock(s.mutex);
  s.closed_groups.erase(group);
}

void Server::drain_group(const std::string& group) {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    if (s.live.count(group) == 0 || s.workers.empty()) return;
  }
  for (auto& w : s.workers) w->close_group(group, false);
  std::unique_lock lock(s.mutex);
  auto gone = [&] { return s.live.count(group) == 0; };
  if (!s.changed.wait_for(lock, s.options.close_grace, gone)) {
    // A client that stops reading its replies cannot hold the close up forever.
    spdlog::warn("nbd: connections of {} did not finish within the grace period; cutting off",
                 group);
    lock.unlock();
    for (auto& w : s.workers) w->close_group(group, true);
    lock.lock();
    s.changed.wait(lock, gone);
  }
}

size_t Server::connections(const std::string& group) const {
  std::lock_guard lock(impl_->mutex);
  auto it = impl_->live.find(group);
  return it == impl_->live.end() ? 0 : it->second.size();
}

}  // namespace shareblk::target

namespace shareblk::target {

std::vector<GroupStats> Server::stats() const {
  const Impl& s = *impl_;
  std::unordered_map<std::string, IoStats> io;
  std::map<std::string, GroupStats> groups;  // by name, so the order is stable
  std::lock_guard lock(s.mutex);
  for (const auto& w : s.workers) w->collect(io);
  for (auto& [group, figures] : io) {
    GroupStats& g = groups[group];
    g.group = group;
    g.io = std::move(figures);
  }
  for (const auto& [group, connections] : s.peers) {
    GroupStats& g = groups[group];
    g.group = group;
    for (const auto& [serial, c] : connections) g.connections.push_back(c);
  }
  std::vector<GroupStats> out;
  out.reserve(groups.size());
  for (auto& [group, g] : groups) out.push_back(std::move(g));
  return out;
}

}  // namespace shareblk::target
