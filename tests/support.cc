#include "tests/support.h"

#include <netinet/in.h>
#include <sys/time.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

namespace shareblk::testing {

bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

bool have_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (::access((dir + "/" + name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

bool is_root() {
  return ::geteuid() == 0;
}

namespace {
// mkdtemp under `parent`; empty when it fails.
std::filesystem::path make_temp_dir(const std::filesystem::path& parent) {
  std::string tmpl = (parent / "shareblk-test-XXXXXX").string();
  if (::mkdtemp(tmpl.data()) == nullptr) return {};
  return tmpl;
}
}  // namespace

TempDir::TempDir() : path_(make_temp_dir(std::filesystem::temp_directory_path())) {
  if (path_.empty()) throw std::runtime_error("mkdtemp failed");
}

TempDir::TempDir(const std::filesystem::path& parent, std::nothrow_t)
    : path_(make_temp_dir(parent)) {}

TempDir::~TempDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

void make_file(const std::string& path, uint64_t size, int fill) {
  int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + path);
  if (fill < 0) {
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) throw std::runtime_error("ftruncate");
  } else {
    std::string chunk(1 << 20, static_cast<char>(fill));
    for (uint64_t done = 0; done < size;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), size - done));
      if (::write(fd, chunk.data(), n) != static_cast<ssize_t>(n))
        throw std::runtime_error("write");
      done += n;
    }
  }
  ::close(fd);
}

std::string read_file(const std::string& path, uint64_t offset, size_t length) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(offset));
  std::string data(length, '\0');
  in.read(data.data(), static_cast<std::streamsize>(length));
  data.resize(static_cast<size_t>(in.gcount()));
  return data;
}

namespace {

pid_t spawn(const std::vector<std::string>& argv, int out_fd) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    int devnull = ::open("/dev/null", O_RDONLY);
    ::dup2(devnull, 0);
    ::dup2(out_fd, 1);
    ::dup2(out_fd, 2);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  return pid;
}

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

RunResult run(const std::vector<std::string>& argv, std::chrono::seconds timeout) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) return {};
  pid_t pid = spawn(argv, pipefd[1]);
  ::close(pipefd[1]);
  RunResult result;
  std::thread reader([&] {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(pipefd[0], buf, sizeof buf)) > 0) result.output.append(buf, size_t(n));
  });
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      result.output += "\n[killed: timed out]";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  reader.join();
  ::close(pipefd[0]);
  result.status = decode_status(status);
  return result;
}

bool wait_for_socket(const std::string& path, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

int connect_loopback(int port, std::chrono::milliseconds timeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (timeout.count() > 0) {
    timeval tv{};
    tv.tv_sec = timeout.count() / 1000;
    tv.tv_usec = (timeout.count() % 1000) * 1000;
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool daemon_has_test_hooks() {
  return SHAREBLK_DAEMON_TEST_HOOKS != 0;
}

std::string Daemon::binary() {
  return SHAREBLKD_PATH;
}

std::string Daemon::helper_binary() {
  return SHAREBLK_HELPER_PATH;
}

Daemon::Daemon(const std::vector<std::string>& args, const std::string& ready_socket,
               const std::vector<std::string>& launcher) {
  log_ = ready_socket + ".log";
  int fd = ::open(log_.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  std::vector<std::string> argv = launcher;
  argv.push_back(binary());
  argv.insert(argv.end(), args.begin(), args.end());
  pid_ = spawn(argv, fd);
  ::close(fd);
  if (!wait_for_socket(ready_socket, std::chrono::seconds(20))) {
    std::string text = log();
    stop(SIGKILL);
    throw std::runtime_error("shareblkd did not come up; its log:\n" + text);
  }
}

Daemon::~Daemon() {
  stop(SIGTERM);
}

int wait_exit(pid_t pid, std::chrono::seconds timeout) {
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return decode_status(status);
}

int Daemon::stop(int sig) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, sig);
  const int status = wait_exit(pid_, std::chrono::seconds(30));
  pid_ = -1;
  return status;
}

std::string Daemon::log() const {
  std::ifstream in(log_);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int logged_tcp_port(const Daemon& daemon, const std::string& address) {
  const std::string marker = "listening on tcp:" + address + ":";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string log = daemon.log();
    const size_t at = log.find(marker);
    if (at != std::string::npos) return std::atoi(log.c_str() + at + marker.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return 0;
}

}  // namespace shareblk::testing
