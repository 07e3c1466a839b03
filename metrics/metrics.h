// metrics: the attachments' I/O figures as Prometheus text (exposition format 0.0.4), and the
// opt-in HTTP listener that serves them at GET /metrics (shareblkd --metrics-listen).
// docs/metrics.md lists every metric, its labels and units, and the listener's bounds.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "control/control.h"

namespace shareblk::metrics {

// The metrics text: every attachment's series, labelled attachment, volume and mode;
// `started` is when the daemon started (shareblk_start_time_seconds).
std::string render(const std::vector<control::AttachmentStats>& attachments,
                   std::chrono::system_clock::time_point started);

// The listener's bounds, whoever connects (it has no authentication).
struct ListenerLimits {
  // Open connections at most: with the listening socket and the wake-up descriptor, the
  // listener never holds more than max_connections + 2 descriptors, so NBD and the control
  // socket keep the rest. A connection accepted past it pushes out the oldest one still
  // sending its request (or, when all are being answered, the oldest).
  size_t max_connections = 16;
  // From accept to the end of the request's headers; then the connection is closed.
  std::chrono::milliseconds request_deadline{5000};
  // From accept to the last byte of the response handed to the kernel.
  std::chrono::milliseconds response_deadline{10000};
  // Request line and headers together; past it the answer is 431 and the connection closes.
  size_t max_request_bytes = 8192;
};

// Serves GET (and HEAD) /metrics with what `body` returns at each scrape, on one thread of its
// own: HTTP/1.1, one request per connection (`Connection: close`), no Range, no body read.
// Any other path is 404, any other method on /metrics 405, a malformed request 400.
class Listener {
 public:
  explicit Listener(std::function<std::string()> body, ListenerLimits limits = {});
  ~Listener();  // stops if running
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Binds ADDR:PORT ("127.0.0.1:9105", "[::1]:0"; port 0 picks one) and starts serving;
  // `bound` is the address actually bound. Errors say what failed in `what`; a malformed
  // ADDR:PORT is invalid_argument.
  std::error_code start(const std::string& endpoint, std::string& bound, std::string& what);
  // Closes the listening socket and every connection; a scrape being answered is cut off.
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace shareblk::metrics
