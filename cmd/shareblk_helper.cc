// shareblk-helper: the privileged helper (privsep/privsep.h). Either started by shareblkd
// itself on an inherited socket (--fd), or as its own service listening on a socket that only
// the daemon's user may connect to (--daemon-user, with --listen or shareblk-helper.socket).
#include <pwd.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <atomic>
#include <boost/program_options.hpp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <thread>

#include "privsep/privsep.h"
#include "rights/rights.h"

namespace po = boost::program_options;
using shareblk::privsep::HelperConfig;

namespace {

constexpr unsigned kMaxConnections = 4;  // a daemon and its restart

po::options_description helper_options() {
  po::options_description desc("shareblk-helper options");
  // clang-format off
  desc.add_options()
    ("help,h", "show this help")
    ("config", po::value<std::string>(),
     "read store, lvm-config and fuse-mount-root from shareblkd's config FILE (other keys are "
     "shareblkd's and ignored)")
    ("fd", po::value<int>(), "serve the connected socket inherited as descriptor N (shareblkd "
     "starts the helper so); exit when it closes")
    ("listen", po::value<std::string>(), "listen on the Unix socket PATH")
    ("daemon-user", po::value<std::string>(),
     "the user (a name) whose daemon may connect, no one else may; with --fd, UID:GID of "
     "the user the daemon becomes")
    ("store", po::value<std::string>()->default_value("file"),
     "shareblkd's --store: lvm:VG is the volume group the helper serves")
    ("lvm-config", po::value<std::string>()->default_value(""), "shareblkd's --lvm-config")
    ("fuse-mount-root", po::value<std::string>()->default_value("/run/shareblk/mounts"),
     "shareblkd's --fuse-mount-root");
  // clang-format on
  return desc;
}

bool parse(int argc, char** argv, po::variables_map& vm, std::string& error) {
  const po::options_description desc = helper_options();
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("config")) {
      const std::string file = vm["config"].as<std::string>();
      std::ifstream in(file);
      if (!in) {
        error = "cannot read config file " + file + ": " + std::strerror(errno);
        return false;
      }
      po::store(po::parse_config_file(in, desc, /*allow_unregistered=*/true), vm);
    }
    po::notify(vm);
  } catch (const po::error& e) {
    error = e.what();
    return false;
  }
  return true;
}

int listen_on(const std::string& path, uid_t uid, gid_t gid, std::string& error) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof address.sun_path) {
    error = path + ": path too long";
    return -1;
  }
  std::memcpy(address.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ::unlink(path.c_str());  // a socket a helper that was killed left
  // Made 0600 before it is bound (umask), then given to the daemon's user: no one else ever
  // can connect, not even for a moment.
  const mode_t old_mask = ::umask(0177);
  const bool bound =
      fd >= 0 && ::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0;
  ::umask(old_mask);
  if (!bound || ::chown(path.c_str(), uid, gid) != 0 || ::listen(fd, 8) != 0) {
    error = path + ": " + std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

int run(int argc, char** argv) {
  po::variables_map vm;
  std::string error;
  if (!parse(argc, argv, vm, error)) {
    std::cerr << "shareblk-helper: " << error << "\n";
    return 2;
  }
  if (vm.count("help")) {
    std::cout << helper_options();
    return 0;
  }
  HelperConfig config;
  const std::string store = vm["store"].as<std::string>();
  if (store.starts_with("lvm:") && store.size() > 4) config.vg = store.substr(4);
  config.lvm_config = vm["lvm-config"].as<std::string>();
  config.fuse_mount_root = vm["fuse-mount-root"].as<std::string>();
  ::signal(SIGPIPE, SIG_IGN);
  spdlog::set_pattern("shareblk-helper: [%l] %v");
  if (::geteuid() != 0) spdlog::warn("not running as root: mounts and lvm2 will fail");

  if (vm.count("fd")) {
    const int fd = vm["fd"].as<int>();
    const auto peer = shareblk::rights::peer_of(fd);
    if (!peer) {
      std::cerr << "shareblk-helper: --fd " << fd << " is not a connected Unix socket\n";
      return 2;
    }
    // The daemon made the socketpair as root, before it became its user: that user is named.
    unsigned uid = peer->uid;
    unsigned gid = peer->gid;
    if (vm.count("daemon-user") &&
        std::sscanf(vm["daemon-user"].as<std::string>().c_str(), "%u:%u", &uid, &gid) != 2) {
      std::cerr << "shareblk-helper: with --fd, --daemon-user is UID:GID\n";
      return 2;
    }
    spdlog::info("serving shareblkd (uid {}){}", uid,
                 config.vg.empty() ? std::string() : ", volume group " + config.vg);
    shareblk::privsep::serve(fd, config, uid, gid);
    return 0;
  }
  // Socket activation (shareblk-helper.socket) or --listen.
  const int passed = ::sd_listen_fds(1);
  if ((passed != 1 && !vm.count("listen")) || !vm.count("daemon-user")) {
    std::cerr << "shareblk-helper: give --fd N, or --daemon-user USER with --listen PATH or a "
                 "socket passed by systemd\n";
    return 2;
  }
  const std::string user = vm["daemon-user"].as<std::string>();
  const passwd* pw = ::getpwnam(user.c_str());
  if (pw == nullptr) {
    std::cerr << "shareblk-helper: --daemon-user " << user << ": no such user\n";
    return 2;
  }
  const uid_t uid = pw->pw_uid;
  const gid_t gid = pw->pw_gid;
  const std::string path =
      passed == 1 ? std::string("the socket systemd passed") : vm["listen"].as<std::string>();
  const int listener = passed == 1 ? SD_LISTEN_FDS_START : listen_on(path, uid, gid, error);
  if (listener < 0) {
    std::cerr << "shareblk-helper: --listen " << error << "\n";
    return 1;
  }
  spdlog::info("listening on {} for user {} (uid {}){}", path, user, uid,
               config.vg.empty() ? std::string() : ", volume group " + config.vg);
  std::atomic<unsigned> connections{0};
  while (true) {
    const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      spdlog::error("accept: {}", std::strerror(errno));
      return 1;
    }
    const auto peer = shareblk::rights::peer_of(fd);
    if (!peer || peer->uid != uid || connections.load() >= kMaxConnections) {
      spdlog::warn(
          "refused a connection from uid {}: {}", peer ? std::to_string(peer->uid) : "?",
          peer && peer->uid == uid ? "too many connections" : "only " + user + " may connect");
      ::close(fd);
      continue;
    }
    ++connections;
    std::thread([fd, config, peer, &connections] {
      shareblk::privsep::serve(fd, config, peer->uid, peer->gid);
      ::close(fd);
      --connections;
    }).detach();
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "shareblk-helper: " << e.what() << "\n";
    return 1;
  }
}
