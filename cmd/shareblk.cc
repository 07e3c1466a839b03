// shareblk: the command-line client of the control socket. One subcommand per API method;
// tables for people, --json for scripts. Exit status: 0 ok, 1 the daemon refused (the reason
// is printed), 2 bad usage, 3 the daemon could not be reached.
#include <unistd.h>

#include <array>
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "api/status.h"
#include "cmd/cli_commands.h"
#include "rpc/client.h"
#include "text/printable.h"

namespace po = boost::program_options;
namespace cli = shareblk::cli;
namespace api = shareblk::api;
using Json = nlohmann::json;

namespace {

// JSON for people and scripts alike, in ASCII: control characters and everything past ASCII
// as \u escapes, so that no string a caller stored can reach the terminal as itself.
std::string ascii_json(const Json& v, int indent = -1) {
  return v.dump(indent, ' ', /*ensure_ascii=*/true, Json::error_handler_t::replace);
}

// A table cell. Strings come from callers (a volume's name, an instance_uuid, a host): escaped
// by the daemon's log rule (text/printable.h), so that a newline, a tab or an ESC in one
// cannot forge a row, shift a column or send the terminal a sequence.
std::string text(const Json& v) {
  if (v.is_null()) return "-";
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    return shareblk::printable(s, s.size());
  }
  return ascii_json(v);
}

// A message from the daemon, which may quote a caller's strings.
std::string escaped(const std::string& message) {
  return shareblk::printable(message, message.size());
}

// Where the daemon is when neither --socket nor $SHAREBLK_SOCKET says: the socket of a
// `./dev run` daemon in this directory, else the packaged service's.
constexpr std::array<const char*, 2> kDefaultSockets = {"./var/shareblk.sock",
                                                        "/run/shareblk/shareblk.sock"};

// Connects `client` to `named`, or (when it is empty) to the first default socket that exists:
// one that exists and does not answer is reported, not passed over, for it is the daemon the
// caller is nearest to. On failure prints every socket tried and why, and returns false.
bool connect_to_daemon(shareblk::rpc::Client& client, const std::string& named) {
  std::vector<std::string> candidates(kDefaultSockets.begin(), kDefaultSockets.end());
  if (!named.empty()) candidates = {named};
  std::string tried;
  for (const std::string& path : candidates) {
    const std::error_code ec = client.connect(path, shareblk::rpc::kWaitForever);
    if (!ec) return true;
    if (!named.empty()) {
      std::cerr << "shareblk: cannot reach shareblkd at " << path << ": " << ec.message() << "\n";
      return false;
    }
    tried += (tried.empty() ? "" : ", ") + path + " (" + ec.message() + ")";
    if (ec != std::errc::no_such_file_or_directory) break;
  }
  std::cerr << "shareblk: cannot reach shareblkd; tried " << tried
            << "; --socket PATH or $SHAREBLK_SOCKET names another\n";
  return false;
}

std::string human_size(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  std::ostringstream s;
  s << std::setprecision(v < 10 ? 2 : 4) << v << " " << units[u];
  return s.str();
}

void print_table(const std::vector<std::string>& headers,
                 const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(headers.size());
  for (size_t i = 0; i < headers.size(); ++i) width[i] = headers[i].size();
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t i = 0; i < cells.size(); ++i) {
      std::cout << std::left << std::setw(static_cast<int>(width[i]) + 2) << cells[i];
    }
    std::cout << "\n";
  };
  line(headers);
  for (const auto& row : rows) line(row);
}

void print_volumes(const Json& volumes) {
  std::vector<std::vector<std::string>> rows;
  for (const Json& v : volumes) {
    std::string status = text(v["status"]);  // "deleting 42%" while a job runs
    if (v.contains("progress") && v["progress"].is_number()) {
      status += " " + std::to_string(v["progress"].get<int>()) + "%";
    }
    rows.push_back({text(v["id"]), text(v["name"]), human_size(v["size"].get<uint64_t>()), status,
                    text(v["multiattach"]), text(v["bootable"]),
                    std::to_string(v["attachments"].size())});
  }
  print_table({"ID", "NAME", "SIZE", "STATUS", "MULTIATTACH", "BOOTABLE", "ATTACHMENTS"}, rows);
}

void print_attachments(const Json& attachments) {
  std::vector<std::vector<std::string>> rows;
  for (const Json& a : attachments) {
    rows.push_back({text(a["id"]), text(a["volume_id"]), text(a["instance_uuid"]),
                    text(a["attached_host"]), text(a["mode"]), text(a["attach_status"]),
                    text(a["write_access"]), text(a["connections"])});
  }
  print_table({"ID", "VOLUME", "INSTANCE", "HOST", "MODE", "STATUS", "WRITES", "CONNECTIONS"},
              rows);
}

void print_object(const Json& object) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& [key, value] : object.items()) {
    if (key == "attachments") continue;
    std::string cell =
        key == "connection_info" && value.is_object() ? text(value["data"]["uri"]) : text(value);
    rows.push_back({key, cell});
  }
  print_table({"FIELD", "VALUE"}, rows);
  if (object.contains("attachments") && !object["attachments"].empty()) {
    std::cout << "\n";
    print_attachments(object["attachments"]);
  }
}

// volume-delete and volume-create --from-image start a job on the daemon and return; this
// follows it (volume_show, five times a second) with a progress bar on a terminal's stderr,
// until the volume is gone (a delete) or no longer "creating". Returns the exit status and sets
// `result` to what to print.
// `what` is "volume" or "snapshot": whose _show to poll.
int follow_job(shareblk::rpc::Client& client, const std::string& what, const std::string& volume_id,
               Json& result) {
  const bool bar = ::isatty(2) != 0;
  int last = -1;
  for (;;) {
    const shareblk::rpc::Outcome shown = client.call(what + "_show", {{what + "_id", volume_id}});
    if (shown.error && shown.error->reason == "not_found") {
      if (bar && last >= 0) std::cerr << "\n";
      result = Json{{"id", volume_id}, {"deleted", true}};
      return 0;
    }
    if (shown.error) {
      if (bar && last >= 0) std::cerr << "\n";
      std::cerr << "shareblk: " << what << "_show failed: " << escaped(shown.error->message)
                << "\n";
      return shown.error->link ? 3 : 1;
    }
    const Json& v = shown.result;
    const std::optional<api::VolumeStatus> status =
        api::parse_volume_status(v["status"].get<std::string>());
    if (!status || !api::is_job_running(*status)) {
      if (bar && last >= 0) std::cerr << "\n";
      result = v;
      if (status != api::VolumeStatus::Error) return 0;
      std::cerr << "shareblk: " << what << " " << escaped(volume_id)
                << " is in error: " << text(v["status_reason"]) << "\n";
      return 1;
    }
    const int percent = v["progress"].is_number() ? v["progress"].get<int>() : 0;
    if (bar && percent != last) {
      const int filled = percent / 5;
      std::cerr << "\r" << api::to_string(*status) << " [" << std::string(filled, '#')
                << std::string(20 - filled, ' ') << "] " << std::setw(3) << percent << "%"
                << std::flush;
      last = percent;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

void usage(std::ostream& out, const po::options_description& global) {
  out << "usage: shareblk [--socket PATH] [--json] COMMAND [ARGS]\n\ncommands:\n";
  for (const cli::Command& c : cli::commands()) out << "  " << c.name << " " << c.usage << "\n";
  out << "  call METHOD [JSON_PARAMS]   any method, params as a JSON object\n"
      << "  help [COMMAND]              this, or one command's help with examples\n\n"
      << "VOLUME, SNAPSHOT and ATTACHMENT take an id, a unique prefix of one, or (a volume or\n"
      << "snapshot) its name.\n\n"
      << global;
}

void command_help(std::ostream& out, const cli::Command& c) {
  out << "usage: shareblk [--socket PATH] [--json] " << c.name << " " << c.usage << "\n\n"
      << c.help << "\n\ncalls the API method " << c.method << " (docs/api.md)\n";
}

// What the daemon's list calls return, to find an id by a prefix or a name.
struct Found {
  std::string id;
  std::string label;  // shown when several match
};

// `given` as an id: itself when it is one; else the one id it is a prefix of, or (volumes) the
// one volume of that name. Several: a UsageError listing them. None: `given`, for the daemon to
// say not_found.
std::string resolve(const std::vector<Found>& all, const std::string& given, const char* kind) {
  std::vector<const Found*> matches;
  if (given.empty()) return given;
  for (const Found& f : all) {
    if (f.id == given) return given;
    if (f.id.starts_with(given) || f.label == given) matches.push_back(&f);
  }
  if (matches.empty()) return given;
  if (matches.size() == 1) return matches.front()->id;
  std::string message = "'" + escaped(given) + "' matches " + std::to_string(matches.size()) + " " +
                        kind + "s; give more of the id:";
  for (const Found* f : matches) message += "\n  " + f->id + "  " + escaped(f->label);
  throw cli::UsageError(message);
}

std::vector<Found> listed(shareblk::rpc::Client& client, const char* method, const char* label) {
  const shareblk::rpc::Outcome outcome = client.call(method, Json::object());
  std::vector<Found> found;
  if (!outcome.ok() || !outcome.result.is_array()) return found;  // the call itself will say
  for (const Json& item : outcome.result) {
    found.push_back({item.value("id", ""), item.value(label, "")});
  }
  return found;
}

// Replaces the volume, snapshot and attachment references in `params` by the ids they name.
void resolve_references(shareblk::rpc::Client& client, Json& params) {
  for (const char* key : {"volume_id", "from_volume"}) {
    if (params.contains(key) && params[key].is_string()) {
      params[key] =
          resolve(listed(client, "volume_list", "name"), params[key].get<std::string>(), "volume");
    }
  }
  for (const char* key : {"snapshot_id", "from_snapshot"}) {
    if (params.contains(key) && params[key].is_string()) {
      params[key] = resolve(listed(client, "snapshot_list", "name"), params[key].get<std::string>(),
                            "snapshot");
    }
  }
  if (params.contains("attachment_id") && params["attachment_id"].is_string()) {
    params["attachment_id"] = resolve(listed(client, "attachment_list", "instance_uuid"),
                                      params["attachment_id"].get<std::string>(), "attachment");
  }
}

// `shareblk stats`: an iostat-like table of every live attachment. The first report covers the
// time since the daemon started; with --watch, each next one the interval before it.
struct StatsReport {  // NOLINT(bugprone-exception-escape): a null Json does not throw
  Json result;        // the stats method's
  double uptime = 0;
};

std::string fixed(double v, int decimals) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(decimals) << v;
  return s.str();
}

void print_stats(const StatsReport& now, const StatsReport* before) {
  // An attachment's figures in the report before, when it was there.
  auto earlier = [&](const Json& a) -> const Json* {
    if (before == nullptr) return nullptr;
    for (const Json& b : before->result["attachments"]) {
      if (b["attachment_id"] == a["attachment_id"]) return &b;
    }
    return nullptr;
  };
  const double seconds = std::max(1e-3, now.uptime - (before ? before->uptime : 0.0));
  std::vector<std::vector<std::string>> rows;
  for (const Json& a : now.result["attachments"]) {
    const Json* b = earlier(a);
    auto delta = [&](const char* op, const char* field) {
      const double was = b ? (*b)["ops"][op][field].get<double>() : 0.0;
      return a["ops"][op][field].get<double>() - was;
    };
    auto total = [&](const Json& x) {
      uint64_t n = 0;
      for (const auto& [name, count] : x["errors"].items()) n += count.get<uint64_t>();
      return n;
    };
    const double reads = delta("read", "requests");
    const double writes = delta("write", "requests");
    auto await_ms = [&](const char* op, double n) {
      return n > 0 ? fixed(delta(op, "time_seconds") * 1000 / n, 2) : std::string("0.00");
    };
    const uint64_t errors = total(a) - (b ? total(*b) : 0);
    const uint64_t refused =
        a["refused_writes"].get<uint64_t>() - (b ? (*b)["refused_writes"].get<uint64_t>() : 0);
    rows.push_back(
        {text(a["attachment_id"]), text(a["volume_id"]), text(a["mode"]),
         std::to_string(a["connections"].size()), fixed(reads / seconds, 1),
         fixed(writes / seconds, 1), fixed(delta("read", "bytes") / seconds / (1 << 20), 2),
         fixed(delta("write", "bytes") / seconds / (1 << 20), 2), await_ms("read", reads),
         await_ms("write", writes), std::to_string(errors), std::to_string(refused)});
  }
  std::cout << (before ? "last " : "since start, ") << fixed(seconds, 1) << " s\n";
  print_table({"ATTACHMENT", "VOLUME", "MODE", "CONN", "r/s", "w/s", "rMB/s", "wMB/s", "r_await",
               "w_await", "ERRORS", "REFUSED"},
              rows);
}

int stats_command(shareblk::rpc::Client& client, const std::vector<std::string>& args, bool json) {
  po::options_description d;
  // clang-format off
  d.add_options()
    ("attachment-id", po::value<std::string>())
    ("volume-id", po::value<std::string>())
    ("watch", po::value<double>()->implicit_value(2.0))
    ("count", po::value<unsigned>())
    ("json", po::bool_switch());
  // clang-format on
  Json params = Json::object();
  double interval = 0;
  unsigned count = 1;
  try {
    po::variables_map vm;
    po::store(po::command_line_parser(args).options(d).run(), vm);
    po::notify(vm);
    if (vm.count("attachment-id")) params["attachment_id"] = vm["attachment-id"].as<std::string>();
    if (vm.count("volume-id")) params["volume_id"] = vm["volume-id"].as<std::string>();
    if (vm.count("watch")) {
      interval = vm["watch"].as<double>();
      if (!(interval > 0)) throw cli::UsageError("--watch wants a number of seconds above 0");
      count = 0;  // until interrupted
    }
    if (vm.count("count")) count = vm["count"].as<unsigned>();
    json = json || vm["json"].as<bool>();
  } catch (const std::exception& e) {
    std::cerr << "shareblk: " << e.what() << "\n";
    return 2;
  }
  try {
    resolve_references(client, params);  // ids, prefixes and names, as the other commands
  } catch (const cli::UsageError& e) {
    std::cerr << "shareblk: " << e.what() << "\n";
    return 2;
  }
  const bool redraw = interval > 0 && !json && ::isatty(STDOUT_FILENO);
  StatsReport before;
  for (unsigned n = 0; count == 0 || n < count; ++n) {
    if (n > 0) std::this_thread::sleep_for(std::chrono::duration<double>(interval));
    const shareblk::rpc::Outcome outcome = client.call("stats", params);
    if (outcome.error) {
      std::cerr << "shareblk: stats failed: " << escaped(outcome.error->describe()) << "\n";
      return outcome.error->link ? 3 : 1;
    }
    StatsReport now{outcome.result, outcome.result["uptime_seconds"].get<double>()};
    if (json) {
      std::cout << ascii_json(now.result) << std::endl;  // one report a line
    } else {
      if (redraw) std::cout << "\x1b[H\x1b[2J";
      if (n > 0 && !redraw) std::cout << "\n";
      print_stats(now, n > 0 ? &before : nullptr);
      std::cout << std::flush;
    }
    before = std::move(now);
  }
  return 0;
}

int run(int argc, char** argv) {
  po::options_description global("options");
  const char* env_socket = std::getenv("SHAREBLK_SOCKET");
  // clang-format off
  global.add_options()
    ("help,h", "show this help")
    ("version", "print the version and exit")
    ("socket", po::value<std::string>(),
     "control socket (also $SHAREBLK_SOCKET; else ./var/shareblk.sock, or where that does "
     "not exist /run/shareblk/shareblk.sock)")
    ("json", po::bool_switch(), "print the result as JSON");
  // clang-format on
  po::options_description all;  // what is parsed: the options shown, and the positionals
  all.add(global).add_options()("command", po::value<std::string>(), "")(
      "args", po::value<std::vector<std::string>>(), "");
  po::positional_options_description pos;
  pos.add("command", 1).add("args", -1);
  po::variables_map vm;
  std::vector<std::string> rest;
  try {
    auto parsed =
        po::command_line_parser(argc, argv).options(all).positional(pos).allow_unregistered().run();
    po::store(parsed, vm);
    po::notify(vm);
    rest = po::collect_unrecognized(parsed.options, po::include_positional);
  } catch (const std::exception& e) {
    std::cerr << "shareblk: " << e.what() << "\n";
    return 2;
  }
  // --socket wins over $SHAREBLK_SOCKET; neither: the default sockets.
  const std::string named_socket =
      vm.count("socket") ? vm["socket"].as<std::string>() : (env_socket ? env_socket : "");
  if (vm.count("version")) {
    std::cout << "shareblk " SHAREBLK_VERSION "\n";
    return 0;
  }
  std::string command = vm.count("command") ? vm["command"].as<std::string>() : "";
  // collect_unrecognized with include_positional returns the command too: drop it.
  if (!rest.empty() && rest.front() == command) rest.erase(rest.begin());
  if (command.find('_') != std::string::npos) {
    std::string kebab = command;
    std::replace(kebab.begin(), kebab.end(), '_', '-');
    if (cli::find_command(kebab) != nullptr) {
      std::cerr << "shareblk: '" << escaped(command) << "' is now '" << kebab
                << "'; the old spelling goes in a later release\n";
      command = kebab;
    }
  }
  if (command == "help" || command.empty() || (vm.count("help") && command == "call")) {
    if (command == "help" && !rest.empty()) {
      const cli::Command* c = cli::find_command(rest.front());
      if (c == nullptr) {
        std::cerr << "shareblk: no command '" << escaped(rest.front()) << "'\n";
        return 2;
      }
      command_help(std::cout, *c);
      return 0;
    }
    const bool asked = command == "help" || vm.count("help");
    usage(asked ? std::cout : std::cerr, global);
    return asked ? 0 : 2;
  }
  const cli::Command* found = command == "call" ? nullptr : cli::find_command(command);
  if (command != "call" && found == nullptr) {
    std::cerr << "shareblk: unknown command '" << escaped(command)
              << "' (shareblk help lists them)\n";
    return 2;
  }
  if (found != nullptr && vm.count("help")) {
    command_help(std::cout, *found);
    return 0;
  }
  if (found != nullptr && found->view == cli::View::Stats) {
    shareblk::rpc::Client client;
    if (!connect_to_daemon(client, named_socket)) return 3;
    return stats_command(client, rest, vm["json"].as<bool>());
  }

  // Deletes, and creates that copy bytes in, wait for their job unless --no-wait.
  bool follow = command == "volume-delete" || command == "volume-create" ||
                command == "snapshot-create" || command == "snapshot-delete";
  if (auto it = std::find(rest.begin(), rest.end(), "--no-wait"); follow && it != rest.end()) {
    rest.erase(it);
    follow = false;
  }

  std::string method;
  Json params;
  cli::View view = cli::View::Raw;
  try {
    if (found == nullptr) {
      if (rest.empty() || rest.size() > 2) throw cli::UsageError("call METHOD [JSON_PARAMS]");
      method = rest[0];
      params = rest.size() == 2 ? Json::parse(rest[1]) : Json::object();
    } else {
      method = found->method;
      params = found->params(rest);
      view = found->view;
    }
  } catch (const po::required_option& e) {
    // "--volume_id" is the positional VOLUME of the usage line.
    std::string name = e.get_option_name();
    name.erase(0, name.find_first_not_of('-'));
    if (name.ends_with("_id")) name.resize(name.size() - 3);
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return std::toupper(c); });
    std::cerr << "shareblk: " << command << ": missing " << name << "\n";
    std::cerr << "usage: shareblk " << found->name << " " << found->usage << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "shareblk: " << e.what() << "\n";
    if (found != nullptr)
      std::cerr << "usage: shareblk " << found->name << " " << found->usage << "\n";
    return 2;
  }

  shareblk::rpc::Client client;
  if (!connect_to_daemon(client, named_socket)) return 3;
  if (found != nullptr) {  // `call` passes its params as they are
    try {
      resolve_references(client, params);
    } catch (const cli::UsageError& e) {
      std::cerr << "shareblk: " << e.what() << "\n";
      return 2;
    }
  }
  const shareblk::rpc::Outcome outcome = client.call(method, params);
  if (outcome.error && outcome.error->link) {
    std::cerr << "shareblk: " << method
              << ": no valid reply from shareblkd: " << outcome.error->describe() << "\n";
    return 3;
  }
  if (outcome.error) {
    const shareblk::rpc::Error& error = *outcome.error;
    if (vm["json"].as<bool>()) {
      Json shown{{"code", error.code}, {"message", error.message}};
      if (!error.data.is_null()) shown["data"] = error.data;
      std::cout << ascii_json(shown, 2) << "\n";
    }
    std::cerr << "shareblk: " << method << " failed: " << escaped(error.reason) << ": "
              << escaped(error.message) << "\n";
    return 1;
  }
  Json result = outcome.result;
  int status = 0;
  const std::optional<api::VolumeStatus> started =
      result.is_object() ? api::parse_volume_status(result.value("status", "")) : std::nullopt;
  if (follow && started && api::is_job_running(*started)) {
    status = follow_job(client, method.starts_with("snapshot_") ? "snapshot" : "volume",
                        result["id"].get<std::string>(), result);
    if (method == "volume_delete" && status == 0) view = cli::View::Raw;
  }
  if (vm["json"].as<bool>()) {
    std::cout << ascii_json(result, 2) << "\n";
    return status;
  }
  switch (view) {
    case cli::View::Volumes:
      print_volumes(result);
      break;
    case cli::View::Attachments:
      print_attachments(result);
      break;
    case cli::View::Volume:
    case cli::View::Attachment:
      print_object(result);
      break;
    case cli::View::Raw:
    case cli::View::Stats:
      std::cout << ascii_json(result, 2) << "\n";
      break;
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  // Errors are reported where they happen; this is the last word on one that was not.
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "shareblk: " << e.what() << "\n";
    return 1;
  }
}
