// Internal to target/: log lines that a client can cause (refused connections), rate-limited
// so that a flood of them cannot flood the log: one line per second per reason, the next one
// saying how many were left out.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace shareblk::target {

// Log lines a client can cause, at most one per `interval` for each reason; the next one
// says how many were left out. Thread-safe.
class RateLimitedLog {
 public:
  explicit RateLimitedLog(std::chrono::milliseconds interval = std::chrono::seconds(1))
      : interval_(interval) {}
  struct Outcome {
    bool log;             // write a line now
    uint64_t suppressed;  // left out since the last line of this reason
  };
  Outcome note(const std::string& reason, std::chrono::steady_clock::time_point now);
  // A warning "refusing a connection (DETAIL): REASON", as note() allows.
  void warn(const std::string& reason, const std::string& detail);
  // The warning `line`, as note(reason) allows, with how many were left out appended.
  void warn_line(const std::string& reason, const std::string& line);

 private:
  struct Entry {
    std::chrono::steady_clock::time_point last{};
    uint64_t suppressed = 0;
  };
  std::chrono::milliseconds interval_;
  std::mutex mutex_;
  std::map<std::string, Entry> entries_;
};

// What a client of an established connection can make the workers log (cut off, broken
// framing, lost): one limiter for every worker together.
RateLimitedLog& client_log();

}  // namespace shareblk::target
