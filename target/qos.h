// Part of target/'s public header (target.h): QoS limits, the spec Cinder gives (docs/qos.md)
// and the token buckets every connection it limits shares, on any worker.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace shareblk::target {

// Cinder's front-end QoS spec (docs/qos.md): per-second limits, 0 for none. Each rate has a
// burst, its `*_max` key: how many operations (bytes) above the rate may go at once after an
// idle spell; 0 means a tenth of the rate, as QEMU's throttling does.
struct QosSpec {
  enum Key : uint8_t { TotalIops, ReadIops, WriteIops, TotalBytes, ReadBytes, WriteBytes, kKeys };
  // "total_iops_sec", ..., "write_bytes_sec"; the burst's key is this plus "_max".
  static const char* key_name(size_t key);
  std::array<uint64_t, kKeys> rate{};
  std::array<uint64_t, kKeys> burst{};

  bool limits() const;  // some rate is set
  bool operator==(const QosSpec&) const = default;
};

// One set of token buckets (QosSpec's), shared by every connection it limits, on any worker:
// an attachment's connections, or every attachment of a volume (the attachment's limiter's
// parent). Reads and writes count one operation and their length in bytes; trims and
// write-zeroes one write operation and no bytes (they carry no payload); flush, block status
// and cache nothing. A request takes what it costs when it asks, going into debt, and starts
// once the debt that requests before it ran up is paid: the rate holds over time, a large
// request waits for the refill like a small one instead of for a full bucket, and requests
// take turns in the order they ask, from whichever connection or worker, so that no
// connection sharing a bucket can starve another.
class QosLimiter {
 public:
  // An attachment's limiter, under its volume's `parent` (nullptr: none).
  static std::shared_ptr<QosLimiter> make(const QosSpec& spec,
                                          std::shared_ptr<QosLimiter> parent = nullptr);
  // One that never limits: for exports without QoS, so that connections need not test for
  // a null pointer.
  static QosLimiter& unlimited();
  ~QosLimiter();
  QosLimiter(const QosLimiter&) = delete;
  QosLimiter& operator=(const QosLimiter&) = delete;

  // A new spec, in force from the next request of every connection that has this limiter;
  // any thread. Buckets keep their level, cut to the new capacity.
  void set(const QosSpec& spec);
  QosSpec spec() const;

  // True when this limiter or its parent limits anything. The one test on the I/O path of an
  // unlimited attachment: a relaxed load that nothing writes while the limits stay as they are.
  bool engaged() const { return engaged_.load(std::memory_order_relaxed); }

  enum class Dir : uint8_t { Read, Write, None };
  // Takes the cost of a request of `dir` moving `bytes` from this limiter and its parent,
  // and returns how long after `now` its turn comes (zero: it may start now).
  std::chrono::nanoseconds admit(Dir dir, uint64_t bytes,
                                 std::chrono::steady_clock::time_point now);
  // Gives back what admit() took for a request that will never run (its connection ended
  // while it waited): the requests that ask after this are not held back by a dead one's
  // debt. Buckets are not filled past their burst. Requests already waiting keep their turns.
  void refund(Dir dir, uint64_t bytes);
  // Changes with every set() of this limiter or its parent: a request whose turn was given
  // under other limits need not wait for it (a raised or removed limit reaches it at once).
  uint64_t generation() const { return generation_.load(std::memory_order_relaxed); }

  struct Impl;

 private:
  QosLimiter();
  void update_engaged();  // under the parent's lock when there is one
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> engaged_{false};
  std::atomic<uint64_t> generation_{0};
};

}  // namespace shareblk::target
