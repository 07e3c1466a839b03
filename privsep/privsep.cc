#include "privsep/privsep.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

extern char** environ;

namespace shareblk::privsep {

namespace {

using Json = nlohmann::json;

constexpr size_t kMaxRequest = 64 << 10;  // the longest lvm2 command line is a few hundred bytes
constexpr size_t kMaxReply = 64 << 20;    // an lvs report of many thousand volumes

// One message, and perhaps one descriptor with it. False when the peer is gone.
bool send_message(int fd, const std::string& body, int pass_fd) {
  std::string frame(4, '\0');
  const auto length = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  frame += body;
  size_t sent = 0;
  while (sent < frame.size()) {
    iovec iov{frame.data() + sent, frame.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (sent == 0 && pass_fd >= 0) {  // the descriptor rides with the first byte
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    }
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// Reads `n` bytes into `out`, keeping the first descriptor that comes with them in `got_fd`
// (and closing any other). False at end of file or on error.
bool receive_bytes(int fd, char* out, size_t n, int& got_fd) {
  size_t done = 0;
  while (done < n) {
    iovec iov{out + done, n - done};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t got = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int passed = -1;
        std::memcpy(&passed, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (got_fd < 0) {
          got_fd = passed;
        } else {
          ::close(passed);
        }
      }
    }
    done += static_cast<size_t>(got);
  }
  return true;
}

// One message of at most `max` bytes. False when the peer is gone or breaks the framing.
bool receive_message(int fd, std::string& body, int& got_fd, size_t max) {
  got_fd = -1;
  unsigned char header[4];
  if (!receive_bytes(fd, reinterpret_cast<char*>(header), 4, got_fd)) return false;
  const uint32_t length =
      header[0] | (header[1] << 8) | (header[2] << 16) | (static_cast<uint32_t>(header[3]) << 24);
  if (length > max) return false;
  body.assign(length, '\0');
  return length == 0 || receive_bytes(fd, body.data(), length, got_fd);
}

Json refusal(int err, const std::string& why) {
  return Json{{"errno", err}, {"error", why}};
}

// What a request was, for the log: JSON escapes whatever a peer put in it.
std::string described(const Json& request) {
  std::string text = request.dump(-1, ' ', true, Json::error_handler_t::replace);
  if (text.size() > 512) text = text.substr(0, 512) + "...";
  return text;
}

// One request, answered: the reply, and the descriptor that goes with it (-1: none).
Json answer(const Json& request, const HelperConfig& config, const lvm::Lvm2& lvm2, uid_t peer_uid,
            gid_t peer_gid, int& fd) {
  const std::string op = request.value("op", "");
  if (op == "hello") {
    return Json{{"vg", config.vg}, {"device_mapper", lvm2.device_mapper}};
  }
  if (op == "lvm" || op == "open") {
    if (config.vg.empty()) return refusal(EPERM, "this helper serves no volume group");
  }
  if (op == "lvm") {
    std::vector<std::string> argv;
    for (const Json& arg : request.at("argv")) argv.push_back(arg.get<std::string>());
    std::string why;
    if (!lvm::check_lvm2_request(config.vg, argv, why)) return refusal(EPERM, why);
    const store::CommandResult r = lvm2.run(argv);
    return Json{{"status", r.status}, {"exec_errno", r.exec_errno}, {"out", r.out}, {"err", r.err}};
  }
  if (op == "open") {
    const std::string path = request.at("path").get<std::string>();
    const int flags = request.at("flags").get<int>();
    std::vector<std::string> pvs;
    if (store::StoreError e = lvm::physical_volumes(lvm2, config.vg, pvs)) {
      return refusal(e.code.value(), e.message);
    }
    std::string why;
    if (!lvm::check_lvm2_device(config.vg, pvs, path, flags, why)) return refusal(EPERM, why);
    fd = ::open(path.c_str(), flags | O_CLOEXEC);
    if (fd < 0) return refusal(errno, "open " + path + ": " + std::strerror(errno));
    return Json::object();
  }
  if (op == "mount") {
    std::string resolved;
    std::string error;
    const std::string mountpoint = request.at("mountpoint").get<std::string>();
    if (const int err = fuse::mount_fuse(mountpoint, config.fuse_mount_root, peer_uid, peer_gid, fd,
                                         resolved, error)) {
      return refusal(err, error);
    }
    return Json{{"resolved", resolved}};
  }
  if (op == "unmount") {
    bool lazily = false;
    std::string error;
    const std::string mountpoint = request.at("mountpoint").get<std::string>();
    if (const int err = fuse::unmount_fuse(mountpoint, config.fuse_mount_root, lazily, error)) {
      return refusal(err, error);
    }
    return Json{{"lazily", lazily}};
  }
  return refusal(EPERM, "'" + op + "' is not a request the helper serves");
}

}  // namespace

void serve(int fd, const HelperConfig& config, uid_t peer_uid, gid_t peer_gid) {
  const lvm::Lvm2 lvm2 = config.vg.empty() ? lvm::Lvm2{} : lvm::local_lvm2(config.lvm_config);
  while (true) {
    std::string body;
    int passed = -1;
    if (!receive_message(fd, body, passed, kMaxRequest)) break;
    if (passed >= 0) {  // a request never carries a descriptor
      ::close(passed);
      spdlog::warn("helper: uid {} sent a descriptor; closing its connection", peer_uid);
      break;
    }
    const Json request = Json::parse(body, nullptr, false);
    if (!request.is_object() || !request.contains("op") || !request["op"].is_string()) {
      spdlog::warn("helper: uid {} sent a message that is not a request; closing its connection",
                   peer_uid);
      break;
    }
    int reply_fd = -1;
    Json reply;
    try {
      reply = answer(request, config, lvm2, peer_uid, peer_gid, reply_fd);
    } catch (const Json::exception& e) {  // a field missing or of the wrong type
      reply = refusal(EINVAL, std::string("malformed request: ") + e.what());
    }
    if (reply.contains("errno")) {
      spdlog::warn("helper: uid {}: {}: refused: {}", peer_uid, described(request),
                   reply["error"].get<std::string>());
    } else {
      spdlog::info("helper: uid {}: {}: {}", peer_uid, described(request),
                   reply.contains("status") ? "exit " + std::to_string(reply["status"].get<int>())
                                            : std::string("done"));
    }
    const bool sent =
        send_message(fd, reply.dump(-1, ' ', false, Json::error_handler_t::replace), reply_fd);
    if (reply_fd >= 0) ::close(reply_fd);
    if (!sent) break;
  }
}

struct Helper::Reply {  // NOLINT(bugprone-exception-escape): a null Json's constructor does not
                        // throw
  Json body;
  int fd = -1;
};

Helper::Helper(int fd) : fd_(fd) {}

Helper::~Helper() {
  ::close(fd_);
  if (child_ > 0) {
    int status = 0;
    while (::waitpid(child_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

namespace {

// A connected socket to `path`, or -1 with `error`.
int connect_to(const std::string& path, std::string& error) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof address.sun_path) {
    error = "helper socket path " + path + " is too long";
    return -1;
  }
  std::memcpy(address.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    error = "cannot reach the privileged helper at " + path + ": " + std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

std::shared_ptr<Helper> Helper::connect(const std::string& path, std::string& error) {
  const int fd = connect_to(path, error);
  if (fd < 0) return nullptr;
  auto helper = std::make_shared<Helper>(fd);
  helper->path_ = path;
  return helper;
}

std::shared_ptr<Helper> Helper::start(const std::string& program, const HelperConfig& config,
                                      uid_t uid, gid_t gid, std::string& error) {
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    error = std::string("socketpair: ") + std::strerror(errno);
    return nullptr;
  }
  // The helper's end becomes its descriptor 3 (dup2 clears close-on-exec on it alone).
  std::vector<std::string> args = {program,
                                   "--fd",
                                   "3",
                                   "--daemon-user",
                                   std::to_string(uid) + ":" + std::to_string(gid),
                                   "--fuse-mount-root",
                                   config.fuse_mount_root};
  if (!config.vg.empty()) {
    args.insert(args.end(), {"--store", "lvm:" + config.vg, "--lvm-config", config.lvm_config});
  }
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pair[1], 3);
  pid_t pid = -1;
  const int err = ::posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pair[1]);
  if (err != 0) {
    ::close(pair[0]);
    error = "cannot start the privileged helper " + program + ": " + std::strerror(err);
    return nullptr;
  }
  auto helper = std::make_shared<Helper>(pair[0]);
  helper->child_ = pid;
  return helper;
}

int Helper::call(const std::string& request, Reply& reply, std::string& error) {
  std::lock_guard lock(mutex_);
  std::string body;
  bool sent = send_message(fd_, request, -1);
  // Refused at once: the helper is gone and never saw the request. Its service may have
  // started a new one: that one gets it. A helper that goes away while it holds a request is
  // not asked again (it may have carried it out).
  if (!sent && !path_.empty()) {
    if (const int fd = connect_to(path_, error); fd >= 0) {
      ::close(fd_);
      fd_ = fd;
      spdlog::warn("privileged helper: connected again to {}", path_);
      sent = send_message(fd_, request, -1);
    }
  }
  if (!sent || !receive_message(fd_, body, reply.fd, kMaxReply)) {
    error = "the privileged helper is gone";
    return EPIPE;
  }
  reply.body = Json::parse(body, nullptr, false);
  if (!reply.body.is_object()) {
    error = "the privileged helper answered something that is not a reply";
    return EPIPE;
  }
  if (reply.body.contains("errno")) {
    error = reply.body.value("error", "");
    const int err = reply.body["errno"].is_number_integer() ? reply.body["errno"].get<int>() : 0;
    return err > 0 ? err : EIO;
  }
  return 0;
}

int Helper::hello(std::string& vg, bool& device_mapper, std::string& error) {
  Reply reply;
  if (const int err = call(Json{{"op", "hello"}}.dump(), reply, error)) return err;
  vg = reply.body.value("vg", "");
  device_mapper = reply.body.value("device_mapper", false);
  return 0;
}

int Helper::run_lvm(const std::vector<std::string>& argv, store::CommandResult& out,
                    std::string& error) {
  Reply reply;
  if (const int err = call(Json{{"op", "lvm"}, {"argv", argv}}.dump(), reply, error)) return err;
  out.status = reply.body.value("status", -1);
  out.exec_errno = reply.body.value("exec_errno", 0);
  out.out = reply.body.value("out", "");
  out.err = reply.body.value("err", "");
  return 0;
}

int Helper::open_device(const std::string& path, int flags, int& fd, std::string& error) {
  Reply reply;
  const int err = call(Json{{"op", "open"}, {"path", path}, {"flags", flags}}.dump(), reply, error);
  if (err == 0 && reply.fd < 0) {
    error = "the privileged helper opened " + path + " but passed no descriptor";
    return EIO;
  }
  fd = reply.fd;
  return err;
}

int Helper::mount(const std::string& mountpoint, int& fuse_fd, std::string& resolved,
                  std::string& error) {
  Reply reply;
  const int err = call(Json{{"op", "mount"}, {"mountpoint", mountpoint}}.dump(), reply, error);
  if (err != 0) return err;
  if (reply.fd < 0) {
    error = "the privileged helper mounted " + mountpoint + " but passed no descriptor";
    return EIO;
  }
  fuse_fd = reply.fd;
  resolved = reply.body.value("resolved", "");
  return 0;
}

int Helper::unmount(const std::string& resolved, bool& lazily, std::string& error) {
  Reply reply;
  const int err = call(Json{{"op", "unmount"}, {"mountpoint", resolved}}.dump(), reply, error);
  lazily = err == 0 && reply.body.value("lazily", false);
  return err;
}

lvm::Lvm2 Helper::lvm2(bool device_mapper) {
  lvm::Lvm2 lvm2;
  lvm2.device_mapper = device_mapper;
  std::shared_ptr<Helper> self = shared_from_this();
  lvm2.run = [self](const std::vector<std::string>& argv) {
    store::CommandResult result;
    std::string error;
    if (const int err = self->run_lvm(argv, result, error)) {
      result = {};
      result.status = -1;
      result.exec_errno = err == EPIPE ? EPIPE : 0;
      result.err = "privileged helper: " + error;
    }
    return result;
  };
  lvm2.open_device = [self](const std::string& path, int flags) {
    int fd = -1;
    std::string error;
    if (const int err = self->open_device(path, flags, fd, error)) {
      spdlog::error("privileged helper: {}", error);
      return -err;
    }
    return fd;
  };
  return lvm2;
}

namespace {

class HelperMounter final : public fuse::Mounter {
 public:
  explicit HelperMounter(std::shared_ptr<Helper> helper) : helper_(std::move(helper)) {}
  int mount(const std::string& mountpoint, const std::string& /*root: the helper's own*/,
            int& fuse_fd, std::string& resolved, std::string& error) override {
    return helper_->mount(mountpoint, fuse_fd, resolved, error);
  }
  int unmount(const std::string& resolved, const std::string& /*root*/, bool& lazily,
              std::string& error) override {
    return helper_->unmount(resolved, lazily, error);
  }

 private:
  std::shared_ptr<Helper> helper_;
};

}  // namespace

std::shared_ptr<fuse::Mounter> Helper::mounter() {
  return std::make_shared<HelperMounter>(shared_from_this());
}

}  // namespace shareblk::privsep
