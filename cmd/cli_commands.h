// shareblk's commands: what each is called on the command line, the API method it calls, its
// arguments, its help with examples, and how its arguments become the method's params. The
// table is the CLI's one list of commands: usage, help and completion read it (docs/cli.md).
#pragma once

#include <nlohmann/json.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace shareblk::cli {

using Json = nlohmann::json;

// Bad arguments: status 2, no call made.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// How a result is printed when --json is not given.
// Stats: the command prints its own reports (shareblk stats --watch), the table only names it.
enum class View { Volume, Volumes, Attachment, Attachments, Raw, Stats };

struct Command {
  const char* name;    // as typed: "volume-create"
  const char* method;  // the API method (docs/api.md)
  const char* usage;   // its arguments
  const char* help;    // what it does, then examples
  // The method's params from the command's arguments; throws UsageError or boost's errors.
  Json (*params)(const std::vector<std::string>& args);
  View view;
};

std::span<const Command> commands();
const Command* find_command(const std::string& name);  // nullptr: no such command

}  // namespace shareblk::cli
