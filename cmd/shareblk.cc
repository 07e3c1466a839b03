// shareblk: the command-line client of the control socket. One subcommand per API method;
// tables for people, --json for scripts. Exit status: 0 ok, 1 the daemon refused (the reason
// is printed), 2 bad usage, 3 the daemon could not be reached.
#include <unistd.h>

#include <boost/program_options.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
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

// volume-delete and volume-create --from-image start a job on the daemon and return; this
// follows it (volume_show, five times a second) with a progress bar on a terminal's stderr,
// until the volume is gone (a delete) or no longer "creating". Returns the exit status and sets
// `result` to what to print.
int follow_job(shareblk::rpc::Client& client, const std::string& volume_id, Json& result) {
  const bool bar = ::isatty(2) != 0;
  int last = -1;
  for (;;) {
    const shareblk::rpc::Outcome shown = client.call("volume_show", {{"volume_id", volume_id}});
    if (shown.error && shown.error->reason == "not_found") {
      if (bar && last >= 0) std::cerr << "\n";
      result = Json{{"id", volume_id}, {"deleted", true}};
      return 0;
    }
    if (shown.error) {
      if (bar && last >= 0) std::cerr << "\n";
      std::cerr << "shareblk: volume_show failed: " << escaped(shown.error->message) << "\n";
      return shown.error->link ? 3 : 1;
    }
    const Json& v = shown.result;
    const std::string status = v["status"].get<std::string>();
    if (status != "deleting" && status != "creating") {
      if (bar && last >= 0) std::cerr << "\n";
      result = v;
      if (status != "error") return 0;
      std::cerr << "shareblk: volume " << escaped(volume_id)
                << " is in error: " << text(v["status_reason"]) << "\n";
      return 1;
    }
    const int percent = v["progress"].is_number() ? v["progress"].get<int>() : 0;
    if (bar && percent != last) {
      const int filled = percent / 5;
      std::cerr << "\r" << status << " [" << std::string(filled, '#')
                << std::string(20 - filled, ' ') << "] " << std::setw(3) << percent << "%"
                << std::flush;
      last = percent;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

struct Command {
  const char* name;
  const char* summary;
  // Builds the method's params from the subcommand's arguments.
  Json (*params)(const std::vector<std::string>& args);
  enum class View { Volume, Volumes, Attachment, Attachments, Raw } view;
};

const Command kCommands[] = {
    {"volume_create",
     "NAME SIZE [--multiattach] [--bootable] [--writer-policy multi|single] | NAME [SIZE] "
     "--from-image FILE [--no-wait]",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       d.add_options()("multiattach", po::bool_switch())("bootable", po::bool_switch())(
           "writer-policy", po::value<std::string>())("from-image", po::value<std::string>())(
           "name", po::value<std::string>()->required())("size", po::value<std::string>());
       po::positional_options_description pos;
       pos.add("name", 1).add("size", 1);
       po::variables_map vm;
       po::store(po::command_line_parser(args).options(d).positional(pos).run(), vm);
       po::notify(vm);
       Json p{{"name", get(vm, "name")},
              {"multiattach", vm["multiattach"].as<bool>()},
              {"bootable", vm["bootable"].as<bool>()}};
       if (vm.count("size")) p["size"] = size_value(get(vm, "size"));
       if (vm.count("from-image")) {
         // A path on the daemon's host: made absolute here, where the caller's directory is.
         p["from_image"] = std::filesystem::absolute(get(vm, "from-image")).string();
       } else if (!vm.count("size")) {
         throw UsageError("volume-create needs SIZE, or --from-image");
       }
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
    {"volume_delete", "VOLUME_ID [--no-wait]",
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

void usage(std::ostream& out, const po::options_description& global) {
  out << "usage: shareblk [--socket PATH] [--json] COMMAND [ARGS]\n\ncommands:\n";
  for (const Command& c : kCommands) {
    std::string name = c.name;
    std::replace(name.begin(), name.end(), '_', '-');
    out << "  " << name << " " << c.summary << "\n";
  }
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

  // volume-delete and volume-create --from-image wait for their job unless --no-wait.
  bool follow = command == "volume_delete" || command == "volume_create";
  if (auto it = std::find(rest.begin(), rest.end(), "--no-wait"); follow && it != rest.end()) {
    rest.erase(it);
    follow = false;
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
  Json result = outcome.result;
  int status = 0;
  if (follow && result.is_object() &&
      (result.value("status", "") == "deleting" || result.value("status", "") == "creating")) {
    status = follow_job(client, result["id"].get<std::string>(), result);
    if (method == "volume_delete" && status == 0) view = Command::View::Raw;
  }
  if (vm["json"].as<bool>()) {
    std::cout << ascii_json(result, 2) << "\n";
    return status;
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
