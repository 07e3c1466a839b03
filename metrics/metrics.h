// metrics: the attachments' I/O figures as Prometheus text (exposition format 0.0.4), and the
// opt-in HTTP listener that serves them at GET /metrics (shareblkd --metrics-listen).
// docs/metrics.md lists every metric, its labels and units.
#pragma once

#include <chrono>
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

// Serves GET /metrics with what `body` returns at each scrape, on its own threads (two).
class Listener {
 public:
  explicit Listener(std::function<std::string()> body);
  ~Listener();  // stops if running
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Binds ADDR:PORT ("127.0.0.1:9105", "[::1]:0"; port 0 picks one) and starts serving;
  // `bound` is the address actually bound. Errors say what failed in `what`.
  std::error_code start(const std::string& endpoint, std::string& bound, std::string& what);
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace shareblk::metrics
