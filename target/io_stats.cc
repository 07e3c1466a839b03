// Request counting: per worker and group while serving (GroupCounters), summed on demand
// (IoStats). docs/metrics.md says what each figure means.
#include <algorithm>
#include <bit>
#include <cstring>

#include "target/io_stats.h"
#include "target/worker.h"

namespace shareblk::target {

namespace {
// Bucket i: answered within 2^i microseconds (1.5 us is not within 1 us: rounded up).
size_t latency_bucket(std::chrono::nanoseconds took) {
  const uint64_t us = (static_cast<uint64_t>(std::max<int64_t>(took.count(), 0)) + 999) / 1000;
  const size_t bucket = us <= 1 ? 0 : static_cast<size_t>(std::bit_width(us - 1));
  return std::min(bucket, IoStats::kBuckets - 1);
}
}  // namespace

const char* IoStats::kind_name(size_t kind) {
  static constexpr const char* kNames[kKinds] = {"read",  "write",        "trim", "write_zeroes",
                                                 "flush", "block_status", "cache"};
  return kind < kKinds ? kNames[kind] : "unknown";
}

std::string IoStats::errno_name(int err) {
  const char* name = strerrordesc_np(err) != nullptr ? strerrorname_np(err) : nullptr;
  return name != nullptr ? name : std::to_string(err);
}

IoStats& IoStats::operator+=(const IoStats& other) {
  for (size_t k = 0; k < kKinds; ++k) {
    Op& mine = ops[k];
    const Op& theirs = other.ops[k];
    mine.requests += theirs.requests;
    mine.bytes += theirs.bytes;
    mine.errors += theirs.errors;
    mine.time_ns += theirs.time_ns;
    for (size_t b = 0; b < kBuckets; ++b) mine.latency[b] += theirs.latency[b];
  }
  refused_writes += other.refused_writes;
  for (const auto& [err, count] : other.errors) {
    auto it = std::lower_bound(errors.begin(), errors.end(), std::make_pair(err, uint64_t{0}));
    if (it != errors.end() && it->first == err) {
      it->second += count;
    } else {
      errors.insert(it, {err, count});
    }
  }
  return *this;
}

void GroupCounters::record(IoStats::Kind kind, uint64_t bytes, int err,
                           std::chrono::nanoseconds took) {
  if (err != 0) by_errno[static_cast<size_t>(std::clamp(err, 0, kErrnoSlots))].add(1);
  if (kind >= IoStats::kKinds) return;
  Op& op = ops[kind];
  op.requests.add(1);
  if (err == 0) {
    op.bytes.add(bytes);
  } else {
    op.errors.add(1);
    if (err == EPERM &&
        (kind == IoStats::Write || kind == IoStats::Trim || kind == IoStats::WriteZeroes)) {
      refused_writes.add(1);
    }
  }
  op.time_ns.add(static_cast<uint64_t>(std::max<int64_t>(took.count(), 0)));
  op.latency[latency_bucket(took)].add(1);
}

void GroupCounters::add_to(IoStats& into) const {
  IoStats mine;
  for (size_t k = 0; k < IoStats::kKinds; ++k) {
    mine.ops[k].requests = ops[k].requests.get();
    mine.ops[k].bytes = ops[k].bytes.get();
    mine.ops[k].errors = ops[k].errors.get();
    mine.ops[k].time_ns = ops[k].time_ns.get();
    for (size_t b = 0; b < IoStats::kBuckets; ++b) mine.ops[k].latency[b] = ops[k].latency[b].get();
  }
  mine.refused_writes = refused_writes.get();
  for (int err = 1; err <= kErrnoSlots; ++err) {
    // The last slot holds the errno values past Linux's: shown as that slot's number.
    if (const uint64_t n = by_errno[static_cast<size_t>(err)].get())
      mine.errors.emplace_back(err, n);
  }
  into += mine;
}

GroupCounters& Worker::counters_for(const std::string& group) {
  std::lock_guard lock(counters_mutex_);
  auto& slot = counters_[group];
  if (!slot) slot = std::make_unique<GroupCounters>();
  return *slot;
}

void Worker::collect(std::unordered_map<std::string, IoStats>& into) const {
  std::lock_guard lock(counters_mutex_);
  for (const auto& [group, counters] : counters_) counters->add_to(into[group]);
}

void Worker::forget_counters(const std::string& group) {
  post([group](Worker& w) {
    for (const Connection* c : w.connections_) {
      if (c->group() == group) return;  // reopened meanwhile (a mode change): keep counting
    }
    std::lock_guard lock(w.counters_mutex_);
    w.counters_.erase(group);
  });
}

}  // namespace shareblk::target
