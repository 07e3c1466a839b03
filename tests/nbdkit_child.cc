// nbdkit as a child process of a test, with the plugin under test loaded.
#include "tests/nbdkit_child.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "tests/support.h"

namespace shareblk::testing {

using std::chrono::milliseconds;
using std::chrono::seconds;

// What an nbdkit child's environment needs for an ASan-instrumented plugin (the asan preset):
// nbdkit is not instrumented, so the ASan runtime must be preloaded. And it must initialize
// before libp11-kit's constructor (nbdkit links it through gnutls) runs: otherwise ASan
// initializes lazily from inside that constructor's newlocale(), whose write lock on the
// locale is then released by ASan's own dlerror() (glibc's gettext), and nbdkit hangs in
// freelocale() at exit. Constructors of unrelated preloaded libraries run last to first, so
// libp11-kit goes before the runtime, and ASan is told not to insist on coming first.
// Empty outside the asan preset.
std::vector<std::string> nbdkit_environment() {
#ifdef NBDKIT_PRELOAD
  static const std::vector<std::string> environment = [] {
    std::string preload = NBDKIT_PRELOAD;
    RunResult ldd = run({"sh", "-c", "ldd \"$(command -v nbdkit)\""});
    std::istringstream lines(ldd.output);
    for (std::string line; std::getline(lines, line);) {
      const size_t arrow = line.find("=> ");
      if (line.find("libp11-kit") == std::string::npos || arrow == std::string::npos) continue;
      const std::string path = line.substr(arrow + 3, line.find(" (") - arrow - 3);
      preload = path + " " + preload;
    }
    const char* options = std::getenv("ASAN_OPTIONS");
    return std::vector<std::string>{
        "LD_PRELOAD=" + preload,
        "ASAN_OPTIONS=" + std::string(options ? options : "") + ":verify_asan_link_order=0"};
  }();
  return environment;
#else
  return {};
#endif
}

Nbdkit::Nbdkit(const std::vector<std::string>& args, const std::string& pidfile,
               const std::string& log)
    : log_(log) {
  ::unlink(pidfile.c_str());
  std::vector<std::string> argv{"nbdkit", "--foreground", "--pidfile", pidfile};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargs;
  for (auto& a : argv) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  const std::vector<std::string> environment = nbdkit_environment();
  const int out = ::open(log.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  pid_ = ::fork();
  if (pid_ == 0) {
    ::setpgid(0, 0);
    const int devnull = ::open("/dev/null", O_RDONLY);
    ::dup2(devnull, 0);
    ::dup2(out, 1);
    ::dup2(out, 2);
    for (const std::string& setting : environment) {
      const size_t eq = setting.find('=');
      ::setenv(setting.substr(0, eq).c_str(), setting.substr(eq + 1).c_str(), 1);
    }
    ::execvp(cargs[0], cargs.data());
    std::fprintf(stderr, "exec nbdkit: %s\n", std::strerror(errno));
    ::_exit(127);
  }
  ::close(out);
  const auto deadline = std::chrono::steady_clock::now() + seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(pidfile);
    pid_t written = 0;
    if (in >> written) {
      if (written != pid_) throw std::runtime_error("nbdkit's pidfile names another process");
      idle_sockets_ = sockets();
      return;
    }
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      throw std::runtime_error("nbdkit exited at start; its log:\n" + this->log());
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  stop(SIGKILL);
  throw std::runtime_error("nbdkit did not come up; its log:\n" + this->log());
}

bool Nbdkit::running() const {
  siginfo_t info{};
  return pid_ > 0 &&
         ::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
         info.si_pid == 0;
}

int Nbdkit::stop(int sig) {
  if (pid_ <= 0) return -1;
  if (sig == SIGTERM) {
    const auto idle_deadline = std::chrono::steady_clock::now() + seconds(10);
    while (sockets() > idle_sockets_ && std::chrono::steady_clock::now() < idle_deadline) {
      std::this_thread::sleep_for(milliseconds(10));
    }
  }
  ::kill(pid_, sig);
  const int status = wait_exit(pid_, seconds(30));
  pid_ = -1;
  return status;
}

std::string Nbdkit::log() const {
  std::ifstream in(log_);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

size_t Nbdkit::sockets() const {
  size_t count = 0;
  std::error_code ec;
  for (const auto& fd :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid_) + "/fd", ec)) {
    std::error_code link_ec;
    if (std::filesystem::read_symlink(fd.path(), link_ec).string().starts_with("socket:")) {
      ++count;
    }
  }
  return count;
}

}  // namespace shareblk::testing
