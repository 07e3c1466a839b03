// QoS token buckets (qos.h, QosLimiter; docs/qos.md).
#include <algorithm>
#include <cmath>
#include <mutex>
#include <utility>
#include <vector>

#include "target/qos.h"

namespace shareblk::target {

namespace {

constexpr std::array<const char*, QosSpec::kKeys> kKeyNames = {"total_iops_sec", "read_iops_sec",
                                                               "write_iops_sec", "total_bytes_sec",
                                                               "read_bytes_sec", "write_bytes_sec"};

struct Bucket {
  double rate = 0;  // per second; 0: no limit
  double capacity = 0;
  double level = 0;  // may go below zero: the debt of requests already let through
};

}  // namespace

const char* QosSpec::key_name(size_t key) {
  return key < kKeyNames.size() ? kKeyNames[key] : "?";
}

bool QosSpec::limits() const {
  return std::any_of(rate.begin(), rate.end(), [](uint64_t r) { return r != 0; });
}

struct QosLimiter::Impl {
  mutable std::mutex mutex;
  QosSpec spec;
  std::array<Bucket, QosSpec::kKeys> buckets;
  std::chrono::steady_clock::time_point refilled = std::chrono::steady_clock::now();
  std::atomic<bool> limits{false};  // spec.limits(), for the children's engaged()
  std::shared_ptr<QosLimiter> parent;
  std::vector<QosLimiter*> children;  // under `mutex`

  void refill(std::chrono::steady_clock::time_point now) {
    // Workers read the clock before they lock: a later caller may bring an earlier time.
    if (now <= refilled) return;
    const double seconds = std::chrono::duration<double>(now - refilled).count();
    refilled = now;
    for (Bucket& b : buckets) {
      if (b.rate > 0) b.level = std::min(b.capacity, b.level + b.rate * seconds);
    }
  }

  // The buckets a request draws on, with what it costs in each.
  template <typename F>
  static void for_each_cost(Dir dir, uint64_t bytes, F&& f) {
    if (dir == Dir::None) return;
    const bool read = dir == Dir::Read;
    f(QosSpec::TotalIops, 1.0);
    f(read ? QosSpec::ReadIops : QosSpec::WriteIops, 1.0);
    if (bytes == 0) return;
    const auto b = static_cast<double>(bytes);
    f(QosSpec::TotalBytes, b);
    f(read ? QosSpec::ReadBytes : QosSpec::WriteBytes, b);
  }

  // How long until every bucket the request draws on is out of the debt run up before it.
  std::chrono::nanoseconds wait(Dir dir, uint64_t bytes) const {
    double seconds = 0;
    for_each_cost(dir, bytes, [&](QosSpec::Key k, double) {
      const Bucket& b = buckets[k];
      // Within a microsecond's refill of zero counts as zero: no rounding leaves a request
      // waiting for a last fraction of a token.
      if (b.rate > 0 && b.level < -b.rate * 1e-6) seconds = std::max(seconds, -b.level / b.rate);
    });
    if (seconds <= 0) return std::chrono::nanoseconds(0);
    return std::chrono::nanoseconds(static_cast<int64_t>(std::ceil(seconds * 1e9)));
  }

  void charge(Dir dir, uint64_t bytes) {
    for_each_cost(dir, bytes, [&](QosSpec::Key k, double cost) {
      if (buckets[k].rate > 0) buckets[k].level -= cost;
    });
  }

  void give_back(Dir dir, uint64_t bytes, std::chrono::steady_clock::time_point now) {
    refill(now);
    for_each_cost(dir, bytes, [&](QosSpec::Key k, double cost) {
      Bucket& b = buckets[k];
      if (b.rate > 0) b.level = std::min(b.capacity, b.level + cost);
    });
  }
};

QosLimiter::QosLimiter() : impl_(std::make_unique<Impl>()) {}

QosLimiter::~QosLimiter() {
  if (impl_->parent) {
    std::lock_guard lock(impl_->parent->impl_->mutex);
    std::erase(impl_->parent->impl_->children, this);
  }
}

std::shared_ptr<QosLimiter> QosLimiter::make(const QosSpec& spec,
                                             std::shared_ptr<QosLimiter> parent) {
  std::shared_ptr<QosLimiter> limiter(new QosLimiter());
  if (parent) {
    std::lock_guard lock(parent->impl_->mutex);
    parent->impl_->children.push_back(limiter.get());
    limiter->impl_->parent = std::move(parent);
  }
  limiter->set(spec);
  return limiter;
}

QosLimiter& QosLimiter::unlimited() {
  static QosLimiter none;
  return none;
}

void QosLimiter::set(const QosSpec& spec) {
  Impl& in = *impl_;
  {
    std::lock_guard lock(in.mutex);
    in.refill(std::chrono::steady_clock::now());
    for (size_t k = 0; k < QosSpec::kKeys; ++k) {
      Bucket& b = in.buckets[k];
      const auto rate = static_cast<double>(spec.rate[k]);
      // QEMU's default burst: a tenth of a second's worth, and at least one request.
      const double capacity =
          spec.burst[k] != 0 ? static_cast<double>(spec.burst[k]) : std::max(rate / 10, 1.0);
      const bool fresh = b.rate == 0;
      b.rate = rate;
      b.capacity = capacity;
      b.level = fresh ? capacity : std::min(b.level, capacity);
    }
    in.spec = spec;
    in.limits.store(spec.limits(), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_relaxed);
    // A volume's limiter: its attachments' engaged() and generation() follow it.
    for (QosLimiter* child : in.children) {
      child->update_engaged();
      child->generation_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (in.parent) {
    std::lock_guard lock(in.parent->impl_->mutex);
    update_engaged();
  } else {
    update_engaged();
  }
}

QosSpec QosLimiter::spec() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->spec;
}

void QosLimiter::update_engaged() {
  const bool parent = impl_->parent && impl_->parent->impl_->limits.load(std::memory_order_relaxed);
  engaged_.store(parent || impl_->limits.load(std::memory_order_relaxed),
                 std::memory_order_relaxed);
}

std::chrono::nanoseconds QosLimiter::admit(Dir dir, uint64_t bytes,
                                           std::chrono::steady_clock::time_point now) {
  if (dir == Dir::None) return std::chrono::nanoseconds(0);
  Impl& own = *impl_;
  Impl* parent = own.parent ? own.parent->impl_.get() : nullptr;
  if (parent != nullptr && !parent->limits.load(std::memory_order_relaxed)) parent = nullptr;
  // A child's lock, then its parent's: set() takes them one at a time, never in reverse.
  std::unique_lock lock(own.mutex);
  own.refill(now);
  std::chrono::nanoseconds wait = own.wait(dir, bytes);
  std::unique_lock<std::mutex> parent_lock;
  if (parent != nullptr) {
    parent_lock = std::unique_lock(parent->mutex);
    parent->refill(now);
    wait = std::max(wait, parent->wait(dir, bytes));
  }
  // Taken now, whatever the wait: the next request to ask, from any connection, waits
  // behind this one (first come, first served).
  own.charge(dir, bytes);
  if (parent != nullptr) parent->charge(dir, bytes);
  return wait;
}

void QosLimiter::refund(Dir dir, uint64_t bytes) {
  if (dir == Dir::None) return;
  const auto now = std::chrono::steady_clock::now();
  Impl& own = *impl_;
  Impl* parent = own.parent ? own.parent->impl_.get() : nullptr;
  if (parent != nullptr && !parent->limits.load(std::memory_order_relaxed)) parent = nullptr;
  // The locks in admit()'s order.
  std::lock_guard lock(own.mutex);
  own.give_back(dir, bytes, now);
  if (parent != nullptr) {
    std::lock_guard parent_lock(parent->mutex);
    parent->give_back(dir, bytes, now);
  }
}

}  // namespace shareblk::target
