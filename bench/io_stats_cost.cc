// What counting one request costs on the worker thread, alone: the clock read at its reply,
// the clock read per receive shared by the requests in it (here one per 32, a QD32 client's
// batch), and GroupCounters::record(). Built and run by bench/io-stats.
#include <chrono>
#include <cinttypes>
#include <cstdio>

#include "target/worker.h"

int main() {
  using clock = std::chrono::steady_clock;
  constexpr int kRequests = 20'000'000;
  shareblk::target::GroupCounters counters;
  const auto begin = clock::now();
  clock::time_point received;
  for (int i = 0; i < kRequests; ++i) {
    if (i % 32 == 0) received = clock::now();
    const auto kind = static_cast<shareblk::target::IoStats::Kind>(i & 1);  // reads, writes
    counters.record(kind, 4096, 0, clock::now() - received);
  }
  const double ns = std::chrono::duration<double, std::nano>(clock::now() - begin).count();
  const uint64_t counted = counters.ops[0].requests.get() + counters.ops[1].requests.get();
  std::printf("counting one request: %.1f ns (%d requests counted: %" PRIu64 ")\n", ns / kRequests,
              kRequests, counted);
}
