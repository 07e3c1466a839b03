// One transmission-phase Connection on a real io_uring Worker, driven over a socketpair, for
// orderings that a whole daemon cannot force.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "backend/backend.h"
#include "target/nbd_proto.h"
#include "target/worker.h"
#include "tests/support.h"

namespace shareblk::testing {
namespace {

using namespace std::chrono_literals;

class ClosedCount final : public target::ConnectionRegistry {
 public:
  void connection_closed(const std::string& /*group*/) override {
    std::lock_guard lock(mutex_);
    ++closed_;
    changed_.notify_all();
  }
  bool wait(int count, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return closed_ >= count; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int closed_ = 0;
};

bool send_all(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// A request that completes inside dispatch (here: refused at admission, a read-only export)
// while the connection is already aborted must not close it under the receive handler that
// dispatched it. The worker runs the abort first and then the receive that completes the
// payload, in one batch of completions; AddressSanitizer saw the handler use the freed
// connection.
TEST(ConnectionTest, AbortBeforeTheLastPayloadBytesArrive) {
  TempDir dir;
  make_file(dir / "volume.img", 1 << 20);
  std::error_code ec;
  auto volume = backend::Volume::open(dir / "volume.img", ec);
  ASSERT_TRUE(volume) << ec.message();

  ClosedCount registry;
  target::Worker worker(registry);
  ASSERT_FALSE(worker.start());
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  target::Session session;
  session.export_name = "ro";
  session.exp = target::Export{volume, backend::AttachMode::ReadOnly, "group", ""};
  worker.adopt(fds[0], session);

  uint8_t header[nbd::kRequestSize];
  nbd::encode_request(header, nbd::Request{nbd::kRequestMagic, 0, nbd::kCmdWrite, 1, 0, 8192});
  const std::string half(4096, 'w');
  ASSERT_TRUE(send_all(fds[1], header, sizeof header));
  ASSERT_TRUE(send_all(fds[1], half.data(), half.size()));
  std::this_thread::sleep_for(50ms);  // the rest of the payload is now an armed receive

  // Hold the worker in a task; meanwhile the payload's end arrives and the abort is posted.
  // When the task returns, the re-armed wakeup completes at submission, ahead of the receive.
  worker.post([](target::Worker&) { std::this_thread::sleep_for(200ms); });
  std::this_thread::sleep_for(50ms);
  ASSERT_TRUE(send_all(fds[1], half.data(), half.size()));
  worker.close_group("group", /*now=*/true);

  EXPECT_TRUE(registry.wait(1, 5s)) << "the connection did not close";
  worker.stop();
  ::close(fds[1]);
}

}  // namespace
}  // namespace shareblk::testing
