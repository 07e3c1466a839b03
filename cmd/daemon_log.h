// Where shareblkd's log goes: standard output (the journal, under systemd) or a file that
// SIGHUP reopens, so that logrotate can move it away (docs/operations.md, "Logs").
#pragma once

#include <string>

namespace shareblk::cmd {

// Sends the log to `file` ("" = standard output, as spdlog's default logger does). False with
// `error` when the file cannot be opened.
bool log_to(const std::string& file, std::string& error);

// Reopens the log file by its name (a no-op when logging to standard output). False with
// `error` when it cannot be opened; the log then goes on to the file it had.
bool reopen_log(std::string& error);

}  // namespace shareblk::cmd
