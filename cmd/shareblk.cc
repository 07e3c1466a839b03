// shareblk: the command-line client of the control socket. One subcommand per API method;
// tables for people, --json for scripts. Exit status: 0 ok, 1 the daemon refused (the reason
// is printed), 2 bad usage, 3 the daemon could not be reached.
#include <unistd.h>

#include <boost/program_options.hpp>
#include <chrono>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "rpc/client.h"
#include "text/printable.h"

namespace po = boost::program_options;
using Json = nlohmann::json;

namespace {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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
    rows.push_back({text(v["id"]), text(v["name"]), human_size(v["size"].get<uint64_t>()),
                    text(v["status"]), text(v["multiattach"]), text(v["bootable"]),
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

// Parses a subcommand's own arguments: `positional` names fill in order, then options.
po::variables_map parse(const std::vector<std::string>& args, po::options_description options,
                        const std::vector<std::string>& positional) {
  po::positional_options_description pos;
  for (const auto& name : positional) {
    options.add_options()(name.c_str(), po::value<std::string>()->required(), "");
    pos.add(name.c_str(), 1);
  }
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(options).positional(pos).run(), vm);
  po::notify(vm);
  return vm;
}

std::string get(const po::variables_map& vm, const char* name) {
  return vm[name].as<std::string>();
}

Json size_value(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("0123456789") == std::string::npos) {
    return Json(std::stoull(s));
  }
  return Json(s);
}

Json connector_from(const po::variables_map& vm) {
  if (!vm.count("connector-host")) return nullptr;
  Json c{{"host", get(vm, "connector-host")}, {"transport", get(vm, "transport")}};
  if (vm.count("ip")) c["ip"] = get(vm, "ip");
  return c;
}

po::options_description connector_options() {
  po::options_description d("connector");
  // clang-format off
  d.add_options()
    ("connector-host", po::value<std::string>(), "the host that connects (makes a connector)")
    ("transport", po::value<std::string>()->default_value("unix"), "unix or tcp")
    ("ip", po::value<std::string>(), "accept TCP connections only from this address");
  // clang-format on
  return d;
}

struct Command {
  const char* name;
  const char* summary;
  // Builds the method's params from the subcommand's arguments.
  Json (*params)(const std::vector<std::string>& args);
  enum class View { Volume, Volumes, Attachment, Attachments, Raw } view;
};

const Command kCommands[] = {
    {"volume_create", "NAME SIZE [--multiattach] [--bootable] [--writer-policy multi|single]",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       d.add_options()("multiattach", po::bool_switch())("bootable", po::bool_switch())(
           "writer-policy", po::value<std::string>());
       auto vm = parse(args, d, {"name", "size"});
       Json p{{"name", get(vm, "name")},
              {"size", size_value(get(vm, "size"))},
              {"multiattach", vm["multiattach"].as<bool>()},
              {"bootable", vm["bootable"].as<bool>()}};
       if (vm.count("writer-policy")) p["writer_policy"] = get(vm, "writer-policy");
       return p;
     },
     Command::View::Volume},
    {"volume_list", "",
     [](const std::vector<std::string>& args) {
       parse(args, {}, {});
       return Json::object();
     },
     Command::View::Volumes},
    {"volume_show", "VOLUME_ID",
     [](const std::vector<std::string>& args) {
       return Json{{"volume_id", get(parse(args, {}, {"volume_id"}), "volume_id")}};
     },
     Command::View::Volume},
    {"volume_delete", "VOLUME_ID",
     [](const std::vector<std::string>& args) {
       return Json{{"volume_id", get(parse(args, {}, {"volume_id"}), "volume_id")}};
     },
     Command::View::Raw},
    {"volume_extend", "VOLUME_ID SIZE",
     [](const std::vector<std::string>& args) {
       auto vm = parse(args, {}, {"volume_id", "size"});
       return Json{{"volume_id", get(vm, "volume_id")}, {"size", size_value(get(vm, "size"))}};
     },
     Command::View::Volume},
    {"volume_update",
     "VOLUME_ID [--name N] [--multiattach true|false] [--bootable true|false] [--writer-policy "
     "multi|single]",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       d.add_options()("name", po::value<std::string>())("multiattach", po::value<bool>())(
           "bootable", po::value<bool>())("writer-policy", po::value<std::string>());
       auto vm = parse(args, d, {"volume_id"});
       Json p{{"volume_id", get(vm, "volume_id")}};
       if (vm.count("writer-policy")) p["writer_policy"] = get(vm, "writer-policy");
       if (vm.count("name")) p["name"] = get(vm, "name");
       if (vm.count("multiattach")) p["multiattach"] = vm["multiattach"].as<bool>();
       if (vm.count("bootable")) p["bootable"] = vm["bootable"].as<bool>();
       return p;
     },
     Command::View::Volume},
    {"attachment_create",
     "VOLUME_ID INSTANCE_UUID [--host H] [--mode rw|ro] [--connector-host H [--transport "
     "unix|tcp] [--ip IP]]",
     [](const std::vector<std::string>& args) {
       po::options_description d = connector_options();
       d.add_options()("host", po::value<std::string>())(
           "mode", po::value<std::string>()->default_value("rw"));
       auto vm = parse(args, d, {"volume_id", "instance_uuid"});
       Json p{{"volume_id", get(vm, "volume_id")},
              {"instance_uuid", get(vm, "instance_uuid")},
              {"mode", get(vm, "mode")}};
       if (vm.count("host")) p["attached_host"] = get(vm, "host");
       Json c = connector_from(vm);
       if (!c.is_null()) p["connector"] = c;
       return p;
     },
     Command::View::Attachment},
    {"attachment_update",
     "ATTACHMENT_ID (--connector-host H [--transport unix|tcp] [--ip IP] | --mode rw|ro)",
     [](const std::vector<std::string>& args) {
       po::options_description d = connector_options();
       d.add_options()("mode", po::value<std::string>());
       auto vm = parse(args, d, {"attachment_id"});
       Json c = connector_from(vm);
       if (vm.count("mode") && c.is_null()) {
         return Json{{"attachment_id", get(vm, "attachment_id")}, {"mode", get(vm, "mode")}};
       }
       if (c.is_null() || vm.count("mode")) {
         throw UsageError("attachment_update needs --connector-host or --mode, not both");
       }
       return Json{{"attachment_id", get(vm, "attachment_id")}, {"connector", c}};
     },
     Command::View::Attachment},
    {"attachment_complete", "ATTACHMENT_ID",
     [](const std::vector<std::string>& args) {
       return Json{{"attachment_id", get(parse(args, {}, {"attachment_id"}), "attachment_id")}};
     },
     Command::View::Attachment},
    {"attachment_delete", "ATTACHMENT_ID",
     [](const std::vector<std::string>& args) {
       return Json{{"attachment_id", get(parse(args, {}, {"attachment_id"}), "attachment_id")}};
     },
     Command::View::Attachment},
    {"attachment_list", "[--volume-id V]",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       d.add_options()("volume-id", po::value<std::string>());
       auto vm = parse(args, d, {});
       Json p = Json::object();
       if (vm.count("volume-id")) p["volume_id"] = get(vm, "volume-id");
       return p;
     },
     Command::View::Attachments},
    {"attachment_show", "ATTACHMENT_ID",
     [](const std::vector<std::string>& args) {
       return Json{{"attachment_id", get(parse(args, {}, {"attachment_id"}), "attachment_id")}};
     },
     Command::View::Attachment},
    {"volume_takeover", "VOLUME_ID ATTACHMENT_ID",
     [](const std::vector<std::string>& args) {
       auto vm = parse(args, {}, {"volume_id", "attachment_id"});
       return Json{{"volume_id", get(vm, "volume_id")},
                   {"attachment_id", get(vm, "attachment_id")}};
     },
     Command::View::Raw},
    {"volume_detach", "VOLUME_ID [--attachment-id A]",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       d.add_options()("attachment-id", po::value<std::string>());
       auto vm = parse(args, d, {"volume_id"});
       Json p{{"volume_id", get(vm, "volume_id")}};
       if (vm.count("attachment-id")) p["attachment_id"] = get(vm, "attachment-id");
       return p;
     },
     Command::View::Attachment},
};

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
    auto vm = parse(args, d, {});
    if (vm.count("attachment-id")) params["attachment_id"] = get(vm, "attachment-id");
    if (vm.count("volume-id")) params["volume_id"] = get(vm, "volume-id");
    if (vm.count("watch")) {
      interval = vm["watch"].as<double>();
      if (!(interval > 0)) throw UsageError("--watch wants a number of seconds above 0");
      count = 0;  // until interrupted
    }
    if (vm.count("count")) count = vm["count"].as<unsigned>();
    json = json || vm["json"].as<bool>();
  } catch (const std::exception& e) {
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

void usage(std::ostream& out, const po::options_description& global) {
  out << "usage: shareblk [--socket PATH] [--json] COMMAND [ARGS]\n\ncommands:\n";
  for (const Command& c : kCommands) {
    std::string name = c.name;
    std::replace(name.begin(), name.end(), '_', '-');
    out << "  " << name << " " << c.summary << "\n";
  }
  out << "  stats [--attachment-id A | --volume-id V] [--watch [SECONDS] [--count N]] [--json]\n"
         "                              I/O per attachment, like iostat\n";
  out << "  call METHOD [JSON_PARAMS]   any method, params as a JSON object\n\n" << global;
}

int run(int argc, char** argv) {
  po::options_description global("options");
  const char* env_socket = std::getenv("SHAREBLK_SOCKET");
  // clang-format off
  global.add_options()
    ("help,h", "show this help")
    ("socket", po::value<std::string>()->default_value(env_socket ? env_socket : "./var/shareblk.sock"),
     "control socket (also $SHAREBLK_SOCKET)")
    ("json", po::bool_switch(), "print the result as JSON")
    ("command", po::value<std::string>(), "")
    ("args", po::value<std::vector<std::string>>(), "");
  // clang-format on
  po::positional_options_description pos;
  pos.add("command", 1).add("args", -1);
  po::variables_map vm;
  std::vector<std::string> rest;
  try {
    auto parsed = po::command_line_parser(argc, argv)
                      .options(global)
                      .positional(pos)
                      .allow_unregistered()
                      .run();
    po::store(parsed, vm);
    po::notify(vm);
    rest = po::collect_unrecognized(parsed.options, po::include_positional);
  } catch (const std::exception& e) {
    std::cerr << "shareblk: " << e.what() << "\n";
    return 2;
  }
  if (vm.count("help") || !vm.count("command")) {
    usage(vm.count("help") ? std::cout : std::cerr, global);
    return vm.count("help") ? 0 : 2;
  }
  std::string command = vm["command"].as<std::string>();
  std::replace(command.begin(), command.end(), '-', '_');
  // collect_unrecognized with include_positional returns the command too: drop it.
  if (!rest.empty() && rest.front() == vm["command"].as<std::string>()) rest.erase(rest.begin());

  if (command == "stats") {
    const std::string path = vm["socket"].as<std::string>();
    shareblk::rpc::Client client;
    if (const std::error_code ec = client.connect(path, shareblk::rpc::kWaitForever)) {
      std::cerr << "shareblk: cannot reach shareblkd at " << path << ": " << ec.message() << "\n";
      return 3;
    }
    return stats_command(client, rest, vm["json"].as<bool>());
  }

  std::string method;
  Json params;
  Command::View view = Command::View::Raw;
  try {
    if (command == "call") {
      if (rest.empty() || rest.size() > 2) throw UsageError("call METHOD [JSON_PARAMS]");
      method = rest[0];
      params = rest.size() == 2 ? Json::parse(rest[1]) : Json::object();
    } else {
      const Command* found = nullptr;
      for (const Command& c : kCommands) {
        if (command == c.name) found = &c;
      }
      if (!found) throw UsageError("unknown command '" + vm["command"].as<std::string>() + "'");
      method = found->name;
      params = found->params(rest);
      view = found->view;
    }
  } catch (const std::exception& e) {
    std::cerr << "shareblk: " << e.what() << "\n";
    return 2;
  }

  const std::string socket_path = vm["socket"].as<std::string>();
  shareblk::rpc::Client client;
  if (const std::error_code ec = client.connect(socket_path, shareblk::rpc::kWaitForever)) {
    std::cerr << "shareblk: cannot reach shareblkd at " << socket_path << ": " << ec.message()
              << "\n";
    return 3;
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
  const Json& result = outcome.result;
  if (vm["json"].as<bool>()) {
    std::cout << ascii_json(result, 2) << "\n";
    return 0;
  }
  switch (view) {
    case Command::View::Volumes:
      print_volumes(result);
      break;
    case Command::View::Attachments:
      print_attachments(result);
      break;
    case Command::View::Volume:
    case Command::View::Attachment:
      print_object(result);
      break;
    case Command::View::Raw:
      std::cout << ascii_json(result, 2) << "\n";
      break;
  }
  return 0;
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
