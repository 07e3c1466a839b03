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

#include <atomic>
#include <boost/program_options.hpp>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>

#include "backend/backend.h"
#include "cmd/daemon_log.h"
#include "cmd/daemon_options.h"
#include "cmd/json_log.h"
#include "cmd/open_files.h"
#include "cmd/privileges.h"
#include "cmd/systemd.h"
#include "control/control.h"
#include "fuse/local_attach.h"
#include "lvm/lvm2.h"
#include "metrics/metrics.h"
#include "privsep/privsep.h"
#include "rbd/rbd_store.h"
#include "store/volume_store.h"
#include "target/target.h"

namespace po = boost::program_options;
using namespace shareblk;  // NOLINT(google-build-using-namespace)

namespace {

// Set when the Ceph cluster has fenced this gateway (ClusterOptions::on_fenced): the daemon
// then stops and exits 3.
std::atomic<bool> fenced{false};

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
// waits for them with sigwait. SIGINT and SIGTERM stop the daemon cleanly; SIGHUP reloads;
// SIGUSR1 and SIGUSR2, which an operator may send by mistake (or to another daemon's pid), are
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

// The group the option names, by name or number; false with a message when there is none.
bool parse_group(const po::variables_map& vm, const std::string& option, gid_t& gid,
                 std::string& error) {
  const std::string name = vm[option].as<std::string>();
  if (const struct group* g = ::getgrnam(name.c_str())) {
    gid = g->gr_gid;
    return true;
  }
  char* end = nullptr;
  const unsigned long number = std::strtoul(name.c_str(), &end, 10);
  if (name.empty() || *end != '\0' || number >= static_cast<unsigned long>(UINT32_MAX)) {
    error = "--" + option + ": no group '" + name + "'";
    return false;
  }
  gid = static_cast<gid_t>(number);
  return true;
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
  gid_t gid = 0;
  if (!parse_group(vm, name + "-group", gid, error)) return false;
  out.group = gid;
  return true;
}

// Who may call what on the control socket (control::Roles). A read-only group needs the socket
// open to every local user, since a socket file has one group: callers are then told apart by
// the credentials the kernel gives for each connection.
bool parse_roles(const po::variables_map& vm, target::SocketAccess& access, control::Roles& roles,
                 std::string& error) {
  roles.admin_group = access.group;
  if (vm.count("control-readonly-group") == 0) return true;
  gid_t gid = 0;
  if (!parse_group(vm, "control-readonly-group", gid, error)) return false;
  roles.read_group = gid;
  access.mode |= 0666;
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

// The policy the options name; at start and on SIGHUP.
control::Policy policy_from(const po::variables_map& vm, const target::TlsOptions& tls) {
  control::Policy policy;
  policy.allow_multiattach = vm["allow-multiattach"].as<bool>();
  policy.allow_multiattach_bootable = vm["allow-multiattach-bootable"].as<bool>();
  policy.nbd_allow_root = vm["nbd-allow-root"].as<bool>();
  policy.tls = tls.mode;
  policy.tls_x509 = !tls.x509_dir.empty();
  policy.fuse_mount_root = vm["fuse-mount-root"].as<std::string>();
  return policy;
}

// SIGHUP: reads the options again (the command line and the --config file) and applies what can
// change while serving: the log file (reopened), the log level, the policy and the TLS
// credentials. Every connection stays; anything else in the file waits for a restart. A file
// that does not parse changes nothing.
void reload(int argc, char** argv, control::ControlPlane* plane, target::Server& server,
            const target::TlsOptions& tls) {
  po::variables_map vm;
  std::vector<std::string> warnings;
  std::string error;
  if (!cmd::reopen_log(error))
    spdlog::error("SIGHUP: log file: {}; logging on to the old one", error);
  if (!cmd::load_options(argc, argv, vm, warnings, error)) {
    spdlog::error("SIGHUP: options not reloaded, the old ones stay: {}", error);
    return;
  }
  for (const std::string& w : warnings) spdlog::warn("{}", w);
  std::string policy = "unchanged";
  if (plane) {
    const std::string changed = plane->set_policy(policy_from(vm, tls));
    if (!changed.empty()) policy = changed;
  }
  std::string credentials = "off";
  if (tls.mode != target::TlsOptions::Mode::Off) {
    credentials =
        server.reload_tls(error) ? "not reloaded, the old ones stay: " + error : "reloaded";
  }
  spdlog::info("SIGHUP: reloaded: log level {}, policy {}, TLS credentials {}",
               vm["log-level"].as<std::string>(), policy, credentials);
  // Last, so that the line above is logged even when the new level is quieter.
  spdlog::set_level(spdlog::level::from_str(vm["log-level"].as<std::string>()));
}

// The TCP endpoint connection_info URIs name: --advertise-address with the port bound, or the
// bound address itself. A wildcard address reaches no one: then this host's name, and a warning.
std::string advertised_tcp(const std::string& bound, const po::variables_map& vm) {
  const size_t colon = bound.rfind(':');
  const std::string host = bound.substr(0, colon);
  const std::string port = bound.substr(colon + 1);
  if (vm.count("advertise-address")) {
    std::string advertised = vm["advertise-address"].as<std::string>();
    if (advertised.find(':') != std::string::npos && advertised.front() != '[') {
      advertised = "[" + advertised + "]";  // an IPv6 address, as a URI writes it
    }
    return advertised + ":" + port;
  }
  if (host != "0.0.0.0" && host != "[::]") return bound;
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  spdlog::warn(
      "listening on the wildcard address {}: connection_info names this host as '{}' (its "
      "hostname); give --advertise-address HOST to name the address clients should use",
      bound, name);
  return std::string(name) + ":" + port;
}

bool helper_device_mapper = false;  // what the privileged helper said at hello

// The privileged helper: the one at --privileged-helper, or one started here (as root, before
// --user drops it) from shareblk-helper beside this program. It must serve `wanted`'s volume
// group, if any.
bool start_helper(const po::variables_map& vm, const privsep::HelperConfig& wanted,
                  const std::optional<cmd::Identity>& identity,
                  std::shared_ptr<privsep::Helper>& helper, std::string& error) {
  if (vm.count("privileged-helper")) {
    helper = privsep::Helper::connect(vm["privileged-helper"].as<std::string>(), error);
  } else {
    std::error_code ec;
    const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) {
      error = "cannot find shareblk-helper: /proc/self/exe: " + ec.message();
      return false;
    }
    helper = privsep::Helper::start((self.parent_path() / "shareblk-helper").string(), wanted,
                                    identity->uid, identity->gid, error);
  }
  if (!helper) return false;
  std::string vg;
  if (const int err = helper->hello(vg, helper_device_mapper, error)) {
    error = "privileged helper: " + error + " (" + std::strerror(err) + ")";
    return false;
  }
  if (vg != wanted.vg) {
    error = "the privileged helper serves volume group '" + vg + "', this daemon's store is '" +
            wanted.vg + "': give both the same --store";
    return false;
  }
  spdlog::info("privileged helper: {}{}",
               vm.count("privileged-helper") ? vm["privileged-helper"].as<std::string>()
                                             : std::string("started"),
               vg.empty() ? "" : " (volume group " + vg + ")");
  return true;
}

int run(int argc, char** argv) {
  po::variables_map vm;
  std::vector<std::string> warnings;
  std::string error;
  if (!cmd::load_options(argc, argv, vm, warnings, error)) {
    std::cerr << "shareblkd: " << error << " (shareblkd --help lists the options)\n";
    return 2;
  }
  if (vm.count("help")) {
    std::cout << cmd::daemon_options();
    return 0;
  }
  if (vm.count("version")) {
    std::cout << "shareblkd " SHAREBLK_VERSION "\n";
    return 0;
  }
  spdlog::set_level(spdlog::level::from_str(vm["log-level"].as<std::string>()));
  if (vm.count("log-file") && !cmd::log_to(vm["log-file"].as<std::string>(), error)) {
    std::cerr << "shareblkd: --log-file: " << error << "\n";
    return 1;
  }
  if (const std::string format = vm["log-format"].as<std::string>(); format == "json") {
    spdlog::set_formatter(json_log_formatter());
  } else if (format != "text") {
    std::cerr << "shareblkd: --log-format must be text or json\n";
    return 2;
  }
  const auto started = std::chrono::system_clock::now();
  for (const std::string& w : warnings) spdlog::warn("{}", w);
  // --user: resolved now, dropped to once everything is bound and open (below).
  std::optional<cmd::Identity> identity;
  if (vm.count("user")) {
    identity.emplace();
    if (!cmd::resolve_identity(vm["user"].as<std::string>(),
                               vm.count("group") ? vm["group"].as<std::string>() : "", *identity,
                               error)) {
      std::cerr << "shareblkd: " << error << "\n";
      return 2;
    }
    if (::geteuid() != 0) {
      if (identity->uid != ::geteuid() || identity->gid != ::getegid()) {
        std::cerr << "shareblkd: --user " << identity->user << ": shareblkd runs as uid "
                  << ::geteuid() << ", not root, and cannot change its user\n";
        return 1;
      }
      identity.reset();  // already that user: nothing to drop
    }
  }
  const bool lvm_store = !vm.count("export") && vm["store"].as<std::string>().starts_with("lvm:");
  if (lvm_store && !identity && ::geteuid() != 0 && !vm.count("privileged-helper")) {
    std::cerr << "shareblkd: --store lvm: lvm2 and the volume group's devices need root: give "
                 "--privileged-helper SOCKET (the shareblk-helper service), or start shareblkd as "
                 "root with --user, which starts its own helper (docs/security.md, \"The "
                 "privileged helper\")\n";
    return 2;
  }
  target::ServerOptions options;
  if (vm.count("listen-unix"))
    options.listen_unix = vm["listen-unix"].as<std::vector<std::string>>();
  if (vm.count("listen-tcp")) options.listen_tcp = vm["listen-tcp"].as<std::vector<std::string>>();
  options.workers = vm["workers"].as<cmd::Workers>().value;
  options.max_connections = vm["max-connections"].as<cmd::Count>().value;
  options.payload_memory = vm["payload-memory-mib"].as<cmd::MiB>().value << 20;
  options.max_handshakes = vm["max-handshakes"].as<cmd::Count>().value;
  options.max_handshakes_per_peer = vm["max-handshakes-per-peer"].as<cmd::Count>().value;
  if (options.max_handshakes == 0 || options.max_handshakes_per_peer == 0) {
    std::cerr << "shareblkd: --max-handshakes and --max-handshakes-per-peer must be at least 1\n";
    return 2;
  }
  options.handshake_timeout =
      std::chrono::milliseconds(vm["handshake-timeout-ms"].as<cmd::Milliseconds>().value);
  if (options.handshake_timeout.count() == 0) {
    std::cerr << "shareblkd: --handshake-timeout-ms must be at least 1\n";
    return 2;
  }
  target::SocketAccess control_access;
  control::Roles roles;
  if (!parse_socket_access(vm, "nbd-socket", options.unix_access, error) ||
      !parse_socket_access(vm, "control-socket", control_access, error) ||
      !parse_roles(vm, control_access, roles, error)) {
    std::cerr << "shareblkd: " << error << "\n";
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
  options.send_timeout =
      std::chrono::milliseconds(vm["send-timeout-ms"].as<cmd::Milliseconds>().value);
  options.peer_timeout =
      std::chrono::milliseconds(vm["peer-timeout-ms"].as<cmd::Milliseconds>().value);
  options.payload_timeout =
      std::chrono::milliseconds(vm["payload-timeout-ms"].as<cmd::Milliseconds>().value);
  options.tcp_send_buffer = vm["tcp-send-buffer-kib"].as<cmd::KiB>().value << 10;
  // Logged once every option has been checked, so that a bad one is a single line.
  if (!identity && ::geteuid() == 0) {
    spdlog::warn("running as root; --user USER drops privileges after binding");
  }
  // Every descriptor the hard limit allows; the metrics listener holds a bounded few of them
  // (docs/metrics.md, "Bounds of the metrics endpoint"), the rest is for NBD, the control
  // socket and volumes.
  if (const cmd::OpenFilesLimit files = cmd::raise_open_files_limit(); files.error != 0) {
    spdlog::warn("open files: cannot raise the soft limit ({}) to the hard one: {}", files.before,
                 std::strerror(files.error));
  } else if (files.now != files.before) {
    spdlog::info("open files: at most {} (the hard limit; raised from {})", files.now,
                 files.before);
  } else {
    spdlog::info("open files: at most {} (the hard limit)", files.now);
  }
  sigset_t signals = block_signals();
  // Socket activation: the sockets a .socket unit passed replace the configured ones (one
  // config file serves both ways of starting; binding --listen-unix's path as well would take
  // it from systemd).
  cmd::PassedSockets passed;
  std::string passed_error;
  if (!cmd::take_passed_sockets(passed, passed_error)) {
    std::cerr << "shareblkd: " << passed_error << "\n";
    return 1;
  }
  if (!passed.nbd.empty()) {
    spdlog::info(
        "socket activation: {} NBD listeners passed, used instead of --listen-unix and "
        "--listen-tcp",
        passed.nbd.size());
    options.listen_unix.clear();
    options.listen_tcp.clear();
    options.listen_fds = passed.nbd;
  }
  const bool no_listener =
      options.listen_unix.empty() && options.listen_tcp.empty() && options.listen_fds.empty();

  std::shared_ptr<target::ExportCatalog> catalog;
  std::vector<std::shared_ptr<backend::Volume>> standalone_volumes;
  std::map<std::string, std::string> standalone_modes;  // export name -> "rw" or "ro"
  std::unique_ptr<store::VolumeStore> store;
  std::unique_ptr<store::Gateways> gateways;  // a store several gateways share: rbd
  std::unique_ptr<control::ControlPlane> plane;
  std::string control_socket;
  int control_fd = -1;  // bound before root goes, served after
  if (vm.count("export")) {
    if (!passed.control.empty()) {
      std::cerr << "shareblkd: a control socket was passed (socket activation), but standalone "
                   "--export mode has none\n";
      return 2;
    }
    if (no_listener) options.listen_tcp.push_back("127.0.0.1:10809");
    auto exports = std::make_shared<target::StaticCatalog>();
    backend::OpenOptions open_options;
    open_options.direct = !vm["buffered"].as<bool>();
    for (const std::string& text : vm["export"].as<std::vector<std::string>>()) {
      ExportSpec spec;
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
      standalone_volumes.push_back(volume);
      const auto mode =
          spec.read_only ? backend::AttachMode::ReadOnly : backend::AttachMode::ReadWrite;
      standalone_modes[spec.name] = backend::to_string(mode);
      exports->add(spec.name, target::Export{volume, mode, spec.name, spec.path});
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
    if (passed.control.size() > 1) {
      std::cerr << "shareblkd: socket activation passed " << passed.control.size()
                << " control sockets; shareblkd serves one\n";
      return 2;
    }
    if (no_listener) {
      options.listen_unix.push_back((state / "nbd.sock").string());
      options.listen_tcp.push_back("127.0.0.1:10809");
    }
    for (auto& path : options.listen_unix) path = fs::absolute(path).lexically_normal().string();
    store::StoreError store_error;
    const std::string store_spec = vm["store"].as<std::string>();
    // What needs root once the daemon has none: lvm2, the group's devices and FUSE mounts.
    std::shared_ptr<privsep::Helper> helper;
    if (identity || vm.count("privileged-helper")) {
      privsep::HelperConfig wanted;
      if (lvm_store) wanted.vg = store_spec.substr(4);
      wanted.lvm_config = vm["lvm-config"].as<std::string>();
      wanted.fuse_mount_root = vm["fuse-mount-root"].as<std::string>();
      if (!start_helper(vm, wanted, identity, helper, error)) {
        std::cerr << "shareblkd: " << error << "\n";
        return 1;
      }
      fuse::use_mounter(helper->mounter());
    }
    if (store_spec.rfind("rbd:", 0) == 0 && store_spec.size() > 4) {
      // The only store: a cluster out of reach is an error at start (docs/scale-out.md).
      rbd::ClusterOptions cluster;
      cluster.pool = store_spec.substr(4);
      cluster.conf_path = vm["ceph-conf"].as<std::string>();
      cluster.client_id = vm["ceph-id"].as<std::string>();
      cluster.timeout = std::chrono::seconds(std::max(1u, vm["ceph-timeout"].as<unsigned>()));
      // Fenced by a takeover on another gateway: every request of this client fails from now
      // on, for every volume. The daemon stops, and exits 3 for its service manager to start
      // it again as a new client (docs/scale-out.md, "A fenced gateway").
      cluster.on_fenced = [] {
        fenced.store(true);
        ::kill(::getpid(), SIGTERM);
      };
      store = rbd::make_rbd_store(cluster, gateways, store_error);
    } else if (lvm_store && store_spec.size() > 4) {
      store = lvm::make_lvm_store(store_spec.substr(4),
                                  helper ? helper->lvm2(helper_device_mapper)
                                         : lvm::local_lvm2(vm["lvm-config"].as<std::string>()),
                                  store_error);
    } else if (store_spec == "file") {
      store = store::make_file_store((state / "volumes").string(), vm["preallocate"].as<bool>(),
                                     store_error);
    } else {
      store_error = {std::make_error_code(std::errc::invalid_argument),
                     "--store wants 'file', 'lvm:VG' or 'rbd:POOL', got '" + store_spec + "'"};
    }
    if (!store) {
      std::cerr << "shareblkd: " << store_error.message << "\n";
      return 1;
    }
    try {
      plane = std::make_unique<control::ControlPlane>((state / "shareblk.db").string(), *store,
                                                      policy_from(vm, options.tls), gateways.get());
    } catch (const std::exception& e) {
      std::cerr << "shareblkd: " << e.what() << "\n";
      return 1;
    }
    catalog = plane->catalog();
  }

  // Everything is bound and opened first, while root may still be needed for it; no NBD
  // connection or control call is taken until root is gone (below), or one that came early
  // would be served with root's authority. (The metrics endpoint only reads figures.)
  target::Server server(options, catalog);
  std::string what;
  if (std::error_code ec = server.bind(what)) {
    std::cerr << "shareblkd: " << what << ": " << ec.message() << "\n";
    return 1;
  }
  for (const auto& path : server.unix_paths()) spdlog::info("listening on unix:{}", path);
  for (const auto& ep : server.tcp_endpoints()) spdlog::info("listening on tcp:{}", ep);
  if (plane) {
    control::Endpoints endpoints;
    if (!server.unix_paths().empty()) endpoints.unix_socket = server.unix_paths().front();
    if (!server.tcp_endpoints().empty()) {
      endpoints.tcp = advertised_tcp(server.tcp_endpoints().front(), vm);
    }
    plane->bind(&server, endpoints);
    if (!passed.control.empty()) {
      control_socket = "passed by systemd";
      control_fd = passed.control.front();
    } else if (std::error_code ec =
                   target::listen_unix(control_socket, control_access, control_fd)) {
      std::cerr << "shareblkd: control socket " << control_socket << ": " << ec.message() << "\n";
      return 1;
    }
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
  if (identity) {
    // Everything is bound and open: what the daemon made becomes the user's (it goes on
    // writing there), then root goes. The configured sockets only: passed ones are systemd's.
    bool given =
        plane == nullptr || cmd::give_tree(vm["state-dir"].as<std::string>(), *identity, error);
    for (const std::string& path : options.listen_unix) {
      given = given && cmd::give_file(path, *identity, error);
    }
    if (given && plane && passed.control.empty()) {
      given = cmd::give_file(control_socket, *identity, error);
    }
    if (!given || !cmd::drop_to(*identity, error)) {
      std::cerr << "shareblkd: --user " << identity->user << ": " << error << "\n";
      return 1;
    }
    spdlog::info("running as user {} (uid {}, gid {}), without capabilities", identity->user,
                 identity->uid, identity->gid);
  }
  server.serve();
  if (plane) {
    const unsigned max_clients = vm["max-control-connections"].as<cmd::Count>().value;
    if (std::error_code ec = plane->serve(control_fd, max_clients, roles,
                                          passed.control.empty() ? control_socket : "")) {
      std::cerr << "shareblkd: control socket " << control_socket << ": " << ec.message() << "\n";
      return 1;
    }
    spdlog::info("control socket {} (store: {})", control_socket, store->kind());
  }

  cmd::notify_ready(plane ? "serving; control socket " + control_socket : "serving exports");
  const cmd::WatchdogThread watchdog;

  int sig = 0;
  while (sigwait(&signals, &sig) == 0 && sig != SIGINT && sig != SIGTERM) {
    if (sig == SIGHUP) {
      cmd::notify_reloading();
      reload(argc, argv, plane.get(), server, options.tls);
      cmd::notify_ready(plane ? "serving; control socket " + control_socket : "serving exports");
    } else {
      spdlog::info("signal {} ({}): ignored; SIGTERM or SIGINT stops shareblkd, SIGHUP reloads",
                   sig, strsignal(sig));
    }
  }
  // Stop taking calls and connections, let the requests in flight be answered, then make every
  // acknowledged write durable; the database closes with the control plane.
  spdlog::info("signal {}: stopping", sig);
  cmd::notify_stopping();
  metrics_listener.stop();  // it reads the control plane and the server
  if (plane) plane->stop();
  server.stop();
  bool flushed = true;
  if (plane) flushed = plane->flush_volumes();
  for (const auto& volume : standalone_volumes) {
    if (const int err = backend::Handle(volume, backend::AttachMode::ReadOnly).flush()) {
      spdlog::error("{}: cannot flush at shutdown: {}", volume->path(), std::strerror(err));
      flushed = false;
    }
  }
  plane.reset();
  if (fenced.load()) {
    spdlog::critical(
        "stopped: the Ceph cluster has blocklisted this gateway's client (a volume_takeover "
        "on another gateway fenced it); exit status 3: start it again to serve as a new client");
    return 3;
  }
  spdlog::info("stopped{}", flushed ? "" : " (a volume could not be flushed: see above)");
  return flushed ? 0 : 1;
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
