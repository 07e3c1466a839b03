// Clients beyond what the daemon can serve are refused, and the daemon goes on serving the rest.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "tests/e2e_control_fixture.h"

namespace shareblk::testing::control_e2e {
namespace {

// --- Limits: a client beyond what the daemon can serve is refused, and the daemon goes on ---

class ControlLimitsTest : public ControlE2eTest {
 protected:
  std::string store() const override { return "file"; }
};

// The refusal a control client gets instead of service: one error line, then end of file.
void expect_refused(RpcConnection& c, const std::string& why) {
  Json reply = c.read_reply();
  ASSERT_TRUE(reply.is_object()) << "no refusal";
  EXPECT_EQ(reason_of(reply), "internal") << reply;
  EXPECT_NE(reply["error"].value("message", "").find(why), std::string::npos) << reply;
  EXPECT_FALSE(c.read_line(milliseconds(2000))) << "the refused connection stayed open";
}

// A control connection that has been served a call, so that it counts against the limit. A
// client that has just closed (the readiness probe of st::Daemon, a one-shot rpc()) still
// counts until the daemon's thread for it has seen it go, so a refusal is tried again for a
// while; a connection that is never served comes back null.
std::unique_ptr<RpcConnection> served_connection(const std::string& socket) {
  const auto deadline = std::chrono::steady_clock::now() + seconds(10);
  do {
    auto c = std::make_unique<RpcConnection>(socket);
    if (c->send_raw(R"({"jsonrpc":"2.0","id":0,"method":"volume_list"})"
                    "\n") &&
        c->read_reply().contains("result")) {
      return c;
    }
    std::this_thread::sleep_for(milliseconds(20));
  } while (std::chrono::steady_clock::now() < deadline);
  return nullptr;
}

TEST_F(ControlLimitsTest, ClientsBeyondTheLimitAreRefusedAndLaterOnesServed) {
  start({"--max-control-connections", "4"});
  std::vector<std::unique_ptr<RpcConnection>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(served_connection(control_socket()));
    ASSERT_TRUE(held.back()) << "connection " << i << " of 4 was never served";
  }
  {
    RpcConnection fifth(control_socket());
    ASSERT_NO_FATAL_FAILURE(expect_refused(fifth, "too many control connections (4 at once)"));
  }
  // One client leaves: its place is free again once the daemon has seen it go.
  held.pop_back();
  bool served = false;
  for (int i = 0; i < 100 && !served; ++i) {
    // A refused connection may be closed before the request is even sent.
    RpcConnection next(control_socket());
    served = next.send_raw(R"({"jsonrpc":"2.0","id":1,"method":"volume_list"})"
                           "\n") &&
             next.read_reply().contains("result");
    if (!served) std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(served) << daemon_->log();
  for (auto& c : held) EXPECT_TRUE(c->call("volume_list", Json::object()).contains("result"));
}

// The CLI reports the daemon's refusal of its connection with the reason and status 1, as any
// refusal. It used to send its request after the daemon had closed the connection, fail, and
// report status 3 ("cannot send to shareblkd"), as if no daemon were there.
TEST_F(ControlLimitsTest, TheCliReportsTheRefusalOfItsConnection) {
  start({"--max-control-connections", "2"});
  std::vector<std::unique_ptr<RpcConnection>> held;
  for (int i = 0; i < 2; ++i) {
    held.push_back(served_connection(control_socket()));
    ASSERT_TRUE(held.back()) << "connection " << i << " of 2 was never served";
  }
  for (int i = 0; i < 5; ++i) {
    const st::RunResult refused =
        st::run({SHAREBLK_CLI_PATH, "--socket", control_socket(), "volume-list"}, seconds(30));
    EXPECT_EQ(refused.status, 1) << refused.output;
    EXPECT_NE(refused.output.find("internal: too many control connections (2 at once)"),
              std::string::npos)
        << refused.output;
  }
}

// The daemon moved into a cgroup (v1 pids controller) whose limit it can be held at, so that
// starting a thread fails.
class PidsCgroup {
 public:
  explicit PidsCgroup(pid_t pid) : pid_(pid) {
    std::error_code ec;
    if (!fs::exists(root_ / "cgroup.procs", ec)) return;
    dir_ = root_ / ("shareblk-test-" + std::to_string(::getpid()));
    if (!fs::create_directory(dir_, ec) && ec) {
      dir_.clear();
      return;
    }
    ok_ = write(dir_ / "cgroup.procs", std::to_string(pid_));
  }
  ~PidsCgroup() {
    if (ok_) write(root_ / "cgroup.procs", std::to_string(pid_));
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  PidsCgroup(const PidsCgroup&) = delete;
  PidsCgroup& operator=(const PidsCgroup&) = delete;

  bool ok() const { return ok_; }
  // No task (thread) more than the daemon has now, or "max".
  bool hold() { return write(dir_ / "pids.max", st::read_file(dir_ / "pids.current", 0, 32)); }
  bool release() { return write(dir_ / "pids.max", "max"); }

 private:
  static bool write(const fs::path& file, const std::string& value) {
    FILE* f = std::fopen(file.c_str(), "w");
    if (f == nullptr) return false;
    const bool ok = std::fputs(value.c_str(), f) >= 0;
    return std::fclose(f) == 0 && ok;
  }
  const fs::path root_ = "/sys/fs/cgroup/pids";
  fs::path dir_;
  pid_t pid_;
  bool ok_ = false;
};

// Every control client and every NBD handshake runs on a thread of its own. When none can be
// started (a pids limit such as systemd's TasksMax, or no memory) the client is refused; the
// daemon used to abort (an uncaught std::system_error).
TEST_F(ControlLimitsTest, NoThreadForAClientRefusesItAndTheDaemonGoesOn) {
  const std::string vol = create_volume("v", kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  RpcConnection served(control_socket());
  ASSERT_TRUE(served.call("volume_list", Json::object()).contains("result"));

  PidsCgroup cgroup(daemon_->pid());
  SHAREBLK_REQUIRE(cgroup.ok(), "a writable cgroup v1 pids controller at /sys/fs/cgroup/pids");
  ASSERT_TRUE(cgroup.hold());
  for (int i = 0; i < 3; ++i) {
    RpcConnection refused(control_socket());
    ASSERT_NO_FATAL_FAILURE(expect_refused(refused, "cannot serve another control connection now"));
  }
  int errnum = 0;
  EXPECT_FALSE(nbd_open(uri_of(rw), &errnum)) << "an NBD handshake ran without a thread";

  // Alive and still serving what it served.
  EXPECT_TRUE(served.call("volume_list", Json::object()).contains("result")) << daemon_->log();
  ASSERT_TRUE(cgroup.release());
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["id"], vol);
  NbdHandle h = nbd_open(uri_of(rw));
  ASSERT_TRUE(h) << nbd_get_error();
  const std::string data = pattern(3, 4096);
  EXPECT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_read(h.get(), 0, data.size()), data);
}

TEST_F(ControlLimitsTest, DeeplyNestedRequestsAreRefusedAndTheDaemonGoesOn) {
  RpcConnection c(control_socket());
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string lines[] = {
      R"({"jsonrpc":"2.0","id":)" + deep + R"(,"method":"volume_list"})",
      R"({"jsonrpc":"2.0","id":1,"method":"volume_list","params":{"x":)" + deep + "}}",
      "[" + deep + "]",
  };
  for (const std::string& line : lines) {
    ASSERT_TRUE(c.send_raw(line + "\n"));
    Json reply = c.read_reply();
    ASSERT_TRUE(reply.is_object()) << "no reply; daemon log:\n" << daemon_->log();
    EXPECT_EQ(reply["error"]["code"], -32600) << reply;
    EXPECT_EQ(reason_of(reply), "invalid_params") << reply;
  }
  EXPECT_TRUE(c.call("volume_list", Json::object()).contains("result"));
}

// A revocation notice goes out from inside attachment_delete, under the volume's lock, which
// then waits for the subscriber to let go. A subscriber that takes no replies (here: a batch of
// 2,000 calls it never reads) used to hold the delete, and every other change to that volume,
// until it went away. It holds it at most the 10 s a subscriber has to let go (docs/api.md);
// then its link is cut, which a subscriber takes as a revocation.
TEST_F(ControlLimitsTest, ASubscriberThatDoesNotReadDoesNotHoldADelete) {
  const std::string vol = create_volume("v", kMiB, true)["id"];
  Json a = attach(vol, "writer", "rw");
  RpcConnection subscriber(control_socket());
  ASSERT_TRUE(
      subscriber.call("export_resolve", {{"export_name", export_of(a)}}).contains("result"));
  Json batch = Json::array();
  for (int i = 0; i < 2000; ++i) {
    batch.push_back({{"jsonrpc", "2.0"},
                     {"id", i},
                     {"method", "attachment_show"},
                     {"params", {{"attachment_id", a["id"]}}}});
  }
  ASSERT_TRUE(subscriber.send_raw(batch.dump() + "\n"));
  std::this_thread::sleep_for(milliseconds(500));  // its reply now fills the socket

  const auto start = std::chrono::steady_clock::now();
  ok("attachment_delete", {{"attachment_id", a["id"]}});
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(12));
  EXPECT_EQ(ok("volume_extend", {{"volume_id", vol}, {"size", "2M"}})["size"], 2 * kMiB);
  // The subscriber's link is closed: what was sent before the cut, then end of file.
  bool closed = false;
  for (int i = 0; i < 100000 && !closed; ++i) closed = !subscriber.read_line(seconds(5));
  EXPECT_TRUE(closed);
}

// Every nbdkit connection holds a control connection (its subscription) for its whole life.
// With one per NBD client through nbdkit, enough clients would take every control connection
// and lock the operators out; subscriptions are capped below the limit instead.
TEST_F(ControlLimitsTest, SubscribersLeaveControlConnectionsForOperators) {
  start({"--max-control-connections", "8"});  // 4 of them for subscribers at most
  const std::string vol = create_volume("v", kMiB, true)["id"];
  Json a = attach(vol, "writer", "rw");
  std::vector<std::unique_ptr<RpcConnection>> subscribers;
  for (int i = 0; i < 4; ++i) {
    subscribers.push_back(served_connection(control_socket()));
    ASSERT_TRUE(subscribers.back()) << "connection " << i << " was never served";
    Json reply = subscribers.back()->call("export_resolve", {{"export_name", export_of(a)}});
    ASSERT_TRUE(reply.contains("result")) << reply;
  }
  std::unique_ptr<RpcConnection> fifth = served_connection(control_socket());
  ASSERT_TRUE(fifth);
  Json refused = fifth->call("export_resolve", {{"export_name", export_of(a)}});
  EXPECT_EQ(reason_of(refused), "internal") << refused;
  // The remaining connections serve operators.
  std::vector<std::unique_ptr<RpcConnection>> operators;
  for (int i = 0; i < 3; ++i) {
    operators.push_back(served_connection(control_socket()));
    EXPECT_TRUE(operators.back()) << "operator " << i << " of 3 was never served";
  }
  // A subscriber that goes away makes room for another.
  subscribers.pop_back();
  bool resolved = false;
  for (int i = 0; i < 100 && !resolved; ++i) {
    resolved = fifth->call("export_resolve", {{"export_name", export_of(a)}}).contains("result");
    if (!resolved) std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(resolved);
}

}  // namespace
}  // namespace shareblk::testing::control_e2e
