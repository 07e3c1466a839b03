// QoS end to end (docs/qos.md): limits set through the API hold on real libnbd clients that ask
// for far more, requests over them wait and never fail, other attachments on the same worker
// are not slowed, changes reach live connections, and limits survive a restart.
#include <gtest/gtest.h>
#include <libnbd.h>

#include <atomic>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"
#include "tests/managed_daemon.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr size_t kDepth = 32;  // the client's queue depth: far more than any limit here needs
constexpr uint64_t kVolumeSize = 64 << 20;

struct Rate {
  double per_second = 0;  // requests completed in the measured window, per second
  uint64_t failed = 0;    // requests answered with an error, over the whole run
};

int count_done(void* user_data, int* error) {
  auto* counts = static_cast<std::pair<uint64_t, uint64_t>*>(user_data);
  ++(*error == 0 ? counts->first : counts->second);
  return 1;  // libnbd retires the command
}

// Keeps `kDepth` requests of `length` bytes (reads, or writes) in flight on `h` for `warmup`
// and then `measure`; counts what completes in the second part. Its offsets walk the volume.
Rate drive(nbd_handle* h, bool write, size_t length, std::chrono::duration<double> warmup,
           std::chrono::duration<double> measure) {
  std::vector<char> buf(length, 0x5a);
  std::pair<uint64_t, uint64_t> counts{0, 0};  // ok, failed
  const Clock::time_point start = Clock::now();
  const Clock::time_point from = start + std::chrono::duration_cast<Clock::duration>(warmup);
  const Clock::time_point end = from + std::chrono::duration_cast<Clock::duration>(measure);
  uint64_t offset = 0;
  uint64_t at_from = 0;
  bool measuring = false;
  for (Clock::time_point now = start; now < end; now = Clock::now()) {
    if (!measuring && now >= from) {
      measuring = true;
      at_from = counts.first;
    }
    while (nbd_aio_in_flight(h) < static_cast<int>(kDepth)) {
      const nbd_completion_callback done{count_done, &counts, nullptr};
      const int64_t cookie = write ? nbd_aio_pwrite(h, buf.data(), length, offset, done, 0)
                                   : nbd_aio_pread(h, buf.data(), length, offset, done, 0);
      if (cookie < 0) {
        ADD_FAILURE() << nbd_get_error();
        return {};
      }
      offset = (offset + length) % kVolumeSize;
    }
    if (nbd_poll(h, 100) < 0) {
      ADD_FAILURE() << nbd_get_error();
      return {};
    }
  }
  const uint64_t in_window = counts.first - at_from;
  // Every request is answered (none failed), within seconds: a held request must not be
  // forgotten.
  const Clock::time_point give_up = Clock::now() + std::chrono::seconds(5);
  while (nbd_aio_in_flight(h) > 0 && Clock::now() < give_up) {
    if (nbd_poll(h, 100) < 0) break;
  }
  EXPECT_EQ(nbd_aio_in_flight(h), 0) << "requests left unanswered";
  return {static_cast<double>(in_window) / measure.count(), counts.second};
}

constexpr std::chrono::duration<double> kWarmup{0.5};
constexpr std::chrono::duration<double> kMeasure{2.5};

class QosTest : public st::ManagedDaemonTest {
 protected:
  void SetUp() override {
    start();
    volume_ = create_volume("64M");
  }
  // A live unix attachment with several connections allowed, and a libnbd client on it.
  Json attach_client(const std::string& instance, st::NbdHandle& client) {
    Json a = attach(volume_, instance, {{"host", instance}, {"transport", "unix"}});
    client = st::nbd_connect(a["connection_info"]["data"]["uri"]);
    EXPECT_TRUE(client) << daemon_->log();
    return a;
  }
  Json set_attachment_qos(const std::string& id, const Json& qos) {
    return st::rpc_ok(control(), "attachment_update", {{"attachment_id", id}, {"qos", qos}});
  }
  static void expect_within(double measured, double limit, double tolerance = 0.05) {
    EXPECT_GE(measured, limit * (1 - tolerance)) << "limit " << limit;
    EXPECT_LE(measured, limit * (1 + tolerance)) << "limit " << limit;
  }

  std::string volume_;
};

TEST_F(QosTest, AnAttachmentsIopsLimitHoldsAndSlowsNoOtherAttachment) {
  st::NbdHandle limited(nullptr, nbd_close), free(nullptr, nbd_close);
  const Json a = attach_client("limited", limited);
  attach_client("free", free);
  ASSERT_TRUE(limited && free);
  // The unlimited one alone first, on the daemon's one worker.
  const Rate alone = drive(free.get(), false, 4096, std::chrono::duration<double>(0.2),
                           std::chrono::duration<double>(1.0));
  const Json shown = set_attachment_qos(a["id"], {{"total_iops_sec", 2000}});
  EXPECT_EQ(shown["qos"], Json({{"total_iops_sec", 2000}})) << shown;
  Rate throttled, beside;
  std::thread other([&] { beside = drive(free.get(), false, 4096, kWarmup, kMeasure); });
  throttled = drive(limited.get(), false, 4096, kWarmup, kMeasure);
  other.join();
  expect_within(throttled.per_second, 2000);
  EXPECT_EQ(throttled.failed, 0u);
  EXPECT_EQ(beside.failed, 0u);
  // The other attachment shares the worker and is not held back with it.
  EXPECT_GT(beside.per_second, 2 * 2000.0) << "alone: " << alone.per_second;
  EXPECT_GT(beside.per_second, alone.per_second / 2) << "alone: " << alone.per_second;
  EXPECT_EQ(st::rpc_ok(control(), "attachment_show", {{"attachment_id", a["id"]}})["qos"],
            Json({{"total_iops_sec", 2000}}));
}

// A volume in memory is served inline on the worker: a held request that the worker's timer
// starts is answered at once, and its reply must go out then, not at the next wakeup.
TEST_F(QosTest, AVolumeInMemoryIsLimitedAlike) {
  st::TempDir shm("/dev/shm", std::nothrow);
  SHAREBLK_REQUIRE(shm.ok(), "no writable /dev/shm");
  st::TempDir sockets;
  const std::string control = shm / "shareblk.sock";
  st::Daemon daemon(
      {"--state-dir", shm.path().string(), "--listen-unix", sockets / "nbd.sock", "--workers", "1"},
      control);
  const std::string volume = st::rpc_ok(
      control, "volume_create", {{"name", "m"}, {"size", "64M"}, {"multiattach", true}})["id"];
  const Json a = st::rpc_ok(control, "attachment_create",
                            {{"volume_id", volume},
                             {"instance_uuid", "vm"},
                             {"connector", {{"host", "vm"}, {"transport", "unix"}}}});
  st::rpc_ok(control, "attachment_update",
             {{"attachment_id", a["id"]}, {"qos", {{"total_iops_sec", 2000}}}});
  st::NbdHandle client = st::nbd_connect(a["connection_info"]["data"]["uri"]);
  ASSERT_TRUE(client) << daemon.log();
  const Rate reads = drive(client.get(), false, 4096, kWarmup, std::chrono::duration<double>(1.5));
  expect_within(reads.per_second, 2000);
  EXPECT_EQ(reads.failed, 0u);
  client.reset();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

TEST_F(QosTest, ABytesLimitHoldsOnWrites) {
  st::NbdHandle client(nullptr, nbd_close);
  const Json a = attach_client("writer", client);
  ASSERT_TRUE(client);
  set_attachment_qos(a["id"], {{"write_bytes_sec", 16 << 20}, {"read_iops_sec", 10}});
  const Rate writes = drive(client.get(), true, 65536, kWarmup, kMeasure);
  expect_within(writes.per_second * 65536, 16 << 20);
  EXPECT_EQ(writes.failed, 0u);
}

TEST_F(QosTest, AVolumeLimitIsSharedByItsAttachments) {
  st::NbdHandle one(nullptr, nbd_close), two(nullptr, nbd_close);
  attach_client("one", one);
  attach_client("two", two);
  ASSERT_TRUE(one && two);
  const Json v = st::rpc_ok(control(), "volume_update",
                            {{"volume_id", volume_}, {"qos", {{"total_iops_sec", "3000"}}}});
  EXPECT_EQ(v["qos"], Json({{"total_iops_sec", 3000}})) << v;
  Rate first, second;
  std::thread other([&] { second = drive(two.get(), false, 4096, kWarmup, kMeasure); });
  first = drive(one.get(), true, 4096, kWarmup, kMeasure);
  other.join();
  expect_within(first.per_second + second.per_second, 3000);
  EXPECT_EQ(first.failed + second.failed, 0u);
  // Turns are taken first come, first served: two clients that both ask for more than the
  // limit share it about evenly, whatever their requests or workers (a write and a read here).
  // Before turns, whichever worker woke first took the tokens, and one client was left with
  // 184 of the 3,000 (a CI run).
  EXPECT_GT(first.per_second, 3000 / 3.0) << "the other got " << second.per_second;
  EXPECT_GT(second.per_second, 3000 / 3.0) << "the other got " << first.per_second;
}

TEST_F(QosTest, AChangeReachesLiveConnectionsAndAnEmptyObjectClears) {
  st::NbdHandle client(nullptr, nbd_close);
  const Json a = attach_client("vm", client);
  ASSERT_TRUE(client);
  set_attachment_qos(a["id"], {{"read_iops_sec", 1000}, {"read_iops_sec_max", 1000}});
  const Rate low = drive(client.get(), false, 4096, std::chrono::duration<double>(1.0),
                         std::chrono::duration<double>(1.5));
  expect_within(low.per_second, 1000);
  // Raised on the same connection: no reconnect.
  set_attachment_qos(a["id"], {{"read_iops_sec", 3000}});
  const Rate high = drive(client.get(), false, 4096, std::chrono::duration<double>(0.3),
                          std::chrono::duration<double>(1.5));
  expect_within(high.per_second, 3000);
  const Json cleared = set_attachment_qos(a["id"], Json::object());
  EXPECT_EQ(cleared["qos"], Json::object());
  const Rate none = drive(client.get(), false, 4096, std::chrono::duration<double>(0.1),
                          std::chrono::duration<double>(0.5));
  EXPECT_GT(none.per_second, 3000 * 1.5);
  EXPECT_EQ(low.failed + high.failed + none.failed, 0u);
  EXPECT_EQ(cleared["connections"], 1) << "the client stayed connected";
}

TEST_F(QosTest, LimitsSurviveARestart) {
  st::NbdHandle client(nullptr, nbd_close);
  const Json a = attach_client("vm", client);
  ASSERT_TRUE(client);
  set_attachment_qos(a["id"], {{"read_iops_sec", 1500}});
  st::rpc_ok(control(), "volume_update",
             {{"volume_id", volume_}, {"qos", {{"write_bytes_sec", 1 << 20}}}});
  client.reset();
  start();
  EXPECT_EQ(st::rpc_ok(control(), "attachment_show", {{"attachment_id", a["id"]}})["qos"],
            Json({{"read_iops_sec", 1500}}));
  const Json v = st::rpc_ok(control(), "volume_show", {{"volume_id", volume_}});
  EXPECT_EQ(v["qos"], Json({{"write_bytes_sec", 1 << 20}}));
  EXPECT_EQ(v["attachments"][0]["qos"], Json({{"read_iops_sec", 1500}}));
  client = st::nbd_connect(a["connection_info"]["data"]["uri"]);
  ASSERT_TRUE(client) << daemon_->log();
  const Rate reads = drive(client.get(), false, 4096, kWarmup, std::chrono::duration<double>(1.5));
  expect_within(reads.per_second, 1500);
  EXPECT_EQ(reads.failed, 0u);
}

TEST_F(QosTest, InvalidSpecsAreRefusedNamingTheKey) {
  const Json a = attach(volume_, "vm", {{"host", "vm"}, {"transport", "unix"}});
  const std::string id = a["id"];
  const auto refusal = [&](const Json& qos) {
    const Json r = st::rpc(control(), "attachment_update", {{"attachment_id", id}, {"qos", qos}});
    EXPECT_EQ(r["error"]["data"]["reason"], "invalid_params") << qos << " " << r;
    return r["error"]["message"].is_string() ? r["error"]["message"].get<std::string>() : "";
  };
  EXPECT_NE(refusal({{"total_iops", 5}}).find("qos.total_iops"), std::string::npos);
  EXPECT_NE(refusal({{"read_iops_sec", -1}}).find("qos.read_iops_sec"), std::string::npos);
  EXPECT_NE(refusal({{"read_iops_sec", 1.5}}).find("qos.read_iops_sec"), std::string::npos);
  EXPECT_NE(refusal({{"read_iops_sec", "1e3"}}).find("qos.read_iops_sec"), std::string::npos);
  EXPECT_NE(refusal({{"total_bytes_sec", 1}, {"write_bytes_sec", 1}}).find("qos.write_bytes_sec"),
            std::string::npos);
  EXPECT_NE(
      refusal({{"write_iops_sec", 100}, {"write_iops_sec_max", 99}}).find("qos.write_iops_sec_max"),
      std::string::npos);
  EXPECT_NE(refusal({{"read_bytes_sec_max", 99}}).find("qos.read_bytes_sec_max"),
            std::string::npos);
  refusal(5);
  // Exactly one of connector, mode and qos.
  EXPECT_EQ(st::rpc_reason(control(), "attachment_update",
                           {{"attachment_id", id}, {"mode", "ro"}, {"qos", Json::object()}}),
            "invalid_params");
  EXPECT_EQ(st::rpc_reason(
                control(), "volume_update",
                {{"volume_id", volume_}, {"qos", {{"total_iops_sec", 1}, {"read_iops_sec", 1}}}}),
            "invalid_params");
  EXPECT_EQ(st::rpc_reason(control(), "volume_create",
                           {{"name", "w"}, {"size", "1M"}, {"qos", {{"bogus", 1}}}}),
            "invalid_params");
  // Nothing was changed by the refusals; 0 is no limit.
  EXPECT_EQ(st::rpc_ok(control(), "attachment_show", {{"attachment_id", id}})["qos"],
            Json::object());
  EXPECT_EQ(set_attachment_qos(id, {{"total_iops_sec", 0}})["qos"], Json::object());
  const Json made =
      st::rpc_ok(control(), "volume_create",
                 {{"name", "w"}, {"size", "1M"}, {"qos", {{"read_bytes_sec", "1048576"}}}});
  EXPECT_EQ(made["qos"], Json({{"read_bytes_sec", 1048576}}));
}

}  // namespace
