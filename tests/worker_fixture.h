// A real io_uring Worker serving one file, with clients on socketpairs: the fixture of the
// tests that drive one transmission-phase Connection without a whole daemon.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "target/nbd_proto.h"
#include "target/worker.h"
#include "tests/closed_count.h"
#include "tests/support.h"

namespace shareblk::testing {

inline bool send_all(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// A real Worker serving one file of `size` bytes; clients connect over socketpairs.
class WorkerOnAFile {
 public:
  explicit WorkerOnAFile(
      uint64_t size, uint64_t payload_budget = target::Worker::kDefaultPayloadBudget,
      std::chrono::milliseconds send_timeout = target::ServerOptions{}.send_timeout)
      : worker_(registry_, payload_budget, send_timeout) {
    make_file(path(), size);
    std::error_code ec;
    volume_ = backend::Volume::open(path(), ec);
    started_ = volume_ && !worker_.start();
  }
  ~WorkerOnAFile() { worker_.stop(); }
  WorkerOnAFile(const WorkerOnAFile&) = delete;
  WorkerOnAFile& operator=(const WorkerOnAFile&) = delete;

  bool started() const { return started_; }
  std::string path() const { return dir_ / "volume.img"; }
  target::Worker& worker() { return worker_; }
  ClosedCount& registry() { return registry_; }

  // A new connection of `mode` in the group "group"; the client's end, or -1.
  int connect(backend::AttachMode mode, bool structured_replies = false,
              bool base_allocation = false) {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return -1;
    target::Session session;
    session.export_name = "volume";
    session.exp = target::Export{volume_, mode, "group", ""};
    session.structured_replies = structured_replies;
    session.base_allocation = base_allocation;
    session.transmission_flags = target::transmission_flags(session.exp, structured_replies);
    worker_.adopt(fds[0], session);
    return fds[1];
  }

 private:
  TempDir dir_;
  ClosedCount registry_;
  std::shared_ptr<backend::Volume> volume_;
  target::Worker worker_;
  bool started_ = false;
};

inline bool send_request(int fd, uint16_t type, uint64_t cookie, uint64_t offset, uint32_t length,
                         uint16_t flags = 0) {
  uint8_t header[nbd::kRequestSize];
  nbd::encode_request(header,
                      nbd::Request{nbd::kRequestMagic, flags, type, cookie, offset, length});
  return send_all(fd, header, sizeof header);
}

}  // namespace shareblk::testing
