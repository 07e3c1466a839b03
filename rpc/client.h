// A JSON-RPC 2.0 client of shareblkd's control socket: a Unix stream socket carrying one JSON
// object per line each way (the server is control/control.cc). The CLI, the nbdkit plugin and
// the tests all talk to the daemon through this one client.
//
// Errors travel as values, never as exceptions: a call returns its result or an Error, and no
// member throws (call() turns even a failed allocation into an Error), so the nbdkit plugin can
// use it from nbdkit's C callbacks. Callers that prefer exceptions (the CLI, the tests) throw at
// their own edge.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

namespace shareblk::rpc {

using Json = nlohmann::json;

// A received line longer than this is not the daemon's: the link is dropped (EMSGSIZE). The
// daemon bounds the lines it reads the same way.
inline constexpr size_t kMaxLine = size_t{1} << 20;

// A timeout of zero waits as long as it takes.
inline constexpr std::chrono::milliseconds kWaitForever{0};

// Why a call has no result.
struct Error {  // NOLINT(bugprone-exception-escape): a null Json's constructor does not throw
  // Set when no answer came: sending or receiving failed (the errno), the peer closed
  // (ECONNRESET), the timeout passed (ETIMEDOUT), a line was too long (EMSGSIZE), the reply had
  // neither a result nor an error object (EPROTO), the request was not valid JSON text
  // (EINVAL: a string not UTF-8), or there was no connection (ENOTCONN). Empty when the
  // daemon refused the call. Lines that are not JSON objects are passed over, not errors.
  std::error_code link;
  // The daemon's refusal (a JSON-RPC error object): its code, message, data.reason ("" when
  // there is none) and the whole data member (null when there is none).
  int code = 0;
  std::string message;
  std::string reason;
  Json data;

  // One line for a log or a terminal: "reason: message", or the link's error.
  std::string describe() const;
};

// A call's outcome: the method's result, or why there is none.
struct Outcome {  // NOLINT(bugprone-exception-escape): as Error
  Json result;
  std::optional<Error> error;
  bool ok() const { return !error; }
};

// A request without an id, sent by the daemon unasked (attachment_revoked).
struct Notification {
  std::string method;
  Json params;
};

// One connection. Not thread-safe, except has_news(): callers serialize the other members.
class Client {
 public:
  Client() = default;
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Connects to the Unix socket at `path`. `timeout` bounds the connect (a listener whose
  // backlog is full) and, later, each call: sending its request and waiting for its reply.
  // Fails with the errno of socket(2) or connect(2), ENAMETOOLONG for a path too long for a
  // socket address, ETIMEDOUT, or EISCONN when already connected.
  std::error_code connect(const std::string& path, std::chrono::milliseconds timeout) noexcept;

  // Sends one request and waits for the reply with its id. Notifications that arrive first are
  // kept for poll(); replies to other ids are dropped. An error reply with a null id answers
  // this call: it is the daemon's answer to a line it could not read, or its refusal to serve
  // this connection. A timed-out call leaves the link usable (a late reply is dropped by id);
  // every other link error breaks it for good. Throws nothing (ENOMEM breaks the link).
  Outcome call(const std::string& method, const Json& params = Json::object());

  // Never waits. Appends to `out` the notifications that have arrived (those a call kept come
  // first) and returns the link's state: empty while it works, else why it broke. Once broken
  // it stays broken; notifications received before the break are still delivered.
  std::error_code poll(std::vector<Notification>& out) noexcept;

  // Whether poll() has anything new to say: a kept notification, bytes on the socket, end of
  // file, or a broken link. Never waits; safe to call from any thread at any time, so callers
  // can skip their lock while nothing has arrived.
  bool has_news() const noexcept;

  // The socket, to poll(2) for news beside other descriptors, or to shutdown(2) from any
  // thread; -1 when not connected. Reading or writing it directly would confuse the client.
  int native_handle() const noexcept { return fd_; }

 private:
  // What a received line is to this client.
  enum class Line { Other, Notification, Reply };
  Line classify(const std::string& text, int64_t awaited, Outcome& reply);
  // Takes every complete line in buffer_: notifications into kept_, the reply to `awaited` (0:
  // none) into `reply` (then true), the rest dropped. Fails the link on an over-long line.
  bool take_lines(int64_t awaited, Outcome& reply);
  // One recv into buffer_; `wait` false makes it return EWOULDBLOCK instead of waiting.
  std::error_code receive(bool wait);
  std::error_code send_all(const std::string& bytes);
  // Waits for `events` until the current call's deadline.
  std::error_code wait_for(short events);
  void fail(std::error_code why);

  int fd_ = -1;
  std::chrono::milliseconds timeout_ = kWaitForever;
  std::chrono::steady_clock::time_point deadline_;  // of the call under way
  int64_t next_id_ = 1;
  std::string buffer_;                  // received, not yet a whole line
  std::deque<Notification> kept_;       // arrived during a call, not yet polled
  std::error_code broken_;              // why the link broke, once it has
  std::atomic<bool> kept_or_broken_{};  // !kept_.empty() || broken_, for has_news()
};

}  // namespace shareblk::rpc
