#include "target/rate_limited_log.h"

#include <spdlog/spdlog.h>

namespace shareblk::target {

RateLimitedLog::Outcome RateLimitedLog::note(const std::string& reason,
                                             std::chrono::steady_clock::time_point now) {
  std::lock_guard lock(mutex_);
  Entry& e = entries_[reason];
  if (e.last.time_since_epoch().count() != 0 && now - e.last < interval_) {
    ++e.suppressed;
    return {false, 0};
  }
  const uint64_t suppressed = e.suppressed;
  e.last = now;
  e.suppressed = 0;
  return {true, suppressed};
}

void RateLimitedLog::warn(const std::string& reason, const std::string& detail) {
  const Outcome o = note(reason, std::chrono::steady_clock::now());
  if (!o.log) return;
  if (o.suppressed == 0) {
    spdlog::warn("nbd: refusing a connection ({}): {}", detail, reason);
  } else {
    spdlog::warn("nbd: refusing a connection ({}): {} (and {} more like it since the last line)",
                 detail, reason, o.suppressed);
  }
}

void RateLimitedLog::warn_line(const std::string& reason, const std::string& line) {
  const Outcome o = note(reason, std::chrono::steady_clock::now());
  if (!o.log) return;
  if (o.suppressed == 0) {
    spdlog::warn("{}", line);
  } else {
    spdlog::warn("{} (and {} more like it since the last line)", line, o.suppressed);
  }
}

RateLimitedLog& client_log() {
  static RateLimitedLog log;
  return log;
}

}  // namespace shareblk::target
