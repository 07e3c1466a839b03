// The control socket: a listener thread, a thread per client, replies and notices in order.
#include "control/control.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <utility>

#include "control/jsonrpc.h"
#include "control/service.h"
#include "rights/rights.h"
#include "target/rate_limited_log.h"

namespace shareblk::control {

namespace {

// A control socket line may not be longer than this; a longer one is answered with a parse
// error and skipped.
constexpr size_t kMaxLine = 1 << 20;
// Reply bytes held at once for all clients, while they are sent (a client that does not read
// holds its reply until it does, or goes). Past it a reply is replaced by a short error.
constexpr size_t kMaxReplyMemory = 256 << 20;

// A share of kMaxReplyMemory, held while one reply is sent.
class ReplyShare {
 public:
  ReplyShare(std::atomic<size_t>& held, size_t bytes) : held_(held), bytes_(bytes) {
    if (held_.fetch_add(bytes_) + bytes_ > kMaxReplyMemory) {
      held_.fetch_sub(bytes_);
      bytes_ = 0;
    }
  }
  ~ReplyShare() { held_.fetch_sub(bytes_); }
  ReplyShare(const ReplyShare&) = delete;
  ReplyShare& operator=(const ReplyShare&) = delete;
  bool granted() const { return bytes_ != 0; }

 private:
  std::atomic<size_t>& held_;
  size_t bytes_;
};

// After its refusal line: lets a refused client finish sending its request (up to EOF or a
// second), so that it reads the refusal instead of failing its write on a closed socket.
void linger_briefly(int fd) {
  ::shutdown(fd, SHUT_WR);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  char sink[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) return;
    if (::recv(fd, sink, sizeof sink, 0) <= 0) return;
  }
}

class Catalog final : public target::ExportCatalog {
 public:
  explicit Catalog(Service& service) : service_(service) {}
  Lookup resolve(const std::string& name, const target::Peer& peer) override {
    try {
      return service_.resolve(name, peer);
    } catch (const std::exception& e) {
      spdlog::error("control: resolving an export failed: {}", e.what());
      return {};
    }
  }
  std::optional<std::string> psk_key(const std::string& identity) override {
    try {
      return service_.psk_key(identity);
    } catch (const std::exception& e) {
      spdlog::error("control: looking up a TLS-PSK identity failed: {}", e.what());
      return std::nullopt;
    }
  }
  // Attachment export names are capabilities: NBD_OPT_LIST shows none of them.
  std::vector<std::string> listable() override { return {}; }

 private:
  Service& service_;
};

}  // namespace

struct ControlPlane::Impl {
  Impl(const std::string& db_path, store::VolumeStore& store, Policy policy,
       store::Gateways* gateways)
      : service(db_path, store, std::move(policy), gateways),
        catalog(std::make_shared<Catalog>(service)) {}

  void accept_loop();
  void serve_client(int fd);
  void refuse(int fd, const std::string& why);

  Service service;
  std::shared_ptr<Catalog> catalog;

  int listen_fd = -1;
  int stop_event = -1;      // an eventfd: written at stop, ends the accept loop's wait
  std::string socket_path;  // the socket listen() bound; empty for a passed one
  size_t max_clients = 0;
  Roles roles;
  std::thread acceptor;
  std::mutex mutex;
  std::condition_variable idle;
  std::unordered_set<int> clients;
  bool stopping = false;
  std::atomic<size_t> reply_bytes{0};  // see ReplyShare
  target::RateLimitedLog refused_log;  // callers with no role can cause these lines in bulk
};

ControlPlane::ControlPlane(const std::string& db_path, store::VolumeStore& store, Policy policy,
                           store::Gateways* gateways)
    : impl_(std::make_unique<Impl>(db_path, store, std::move(policy), gateways)) {}

ControlPlane::~ControlPlane() {
  stop();
}

std::shared_ptr<target::ExportCatalog> ControlPlane::catalog() {
  return impl_->catalog;
}

void ControlPlane::bind(target::Server* server, Endpoints endpoints) {
  impl_->service.bind(server, std::move(endpoints));
}

bool ControlPlane::flush_volumes() {
  return impl_->service.flush_volumes();
}

std::string ControlPlane::set_policy(const Policy& policy) {
  return impl_->service.set_policy(policy);
}

std::vector<AttachmentStats> ControlPlane::stats() {
  return impl_->service.attachment_stats("", "");
}

std::string ControlPlane::handle(const std::string& line, const Caller& caller) {
  return handle_line(line, impl_->service, caller);
}

Role role_of(const rights::Credentials& who, const Roles& roles) {
  if (who.uid == 0 || who.uid == ::geteuid()) return Role::Admin;
  if (roles.admin_group && rights::in_group(who, *roles.admin_group)) return Role::Admin;
  if (roles.read_group && rights::in_group(who, *roles.read_group)) return Role::Read;
  return Role::None;
}

std::error_code ControlPlane::listen(const std::string& path, size_t max_clients,
                                     target::SocketAccess access, Roles roles) {
  int fd = -1;
  if (std::error_code ec = target::listen_unix(path, access, fd)) return ec;
  return serve(fd, max_clients, roles, path);
}

std::error_code ControlPlane::serve(int listening_fd, size_t max_clients, Roles roles,
                                    const std::string& socket_path) {
  Impl& s = *impl_;
  s.socket_path = socket_path;
  s.max_clients = max_clients;
  s.roles = roles;
  // nbdkit's connections each hold a control connection for their whole life: some are kept
  // back for operators, or enough NBD clients through nbdkit would lock them out.
  s.service.set_max_subscribers(max_clients - std::min<size_t>(16, max_clients / 2));
  s.stop_event = ::eventfd(0, EFD_CLOEXEC);
  if (s.stop_event < 0) {
    const std::error_code ec(errno, std::generic_category());
    ::close(listening_fd);
    return ec;
  }
  s.listen_fd = listening_fd;
  s.acceptor = std::thread([&s] { s.accept_loop(); });
  return {};
}

void ControlPlane::Impl::accept_loop() {
  for (;;) {
    int fd = target::accept_or_stop(listen_fd, stop_event);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      return;
    }
    std::lock_guard lock(mutex);
    if (stopping) {
      ::close(fd);
      continue;
    }
    if (clients.size() >= max_clients) {
      refuse(fd, "too many control connections (" + std::to_string(max_clients) +
                     " at once); try again later");
      continue;
    }
    clients.insert(fd);
    try {
      std::thread([this, fd] { serve_client(fd); }).detach();
    } catch (const std::system_error& e) {  // out of threads (pids limit, memory)
      clients.erase(fd);
      refuse(fd, std::string("cannot serve another control connection now: ") + e.what());
    }
  }
}

// Tells a client it will not be served, without waiting on it, and closes it.
void ControlPlane::Impl::refuse(int fd, const std::string& why) {
  spdlog::warn("control: {}", why);
  const std::string line = error_line(code_for("internal"), "internal", why) + "\n";
  (void)!::send(fd, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::close(fd);
}

namespace {

// One control-socket client. Replies (from its own thread) and notices (from the threads of
// other clients' calls) share the socket, so every line goes out whole under one mutex. The
// descriptor lives as long as this object, so a notice may shut it down at any time.
class ClientConnection final : public Subscriber {
 public:
  explicit ClientConnection(int fd) : fd_(fd), server_(std::this_thread::get_id()) {}
  ~ClientConnection() override { ::close(fd_); }
  ClientConnection(const ClientConnection&) = delete;
  ClientConnection& operator=(const ClientConnection&) = delete;

  // A reply waits for the client to take it, however long that is.
  void send_line(const std::string& line) {
    {
      std::unique_lock lock(mutex_);
      free_.wait(lock, [&] { return !sending_; });
      sending_ = true;
    }
    if (send_all(line, 0)) send_all("\n", 0);  // no copy of a large reply for its newline
    done_sending();
  }

  // A notice goes out from inside another client's call, which holds a volume's lock: it must
  // not wait on this client. When it cannot go out at once (a reply to this client is stuck,
  // or its socket is full), the link is cut instead. A subscriber (the nbdkit plugin) takes a
  // broken link as a revocation, so the notice's meaning still arrives.
  void notify(const std::string& line) override {
    bool sent = false;
    {
      std::unique_lock lock(mutex_);
      if (free_.wait_for(lock, std::chrono::milliseconds(200), [&] { return !sending_; })) {
        sending_ = true;
        lock.unlock();
        sent = send_all(line + "\n", MSG_DONTWAIT);
        done_sending();
      }
    }
    if (sent) return;
    spdlog::warn("control: a client does not take its notices; closing its connection");
    ::shutdown(fd_, SHUT_RDWR);
  }

  bool wait_gone(std::chrono::steady_clock::time_point deadline) override {
    if (std::this_thread::get_id() == server_) return true;  // our own call: it cannot close
    std::unique_lock lock(gone_mutex_);
    if (gone_changed_.wait_until(lock, deadline, [&] { return gone_; })) return true;
    ::shutdown(fd_, SHUT_RDWR);  // past its time: cut, which it must take as a revocation
    return false;
  }
  // The client closed (or the daemon stops): nothing more is read from it.
  void mark_gone() {
    std::lock_guard lock(gone_mutex_);
    gone_ = true;
    gone_changed_.notify_all();
  }

 private:
  void done_sending() {
    {
      std::lock_guard lock(mutex_);
      sending_ = false;
    }
    free_.notify_one();
  }

  bool send_all(const std::string& out, int flags) {
    const char* p = out.data();
    size_t left = out.size();
    while (left > 0) {
      ssize_t w = ::send(fd_, p, left, MSG_NOSIGNAL | flags);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return false;  // gone, or (MSG_DONTWAIT) full
      p += w;
      left -= static_cast<size_t>(w);
    }
    return true;
  }

  const int fd_;
  const std::thread::id server_;  // the thread that reads its requests
  // One line at a time goes out: `sending_` under a plain mutex rather than a std::timed_mutex,
  // whose timed lock (pthread_mutex_clocklock) GCC 12's ThreadSanitizer does not see: it took
  // the unlock after a notice's wait for a bug.
  std::mutex mutex_;
  std::condition_variable free_;
  bool sending_ = false;
  std::mutex gone_mutex_;
  std::condition_variable gone_changed_;
  bool gone_ = false;
};

}  // namespace

void ControlPlane::Impl::serve_client(int fd) {
  auto connection = std::make_shared<ClientConnection>(fd);
  Caller caller;
  caller.subscriber = connection;
  caller.role = Role::None;  // unless the kernel says who it is
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) caller.pid = cred.pid;
  if (const std::optional<rights::Credentials> who = rights::peer_of(fd)) {
    caller.uid = who->uid;
    caller.gid = who->gid;
    caller.groups = who->groups;
    caller.role = role_of(*who, roles);
  }
  if (caller.role == Role::None) {
    // The socket's mode let it connect (a readonly group needs the socket open to all), but its
    // user is in no group that has a role.
    refused_log.warn_line("no role", "control: uid=" + std::to_string(caller.uid) + " pid=" +
                                         std::to_string(caller.pid) + " has no role here; refused");
    connection->send_line(
        error_line(code_for("forbidden"), "forbidden",
                   "uid " + std::to_string(caller.uid) + " may not use this control socket"));
    linger_briefly(fd);
    connection->mark_gone();
    std::lock_guard lock(mutex);
    clients.erase(fd);
    idle.notify_all();
    return;
  }
  std::string buffer;
  bool skipping = false;  // inside an over-long line
  char chunk[65536];
  for (;;) {
    ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    buffer.append(chunk, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = buffer.find('\n', start)) != std::string::npos; start = nl + 1) {
      std::string line = buffer.substr(start, nl - start);
      if (skipping) {
        skipping = false;
        continue;
      }
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
      std::string reply = handle_line(line, service, caller);
      if (reply.empty()) continue;
      ReplyShare share(reply_bytes, reply.size());
      if (!share.granted()) {
        reply = error_line(code_for("internal"), "internal",
                           "the control plane holds as many replies as it may for clients that "
                           "have not taken them; try again");
      }
      connection->send_line(reply);
    }
    buffer.erase(0, start);
    if (skipping) {
      // More of an over-long line that was already answered: one line, one reply, however
      // long it goes on.
      buffer.clear();
    } else if (buffer.size() > kMaxLine) {
      connection->send_line(error_line(kParseError, "invalid_params", "line too long"));
      buffer.clear();
      skipping = true;
    }
  }
  connection->mark_gone();
  std::lock_guard lock(mutex);
  clients.erase(fd);  // the descriptor closes with the last reference to `connection`
  idle.notify_all();
}

void ControlPlane::stop() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    if (s.stopping) return;
    s.stopping = true;
  }
  if (s.listen_fd >= 0) {
    const uint64_t one = 1;
    (void)!::write(s.stop_event, &one, sizeof one);  // ends the accept loop's wait
    if (s.acceptor.joinable()) s.acceptor.join();
    ::close(s.listen_fd);
    ::close(s.stop_event);
    // A socket we bound goes with us; a passed one stays with systemd, listening.
    if (!s.socket_path.empty()) ::unlink(s.socket_path.c_str());
  }
  std::unique_lock lock(s.mutex);
  for (int fd : s.clients) ::shutdown(fd, SHUT_RDWR);
  s.idle.wait(lock, [&] { return s.clients.empty(); });
}

}  // namespace shareblk::control
