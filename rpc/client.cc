#include "rpc/client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>

namespace shareblk::rpc {

namespace {

std::error_code from_errno(int err) {
  return {err, std::generic_category()};
}

Outcome link_failure(std::error_code why) {
  Outcome out;
  out.error.emplace();
  out.error->link = why;
  return out;
}

// A response line as an Outcome: its result, or its error object taken apart.
Outcome outcome_of(const Json& response) {
  Outcome out;
  if (const auto error = response.find("error"); error != response.end()) {
    if (!error->is_object()) return link_failure(make_error_code(std::errc::protocol_error));
    Error& e = out.error.emplace();
    if (const auto code = error->find("code"); code != error->end() && code->is_number_integer()) {
      e.code = code->get<int>();
    }
    if (const auto message = error->find("message");
        message != error->end() && message->is_string()) {
      e.message = message->get<std::string>();
    }
    if (const auto data = error->find("data"); data != error->end()) {
      e.data = *data;
      const auto reason = data->is_object() ? data->find("reason") : data->end();
      if (data->is_object() && reason != data->end() && reason->is_string()) {
        e.reason = reason->get<std::string>();
      }
    }
    return out;
  }
  if (const auto result = response.find("result"); result != response.end()) {
    out.result = *result;
    return out;
  }
  return link_failure(make_error_code(std::errc::protocol_error));
}

}  // namespace

std::string Error::describe() const {
  if (link) return link.message();
  return reason.empty() ? message : reason + ": " + message;
}

Client::~Client() {
  if (fd_ >= 0) ::close(fd_);
}

std::error_code Client::connect(const std::string& path,
                                std::chrono::milliseconds timeout) noexcept {
  if (fd_ >= 0) return make_error_code(std::errc::already_connected);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return make_error_code(std::errc::filename_too_long);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return from_errno(errno);
  // A Unix socket's connect waits while the listener's backlog is full; SO_SNDTIMEO bounds
  // that wait (socket(7)), and a zero timeout is no bound.
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  const timeval bound{static_cast<time_t>(seconds.count()),
                      static_cast<suseconds_t>((timeout - seconds).count() * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &bound, sizeof bound);
  int rc;
  do {
    rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  } while (rc != 0 && errno == EINTR);
  // From here on every wait is a poll(2) against the call's deadline.
  if (rc != 0 || ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    return err == EAGAIN || err == EINPROGRESS ? make_error_code(std::errc::timed_out)
                                               : from_errno(err);
  }
  fd_ = fd;
  timeout_ = timeout;
  return {};
}

Outcome Client::call(const std::string& method, const Json& params) {
  try {
    if (broken_) return link_failure(broken_);
    if (fd_ < 0) return link_failure(make_error_code(std::errc::not_connected));
    const int64_t id = next_id_++;
    std::string request;
    try {
      request = Json{{"jsonrpc", "2.0"}, {"id", id}, {"method", method}, {"params", params}}.dump();
    } catch (const Json::exception&) {  // a string that is not UTF-8: nothing was sent
      return link_failure(make_error_code(std::errc::invalid_argument));
    }
    request += '\n';
    deadline_ = std::chrono::steady_clock::now() + timeout_;
    // A failed send breaks the link (part of the line may have gone), but what the daemon said
    // before it closed is still read: its refusal of this connection is the answer.
    const std::error_code unsent = send_all(request);
    Outcome reply;
    for (;;) {
      const bool answered = take_lines(id, reply);
      if (answered && unsent) fail(unsent);
      kept_or_broken_.store(!kept_.empty() || broken_, std::memory_order_release);
      if (answered) return reply;
      if (broken_) return link_failure(broken_);
      if (const std::error_code ec = receive(/*wait=*/!unsent)) {
        const std::error_code why = unsent ? unsent : ec;
        if (why != std::errc::timed_out) fail(why);  // a late reply is dropped by its id
        return link_failure(why);
      }
    }
  } catch (const std::exception&) {  // no memory: what was read may be lost, so fail closed
    fail(make_error_code(std::errc::not_enough_memory));
    return link_failure(broken_);
  }
}

std::error_code Client::poll(std::vector<Notification>& out) noexcept {
  if (fd_ < 0) return make_error_code(std::errc::not_connected);
  try {
    Outcome no_call;
    while (!broken_) {
      take_lines(/*awaited=*/0, no_call);
      if (broken_) break;
      const std::error_code ec = receive(/*wait=*/false);
      if (ec == std::errc::operation_would_block) break;
      if (ec) fail(ec);
    }
    for (; !kept_.empty(); kept_.pop_front()) out.push_back(std::move(kept_.front()));
  } catch (const std::exception&) {  // no memory: a notification may be lost, so fail closed
    fail(make_error_code(std::errc::not_enough_memory));
  }
  kept_or_broken_.store(!kept_.empty() || broken_, std::memory_order_release);
  return broken_;
}

bool Client::has_news() const noexcept {
  if (kept_or_broken_.load(std::memory_order_acquire)) return true;
  pollfd ready{fd_, POLLIN, 0};
  return ::poll(&ready, 1, 0) != 0;  // readable, closed, or poll failed: poll() finds out
}

Client::Line Client::classify(const std::string& text, int64_t awaited, Outcome& reply) {
  const Json line = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!line.is_object()) return Line::Other;
  const auto id = line.find("id");
  const auto method = line.find("method");
  if (id == line.end()) {
    if (method == line.end() || !method->is_string()) return Line::Other;
    kept_.push_back({method->get<std::string>(), line.value("params", Json())});
    return Line::Notification;
  }
  if (method != line.end() || awaited == 0) return Line::Other;
  // A null id is the daemon's answer to a request it could not read, or its refusal.
  const bool answers = *id == Json(awaited) || (id->is_null() && line.contains("error"));
  if (!answers) return Line::Other;
  reply = outcome_of(line);
  return Line::Reply;
}

bool Client::take_lines(int64_t awaited, Outcome& reply) {
  size_t start = 0;
  bool answered = false;
  for (size_t nl; (nl = buffer_.find('\n', start)) != std::string::npos; start = nl + 1) {
    if (nl - start > kMaxLine) break;
    // Every line is taken, those after the reply too, so that has_news() sees kept ones.
    const Line line = classify(buffer_.substr(start, nl - start), answered ? 0 : awaited, reply);
    answered = answered || line == Line::Reply;
  }
  buffer_.erase(0, start);
  if (buffer_.size() > kMaxLine) fail(make_error_code(std::errc::message_size));
  return answered;
}

std::error_code Client::receive(bool wait) {
  char chunk[65536];
  for (;;) {
    const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
    if (n > 0) {
      buffer_.append(chunk, static_cast<size_t>(n));
      return {};
    }
    if (n == 0) return make_error_code(std::errc::connection_reset);  // the daemon closed
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return from_errno(errno);
    if (!wait) return make_error_code(std::errc::operation_would_block);
    if (const std::error_code ec = wait_for(POLLIN)) return ec;
  }
}

std::error_code Client::send_all(const std::string& bytes) {
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
      return from_errno(n == 0 ? EIO : errno);
    if (const std::error_code ec = wait_for(POLLOUT)) return ec;
  }
  return {};
}

std::error_code Client::wait_for(short events) {
  for (;;) {
    int wait_ms = -1;
    if (timeout_ != kWaitForever) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(
          deadline_ - std::chrono::steady_clock::now());
      if (left.count() <= 0) return make_error_code(std::errc::timed_out);
      wait_ms = static_cast<int>(std::min<int64_t>(left.count(), INT_MAX));
    }
    pollfd ready{fd_, events, 0};
    const int n = ::poll(&ready, 1, wait_ms);
    if (n > 0) return {};  // ready, or an error the next send or recv reports
    if (n < 0 && errno != EINTR) return from_errno(errno);
  }
}

void Client::fail(std::error_code why) {
  if (!broken_) broken_ = why;
  kept_or_broken_.store(true, std::memory_order_release);
}

}  // namespace shareblk::rpc
