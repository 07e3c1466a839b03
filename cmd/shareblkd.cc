// shareblkd: the shareblk daemon.
//
// Managed mode (the default) keeps volumes and attachments under --state-dir and serves them
// through the control socket's attachment API. Standalone mode (`--export NAME=PATH[,ro]`,
// repeatable) serves files or block devices directly, like qemu-nbd; the benchmarks use it.
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include "backend/backend.h"
#include "cmd/json_log.h"
#include "control/control.h"
#include "lvm/volume_store.h"
#include "metrics/metrics.h"
#include "target/target.h"

namespace po = boost::program_options;
using namespace shareblk;  // NOLINT(google-build-using-namespace)

namespace {

struct ExportSpec {
  std::string name;
  std::string path;
  bool read_only = false;
};

// NAME=PATH[,ro]
bool parse_export(const std::string& text, ExportSpec& spec, std::string& error) {
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    error = "--export wants NAME=PATH[,ro], got '" + text + "'";
    return false;
  }
  spec.name = text.substr(0, eq);
  spec.path = text.substr(eq + 1);
  if (spec.path.size() > 3 && spec.path.ends_with(",ro")) {
    spec.read_only = true;
    spec.path.resize(spec.path.size() - 3);
  } else if (spec.path.size() > 3 && spec.path.ends_with(",rw")) {
    spec.path.resize(spec.path.size() - 3);
  }
  if (spec.path.empty()) {
    error = "--export " + text + ": empty path";
    return false;
  }
  return true;
}

// Blocks every signal we handle so that worker threads never see them; the main thread
// waits for them with sigwait. SIGINT and SIGTERM stop the daemon cleanly; SIGHUP, SIGUSR1
// and SIGUSR2, which an operator may send by mistake (or to another daemon's pid), are
// logged and change nothing; SIGPIPE is ignored (a client that goes away is an error on its
// socket, not a signal).
sigset_t block_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGUSR1);
  sigaddset(&set, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return set;
}

// "--NAME-mode" and "--NAME-group" as a SocketAccess, or a message saying what is wrong.
bool parse_socket_access(const po::variables_map& vm, const std::string& name,
                         target::SocketAccess& out, std::string& error) {
  const std::string mode = vm[name + "-mode"].as<std::string>();
  char* end = nullptr;
  errno = 0;
  const unsigned long bits = std::strtoul(mode.c_str(), &end, 8);
  if (mode.empty() || *end != '\0' || errno != 0 || bits > 0777) {
    error = "--" + name + "-mode must be an octal mode from 0 to 0777, not '" + mode + "'";
    return false;
  }
  out.mode = static_cast<mode_t>(bits);
  if (vm.count(name + "-group") == 0) return true;
  const std::string group_name = vm[name + "-group"].as<std::string>();
  if (const struct group* g = ::getgrnam(group_name.c_str())) {
    out.group = g->gr_gid;
    return true;
  }
  const unsigned long gid = std::strtoul(group_name.c_str(), &end, 10);
  if (group_name.empty() || *end != '\0' || gid >= static_cast<unsigned long>(UINT32_MAX)) {
    error = "--" + name + "-group: no group '" + group_name + "'";
    return false;
  }
  out.group = static_cast<gid_t>(gid);
  return true;
}

// Takes the state directory's lock (flock, so that it goes with the process however it ends)
// and writes our pid into the file. When another daemon holds it: says which, and false.
bool lock_state_dir(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::cerr << "shareblkd: cannot open " << path << ": " << std::strerror(errno) << "\n";
    return false;
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char pid[32] = {};
    const ssize_t n = ::pread(fd, pid, sizeof pid - 1, 0);
    ::close(fd);
    if (err == EWOULDBLOCK) {
      std::string holder = n > 0 ? std::string(pid, static_cast<size_t>(n)) : "unknown";
      holder.erase(holder.find_last_not_of(" \n") + 1);
      std::cerr << "shareblkd: another shareblkd (pid " << holder << ") serves "
                << path.parent_path() << "; this one exits and leaves its sockets alone\n";
    } else {
      std::cerr << "shareblkd: cannot lock " << path << ": " << std::strerror(err) << "\n";
    }
    return false;
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    spdlog::warn("cannot write the pid into {}: {}", path.string(), std::strerror(errno));
  }
  return true;  // the descriptor stays open, and the lock held, until the process ends
}

int run(int argc, char** argv) {
  const target::ServerOptions defaults;  // the timeouts' defaults live there, once
  auto ms = [](std::chrono::milliseconds d) { return static_cast<unsigned>(d.count()); };
  po::options_description desc("shareblkd options");
  // clang-format off
  desc.add_options()
    ("help,h", "show this help")
    ("config", po::value<std::string>(), "read options from FILE (one `name = value` per line)")
    ("state-dir", po::value<std::string>()->default_value("./var"),
     "managed mode: database, control socket and file-store volumes live here")
    ("control-socket", po::value<std::string>(), "control socket path (default STATE_DIR/shareblk.sock)")
    ("store", po::value<std::string>()->default_value("file"), "volume store: file, or lvm:VG")
    ("lvm-config", po::value<std::string>()->default_value(""),
     "extra lvm2 --config text for the LVM store (e.g. a devices filter)")
    ("allow_multiattach", po::value<bool>()->default_value(true),
     "policy: volumes may be multiattach")
    ("allow_multiattach_bootable", po::value<bool>()->default_value(true),
     "policy: a bootable volume may have several attachments")
    ("nbd-socket-mode", po::value<std::string>()->default_value("0660"),
     "mode of the NBD Unix sockets (octal); connecting needs write permission")
    ("nbd-socket-group", po::value<std::string>(),
     "group of the NBD Unix sockets, a name or a number (default: the daemon's)")
    ("control-socket-mode", po::value<std::string>()->default_value("0600"),
     "mode of the control socket (octal)")
    ("control-socket-group", po::value<std::string>(),
     "group of the control socket, a name or a number (default: the daemon's)")
    ("nbd-allow-root", po::bool_switch(),
     "a unix attachment whose connector binds a uid admits root too")
    ("tls", po::value<std::string>()->default_value("off"),
     "TLS on the NBD listeners: off, on (TLS-only attachments need it) or require (all do)")
    ("tls-x509-dir", po::value<std::string>(),
     "x509 credentials: DIR/ca-cert.pem, server-cert.pem, server-key.pem[, ca-crl.pem]")
    ("tls-psk-file", po::value<std::string>(),
     "standalone mode: TLS-PSK keys (keys.psk lines identity:hexkey, as psktool writes)")
    ("export", po::value<std::vector<std::string>>()->composing(),
     "standalone mode: serve PATH as export NAME: NAME=PATH[,ro] (repeatable)")
    ("listen-unix", po::value<std::vector<std::string>>()->composing(),
     "listen for NBD on a Unix socket at PATH (repeatable; managed default STATE_DIR/nbd.sock)")
    ("listen-tcp", po::value<std::vector<std::string>>()->composing(),
     "listen for NBD on HOST:PORT (repeatable; default 127.0.0.1:10809 when no listener is given)")
    ("workers", po::value<unsigned>()->default_value(0), "io_uring worker threads (0 = one per CPU)")
    ("max-connections", po::value<unsigned>()->default_value(1024), "connections at most")
    ("handshake-timeout-ms", po::value<unsigned>()->default_value(ms(defaults.handshake_timeout)),
     "milliseconds a client has for its whole handshake")
    ("max-handshakes", po::value<unsigned>()->default_value(defaults.max_handshakes),
     "connections in their handshake at most (fewer than --max-connections)")
    ("max-handshakes-per-peer",
     po::value<unsigned>()->default_value(defaults.max_handshakes_per_peer),
     "connections in their handshake at most from one TCP address or one local uid")
    ("send-timeout-ms", po::value<unsigned>()->default_value(ms(defaults.send_timeout)),
     "milliseconds a client may take none of its replies before it is cut off (0 = never)")
    ("payload-timeout-ms", po::value<unsigned>()->default_value(ms(defaults.payload_timeout)),
     "milliseconds a client may send none of a request's payload before it is cut off "
     "(0 = never)")
    ("peer-timeout-ms", po::value<unsigned>()->default_value(ms(defaults.peer_timeout)),
     "milliseconds a TCP client's host may stay silent before its connection is dropped "
     "(0 = the kernel's defaults)")
    ("payload-memory-mib", po::value<uint64_t>()->default_value(0),
     "MiB of request payloads all NBD connections may hold at once (0 = a quarter of RAM)")
    ("max-control-connections", po::value<unsigned>()->default_value(4096),
     "control-socket clients at once (each nbdkit connection through the plugin holds one)")
    ("buffered", po::bool_switch(), "use the page cache instead of O_DIRECT")
    ("log-level", po::value<std::string>()->default_value("info"),
     "trace, debug, info, warn, error")
    ("log-format", po::value<std::string>()->default_value("text"),
     "text, or json (one JSON object per line, for log shippers)")
    ("metrics-listen", po::value<std::string>(),
     "serve Prometheus metrics at http://ADDR:PORT/metrics (docs/metrics.md; off by default)");
  // clang-format on
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("config")) {
      const std::string file = vm["config"].as<std::string>();
      std::ifstream in(file);
      if (!in) throw std::runtime_error("cannot read config file " + file);
      po::store(po::parse_config_file(in, desc), vm);
    }
    po::notify(vm);
  } catch (const std::exception& e) {
    std::cerr << "shareblkd: " << e.what() << "\n" << desc;
    return 2;
  }
  if (vm.count("help")) {
    std::cout << desc;
    return 0;
  }
  spdlog::set_level(spdlog::level::from_str(vm["log-level"].as<std::string>()));
  if (const std::string format = vm["log-format"].as<std::string>(); format == "json") {
    spdlog::set_formatter(json_log_formatter());
  } else if (format != "text") {
    std::cerr << "shareblkd: --log-format must be text or json\n";
    return 2;
  }
  const auto started = std::chrono::system_clock::now();

  target::ServerOptions options;
  if (vm.count("listen-unix"))
    options.listen_unix = vm["listen-unix"].as<std::vector<std::string>>();
  if (vm.count("listen-tcp")) options.listen_tcp = vm["listen-tcp"].as<std::vector<std::string>>();
  options.workers = vm["workers"].as<unsigned>();
  options.max_connections = vm["max-connections"].as<unsigned>();
  options.payload_memory = vm["payload-memory-mib"].as<uint64_t>() << 20;
  options.max_handshakes = vm["max-handshakes"].as<unsigned>();
  options.max_handshakes_per_peer = vm["max-handshakes-per-peer"].as<unsigned>();
  if (options.max_handshakes == 0 || options.max_handshakes_per_peer == 0) {
    std::cerr << "shareblkd: --max-handshakes and --max-handshakes-per-peer must be at least 1\n";
    return 2;
  }
  options.handshake_timeout = std::chrono::milliseconds(vm["handshake-timeout-ms"].as<unsigned>());
  if (options.handshake_timeout.count() == 0) {
    std::cerr << "shareblkd: --handshake-timeout-ms must be at least 1\n";
    return 2;
  }
  target::SocketAccess control_access;
  std::string access_error;
  if (!parse_socket_access(vm, "nbd-socket", options.unix_access, access_error) ||
      !parse_socket_access(vm, "control-socket", control_access, access_error)) {
    std::cerr << "shareblkd: " << access_error << "\n";
    return 2;
  }
  const std::string tls_mode = vm["tls"].as<std::string>();
  if (tls_mode == "on") {
    options.tls.mode = target::TlsOptions::Mode::On;
  } else if (tls_mode == "require") {
    options.tls.mode = target::TlsOptions::Mode::Require;
  } else if (tls_mode != "off") {
    std::cerr << "shareblkd: --tls must be off, on or require\n";
    return 2;
  }
  if (vm.count("tls-x509-dir")) options.tls.x509_dir = vm["tls-x509-dir"].as<std::string>();
  if (vm.count("tls-psk-file")) options.tls.psk_file = vm["tls-psk-file"].as<std::string>();
  if (options.tls.mode == target::TlsOptions::Mode::Off &&
      (!options.tls.x509_dir.empty() || !options.tls.psk_file.empty())) {
    std::cerr << "shareblkd: --tls-x509-dir and --tls-psk-file need --tls on or require\n";
    return 2;
  }
  if (!options.tls.psk_file.empty() && !vm.count("export")) {
    std::cerr << "shareblkd: --tls-psk-file is for standalone --export mode; attachments have "
                 "keys of their own\n";
    return 2;
  }
  options.send_timeout = std::chrono::milliseconds(vm["send-timeout-ms"].as<unsigned>());
  options.peer_timeout = std::chrono::milliseconds(vm["peer-timeout-ms"].as<unsigned>());
  options.payload_timeout = std::chrono::milliseconds(vm["payload-timeout-ms"].as<unsigned>());
  sigset_t signals = block_signals();

  std::shared_ptr<target::ExportCatalog> catalog;
  std::map<std::string, std::string> standalone_modes;  // export name -> "rw" or "ro"
  std::unique_ptr<lvm::VolumeStore> store;
  std::unique_ptr<control::ControlPlane> plane;
  std::string control_socket;
  if (vm.count("export")) {
    if (options.listen_unix.empty() && options.listen_tcp.empty()) {
      options.listen_tcp.push_back("127.0.0.1:10809");
    }
    auto exports = std::make_shared<target::StaticCatalog>();
    backend::OpenOptions open_options;
    open_options.direct = !vm["buffered"].as<bool>();
    for (const std::string& text : vm["export"].as<std::vector<std::string>>()) {
      ExportSpec spec;
      std::string error;
      if (!parse_export(text, spec, error)) {
        std::cerr << "shareblkd: " << error << "\n";
        return 2;
      }
      std::error_code ec;
      auto volume = backend::Volume::open(spec.path, ec, open_options);
      if (!volume) {
        std::cerr << "shareblkd: cannot open " << spec.path << ": " << ec.message() << "\n";
        return 1;
      }
      spdlog::info("export '{}': {} ({} bytes, {}{})", spec.name, spec.path, volume->size(),
                   spec.read_only ? "read-only" : "read-write",
                   volume->is_direct() ? ", O_DIRECT" : ", page cache");
      standalone_modes[spec.name] = spec.read_only ? "ro" : "rw";
      exports->add(spec.name, target::Export{volume,
                                             spec.read_only ? backend::AttachMode::ReadOnly
                                                            : backend::AttachMode::ReadWrite,
                                             spec.name, spec.path});
    }
    catalog = exports;
  } else {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path state = fs::absolute(vm["state-dir"].as<std::string>()).lexically_normal();
    fs::create_directories(state, ec);
    // It holds the database (export names are credentials) and the volumes: the daemon's alone.
    if (!ec) fs::permissions(state, fs::perms::owner_all, ec);
    if (ec) {
      std::cerr << "shareblkd: cannot create " << state << ": " << ec.message() << "\n";
      return 1;
    }
    // One daemon per state directory: a second one would replace the first's sockets and
    // share its database. Taken before anything is opened or bound; held until exit.
    if (!lock_state_dir(state / "shareblkd.lock")) return 1;
    control_socket = vm.count("control-socket") ? vm["control-socket"].as<std::string>()
                                                : (state / "shareblk.sock").string();
    if (options.listen_unix.empty() && options.listen_tcp.empty()) {
      options.listen_unix.push_back((state / "nbd.sock").string());
      options.listen_tcp.push_back("127.0.0.1:10809");
    }
    for (auto& path : options.listen_unix) path = fs::absolute(path).lexically_normal().string();
    lvm::StoreError store_error;
    store = lvm::make_store(vm["store"].as<std::string>(), state.string(),
                            vm["lvm-config"].as<std::string>(), store_error);
    if (!store) {
      std::cerr << "shareblkd: " << store_error.message << "\n";
      return 1;
    }
    control::Policy policy;
    policy.allow_multiattach = vm["allow_multiattach"].as<bool>();
    policy.allow_multiattach_bootable = vm["allow_multiattach_bootable"].as<bool>();
    policy.nbd_allow_root = vm["nbd-allow-root"].as<bool>();
    policy.tls = options.tls.mode;
    policy.tls_x509 = !options.tls.x509_dir.empty();
    try {
      plane =
          std::make_unique<control::ControlPlane>((state / "shareblk.db").string(), *store, policy);
    } catch (const std::exception& e) {
      std::cerr << "shareblkd: " << e.what() << "\n";
      return 1;
    }
    catalog = plane->catalog();
  }

  target::Server server(options, catalog);
  std::string what;
  if (std::error_code ec = server.start(what)) {
    std::cerr << "shareblkd: " << what << ": " << ec.message() << "\n";
    return 1;
  }
  for (const auto& path : options.listen_unix) spdlog::info("listening on unix:{}", path);
  for (const auto& ep : server.tcp_endpoints()) spdlog::info("listening on tcp:{}", ep);
  if (plane) {
    control::Endpoints endpoints;
    if (!options.listen_unix.empty()) endpoints.unix_socket = options.listen_unix.front();
    if (!server.tcp_endpoints().empty()) endpoints.tcp = server.tcp_endpoints().front();
    plane->bind(&server, endpoints);
    if (std::error_code ec = plane->listen(
            control_socket, vm["max-control-connections"].as<unsigned>(), control_access)) {
      std::cerr << "shareblkd: control socket " << control_socket << ": " << ec.message() << "\n";
      return 1;
    }
    spdlog::info("control socket {} (store: {})", control_socket, store->kind());
  }
  // Standalone exports are labelled with their name as attachment and volume.
  metrics::Listener metrics_listener([&] {
    if (plane) return metrics::render(plane->stats(), started);
    std::vector<control::AttachmentStats> figures;
    for (target::GroupStats& g : server.stats()) {
      const std::string name = g.group;
      figures.push_back({name, name, standalone_modes[name], std::move(g)});
    }
    return metrics::render(figures, started);
  });
  if (vm.count("metrics-listen")) {
    std::string bound;
    if (std::error_code ec =
            metrics_listener.start(vm["metrics-listen"].as<std::string>(), bound, what)) {
      std::cerr << "shareblkd: " << what << ": " << ec.message() << "\n";
      return ec == std::errc::invalid_argument ? 2 : 1;
    }
    spdlog::info("metrics on http://{}/metrics", bound);
  }

  int sig = 0;
  while (sigwait(&signals, &sig) == 0 && sig != SIGINT && sig != SIGTERM) {
    spdlog::info("signal {} ({}): ignored; SIGTERM or SIGINT stops shareblkd", sig, strsignal(sig));
  }
  spdlog::info("signal {}: stopping", sig);
  metrics_listener.stop();  // it reads the control plane and the server
  if (plane) plane->stop();
  server.stop();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Errors are reported where they happen; this is the last word on one that was not.
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "shareblkd: " << e.what() << "\n";
    return 1;
  }
}
