// Part of target/'s public header (target.h): the I/O figures the server keeps per connection
// group, and what Server::stats() reports (docs/metrics.md).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace shareblk::target {

// Since-start I/O figures of one connection group (an attachment, or a standalone export),
// summed over the workers: what the `stats` method and /metrics show (docs/metrics.md).
struct IoStats {
  enum Kind : uint8_t { Read, Write, Trim, WriteZeroes, Flush, BlockStatus, Cache, kKinds };
  // "read", "write", "trim", "write_zeroes", "flush", "block_status", "cache".
  static const char* kind_name(size_t kind);
  // How `errors` are shown: "EPERM", "EIO", ...; the number for one without a name.
  static std::string errno_name(int err);
  // Latency histogram: bucket i counts requests answered within 2^i microseconds (and more
  // than the bucket before); the last one counts those slower than 2^(kBuckets-2) us (~16 s).
  static constexpr size_t kBuckets = 26;
  struct Op {
    uint64_t requests = 0;  // answered, with or without an error
    uint64_t bytes = 0;     // the length of those answered without an error
    uint64_t errors = 0;    // answered with an error
    uint64_t time_ns = 0;   // from header parsed to reply queued, all of them together
    std::array<uint64_t, kBuckets> latency{};
  };
  std::array<Op, kKinds> ops{};
  // Writes, trims and write-zeroes answered EPERM: a read-only attachment, or no write access.
  uint64_t refused_writes = 0;
  // Requests answered with an error, by errno (ascending; those seen only). An unknown command
  // has no kind and counts here only.
  std::vector<std::pair<int, uint64_t>> errors;

  IoStats& operator+=(const IoStats& other);
};

// A connection in its transmission phase.
struct LiveConnection {
  std::string peer;  // describe_endpoint()
  std::chrono::system_clock::time_point since;
  uint64_t serial = 0;  // the how-manieth of its group (Session::serial)
};

struct GroupStats {
  std::string group;
  IoStats io;
  std::vector<LiveConnection> connections;  // oldest first
};

}  // namespace shareblk::target
