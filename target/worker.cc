#include "target/worker.h"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "target/rate_limited_log.h"

namespace shareblk::target {

// --- BufferPool ---

namespace {
// Buffers kept per size class: up to 8 MiB worth, and at least one.
size_t keep_limit(uint32_t size) {
  return std::max<size_t>(1, (8u << 20) / size);
}
// Requests kept for reuse per worker.
constexpr size_t kKeepRequests = 1024;
// Requests made when the worker starts: as many as one connection may have in flight, so that
// a burst up to that depth is served without an allocation on the I/O path (~2 KiB each).
constexpr size_t kPreparedRequests = 256;

// Clients cut off: a line a second per reason, for every worker together.
void log_cut_off(const char* reason, const std::string& group, std::chrono::milliseconds after) {
  client_log().warn_line(reason, fmt::format("nbd: a client of {} {} for {} ms; cutting it off",
                                             group, reason, after.count()));
}
}  // namespace

BufferPool::~BufferPool() {
  for (auto& list : free_) {
    for (Buffer b : list) release(b);
  }
}

void BufferPool::use_ring(backend::Ring* ring) {
  if (ring == nullptr) {  // the ring's end unregisters everything at once
    for (auto& list : free_) {
      for (Buffer& b : list) b.index = -1;
    }
  }
  ring_ = ring;
}

int BufferPool::size_class(uint32_t size) {
  if (size <= kMinSize) return 0;
  return std::bit_width(size - 1) - std::bit_width(kMinSize - 1);
}

BufferPool::Buffer BufferPool::get(uint32_t size) {
  const int c = size_class(size);
  if (c >= kClasses) return {};
  auto& list = free_[static_cast<size_t>(c)];
  if (!list.empty()) {
    Buffer b = list.back();
    list.pop_back();
    return b;
  }
  const size_t bytes = size_t{kMinSize} << c;
  Buffer b{static_cast<char*>(std::aligned_alloc(kMinSize, bytes)), -1};
  if (b.data != nullptr && ring_ != nullptr && bytes <= kRegisterMax) {
    b.index = ring_->register_buffer(b.data, bytes);
  }
  return b;
}

void BufferPool::put(Buffer buf, uint32_t size) {
  const int c = size_class(size);
  auto& list = free_[static_cast<size_t>(c)];
  if (list.size() < keep_limit(kMinSize << c)) {
    list.push_back(buf);
  } else {
    release(buf);
  }
}

// The slot is cleared before the memory is freed: a registered buffer refers to its pages, and
// the allocator may hand the same addresses out again.
void BufferPool::release(Buffer buf) {
  if (buf.index >= 0 && ring_ != nullptr) ring_->unregister_buffer(buf.index);
  std::free(buf.data);
}

// --- Worker ---

Worker::Worker(ConnectionRegistry& registry, uint64_t payload_budget,
               std::chrono::milliseconds send_timeout, std::chrono::milliseconds payload_timeout)
    : registry_(registry),
      payload_budget_(payload_budget),
      send_timeout_(send_timeout),
      payload_timeout_(payload_timeout) {
  wakeup_.worker = this;
  free_requests_.reserve(kKeepRequests);  // put_request() never grows it
  for (size_t i = 0; i < kPreparedRequests; ++i) free_requests_.push_back(new Request());
}

Worker::~Worker() {
  stop();
  for (Request* r : free_requests_) delete r;
  if (event_fd_ >= 0) ::close(event_fd_);
}

std::error_code Worker::start() {
  event_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (event_fd_ < 0) return {errno, std::generic_category()};
  std::promise<std::error_code> started;
  auto result = started.get_future();
  thread_ = std::thread([this, &started] { run(&started); });
  std::error_code ec = result.get();
  if (ec) thread_.join();
  return ec;
}

void Worker::run(std::promise<std::error_code>* started) {
  // The ring is made on the thread that uses it: IORING_SETUP_SINGLE_ISSUER binds it here.
  std::error_code ec;
  ring_ = std::make_unique<backend::Ring>(256, ec);
  if (ec) {
    ring_.reset();
    started->set_value(ec);
    return;
  }
  pool_.use_ring(ring_.get());
  ring_->read(event_fd_, &event_value_, sizeof event_value_, &wakeup_);
  started->set_value({});
  while (!(stopping_ && connections_.empty())) {
    int rc = ring_->run_once(wait_timeout_ms());
    if (rc < 0) {
      spdlog::error("worker: io_uring wait failed: {}", std::strerror(-rc));
      break;
    }
    // TLS connections with records received already: their requests join this batch.
    if (!tls_reads_.empty()) {
      tls_reading_.swap(tls_reads_);
      for (size_t i = 0; i < tls_reading_.size(); ++i) {
        if (Connection* c = tls_reading_[i]) c->tls_read();  // may schedule again, or close
      }
      tls_reading_.clear();
    }
    // Requests QoS held whose time has come start before the replies go out: one served
    // inline (a volume in memory) has its reply in this batch, not after the next wakeup.
    if (kQos && !qos_timers_.empty()) resume_qos_waiters();
    // One send per connection for all the replies this batch produced. A flush can
    // schedule another (a short send), and a connection can close and leave the list.
    // Each send wakes a client, and a client woken by a syscall of ours preempts this thread
    // when that syscall returns: one sendmsg per connection would cost every connection of
    // the batch a context switch (bench/PROFILE.md, "Many initiators"). So one connection
    // sends at once (the QD1 latency), several go to the ring and leave in one
    // io_uring_enter.
    while (!flushes_.empty()) {
      flushing_.swap(flushes_);
      const bool with_others = flushing_.size() > 1;
      for (size_t i = 0; i < flushing_.size(); ++i) {
        if (Connection* c = flushing_[i]) c->flush(with_others);
      }
      flushing_.clear();
    }
    if (!budget_waiters_.empty() && !payload_budget_spent()) {
      resuming_.swap(budget_waiters_);
      for (size_t i = 0; i < resuming_.size(); ++i) {
        if (Connection* c = resuming_[i]) c->resume();  // may wait again, or close
      }
      resuming_.clear();
    }
    if (watching()) cut_off_stalled_clients();
  }
  pool_.use_ring(nullptr);
  ring_.reset();  // cancels the eventfd read
}

// Sleeping without a timeout is the common case; only while some socket is full, or some
// request's payload is still to come, does the worker wake up now and then to look for
// clients that stopped taking their replies or sending their payload.
int Worker::wait_timeout_ms() const {
  if (!tls_reads_.empty()) return 0;  // bytes to decrypt wait for no event
  int timeout = stall_check_ms();
  if (!qos_timers_.empty()) {
    // Rounded up: waking before the time would find the tokens not yet there.
    const auto until = qos_timers_.begin()->first - std::chrono::steady_clock::now();
    const auto ms =
        std::max<int64_t>(0, std::chrono::ceil<std::chrono::milliseconds>(until).count());
    timeout = timeout < 0 ? static_cast<int>(ms) : std::min<int>(timeout, static_cast<int>(ms));
  }
  return timeout;
}

void Worker::resume_qos_waiters() {
  const auto now = std::chrono::steady_clock::now();
  while (!qos_timers_.empty() && qos_timers_.begin()->first <= now) {
    Connection* c = qos_timers_.begin()->second;
    qos_timers_.erase(qos_timers_.begin());
    c->qos_resume();  // may wait again, or close
  }
}

int Worker::stall_check_ms() const {
  if (!watching()) return -1;
  int64_t shortest = INT64_MAX;
  if (watching_sends()) shortest = send_timeout_.count();
  if (watching_payloads()) shortest = std::min<int64_t>(shortest, payload_timeout_.count());
  return static_cast<int>(std::clamp<int64_t>(shortest / 4, 10, 1000));
}

void Worker::cut_off_stalled_clients() {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_stall_check_) return;
  next_stall_check_ = now + std::chrono::milliseconds(stall_check_ms());
  const bool sends = watching_sends();
  const bool payloads = watching_payloads();
  std::vector<std::pair<Connection*, bool>> stalled;  // true: its payload stalled
  for (Connection* c : connections_) {
    if (sends && c->send_stalled_since(now - send_timeout_)) {
      stalled.emplace_back(c, false);
    } else if (payloads && c->payload_stalled_since(now - payload_timeout_)) {
      stalled.emplace_back(c, true);
    }
  }
  for (auto [c, payload] : stalled) {
    if (payload) {
      log_cut_off("sent none of a request's payload", c->group(), payload_timeout_);
    } else {
      log_cut_off("took none of its replies", c->group(), send_timeout_);
    }
    c->abort();  // a pending send or receive ends, and the connection closes after it
  }
}

void Worker::stop() {
  if (!thread_.joinable()) return;
  post([](Worker& w) {
    w.stopping_ = true;
    std::vector<Connection*> all(w.connections_.begin(), w.connections_.end());
    for (Connection* c : all) c->abort();
  });
  thread_.join();
}

void Worker::post(std::function<void(Worker&)> task) {
  {
    std::lock_guard lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  uint64_t one = 1;
  ssize_t n = ::write(event_fd_, &one, sizeof one);
  (void)n;  // an eventfd write only fails on counter overflow, and then it is already awake
}

void Worker::on_wakeup(int /*res*/) {
  std::vector<std::function<void(Worker&)>> tasks;
  {
    std::lock_guard lock(mutex_);
    tasks.swap(tasks_);
  }
  for (auto& task : tasks) task(*this);
  if (!stopping_ || !connections_.empty()) {
    ring_->read(event_fd_, &event_value_, sizeof event_value_, &wakeup_);
  }
}

void Worker::adopt(int fd, Session session, std::unique_ptr<TlsConnection> tls) {
  // std::function needs a copyable task: the TLS session travels as a shared_ptr's content.
  auto secure = std::make_shared<std::unique_ptr<TlsConnection>>(std::move(tls));
  post([fd, session = std::move(session), secure](Worker& w) mutable {
    auto* c = new Connection(w, fd, std::move(session), std::move(*secure));
    w.connections_.insert(c);
    if (w.stopping_) {
      c->abort();
    } else {
      c->start();
    }
  });
}

void Worker::close_group(const std::string& group, bool now, uint64_t below) {
  post([group, now, below](Worker& w) {
    std::vector<Connection*> matching;
    for (Connection* c : w.connections_) {
      if (c->group() == group && c->serial() < below) matching.push_back(c);
    }
    for (Connection* c : matching) {
      if (now) {
        c->abort();
      } else {
        c->drain();
      }
    }
  });
}

void Worker::wind_down() {
  post([](Worker& w) {
    std::vector<Connection*> all(w.connections_.begin(), w.connections_.end());
    for (Connection* c : all) c->wind_down();  // may close it
  });
}

void Worker::cut_off_stalled(std::optional<std::string> group, uint64_t below,
                             std::chrono::steady_clock::time_point since) {
  post([group = std::move(group), below, since](Worker& w) {
    std::vector<Connection*> stalled;
    for (Connection* c : w.connections_) {
      if (group && (c->group() != *group || c->serial() >= below)) continue;
      if (c->stalled_since(since)) stalled.push_back(c);
    }
    for (Connection* c : stalled) c->abort();
  });
}

Request* Worker::get_request() {
  if (free_requests_.empty()) return new Request();
  Request* r = free_requests_.back();
  free_requests_.pop_back();
  return r;
}

void Worker::put_request(Request* r) {
  if (free_requests_.size() < kKeepRequests) {
    free_requests_.push_back(r);
  } else {
    delete r;
  }
}

void Worker::cancel_flush(Connection* c) {
  std::erase(flushes_, c);
  std::replace(flushing_.begin(), flushing_.end(), c, static_cast<Connection*>(nullptr));
}

void Worker::cancel_tls_read(Connection* c) {
  std::erase(tls_reads_, c);
  std::replace(tls_reading_.begin(), tls_reading_.end(), c, static_cast<Connection*>(nullptr));
}

void Worker::wait_for_budget(Connection* c) {
  budget_waiters_.push_back(c);
}

void Worker::cancel_wait_for_budget(Connection* c) {
  std::erase(budget_waiters_, c);
  std::replace(resuming_.begin(), resuming_.end(), c, static_cast<Connection*>(nullptr));
}

void Worker::connection_finished(Connection* c) {
  connections_.erase(c);
  std::string group = c->group();
  const uint64_t serial = c->serial();
  delete c;
  registry_.connection_closed(group, serial);
}

}  // namespace shareblk::target
