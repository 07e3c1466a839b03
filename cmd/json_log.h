// shareblkd --log-format json: one JSON object per log line, for log shippers.
#pragma once

#include <spdlog/formatter.h>

#include <memory>

namespace shareblk {

// {"time": "2026-01-02T03:04:05.123456Z", "level": "info", "thread": 1234, "message": "..."}
// Strings are escaped as JSON (ASCII), so a line never breaks in two.
std::unique_ptr<spdlog::formatter> json_log_formatter();

}  // namespace shareblk
