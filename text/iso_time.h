// text: a time as the state database, the API and the JSON log write it: UTC, ISO 8601 with
// microseconds ("2026-11-25T19:55:44.307444Z"), so that the text sorts as the times happened.
// Header-only, as printable.h.
#pragma once

#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>

namespace shareblk {

inline std::string iso8601_utc(std::chrono::system_clock::time_point t) {
  const auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(us / 1000000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%06dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(us % 1000000));
  return buf;
}

}  // namespace shareblk
