// A ConnectionRegistry that counts closed connections, for tests and fuzz targets that run a
// real Worker. A client seeing end of file does not mean its connection is gone: an aborted
// one shuts its socket down at once and finishes its requests in flight after. Waiting for
// the count is how they know the Worker has let go of everything.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "target/worker.h"

namespace shareblk::testing {

class ClosedCount final : public target::ConnectionRegistry {
 public:
  void connection_closed(const std::string& /*group*/, uint64_t /*serial*/) override {
    std::lock_guard lock(mutex_);
    ++closed_;
    changed_.notify_all();
  }
  uint64_t closed() {
    std::lock_guard lock(mutex_);
    return closed_;
  }
  // True once at least `count` connections have closed, false if `timeout` passes first.
  bool wait(uint64_t count, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return closed_ >= count; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t closed_ = 0;
};

}  // namespace shareblk::testing
