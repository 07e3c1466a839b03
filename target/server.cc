// Listeners, handshakes and the registry of live connections.
//
// Each accepted client gets a short-lived thread for its handshake (blocking, with a deadline),
// then its socket moves to an io_uring worker for the transmission phase. Handshakes are rare
// and small; keeping them off the workers keeps a slow or hostile client from stalling I/O.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "target/rate_limited_log.h"
#include "target/server.h"
#include "target/sockets.h"
#include "target/tls.h"
#include "target/worker.h"

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

}  // namespace

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
  size_t handshakes = 0;        // handshake threads running, evicted ones too: stop() waits
  // A place in a handshake table: Unix and TCP have one each, of max_handshakes places, so
  // that neither kind of client can take the other's. A handshake leaves its table when its
  // negotiation ends, or when a newcomer finds the table full and it is the stalest
  // (evict_stalest).
  struct HandshakePlace {
    int fd = -1;
    bool tcp = false;
    std::string key;          // peer_key()
    bool progressed = false;  // the client has sent a whole message (HandshakeProgress)
    std::chrono::steady_clock::time_point last;  // accepted, or its last whole message
  };
  std::unordered_map<uint64_t, HandshakePlace> places;  // by handshake id
  uint64_t last_place = 0;
  std::array<size_t, 2> places_taken{};  // [tcp]
  std::array<size_t, 2> evicted{};       // [tcp]: handshakes evicted whose thread still runs
  std::unordered_map<std::string, size_t> handshakes_by_peer;  // places taken, by peer_key()
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
  void handshake(int fd, bool tcp, uint64_t id);
  // Under the lock, with `tcp`'s table full: shuts down the stalest handshake and frees its
  // place; `peer` says whose it was. The stalest: one whose client never sent a whole message
  // before one that did; of those, one of the peer holding the most places; then the one
  // that has gone longest without progress. False when there is none, or when the evicted
  // ones whose threads still run fill a table already (threads stay bounded).
  bool evict_stalest(bool tcp, std::string& peer);
  // Under the lock: frees handshake `id`'s place. False when it was evicted: its socket is
  // shut down, and it is not to be served.
  bool leave_table(uint64_t id, bool tcp);
  // Waits until the group has no connection older than `serial`, draining them (then, past
  // the grace period, cutting them off). Called without the lock.
  void supersede(const std::string& group, uint64_t serial);
  // Under `lock`: waits until `gone()`. Past the grace period it cuts off the connections
  // (`group`'s older than `below`, or all) whose client takes no replies (or sends no payload
  // it owes) for that long, and goes on waiting for the others: their requests are in
  // storage, and neither the fence nor the exit may come before those complete.
  void wait_closed(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds grace,
                   const std::function<bool()>& gone, const std::optional<std::string>& group,
                   uint64_t below, const std::string& what);
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
    const bool tcp = listener.tcp;
    std::string key = peer_key(fd, tcp);
    std::unique_lock lock(mutex);
    const char* refusal = nullptr;
    std::string evicted_peer;
    if (stopping) {
      refusal = "shutting down";
    } else if (open_connections >= options.max_connections) {
      refusal = "too many connections (--max-connections)";
    } else if (handshakes_by_peer[key] >= options.max_handshakes_per_peer) {
      refusal = "too many handshakes from one peer (--max-handshakes-per-peer)";
    } else if (places_taken[tcp] >= options.max_handshakes && !evict_stalest(tcp, evicted_peer)) {
      refusal = "too many connections in their handshake (--max-handshakes)";
    }
    if (refusal != nullptr) {
      if (handshakes_by_peer[key] == 0) handshakes_by_peer.erase(key);
      lock.unlock();
      refusals.warn(refusal, key);
      ::close(fd);
      continue;
    }
    // Started under the lock, which the handshake takes only later: the connection is counted
    // before that, and only once its thread exists.
    const uint64_t id = ++last_place;
    try {
      std::thread([this, fd, tcp, id] { handshake(fd, tcp, id); }).detach();
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
    ++places_taken[tcp];
    places.emplace(
        id, HandshakePlace{fd, tcp, std::move(key), false, std::chrono::steady_clock::now()});
    lock.unlock();
    if (!evicted_peer.empty()) {
      refusals.warn_line("handshake table full",
                         fmt::format("nbd: the {} handshake table is full (--max-handshakes): "
                                     "closed the stalest handshake, of {}, to let a new "
                                     "connection in",
                                     tcp ? "TCP" : "Unix", evicted_peer));
    }
  }
}

bool Server::Impl::evict_stalest(bool tcp, std::string& peer) {
  if (evicted[tcp] >= options.max_handshakes) return false;
  // A client of a peer with few places is not the one to go while others hold many.
  struct Rank {
    bool progressed;
    size_t peer_places;
    std::chrono::steady_clock::time_point last;
    bool staler_than(const Rank& o) const {
      if (progressed != o.progressed) return !progressed;
      if (peer_places != o.peer_places) return peer_places > o.peer_places;
      return last < o.last;
    }
  };
  auto stalest = places.end();
  Rank worst{};
  for (auto it = places.begin(); it != places.end(); ++it) {
    const HandshakePlace& p = it->second;
    if (p.tcp != tcp) continue;
    const auto by_peer = handshakes_by_peer.find(p.key);
    const Rank rank{p.progressed, by_peer == handshakes_by_peer.end() ? 0 : by_peer->second,
                    p.last};
    if (stalest == places.end() || rank.staler_than(worst)) {
      stalest = it;
      worst = rank;
    }
  }
  if (stalest == places.end()) return false;
  // Its thread sees the socket end, fails its negotiation and closes it; leave_table() tells
  // it that its place is gone.
  ::shutdown(stalest->second.fd, SHUT_RDWR);
  peer = stalest->second.key;
  if (auto by_peer = handshakes_by_peer.find(peer);
      by_peer != handshakes_by_peer.end() && --by_peer->second == 0) {
    handshakes_by_peer.erase(by_peer);
  }
  places.erase(stalest);
  --places_taken[tcp];
  ++evicted[tcp];
  return true;
}

bool Server::Impl::leave_table(uint64_t id, bool tcp) {
  auto it = places.find(id);
  if (it == places.end()) {
    --evicted[tcp];
    return false;
  }
  if (auto by_peer = handshakes_by_peer.find(it->second.key);
      by_peer != handshakes_by_peer.end() && --by_peer->second == 0) {
    handshakes_by_peer.erase(by_peer);
  }
  places.erase(it);
  --places_taken[tcp];
  return true;
}

void Server::Impl::handshake(int fd, bool tcp, uint64_t id) {
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
  // Each whole message of the client's keeps its place from being the stalest.
  struct Progress final : HandshakeProgress {
    Progress(Impl& server, uint64_t handshake) : s(server), id(handshake) {}
    void progressed() override {
      std::lock_guard lock(s.mutex);
      if (auto it = s.places.find(id); it != s.places.end()) {
        it->second.progressed = true;
        it->second.last = std::chrono::steady_clock::now();
      }
    }
    Impl& s;
    uint64_t id;
  } progress(*this, id);
  std::optional<Session> session = negotiate(stream, *catalog, peer, secure.get(), &progress);
  {
    std::lock_guard lock(mutex);
    // Evicted: its socket was shut down, whatever the negotiation got to.
    if (!leave_table(id, tcp)) session.reset();
    // Its place among the group's connections, taken as soon as the client has its answer
    // (before it goes to a worker): a client can have used this connection and given up on
    // it only after this, so a connection it opened later always has a higher serial.
    if (session) session->serial = ++last_serial[session->exp.group];
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
  size_send_buffer(fd, tcp, options.tcp_send_buffer);

  {
    std::unique_lock lock(mutex);
    --handshakes;
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

std::error_code Server::bind(std::string& what) {
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
  return {};
}

void Server::serve() {
  Impl& s = *impl_;
  s.running = true;
  for (auto& l : s.listeners) {
    l.thread = std::thread([&s, &l] { s.accept_loop(l); });
  }
}

std::error_code Server::start(std::string& what) {
  if (std::error_code ec = bind(what)) return ec;
  serve();
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
    for (const auto& [id, place] : s.places) ::shutdown(place.fd, SHUT_RDWR);
    s.changed.wait(lock, [&] { return s.handshakes == 0; });
  }
  // Requests already received are answered before their connections close (issue 40).
  for (auto& w : s.workers) w->wind_down();
  {
    std::unique_lock lock(s.mutex);
    s.wait_closed(
        lock, s.options.stop_grace, [&] { return s.live.empty(); }, std::nullopt, UINT64_MAX,
        "the connections");
  }
  for (auto& w : s.workers) w->stop();
  {
    std::lock_guard lock(s.mutex);  // stats() reads the workers under it
    s.workers.clear();
  }
}

void Server::Impl::wait_closed(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds grace,
                               const std::function<bool()>& gone,
                               const std::optional<std::string>& group, uint64_t below,
                               const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  if (changed.wait_for(lock, grace, gone)) return;
  spdlog::warn(
      "nbd: {} still have requests after {} ms: waiting for the storage to complete them; "
      "a client that takes no reply for that long is cut off",
      what, grace.count());
  const auto step = std::clamp<std::chrono::milliseconds>(grace / 10, std::chrono::milliseconds(10),
                                                          std::chrono::milliseconds(1000));
  do {
    const auto since = std::chrono::steady_clock::now() - grace;
    lock.unlock();
    for (auto& w : workers) w->cut_off_stalled(group, below, since);
    lock.lock();
  } while (!changed.wait_for(lock, step, gone));
  spdlog::info("nbd: {} closed after {} ms", what,
               std::chrono::duration_cast<std::chrono::milliseconds>(
                   std::chrono::steady_clock::now() - start)
                   .count());
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
  wait_closed(lock, options.close_grace, none_older, group, serial,
              "older connections of " + group);
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
  s.wait_closed(
      lock, s.options.close_grace, [&] { return s.live.count(group) == 0; }, group, UINT64_MAX,
      "connections of " + group);
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
