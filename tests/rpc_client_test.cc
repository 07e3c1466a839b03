// The control socket's JSON-RPC client (rpc/client.h) against a fake daemon in the test: a
// Unix socket whose every line the test writes by hand.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "rpc/client.h"
#include "tests/support.h"

namespace {

namespace rpc = shareblk::rpc;
using Json = nlohmann::json;
using std::chrono::milliseconds;

// The daemon's side of one connection, driven by the test.
class FakeDaemon {
 public:
  FakeDaemon() : path_(dir_ / "control.sock") {
    listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof addr.sun_path - 1);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(::listen(listener_, 4), 0);
  }
  ~FakeDaemon() {
    close_client();
    ::close(listener_);
  }
  FakeDaemon(const FakeDaemon&) = delete;
  FakeDaemon& operator=(const FakeDaemon&) = delete;

  const std::string& path() const { return path_; }

  // Takes the connection the client made: connect returned, so it is in the backlog.
  void accept() { client_ = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC); }

  // The next request line the client sent, parsed (null at end of file).
  Json read_request() {
    for (;;) {
      if (size_t nl = buffer_.find('\n'); nl != std::string::npos) {
        Json request = Json::parse(buffer_.substr(0, nl));
        buffer_.erase(0, nl + 1);
        return request;
      }
      char chunk[4096];
      const ssize_t n = ::recv(client_, chunk, sizeof chunk, 0);
      if (n <= 0) return nullptr;
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

  void send_raw(const std::string& bytes) {
    for (size_t done = 0; done < bytes.size();) {
      const ssize_t n = ::send(client_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return;  // the client gave up: what it saw is the test's to check
      done += static_cast<size_t>(n);
    }
  }
  void send(const Json& line) { send_raw(line.dump() + "\n"); }

  void close_client() {
    if (client_ >= 0) ::close(client_);
    client_ = -1;
  }

 private:
  shareblk::testing::TempDir dir_;
  std::string path_;
  int listener_ = -1;
  int client_ = -1;
  std::string buffer_;
};

Json result_for(const Json& id, const Json& result) {
  return {{"jsonrpc", "2.0"}, {"id", id}, {"result", result}};
}

Json notice(const std::string& attachment_id) {
  return {{"jsonrpc", "2.0"},
          {"method", "attachment_revoked"},
          {"params", {{"attachment_id", attachment_id}}}};
}

class RpcClientTest : public ::testing::Test {
 protected:
  // Connects the client and takes its connection on the daemon's side.
  void connect(milliseconds timeout = rpc::kWaitForever) {
    ASSERT_FALSE(client_.connect(daemon_.path(), timeout));
    daemon_.accept();
  }

  FakeDaemon daemon_;
  rpc::Client client_;
};

TEST_F(RpcClientTest, CallsGetTheReplyWithTheirId) {
  connect();
  std::thread daemon([this] {
    const Json first = daemon_.read_request();
    EXPECT_EQ(first["jsonrpc"], "2.0");
    EXPECT_EQ(first["method"], "volume_show");
    EXPECT_EQ(first["params"], (Json{{"volume_id", "v1"}}));
    // Lines that are not this call's reply are passed over: garbage, another id.
    daemon_.send_raw("not json\n\n");
    daemon_.send(result_for(first["id"].get<int>() + 100, "someone else's"));
    daemon_.send(result_for(first["id"], {{"id", "v1"}}));
    const Json second = daemon_.read_request();
    EXPECT_NE(second["id"], first["id"]);
    EXPECT_EQ(second["params"], Json::object());
    daemon_.send(result_for(second["id"], Json::array()));
  });
  const rpc::Outcome shown = client_.call("volume_show", {{"volume_id", "v1"}});
  ASSERT_TRUE(shown.ok()) << shown.error->describe();
  EXPECT_EQ(shown.result, (Json{{"id", "v1"}}));
  const rpc::Outcome listed = client_.call("volume_list");
  ASSERT_TRUE(listed.ok()) << listed.error->describe();
  EXPECT_EQ(listed.result, Json::array());
  daemon.join();
  std::vector<rpc::Notification> notices;
  EXPECT_FALSE(client_.poll(notices));
  EXPECT_TRUE(notices.empty());
}

TEST_F(RpcClientTest, AnErrorReplyCarriesCodeMessageAndReason) {
  connect();
  std::thread daemon([this] {
    const Json request = daemon_.read_request();
    daemon_.send({{"jsonrpc", "2.0"},
                  {"id", request["id"]},
                  {"error",
                   {{"code", -32002},
                    {"message", "volume is attached"},
                    {"data", {{"reason", "volume_in_use"}}}}}});
  });
  const rpc::Outcome refused = client_.call("volume_delete", {{"volume_id", "v1"}});
  daemon.join();
  ASSERT_TRUE(refused.error);
  EXPECT_FALSE(refused.error->link) << "a refusal is not the link's failure";
  EXPECT_EQ(refused.error->code, -32002);
  EXPECT_EQ(refused.error->message, "volume is attached");
  EXPECT_EQ(refused.error->reason, "volume_in_use");
  EXPECT_EQ(refused.error->data, (Json{{"reason", "volume_in_use"}}));
  EXPECT_EQ(refused.error->describe(), "volume_in_use: volume is attached");
  EXPECT_TRUE(refused.result.is_null());
}

// The daemon's refusal of a whole connection (too many clients) or of a line it could not
// read has a null id: it answers the call under way.
// It may come, and the daemon close, before the request is sent: the send fails, and what
// arrived before is still read.
TEST_F(RpcClientTest, AnErrorWithANullIdAnswersTheCall) {
  connect();
  daemon_.send({{"jsonrpc", "2.0"},
                {"id", nullptr},
                {"error",
                 {{"code", -32603},
                  {"message", "too many control connections"},
                  {"data", {{"reason", "internal"}}}}}});
  daemon_.close_client();
  const rpc::Outcome refused = client_.call("export_resolve", {{"export_name", "x"}});
  ASSERT_TRUE(refused.error);
  EXPECT_FALSE(refused.error->link);
  EXPECT_EQ(refused.error->reason, "internal");
}

// An attachment_revoked notice that arrives before the reply is kept for poll(); one that came
// in the same read as the reply is too, and has_news() says so with the socket empty.
TEST_F(RpcClientTest, NotificationsAroundTheReplyAreKeptForPoll) {
  connect();
  std::thread daemon([this] {
    const Json first = daemon_.read_request();
    daemon_.send(notice("a1"));
    daemon_.send(result_for(first["id"], {{"attachment_id", "a1"}}));
    const Json second = daemon_.read_request();
    daemon_.send_raw(result_for(second["id"], "second").dump() + "\n" + notice("a2").dump() +
                     "\n");  // one send, so one read
  });
  EXPECT_FALSE(client_.has_news());
  const rpc::Outcome resolved = client_.call("export_resolve", {{"export_name", "e"}});
  ASSERT_TRUE(resolved.ok()) << resolved.error->describe();
  EXPECT_EQ(resolved.result["attachment_id"], "a1");
  EXPECT_TRUE(client_.has_news());
  std::vector<rpc::Notification> notices;
  EXPECT_FALSE(client_.poll(notices));
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].method, "attachment_revoked");
  EXPECT_EQ(notices[0].params, (Json{{"attachment_id", "a1"}}));
  EXPECT_FALSE(client_.has_news());

  const rpc::Outcome second = client_.call("volume_list");
  daemon.join();
  ASSERT_TRUE(second.ok()) << second.error->describe();
  EXPECT_EQ(second.result, "second");
  EXPECT_TRUE(client_.has_news());
  notices.clear();
  EXPECT_FALSE(client_.poll(notices));
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].params, (Json{{"attachment_id", "a2"}}));
  EXPECT_FALSE(client_.has_news());
}

// Between calls, a notice is news as soon as the daemon's send returned: poll() never waits.
TEST_F(RpcClientTest, PollTakesNotificationsWithoutWaiting) {
  connect();
  std::vector<rpc::Notification> notices;
  EXPECT_FALSE(client_.has_news());
  EXPECT_FALSE(client_.poll(notices));
  EXPECT_TRUE(notices.empty());
  daemon_.send(notice("a1"));
  EXPECT_TRUE(client_.has_news());
  EXPECT_FALSE(client_.poll(notices));
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].params["attachment_id"], "a1");
  // A partial line is not news yet; its end is.
  const std::string line = notice("a2").dump() + "\n";
  daemon_.send_raw(line.substr(0, 10));
  EXPECT_FALSE(client_.poll(notices));
  EXPECT_EQ(notices.size(), 1u);
  EXPECT_FALSE(client_.has_news());
  daemon_.send_raw(line.substr(10));
  EXPECT_TRUE(client_.has_news());
  EXPECT_FALSE(client_.poll(notices));
  ASSERT_EQ(notices.size(), 2u);
  EXPECT_EQ(notices[1].params["attachment_id"], "a2");
}

TEST_F(RpcClientTest, APeerThatClosesBreaksTheLinkForGood) {
  connect();
  std::thread daemon([this] {
    daemon_.read_request();
    daemon_.close_client();
  });
  const rpc::Outcome lost = client_.call("volume_list");
  daemon.join();
  ASSERT_TRUE(lost.error);
  EXPECT_EQ(lost.error->link, std::errc::connection_reset);
  EXPECT_EQ(client_.call("volume_list").error->link, std::errc::connection_reset);
  EXPECT_TRUE(client_.has_news());
  std::vector<rpc::Notification> notices;
  EXPECT_EQ(client_.poll(notices), std::errc::connection_reset);
}

// What the daemon sent before it closed is still delivered, with the break.
TEST_F(RpcClientTest, NotificationsBeforeTheCloseAreDelivered) {
  connect();
  daemon_.send(notice("a1"));
  daemon_.close_client();
  EXPECT_TRUE(client_.has_news());
  std::vector<rpc::Notification> notices;
  EXPECT_EQ(client_.poll(notices), std::errc::connection_reset);
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].params["attachment_id"], "a1");
}

// A reply line of kMaxLine bytes is taken; one byte more is not the daemon's, and the link is
// dropped.
TEST_F(RpcClientTest, LinesAreBoundedAtOneMebibyte) {
  connect();
  size_t longest_result = 0;
  std::thread daemon([&] {
    const Json request = daemon_.read_request();
    Json reply = result_for(request["id"], "");
    longest_result = rpc::kMaxLine - reply.dump().size();
    reply["result"] = std::string(longest_result, 'x');
    daemon_.send(reply);  // kMaxLine bytes and the newline
    daemon_.read_request();
    daemon_.send_raw(std::string(rpc::kMaxLine + 100, 'y'));  // no newline in sight
  });
  const rpc::Outcome longest = client_.call("volume_list");
  const rpc::Outcome too_long = client_.call("volume_list");
  daemon.join();
  ASSERT_TRUE(longest.ok()) << longest.error->describe();
  EXPECT_EQ(longest.result.get<std::string>().size(), longest_result);
  ASSERT_TRUE(too_long.error);
  EXPECT_EQ(too_long.error->link, std::errc::message_size);
  std::vector<rpc::Notification> notices;
  EXPECT_EQ(client_.poll(notices), std::errc::message_size);
}

TEST_F(RpcClientTest, AnOverLongNotificationBreaksTheLinkInPoll) {
  connect();
  std::thread daemon([this] {
    Json line = notice("a1");
    line["params"]["pad"] = std::string(rpc::kMaxLine, 'z');
    daemon_.send(line);
  });
  std::vector<rpc::Notification> notices;
  std::error_code link;
  // The daemon's thread fills the socket as poll() empties it.
  for (int i = 0; i < 10000 && !link; ++i) {
    link = client_.poll(notices);
    if (!link) std::this_thread::sleep_for(milliseconds(1));
  }
  daemon.join();
  EXPECT_EQ(link, std::errc::message_size);
  EXPECT_TRUE(notices.empty());
}

// A reply that never comes ends the call at the timeout; the link stays usable, and the late
// reply is not taken for the next call's.
TEST_F(RpcClientTest, AReplyThatNeverComesTimesOut) {
  // The second call has the same timeout, and its reply comes from a thread that must wake in
  // time: 2 s leaves a busy machine room.
  connect(milliseconds(2000));
  std::thread daemon([this] {
    const Json first = daemon_.read_request();
    const Json second = daemon_.read_request();  // sent once the first call gave up
    daemon_.send(result_for(first["id"], "late"));
    daemon_.send(result_for(second["id"], "on time"));
  });
  const auto start = std::chrono::steady_clock::now();
  const rpc::Outcome unanswered = client_.call("volume_list");
  const auto waited = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(unanswered.error);
  EXPECT_EQ(unanswered.error->link, std::errc::timed_out);
  EXPECT_GE(waited, milliseconds(2000));
  EXPECT_LT(waited, milliseconds(10000));
  const rpc::Outcome next = client_.call("volume_list");
  daemon.join();
  ASSERT_TRUE(next.ok()) << next.error->describe();
  EXPECT_EQ(next.result, "on time");
}

TEST_F(RpcClientTest, ConnectFailuresAreErrorCodes) {
  shareblk::testing::TempDir dir;
  rpc::Client nobody;
  EXPECT_EQ(nobody.connect(dir / "nobody.sock", milliseconds(1000)),
            std::errc::no_such_file_or_directory);
  EXPECT_EQ(nobody.call("volume_list").error->link, std::errc::not_connected);
  rpc::Client too_long;
  EXPECT_EQ(too_long.connect("/" + std::string(200, 'x'), milliseconds(1000)),
            std::errc::filename_too_long);
  connect();
  EXPECT_EQ(client_.connect(daemon_.path(), milliseconds(1000)), std::errc::already_connected);
}

}  // namespace
