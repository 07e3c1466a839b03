#include "tests/ceph_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

namespace shareblk::testing {

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// How long a daemon gets to come up, and to go down before SIGKILL.
constexpr auto kStartTimeout = 30s;
constexpr auto kStopGrace = std::chrono::seconds(10);

std::string new_uuid() {
  std::ifstream in("/proc/sys/kernel/random/uuid");
  std::string uuid;
  std::getline(in, uuid);
  return uuid;
}

// A port nobody listens on now. The monitor binds it a moment later, so another process may
// take it first: start() checks whose monitor answers.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

bool accepting(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

// Starts `argv` without waiting, stdout and stderr to the file `out`; -1 when it cannot.
pid_t spawn_daemon(const std::vector<std::string>& argv, const std::string& out) {
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int out_fd = ::open(out.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = ::getpid();
  pid_t pid = -1;
  if (out_fd >= 0 && null_fd >= 0) pid = ::fork();
  if (pid == 0) {
    // A test process that crashes, or that ctest kills at its timeout, never runs the
    // destructor: the daemon goes with it instead of holding memory and ports.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(null_fd, 0);
    ::dup2(out_fd, 1);
    ::dup2(out_fd, 2);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  if (out_fd >= 0) ::close(out_fd);
  if (null_fd >= 0) ::close(null_fd);
  return pid;
}

// Whether child `pid` has exited; then it is reaped, `pid` is -1 and `how` says how it ended.
bool exited(pid_t& pid, std::string& how) {
  int status = 0;
  if (pid <= 0 || ::waitpid(pid, &status, WNOHANG) != pid) return false;
  pid = -1;
  if (WIFEXITED(status)) how = "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) how = "killed by signal " + std::to_string(WTERMSIG(status));
  return true;
}

void stop_daemon(pid_t& pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  wait_exit(pid, kStopGrace);
  pid = -1;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The last `count` lines of the file, headed by its name; nothing when it is empty or missing.
std::string tail(const std::string& path, size_t count = 40) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(std::move(line));
    if (lines.size() > count) lines.pop_front();
  }
  if (lines.empty()) return "";
  std::string out = "\n--- last lines of " + path + ":\n";
  for (const auto& line : lines) out += line + "\n";
  return out;
}

// Whether `line` is one of the lines of `output` (which may hold warnings too).
bool has_line(const std::string& output, const std::string& line) {
  std::istringstream in(output);
  for (std::string l; std::getline(in, l);) {
    if (l == line) return true;
  }
  return false;
}

}  // namespace

std::string CephCluster::missing_programs() {
  std::string missing;
  for (const char* program : {"ceph-mon", "ceph-osd", "ceph", "rbd"}) {
    if (!have_program(program)) missing += std::string(missing.empty() ? "" : " ") + program;
  }
  return missing;
}

CephCluster::CephCluster() = default;

CephCluster::~CephCluster() {
  stop();
}

namespace {

// True once every thread of pid is in group stop. kill(SIGSTOP) returns before the threads
// stop: one already handling a request may still answer it, which a test must not mistake
// for the daemon serving while frozen.
bool all_threads_stopped(pid_t pid) {
  std::error_code ec;
  const std::filesystem::path tasks = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
    std::ifstream in(task.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto comm_end = stat.rfind(')');  // the state follows the command, which may hold ')'
    if (comm_end == std::string::npos || comm_end + 2 >= stat.size()) continue;  // thread gone
    if (stat[comm_end + 2] != 'T' && stat[comm_end + 2] != 't') return false;
  }
  return !ec;
}

}  // namespace

CephCluster::Frozen::Frozen(pid_t pid) : pid_(pid) {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGSTOP);
  for (const auto deadline = Clock::now() + 5s; Clock::now() < deadline;) {
    if (all_threads_stopped(pid_)) return;
    std::this_thread::sleep_for(1ms);
  }
}

void CephCluster::Frozen::reset() {
  if (pid_ > 0) ::kill(pid_, SIGCONT);
  pid_ = -1;
}

void CephCluster::stop() {
  for (pid_t pid : {osd_, mon_}) {  // a frozen daemon would not act on its SIGTERM
    if (pid > 0) ::kill(pid, SIGCONT);
  }
  stop_daemon(osd_);
  stop_daemon(mon_);
}

RunResult CephCluster::ceph(std::vector<std::string> args) const {
  // Without --connect-timeout the CLI retries a monitor that is not there for 5 minutes.
  args.insert(args.begin(), {"ceph", "-c", conf_path(), "--connect-timeout", "20"});
  return run(args, std::chrono::seconds(60));
}

std::string CephCluster::failure(const std::string& what, const std::string& output,
                                 const std::string& name) const {
  std::string text = "ceph cluster in " + dir_.path().string() + ": " + what;
  if (!output.empty()) text += "\n--- output:\n" + output;
  return text + tail(dir_ / ("log/" + name + ".out")) + tail(dir_ / ("log/" + name + ".log"));
}

void CephCluster::write_conf() const {
  const std::string dir = dir_.path().string();
  const std::string mon = "v2:127.0.0.1:" + std::to_string(port_);
  std::ofstream out(conf_path(), std::ios::trunc);
  // Every path Ceph would default to /var or /etc is set here, under the temp directory.
  out << "[global]\n"
      << "fsid = " << fsid_ << "\n"
      << "mon host = " << mon << "\n"
      << "mon initial members = a\n"
      << "run dir = " << dir << "/run\n"
      << "log file = " << dir << "/log/$name.log\n"
      << "mon cluster log file = default=" << dir << "/log/$channel.log cluster=" << dir
      << "/log/cluster.log\n"
      << "crash dir = " << dir << "/crash\n"
      << "keyring = " << dir << "/keyring\n"
      << "auth cluster required = none\n"
      << "auth service required = none\n"
      << "auth client required = none\n"
      << "osd pool default size = 1\n"
      << "osd pool default min size = 1\n"
      << "osd crush chooseleaf type = 0\n"
      << "mon allow pool delete = true\n"
      << "mon warn on pool no redundancy = false\n"
      << "osd objectstore = memstore\n"
      << "memstore device bytes = " << (1ULL << 30)
      << "\n"
      // The monitor batches map changes for 1 s by default, and getting to a usable pool takes
      // a few: 7 s to start instead of 1.
      << "paxos propose interval = 0.01\n"
      // A monitor whose port was taken gives up at once rather than after 10 s of retries.
      << "ms bind retry count = 1\n"
      << "[mon.a]\n"
      << "mon data = " << dir << "/mon\n"
      << "public addr = " << mon
      << "\n"
      // The temp directory's disk may be nearly full; memstore does not use it.
      << "mon data avail crit = 0\n"
      << "[osd.0]\n"
      << "osd data = " << dir << "/osd\n"
      << "osd journal = " << dir << "/osd/journal\n"
      << "public addr = 127.0.0.1\n"
      << "cluster addr = 127.0.0.1\n";
}

std::string CephCluster::start_monitor(bool& clash) {
  clash = false;
  port_ = free_port();
  if (port_ == 0) return "ceph cluster: no free TCP port on 127.0.0.1";
  std::error_code ec;
  // A previous attempt's, whose log would say it lost its port.
  std::filesystem::remove_all(dir_ / "mon", ec);
  std::filesystem::remove(dir_ / "log/mon.a.log", ec);
  std::filesystem::create_directories(dir_ / "mon", ec);
  write_conf();
  RunResult r =
      run({"ceph-mon", "-c", conf_path(), "--id", "a", "--mkfs", "--keyring", "/dev/null"},
          std::chrono::seconds(60));
  if (r.status != 0) return failure("ceph-mon --mkfs failed", r.output, "mon.a");
  // -f: in the foreground, so that mon_ stays the daemon's pid.
  mon_ = spawn_daemon({"ceph-mon", "-c", conf_path(), "--id", "a", "-f"}, dir_ / "log/mon.a.out");
  if (mon_ < 0) return "ceph cluster: cannot start ceph-mon";
  const std::string where = "127.0.0.1:" + std::to_string(port_);
  // Another process bound the port first; the monitor gives up and exits.
  const auto lost_port = [&] {
    return slurp(dir_ / "log/mon.a.log").find("unable to bind") != std::string::npos;
  };
  std::string how;
  for (const auto deadline = Clock::now() + kStartTimeout; !accepting(port_);) {
    if (exited(mon_, how)) break;
    if (Clock::now() > deadline) return failure("ceph-mon not listening on " + where, "", "mon.a");
    std::this_thread::sleep_for(20ms);
  }
  if (!how.empty()) {
    clash = lost_port();
    return failure("ceph-mon on " + where + " exited (" + how + ")", "", "mon.a");
  }
  // Something listens on the port, but is it this monitor? A client takes whichever cluster
  // answers there, whatever fsid its ceph.conf says.
  r = ceph({"fsid"});
  if (r.status == 0 && r.output.find(fsid_) != std::string::npos) return "";
  clash = lost_port() || r.status == 0;
  if (clash) stop_daemon(mon_);
  if (r.status != 0) return failure("`ceph fsid` failed", r.output, "mon.a");
  return failure("another cluster answers on " + where, r.output, "mon.a");
}

std::string CephCluster::start_osd() {
  RunResult r = ceph({"osd", "create"});
  if (r.status != 0 || !has_line(r.output, "0")) {
    return failure("`ceph osd create` failed (expected id 0)", r.output, "mon.a");
  }
  r = ceph({"osd", "crush", "add", "osd.0", "1", "root=default"});
  if (r.status != 0) return failure("`ceph osd crush add` failed", r.output, "mon.a");
  r = run({"ceph-osd", "-c", conf_path(), "--id", "0", "--mkfs"}, std::chrono::seconds(60));
  if (r.status != 0) return failure("ceph-osd --mkfs failed", r.output, "osd.0");
  osd_ = spawn_daemon({"ceph-osd", "-c", conf_path(), "--id", "0", "-f"}, dir_ / "log/osd.0.out");
  if (osd_ < 0) return "ceph cluster: cannot start ceph-osd";
  return "";
}

std::string CephCluster::start() {
  if (!dir_.ok()) return "ceph cluster: no temp directory";
  fsid_ = new_uuid();
  if (fsid_.empty()) return "ceph cluster: no UUID from /proc/sys/kernel/random/uuid";
  std::error_code ec;
  for (const char* sub : {"osd", "run", "log", "crash"}) {
    if (!std::filesystem::create_directories(dir_ / sub, ec)) {
      return "ceph cluster: cannot make " + (dir_ / sub) + ": " + ec.message();
    }
  }
  // A port found free may be taken before the monitor binds it: then another one.
  std::string why;
  bool clash = true;
  for (int attempt = 0; attempt < 3 && clash; ++attempt) why = start_monitor(clash);
  if (!why.empty()) return why;
  why = start_osd();
  if (!why.empty()) return why;

  // The pool can be made while the OSD boots; initialising it for RBD writes to it.
  RunResult r = ceph({"osd", "pool", "create", pool_, "8"});
  if (r.status != 0) return failure("`ceph osd pool create` failed", r.output, "mon.a");
  // Waits for the OSD here, where its death is seen at once: `rbd pool init` would wait for it
  // until its timeout.
  for (const auto deadline = Clock::now() + kStartTimeout;;) {
    std::string how;
    if (exited(osd_, how)) return failure("ceph-osd exited (" + how + ")", "", "osd.0");
    r = ceph({"osd", "stat", "--format", "json"});
    const size_t json = r.output.find('{');
    if (r.status == 0 && json != std::string::npos) {
      const auto stat = nlohmann::json::parse(r.output.substr(json), nullptr, false);
      if (stat.is_object() && stat.value("num_up_osds", 0) == 1) break;
    }
    if (Clock::now() > deadline) return failure("ceph-osd not up", r.output, "osd.0");
    std::this_thread::sleep_for(100ms);
  }
  r = run({"rbd", "-c", conf_path(), "pool", "init", pool_}, std::chrono::seconds(60));
  if (r.status != 0) return failure("`rbd pool init` failed", r.output, "osd.0");
  return "";
}

}  // namespace shareblk::testing
