#include "cmd/cli_commands.h"

#include <boost/program_options.hpp>
#include <filesystem>

namespace shareblk::cli {
namespace {

namespace po = boost::program_options;

// Parses a command's own arguments: `positional` names fill in order, then options.
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

// --qos KEY=VALUE,...: a `qos` object (docs/qos.md); "" is `{}`, which clears the limits.
// Values go as numbers when they are digits, else as given, for the daemon to refuse by key.
Json qos_from(const std::string& text) {
  Json qos = Json::object();
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(start, end - start);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw UsageError("--qos takes KEY=VALUE,... (e.g. total_iops_sec=2000), not '" + item + "'");
    }
    qos[item.substr(0, eq)] = size_value(item.substr(eq + 1));
    start = end + 1;
  }
  return qos;
}

Json volume_id_only(const std::vector<std::string>& args) {
  return Json{{"volume_id", get(parse(args, {}, {"volume_id"}), "volume_id")}};
}

Json attachment_id_only(const std::vector<std::string>& args) {
  return Json{{"attachment_id", get(parse(args, {}, {"attachment_id"}), "attachment_id")}};
}

// VOLUME and ATTACHMENT arguments take an id, a unique prefix of one, or (a volume) its name.
const Command kCommands[] = {
    {"volume-create", "volume_create",
     "NAME SIZE [--multiattach] [--bootable] [--writer-policy multi|single] [--qos "
     "KEY=VALUE,...] | NAME [SIZE] (--from-image FILE | --from-snapshot SNAPSHOT | "
     "--from-volume VOLUME) [--no-wait]",
     "Creates a volume of SIZE (bytes, or with a K/M/G/T suffix in powers of 1024), or one\n"
     "filled from a raw or qcow2 image on the daemon's host, a snapshot, or a copy of another\n"
     "volume (at least the source's size; a progress bar until it is filled, unless --no-wait).\n"
     "  --multiattach          several live attachments at once\n"
     "  --bootable             marks it bootable (the policy may forbid sharing it)\n"
     "  --writer-policy single at most one attachment writes at a time (volume-takeover)\n"
     "  --qos KEY=VALUE,...    QoS limits of all its attachments together (docs/qos.md)\n"
     "examples:\n"
     "  shareblk volume-create data 10G --multiattach\n"
     "  shareblk volume-create quorum 64M --multiattach --writer-policy single\n"
     "  shareblk volume-create debian --from-image /srv/images/debian-12.qcow2\n"
     "  shareblk volume-create data-restored --from-snapshot before-upgrade",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       d.add_options()("multiattach", po::bool_switch())("bootable", po::bool_switch())(
           "writer-policy", po::value<std::string>())("from-image", po::value<std::string>())(
           "from-snapshot", po::value<std::string>())("from-volume", po::value<std::string>())(
           "qos", po::value<std::string>());
       po::positional_options_description pos;
       d.add_options()("name", po::value<std::string>()->required(), "")(
           "size", po::value<std::string>(), "");
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
       }
       if (vm.count("from-snapshot")) p["from_snapshot"] = get(vm, "from-snapshot");
       if (vm.count("from-volume")) p["from_volume"] = get(vm, "from-volume");
       if (!vm.count("size") && !vm.count("from-image") && !vm.count("from-snapshot") &&
           !vm.count("from-volume")) {
         throw UsageError(
             "volume-create needs SIZE, or --from-image, --from-snapshot or "
             "--from-volume");
       }
       if (vm.count("writer-policy")) p["writer_policy"] = get(vm, "writer-policy");
       if (vm.count("qos")) p["qos"] = qos_from(get(vm, "qos"));
       return p;
     },
     View::Volume},
    {"volume-list", "volume_list", "",
     "Lists every volume.\nexample:\n  shareblk volume-list --json",
     [](const std::vector<std::string>& args) {
       parse(args, {}, {});
       return Json::object();
     },
     View::Volumes},
    {"volume-show", "volume_show", "VOLUME",
     "Shows a volume and its attachments.\nexamples:\n  shareblk volume-show data\n"
     "  shareblk volume-show 3f2a",
     volume_id_only, View::Volume},
    {"volume-delete", "volume_delete", "VOLUME [--no-wait]",
     "Deletes a volume that has no live attachment, and its data. The daemon deletes (and on\n"
     "LVM zeroes) in the background; this shows a progress bar until it is done, unless\n"
     "--no-wait.\nexamples:\n"
     "  shareblk volume-delete data\n  shareblk volume-delete 3f2a --no-wait",
     volume_id_only, View::Raw},
    {"volume-extend", "volume_extend", "VOLUME SIZE",
     "Grows a volume to SIZE; connected clients see the new size when they reconnect.\n"
     "example:\n  shareblk volume-extend data 20G",
     [](const std::vector<std::string>& args) {
       auto vm = parse(args, {}, {"volume_id", "size"});
       return Json{{"volume_id", get(vm, "volume_id")}, {"size", size_value(get(vm, "size"))}};
     },
     View::Volume},
    {"volume-update", "volume_update",
     "VOLUME [--name N] [--multiattach true|false] [--bootable true|false] [--writer-policy "
     "multi|single] [--qos KEY=VALUE,...]",
     "Renames a volume or changes its flags, or its QoS limits (every attachment together;\n"
     "live, and --qos '' clears them).\nexamples:\n"
     "  shareblk volume-update data --name data-old\n"
     "  shareblk volume-update data --writer-policy single\n"
     "  shareblk volume-update data --qos total_iops_sec=5000,total_bytes_sec=104857600",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       d.add_options()("name", po::value<std::string>())("multiattach", po::value<bool>())(
           "bootable", po::value<bool>())("writer-policy", po::value<std::string>())(
           "qos", po::value<std::string>());
       auto vm = parse(args, d, {"volume_id"});
       Json p{{"volume_id", get(vm, "volume_id")}};
       if (vm.count("qos")) p["qos"] = qos_from(get(vm, "qos"));
       if (vm.count("writer-policy")) p["writer_policy"] = get(vm, "writer-policy");
       if (vm.count("name")) p["name"] = get(vm, "name");
       if (vm.count("multiattach")) p["multiattach"] = vm["multiattach"].as<bool>();
       if (vm.count("bootable")) p["bootable"] = vm["bootable"].as<bool>();
       return p;
     },
     View::Volume},
    {"snapshot-create", "snapshot_create", "VOLUME NAME [--no-wait]",
     "Takes a crash-consistent snapshot of a volume, attached or not: its writes wait at the\n"
     "target while it is taken (a moment on XFS or btrfs, a copy elsewhere; a progress bar\n"
     "until it is done, unless --no-wait). docs/snapshots.md says how.\n"
     "example:\n  shareblk snapshot-create data before-upgrade",
     [](const std::vector<std::string>& args) {
       auto vm = parse(args, {}, {"volume_id", "name"});
       return Json{{"volume_id", get(vm, "volume_id")}, {"name", get(vm, "name")}};
     },
     View::Raw},
    {"snapshot-list", "snapshot_list", "[VOLUME]",
     "Lists every snapshot, or a volume's.\nexample:\n  shareblk snapshot-list data",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       po::positional_options_description pos;
       d.add_options()("volume_id", po::value<std::string>(), "");
       pos.add("volume_id", 1);
       po::variables_map vm;
       po::store(po::command_line_parser(args).options(d).positional(pos).run(), vm);
       po::notify(vm);
       return vm.count("volume_id") ? Json{{"volume_id", get(vm, "volume_id")}} : Json::object();
     },
     View::Raw},
    {"snapshot-show", "snapshot_show", "SNAPSHOT",
     "Shows a snapshot.\nexample:\n  shareblk snapshot-show before-upgrade",
     [](const std::vector<std::string>& args) {
       return Json{{"snapshot_id", get(parse(args, {}, {"snapshot_id"}), "snapshot_id")}};
     },
     View::Raw},
    {"snapshot-delete", "snapshot_delete", "SNAPSHOT [--no-wait]",
     "Deletes a snapshot (in the background; a progress bar until it is done, unless\n"
     "--no-wait).\nexample:\n  shareblk snapshot-delete before-upgrade",
     [](const std::vector<std::string>& args) {
       return Json{{"snapshot_id", get(parse(args, {}, {"snapshot_id"}), "snapshot_id")}};
     },
     View::Raw},
    {"attachment-create", "attachment_create",
     "VOLUME INSTANCE_UUID [--host H] [--mode rw|ro] [--connector-host H [--transport "
     "unix|tcp] [--ip IP]]",
     "Attaches a volume to an instance: a reservation, or (with a connector) an export its\n"
     "host connects to; connection_info says where.\n"
     "examples:\n"
     "  shareblk attachment-create data vm-1 --connector-host node-a --transport tcp --ip "
     "10.0.0.5\n"
     "  shareblk attachment-create data vm-2 --mode ro --connector-host node-b",
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
     View::Attachment},
    {"attachment-update", "attachment_update",
     "ATTACHMENT (--connector-host H [--transport unix|tcp] [--ip IP] | --mode rw|ro | --qos "
     "KEY=VALUE,...)",
     "Gives a reservation its connector, changes a live attachment's mode (its clients\n"
     "reconnect and see the new mode), or its QoS limits (live, no reconnect; --qos ''\n"
     "clears them).\nexamples:\n"
     "  shareblk attachment-update 9c1e --connector-host node-a\n"
     "  shareblk attachment-update 9c1e --mode ro\n"
     "  shareblk attachment-update 9c1e --qos read_iops_sec=2000,write_iops_sec=1000",
     [](const std::vector<std::string>& args) {
       po::options_description d = connector_options();
       d.add_options()("mode", po::value<std::string>())("qos", po::value<std::string>());
       auto vm = parse(args, d, {"attachment_id"});
       Json c = connector_from(vm);
       const int given = int{!c.is_null()} + int{vm.count("mode") > 0} + int{vm.count("qos") > 0};
       if (given != 1) {
         throw UsageError("attachment-update needs exactly one of --connector-host, --mode, --qos");
       }
       if (vm.count("qos")) {
         return Json{{"attachment_id", get(vm, "attachment_id")},
                     {"qos", qos_from(get(vm, "qos"))}};
       }
       if (vm.count("mode")) {
         return Json{{"attachment_id", get(vm, "attachment_id")}, {"mode", get(vm, "mode")}};
       }
       return Json{{"attachment_id", get(vm, "attachment_id")}, {"connector", c}};
     },
     View::Attachment},
    {"attachment-complete", "attachment_complete", "ATTACHMENT",
     "Marks an attachment attached (the host has connected).\nexample:\n"
     "  shareblk attachment-complete 9c1e",
     attachment_id_only, View::Attachment},
    {"attachment-delete", "attachment_delete", "ATTACHMENT",
     "Detaches and deletes an attachment: its export goes, its clients are cut off.\n"
     "example:\n  shareblk attachment-delete 9c1e",
     attachment_id_only, View::Attachment},
    {"attachment-list", "attachment_list", "[--volume-id VOLUME]",
     "Lists attachments, of one volume or all.\nexample:\n  shareblk attachment-list "
     "--volume-id data",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       d.add_options()("volume-id", po::value<std::string>());
       auto vm = parse(args, d, {});
       Json p = Json::object();
       if (vm.count("volume-id")) p["volume_id"] = get(vm, "volume-id");
       return p;
     },
     View::Attachments},
    {"attachment-show", "attachment_show", "ATTACHMENT",
     "Shows an attachment, with its connection_info.\nexample:\n  shareblk attachment-show 9c1e",
     attachment_id_only, View::Attachment},
    {"volume-takeover", "volume_takeover", "VOLUME ATTACHMENT",
     "Moves a single-writer volume's write access to ATTACHMENT; the old writer's late writes\n"
     "are refused (docs/fencing.md).\nexample:\n  shareblk volume-takeover quorum 9c1e",
     [](const std::vector<std::string>& args) {
       auto vm = parse(args, {}, {"volume_id", "attachment_id"});
       return Json{{"volume_id", get(vm, "volume_id")},
                   {"attachment_id", get(vm, "attachment_id")}};
     },
     View::Raw},
    {"volume-detach", "volume_detach", "VOLUME [--attachment-id ATTACHMENT]",
     "Detaches a volume's attachment (the only one, or the one named).\nexample:\n"
     "  shareblk volume-detach data --attachment-id 9c1e",
     [](const std::vector<std::string>& args) {
       po::options_description d;
       d.add_options()("attachment-id", po::value<std::string>());
       auto vm = parse(args, d, {"volume_id"});
       Json p{{"volume_id", get(vm, "volume_id")}};
       if (vm.count("attachment-id")) p["attachment_id"] = get(vm, "attachment-id");
       return p;
     },
     View::Attachment},
    {"stats", "stats",
     "[--attachment-id ATTACHMENT | --volume-id VOLUME] [--watch [SECONDS] [--count N]]",
     "I/O per live attachment, like iostat: requests and MB per second, average latency,\n"
     "errors, refused writes, connections. The first report covers the time since the daemon\n"
     "started; with --watch (every SECONDS, default 2) each next one the interval before it.\n"
     "--json prints each report as one line of the stats method's result (docs/metrics.md).\n"
     "examples:\n"
     "  shareblk stats\n"
     "  shareblk stats --volume-id data --watch 1\n"
     "  shareblk stats --json --watch 10 --count 6",
     [](const std::vector<std::string>& /*args*/) { return Json::object(); },  // its own parser
     View::Stats},
    {"backup", "state_backup", "PATH",
     "Copies the daemon's state database to PATH, consistent while it serves; PATH must not\n"
     "exist. Restoring: docs/state.md, \"Backup and restore\".\nexample:\n"
     "  shareblk backup /var/backups/shareblk-$(date +%F).db",
     [](const std::vector<std::string>& args) {
       const std::string path = get(parse(args, {}, {"path"}), "path");
       std::error_code ec;
       // The daemon resolves nothing against its own directory: the path is the caller's.
       return Json{{"path", std::filesystem::absolute(path, ec).lexically_normal().string()}};
     },
     View::Raw},
};

}  // namespace

std::span<const Command> commands() {
  return kCommands;
}

const Command* find_command(const std::string& name) {
  for (const Command& c : kCommands) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

}  // namespace shareblk::cli
