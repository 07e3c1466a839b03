// GET /metrics over HTTP/1.1: a responder for exactly that, on one thread polling at most
// ListenerLimits::max_connections connections. It replaced cpp-httplib (0.11), whose server
// accepts every connection and queues it for its thread pool (a descriptor each, without
// bound), gives a client that sends a byte every few seconds its thread for ever, and answers
// Range headers with a multipart body of every range asked (docs/metrics.md, "Bounds of the
// metrics endpoint").
#include <fcntl.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <thread>
#include <vector>

#include "metrics/metrics.h"
#include "target/rate_limited_log.h"
#include "target/sockets.h"

namespace shareblk::metrics {

namespace {

using Clock = std::chrono::steady_clock;

// Connections accepted per turn of the loop, so that a flood of them does not keep the
// connections already open from being served.
constexpr int kAcceptBatch = 64;
// How long accept waits after running out of descriptors (or memory), rather than spinning on
// a listening socket that stays readable.
constexpr std::chrono::milliseconds kAcceptPause{100};

struct Connection {
  int fd = -1;
  Clock::time_point accepted;
  std::string in;   // the request so far, at most max_request_bytes
  std::string out;  // the response, once the request is in
  size_t sent = 0;
  bool answering = false;
};

// "tcp ADDR:PORT" of an accepted connection, for log lines.
std::string peer_text(int fd) {
  return target::describe_endpoint(target::peer_of(fd, true));
}

std::string response(int status, std::string_view reason, std::string_view type,
                     const std::string& body, bool head, std::string_view extra = {}) {
  std::string r = "HTTP/1.1 " + std::to_string(status) + " " + std::string(reason) +
                  "\r\nContent-Type: " + std::string(type) +
                  "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" +
                  std::string(extra) + "Connection: close\r\n\r\n";
  if (!head) r += body;
  return r;
}

std::string plain(int status, std::string_view reason, std::string_view extra = {}) {
  return response(status, reason, "text/plain; charset=utf-8", std::string(reason) + "\n", false,
                  extra);
}

// Where the request's headers end (the index past the blank line), or npos.
size_t end_of_headers(const std::string& in, size_t from) {
  for (size_t i = in.find('\n', from); i != std::string::npos; i = in.find('\n', i + 1)) {
    if (i + 1 < in.size() && in[i + 1] == '\n') return i + 2;
    if (i + 2 < in.size() && in[i + 1] == '\r' && in[i + 2] == '\n') return i + 3;
  }
  return std::string::npos;
}

}  // namespace

struct Listener::Impl {
  std::function<std::string()> body;
  ListenerLimits limits;
  int listen_fd = -1;
  int wake_fd = -1;  // an eventfd: stop() writes it
  std::thread thread;
  std::vector<Connection> connections;  // oldest first
  Clock::time_point accept_paused_until{};
  // What a client can make the listener log, one line per second per reason.
  target::RateLimitedLog log;

  void run();
  void accept_new(Clock::time_point now);
  bool progress(Connection& c);  // false: done, to be closed
  bool read_request(Connection& c);
  bool send_response(Connection& c);
  void answer(Connection& c);
  void evict_one();
  void close_all();
};

Listener::Listener(std::function<std::string()> body, ListenerLimits limits)
    : impl_(std::make_unique<Impl>()) {
  impl_->body = std::move(body);
  impl_->limits = limits;
}

Listener::~Listener() {
  stop();
}

std::error_code Listener::start(const std::string& endpoint, std::string& bound,
                                std::string& what) {
  const size_t colon = endpoint.rfind(':');
  const std::string port = colon == std::string::npos ? "" : endpoint.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) ||
      std::stoi(port) > 65535) {
    what = "--metrics-listen wants ADDR:PORT, not '" + endpoint + "'";
    return std::make_error_code(std::errc::invalid_argument);
  }
  Impl& s = *impl_;
  if (std::error_code ec = target::listen_tcp(endpoint, s.listen_fd, bound)) {
    what = "metrics listener " + endpoint;
    return ec;
  }
  s.wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s.wake_fd < 0 || ::fcntl(s.listen_fd, F_SETFL, O_NONBLOCK) != 0) {
    std::error_code ec(errno, std::generic_category());
    what = "metrics listener " + endpoint;
    stop();
    return ec;
  }
  s.thread = std::thread([&s] { s.run(); });
  return {};
}

void Listener::stop() {
  Impl& s = *impl_;
  if (s.thread.joinable()) {
    const uint64_t one = 1;
    if (::write(s.wake_fd, &one, sizeof one) != sizeof one) {
      spdlog::error("metrics: cannot wake the listener: {}", std::strerror(errno));
    }
    s.thread.join();
  }
  s.close_all();
}

void Listener::Impl::close_all() {
  for (Connection& c : connections) ::close(c.fd);
  connections.clear();
  for (int* fd : {&listen_fd, &wake_fd}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void Listener::Impl::run() {
  std::vector<pollfd> fds;
  for (;;) {
    const Clock::time_point now = Clock::now();
    Clock::time_point wake = now + std::chrono::hours(1);
    fds.clear();
    fds.push_back({wake_fd, POLLIN, 0});
    // While paused the socket is left out: the connections wait in its backlog.
    fds.push_back({now >= accept_paused_until ? listen_fd : -1, POLLIN, 0});
    if (now < accept_paused_until) wake = accept_paused_until;
    for (const Connection& c : connections) {
      fds.push_back({c.fd, static_cast<short>(c.answering ? POLLOUT : POLLIN), 0});
      wake = std::min(
          wake, c.accepted + (c.answering ? limits.response_deadline : limits.request_deadline));
    }
    // Never negative: that would wait for ever.
    const auto wait = std::max(std::chrono::milliseconds(0),
                               std::chrono::ceil<std::chrono::milliseconds>(wake - now));
    if (::poll(fds.data(), fds.size(), static_cast<int>(wait.count())) < 0 && errno != EINTR) {
      spdlog::error("metrics: poll: {}; the listener stops", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;  // stop()

    // Connections in poll order: accept_new() below only appends.
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      if (fds[i + 2].revents != 0 && !progress(c)) {
        ::close(c.fd);
        c.fd = -1;
      }
    }
    const Clock::time_point after = Clock::now();
    for (Connection& c : connections) {
      if (c.fd < 0) continue;
      if (!c.answering && after - c.accepted >= limits.request_deadline) {
        log.warn_line("metrics slow request",
                      "metrics: closing the connection of " + peer_text(c.fd) +
                          ": no complete request within " +
                          std::to_string(limits.request_deadline.count()) + " ms");
      } else if (c.answering && after - c.accepted >= limits.response_deadline) {
        log.warn_line("metrics slow reader",
                      "metrics: closing the connection of " + peer_text(c.fd) +
                          ": the response not taken within " +
                          std::to_string(limits.response_deadline.count()) + " ms");
      } else {
        continue;
      }
      ::close(c.fd);
      c.fd = -1;
    }
    std::erase_if(connections, [](const Connection& c) { return c.fd < 0; });
    if (fds[1].revents != 0) accept_new(after);
  }
}

void Listener::Impl::accept_new(Clock::time_point now) {
  for (int i = 0; i < kAcceptBatch; ++i) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      // EMFILE, ENFILE, ENOBUFS, ENOMEM: the connection waits in the backlog meanwhile.
      log.warn_line("metrics accept", "metrics: accept: " + std::string(std::strerror(errno)) +
                                          "; trying again in " +
                                          std::to_string(kAcceptPause.count()) + " ms");
      accept_paused_until = now + kAcceptPause;
      return;
    }
    Connection c;
    c.fd = fd;
    c.accepted = now;
    // A scrape's request is usually there already: it is answered without taking a place.
    if (!progress(c)) {
      ::close(fd);
      continue;
    }
    if (!connections.empty() && connections.size() >= limits.max_connections) evict_one();
    connections.push_back(std::move(c));
  }
}

// The oldest connection still sending its request, or else the oldest being answered: a
// scrape sends its request at once, so what is pushed out is what has been slow the longest.
void Listener::Impl::evict_one() {
  auto victim = std::find_if(connections.begin(), connections.end(),
                             [](const Connection& c) { return !c.answering; });
  if (victim == connections.end()) victim = connections.begin();
  log.warn_line(
      "metrics evicted",
      "metrics: " + std::to_string(connections.size()) +
          " connections open, the most there may be: closing the oldest (" + peer_text(victim->fd) +
          ", " + (victim->answering ? "its response not taken" : "its request incomplete") + ")");
  ::close(victim->fd);
  connections.erase(victim);
}

bool Listener::Impl::progress(Connection& c) {
  return c.answering ? send_response(c) : read_request(c);
}

bool Listener::Impl::read_request(Connection& c) {
  char buf[4096];
  while (c.in.size() < limits.max_request_bytes) {
    const size_t room = std::min(sizeof buf, limits.max_request_bytes - c.in.size());
    const ssize_t n = ::recv(c.fd, buf, room, 0);
    if (n == 0) return false;  // gone before its request was complete
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
    const size_t from = c.in.size() >= 2 ? c.in.size() - 2 : 0;
    c.in.append(buf, static_cast<size_t>(n));
    if (end_of_headers(c.in, from) != std::string::npos) {
      answer(c);
      return send_response(c);
    }
  }
  log.warn_line("metrics oversized", "metrics: answering 431 to " + peer_text(c.fd) +
                                         ": no end of headers within " +
                                         std::to_string(limits.max_request_bytes) + " bytes");
  c.out = plain(431, "Request Header Fields Too Large");
  c.answering = true;
  return send_response(c);
}

// The response to the request in c.in, whose headers are complete. No header changes it:
// Range, Accept-Encoding and keep-alive are ignored, the whole body is sent and the
// connection closed.
void Listener::Impl::answer(Connection& c) {
  c.answering = true;
  const size_t eol = c.in.find('\n');
  std::string_view line(c.in.data(), eol);
  if (line.ends_with('\r')) line.remove_suffix(1);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos ||
      !line.substr(sp2 + 1).starts_with("HTTP/1.")) {
    c.out = plain(400, "Bad Request");
    return;
  }
  const std::string_view method = line.substr(0, sp1);
  std::string_view path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const size_t scheme = path.find("://"); scheme != std::string_view::npos) {
    const size_t slash = path.find('/', scheme + 3);  // absolute-form, from a proxy
    path = slash == std::string_view::npos ? "/" : path.substr(slash);
  }
  path = path.substr(0, path.find('?'));
  if (path != "/metrics") {
    c.out = plain(404, "Not Found");
  } else if (method != "GET" && method != "HEAD") {
    c.out = plain(405, "Method Not Allowed", "Allow: GET, HEAD\r\n");
  } else {
    try {
      c.out =
          response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", body(), method == "HEAD");
    } catch (const std::exception& e) {
      log.warn_line("metrics body", "metrics: cannot render the metrics: " + std::string(e.what()));
      c.out = plain(500, "Internal Server Error");
    }
  }
}

bool Listener::Impl::send_response(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
    c.sent += static_cast<size_t>(n);
  }
  // Done. Bytes the client sent past its headers (a body) are read first: closing with them
  // unread would reset the connection, and the client could lose the response.
  ::shutdown(c.fd, SHUT_WR);
  char buf[4096];
  int reads = 0;
  while (reads++ < 16 && ::recv(c.fd, buf, sizeof buf, 0) > 0) continue;
  return false;
}

}  // namespace shareblk::metrics
