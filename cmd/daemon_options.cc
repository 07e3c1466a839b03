#include "cmd/daemon_options.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <set>

#include "target/target.h"

namespace shareblk::cmd {

// Boost finds this by argument-dependent lookup when it parses a Whole option.
template <typename T, T Max>
void validate(boost::any& v, const std::vector<std::string>& values, Whole<T, Max>* /*type*/,
              int /*unused*/) {
  po::validators::check_first_occurrence(v);
  const std::string& text = po::validators::get_single_string(values);
  bool ok = !text.empty() && text.size() <= 20 && text.find_first_not_of("0123456789") == text.npos;
  unsigned long long n = 0;
  if (ok) {
    errno = 0;
    n = std::strtoull(text.c_str(), nullptr, 10);
    ok = errno == 0 && n <= Max;
  }
  if (!ok) {
    po::error_with_option_name e("%canonical_option% must be a whole number from 0 to " +
                                 std::to_string(Max) + ", not '%value%'");
    e.set_substitute("value", text);
    throw e;
  }
  v = Whole<T, Max>{static_cast<T>(n)};
}

namespace {

// Options renamed to the one style (kebab-case); the old spelling works for this release, with
// a warning.
struct Renamed {
  const char* old_name;
  const char* name;
};
constexpr Renamed kRenamed[] = {
    {"allow_multiattach", "allow-multiattach"},
    {"allow_multiattach_bootable", "allow-multiattach-bootable"},
};

template <typename W>
po::typed_value<W>* whole(decltype(W::value) fallback) {
  return po::value<W>()->default_value(W{fallback}, std::to_string(fallback));
}

}  // namespace

po::options_description daemon_options() {
  const target::ServerOptions defaults;  // the timeouts' defaults live there, once
  auto ms = [](std::chrono::milliseconds d) { return static_cast<unsigned>(d.count()); };
  po::options_description desc("shareblkd options");
  // clang-format off
  desc.add_options()
    ("help,h", "show this help")
    ("version", "print the version and exit")
    ("config", po::value<std::string>(),
     "read options from FILE (one `name = value` per line); SIGHUP reads it again")
    ("state-dir", po::value<std::string>()->default_value("./var"),
     "managed mode: database, control socket and file-store volumes live here")
    ("control-socket", po::value<std::string>(), "control socket path (default STATE_DIR/shareblk.sock)")
    ("store", po::value<std::string>()->default_value("file"),
     "volume store: file, lvm:VG, or rbd:POOL")
    ("ceph-conf", po::value<std::string>()->default_value(""),
     "RBD store: the ceph.conf to read (default: librados' search, /etc/ceph/ceph.conf)")
    ("ceph-id", po::value<std::string>()->default_value(""),
     "RBD store: the Ceph user, without 'client.' (default: admin)")
    ("ceph-timeout", po::value<unsigned>()->default_value(30),
     "RBD store: seconds before connecting or a request to the cluster fails (EIO to clients)")
    ("lvm-config", po::value<std::string>()->default_value(""),
     "extra lvm2 --config text for the LVM store (e.g. a devices filter)")
    ("preallocate", po::bool_switch(),
     "file store: reserve every volume's blocks at create (default: sparse files)")
    ("allow-multiattach", po::value<bool>()->default_value(true),
     "policy: volumes may be multiattach (reloaded on SIGHUP)")
    ("allow-multiattach-bootable", po::value<bool>()->default_value(true),
     "policy: a bootable volume may have several attachments (reloaded on SIGHUP)")
    ("nbd-socket-mode", po::value<std::string>()->default_value("0660"),
     "mode of the NBD Unix sockets (octal); connecting needs write permission")
    ("nbd-socket-group", po::value<std::string>(),
     "group of the NBD Unix sockets, a name or a number (default: the daemon's)")
    ("control-socket-mode", po::value<std::string>()->default_value("0600"),
     "mode of the control socket (octal)")
    ("control-socket-group", po::value<std::string>(),
     "group of the control socket, a name or a number (default: the daemon's); its members may "
     "call every method")
    ("control-readonly-group", po::value<std::string>(),
     "members of this group may call the methods that only look (lists, shows, stats), and see "
     "no connection_info; the control socket is then opened to every local user and callers are "
     "told apart by their credentials")
    ("fuse-mount-root", po::value<std::string>()->default_value("/run/shareblk/mounts"),
     "FUSE attachments mount only on directories strictly below this one")
    ("privileged-helper", po::value<std::string>(),
     "reach lvm2, the LVM store's devices and FUSE mounts through the privileged helper "
     "listening at SOCKET (the shareblk-helper service) instead of doing them itself")
    ("user", po::value<std::string>(),
     "once its sockets are bound and its state open, run as USER (a name or a uid), not root")
    ("group", po::value<std::string>(),
     "with --user: run with group GROUP (default: the user's primary group)")
    ("nbd-allow-root", po::value<bool>()->default_value(false)->implicit_value(true),
     "a unix attachment whose connector binds a uid admits root too (reloaded on SIGHUP)")
    ("advertise-address", po::value<std::string>(),
     "the host name or address connection_info's TCP URIs name (default: the TCP listener's)")
    ("tls", po::value<std::string>()->default_value("off"),
     "TLS on the NBD listeners: off, on (TLS-only attachments need it) or require (all do)")
    ("tls-x509-dir", po::value<std::string>(),
     "x509 credentials: DIR/ca-cert.pem, server-cert.pem, server-key.pem[, ca-crl.pem] "
     "(read again on SIGHUP)")
    ("tls-psk-file", po::value<std::string>(),
     "standalone mode: TLS-PSK keys (keys.psk lines identity:hexkey, as psktool writes)")
    ("export", po::value<std::vector<std::string>>()->composing(),
     "standalone mode: serve PATH as export NAME: NAME=PATH[,ro] (repeatable)")
    ("listen-unix", po::value<std::vector<std::string>>()->composing(),
     "listen for NBD on a Unix socket at PATH (repeatable; managed default STATE_DIR/nbd.sock)")
    ("listen-tcp", po::value<std::vector<std::string>>()->composing(),
     "listen for NBD on HOST:PORT (repeatable; default 127.0.0.1:10809 when no listener is given)")
    ("workers", whole<Workers>(0), "io_uring worker threads, at most 256 (0 = one per CPU)")
    ("max-connections", whole<Count>(1024), "connections at most")
    ("handshake-timeout-ms", whole<Milliseconds>(ms(defaults.handshake_timeout)),
     "milliseconds a client has for its whole handshake")
    ("max-handshakes", whole<Count>(defaults.max_handshakes),
     "connections in their handshake at most, over TCP and over Unix sockets each (fewer than "
     "--max-connections); a newcomer to a full table evicts the stalest")
    ("max-handshakes-per-peer", whole<Count>(defaults.max_handshakes_per_peer),
     "connections in their handshake at most from one TCP address or one local uid")
    ("send-timeout-ms", whole<Milliseconds>(ms(defaults.send_timeout)),
     "milliseconds a client may take none of its replies before it is cut off (0 = never)")
    ("payload-timeout-ms", whole<Milliseconds>(ms(defaults.payload_timeout)),
     "milliseconds a client may send none of a request's payload before it is cut off "
     "(0 = never)")
    ("peer-timeout-ms", whole<Milliseconds>(ms(defaults.peer_timeout)),
     "milliseconds a TCP client's host may stay silent before its connection is dropped "
     "(0 = the kernel's defaults)")
    ("tcp-send-buffer-kib", whole<KiB>(defaults.tcp_send_buffer >> 10),
     "KiB of send buffer asked for on each TCP connection (0 = the kernel's autotuning)")
    ("payload-memory-mib", whole<MiB>(0),
     "MiB of request payloads all NBD connections may hold at once (0 = a quarter of RAM)")
    ("max-control-connections", whole<Count>(4096),
     "control-socket clients at once (each nbdkit connection through the plugin holds one)")
    ("buffered", po::bool_switch(), "use the page cache instead of O_DIRECT")
    ("log-level", po::value<std::string>()->default_value("info"),
     "trace, debug, info, warn, error, critical or off (reloaded on SIGHUP)")
    ("log-file", po::value<std::string>(),
     "log to FILE instead of standard output; SIGHUP reopens it (after logrotate moved it)")
    ("log-format", po::value<std::string>()->default_value("text"),
     "text, or json (one JSON object per line, for log shippers)")
    ("metrics-listen", po::value<std::string>(),
     "serve Prometheus metrics at http://ADDR:PORT/metrics (docs/metrics.md; off by default)");
  // clang-format on
  return desc;
}

bool load_options(int argc, char** argv, po::variables_map& vm, std::vector<std::string>& warnings,
                  std::string& error) {
  po::options_description all = daemon_options();
  po::options_description old("renamed options");
  for (const Renamed& r : kRenamed) old.add_options()(r.old_name, po::value<bool>(), "");
  all.add(old);
  std::string where;  // what is being read, for the message
  try {
    po::store(po::parse_command_line(argc, argv, all), vm);
    if (vm.count("config")) {
      const std::string file = vm["config"].as<std::string>();
      std::ifstream in(file);
      if (!in) {
        error = "cannot read config file " + file + ": " + std::strerror(errno);
        return false;
      }
      where = "config file " + file + ": ";
      po::store(po::parse_config_file(in, all), vm);
      where.clear();
    }
    po::notify(vm);
  } catch (const std::exception& e) {
    error = where + e.what();
    return false;
  }
  for (const Renamed& r : kRenamed) {
    if (vm.count(r.old_name) == 0) continue;
    warnings.push_back(std::string(r.old_name) + " is now " + r.name +
                       "; the old name goes in a later release");
    if (vm[r.name].defaulted()) {
      vm.at(r.name) = po::variable_value(boost::any(vm[r.old_name].as<bool>()), false);
    }
  }
  if (vm.count("group") && !vm.count("user")) {
    error = "--group needs --user (the daemon changes both or neither)";
    return false;
  }
  static const std::set<std::string> kLevels = {"trace", "debug",    "info", "warn",
                                                "error", "critical", "off"};
  const std::string level = vm["log-level"].as<std::string>();
  if (kLevels.count(level) == 0) {
    error =
        "--log-level must be trace, debug, info, warn, error, critical or off, not '" + level + "'";
    return false;
  }
  return true;
}

}  // namespace shareblk::cmd
