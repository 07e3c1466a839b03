// store: runs a program (never through a shell) and captures what it says. The LVM store runs
// lvm2's tools with it, and image filling runs qemu-img.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace shareblk::store {

struct CommandResult {
  int status = -1;     // exit code; -1 when it could not run or was killed
  int exec_errno = 0;  // ENOENT when the program is not installed
  std::string out;
  std::string err;
};

// Runs one program; argv[0] is the program.
using CommandRunner = std::function<CommandResult(const std::vector<std::string>& argv)>;

// `input`: a descriptor the program gets as its standard input (/dev/null when -1).
CommandResult run_command(const std::vector<std::string>& argv,
                          std::chrono::seconds timeout = std::chrono::seconds(120), int input = -1);

// Sees what a program writes to its stdout as it comes; returns false to kill the program.
using OutputWatcher = std::function<bool(std::string_view chunk)>;

// run_command without a timeout, for a program that runs as long as its work takes (qemu-img
// convert): its stdout goes to `on_out` instead of CommandResult::out.
CommandResult run_command_watched(const std::vector<std::string>& argv, const OutputWatcher& on_out,
                                  int input = -1);

}  // namespace shareblk::store
