// A writer at queue depth 32 and a volume_takeover at a random moment of its writing, with
// the checks the fencing tests make (docs/fencing.md): shared by the NBD suite
// (e2e_fencing_test.cc) and the nbdkit one (e2e_nbdkit_test.cc).
#pragma once

#include <gtest/gtest.h>
#include <libnbd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"

namespace shareblk::testing {

using Clock = std::chrono::steady_clock;

inline constexpr uint64_t kBlock = 4096;
inline constexpr uint64_t kBlocks = 256;  // the region one run writes: 1 MiB
inline constexpr unsigned kDepth = 32;
inline constexpr uint64_t kMagic = 0x5348424c4b464e43;  // "SHBLKFNC"

// One 4 KiB write's contents: who, which run, which sequence number.
struct Stamp {
  uint64_t magic;
  uint64_t run;
  uint64_t seq;
};

inline void stamp(char* block, uint64_t run, uint64_t seq) {
  std::memset(block, static_cast<int>(seq & 0xff), kBlock);
  const Stamp s{kMagic, run, seq};
  std::memcpy(block, &s, sizeof s);
}

// A writer at QD32 on one connection: each write goes to block seq % kBlocks of the region,
// never to a block with a write still in flight, so that the last write acknowledged on a block
// is the one it must hold.
class QueuedWriter {
 public:
  QueuedWriter(nbd_handle* h, uint64_t run) : h_(h), run_(run), buffers_(kDepth * kBlock) {}

  // Issues writes until `stop` is set, then waits for every one.
  void run(const std::atomic<bool>& stop) {
    std::vector<unsigned> free_slots;
    for (unsigned i = 0; i < kDepth; ++i) free_slots.push_back(i);
    std::vector<bool> busy(kBlocks, false);
    while (!stop.load() || !in_flight_.empty()) {
      while (!stop.load() && !free_slots.empty()) {
        const uint64_t seq = issued_.load() + 1;
        const uint64_t block = seq % kBlocks;
        if (busy[block]) break;
        const unsigned slot = free_slots.back();
        free_slots.pop_back();
        char* buf = &buffers_[slot * kBlock];
        stamp(buf, run_, seq);
        busy[block] = true;
        issued_.store(seq);  // before it is sent: a seq above the mark was sent after it
        auto* op = new Op{this, seq, slot};
        const int64_t cookie =
            nbd_aio_pwrite(h_, buf, kBlock, block * kBlock, {complete, op, nullptr}, 0);
        if (cookie < 0) {
          ADD_FAILURE() << "aio_pwrite: " << nbd_get_error();
          delete op;
          return;
        }
        in_flight_.push_back(op);
      }
      if (in_flight_.empty()) continue;
      if (nbd_poll(h_, -1) < 0) {
        ADD_FAILURE() << "poll: " << nbd_get_error();
        return;
      }
      std::erase_if(in_flight_, [&](Op* op) {
        if (!op->done) return false;
        busy[op->seq % kBlocks] = false;
        free_slots.push_back(op->slot);
        results_.push_back({op->seq, op->error});
        delete op;
        return true;
      });
    }
  }
  uint64_t issued() const { return issued_.load(); }

  struct Result {
    uint64_t seq;
    int error;
  };
  const std::vector<Result>& results() const { return results_; }

 private:
  struct Op {
    QueuedWriter* writer;
    uint64_t seq;
    unsigned slot;
    bool done = false;
    int error = 0;
  };
  static int complete(void* data, int* error) {
    auto* op = static_cast<Op*>(data);
    op->done = true;
    op->error = *error;
    return 1;
  }

  nbd_handle* h_;
  uint64_t run_;
  std::vector<char> buffers_;
  std::atomic<uint64_t> issued_{0};
  std::vector<Op*> in_flight_;
  std::vector<Result> results_;
};

inline double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

// What takeovers under a writer came to.
struct TakeoverFigures {
  int runs = 0;
  uint64_t violations = 0, refused = 0, acknowledged = 0;
  std::vector<double> latency_ms;

  void print(const char* what) const {
    std::printf(
        "%s: %d runs, %llu violations, %llu writes acknowledged, %llu refused; latency p50 "
        "%.2f ms, p99 %.2f ms, max %.2f ms\n",
        what, runs, static_cast<unsigned long long>(violations),
        static_cast<unsigned long long>(acknowledged), static_cast<unsigned long long>(refused),
        percentile(latency_ms, 0.50), percentile(latency_ms, 0.99),
        *std::max_element(latency_ms.begin(), latency_ms.end()));
  }
};

// One run: a QD32 writer on `old_writer` (a connection of the writer attachment), and at a
// random moment volume_takeover to `new_id`, whose connection `next` then reads what the
// volume held at the return and overwrites the region at once. Checks that no write sent after
// the return succeeded (each failed with `refusal`), that the volume held at the return exactly
// the writes acknowledged (then or later: they were drained), and that none landed after it.
inline void takeover_run(const std::string& control, const std::string& vol,
                         const std::string& new_id, nbd_handle* old_writer, nbd_handle* next,
                         int run, int refusal, std::mt19937& random, TakeoverFigures& f) {
  ++f.runs;
  ASSERT_EQ(nbd_zero(old_writer, kBlocks * kBlock, 0, 0), 0) << nbd_get_error();
  QueuedWriter q(old_writer, static_cast<uint64_t>(run));
  std::atomic<bool> stop{false};
  std::thread io([&] { q.run(stop); });
  std::this_thread::sleep_for(std::chrono::microseconds(random() % 20000));
  const auto t0 = Clock::now();
  const nlohmann::json moved =
      rpc_ok(control, "volume_takeover", {{"volume_id", vol}, {"attachment_id", new_id}});
  const uint64_t mark = q.issued();  // every write above it was sent after the return
  f.latency_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  EXPECT_EQ(moved["writer"], new_id);
  // What the volume holds at the return, read by the new writer; then it overwrites the whole
  // region at once, on the connection it had.
  std::string at_return(kBlocks * kBlock, '\0');
  EXPECT_EQ(nbd_pread(next, at_return.data(), at_return.size(), 0, 0), 0) << nbd_get_error();
  std::string mine(kBlocks * kBlock, '\0');
  const uint64_t new_run = static_cast<uint64_t>(run) | (uint64_t{1} << 63);
  for (uint64_t blk = 0; blk < kBlocks; ++blk) stamp(&mine[blk * kBlock], new_run, blk);
  EXPECT_EQ(nbd_pwrite(next, mine.data(), mine.size(), 0, 0), 0) << nbd_get_error();
  // The old writer keeps sending for a while (at least 64 more writes).
  while (q.issued() < mark + 64) std::this_thread::sleep_for(std::chrono::microseconds(100));
  stop = true;
  io.join();

  std::vector<uint64_t> last_ok(kBlocks, 0);
  for (const auto& r : q.results()) {
    if (r.error == 0) {
      ++f.acknowledged;
      last_ok[r.seq % kBlocks] = std::max(last_ok[r.seq % kBlocks], r.seq);
      if (r.seq > mark) {
        ++f.violations;
        ADD_FAILURE() << "run " << run << ": write " << r.seq << " sent after the takeover "
                      << "returned (mark " << mark << ") succeeded";
      }
    } else {
      ++f.refused;
      // EPERM from the write-access gate itself, whatever the frontend's own refusal is.
      EXPECT_TRUE(r.error == refusal || r.error == EPERM)
          << "run " << run << " seq " << r.seq << ": " << std::strerror(r.error);
    }
  }
  // At the return, every write acknowledged (then or later) had landed, and no other.
  for (uint64_t blk = 0; blk < kBlocks; ++blk) {
    Stamp st{};
    std::memcpy(&st, &at_return[blk * kBlock], sizeof st);
    const uint64_t held = st.magic == kMagic && st.run == static_cast<uint64_t>(run) ? st.seq : 0;
    if (held > mark || held != last_ok[blk]) {
      ++f.violations;
      ADD_FAILURE() << "run " << run << " block " << blk << " held seq " << held
                    << " at the return; last acknowledged " << last_ok[blk] << ", mark " << mark;
    }
  }
  // And nothing of the old writer's landed after it: the new writer's data is whole.
  std::string region(kBlocks * kBlock, '\0');
  EXPECT_EQ(nbd_pread(next, region.data(), region.size(), 0, 0), 0) << nbd_get_error();
  for (uint64_t blk = 0; blk < kBlocks; ++blk) {
    if (std::memcmp(&region[blk * kBlock], &mine[blk * kBlock], kBlock) != 0) {
      ++f.violations;
      ADD_FAILURE() << "run " << run << " block " << blk
                    << ": a write of the old writer landed after the takeover returned";
    }
  }
}

}  // namespace shareblk::testing
