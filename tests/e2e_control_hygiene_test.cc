// What callers send, given back intact, through the real daemon: request ids come back over the
// control socket exactly as sent (issue 19, item 5).
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/control_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
using Json = nlohmann::json;

class ControlHygieneTest : public ::testing::Test {
 protected:
  ControlHygieneTest()
      : daemon_({"--state-dir", dir_.path().string(), "--listen-unix", dir_ / "nbd.sock",
                 "--workers", "1"},
                control()) {}

  std::string control() const { return dir_ / "shareblk.sock"; }

  // Sends `line` on a connection of its own and returns the reply line ("" if none in 10 s).
  std::string exchange(const std::string& line) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, control().c_str(), sizeof addr.sun_path - 1);
    std::string reply;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
        ::send(fd, (line + "\n").data(), line.size() + 1, MSG_NOSIGNAL) ==
            static_cast<ssize_t>(line.size() + 1)) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (reply.find('\n') == std::string::npos && std::chrono::steady_clock::now() < deadline) {
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 100) <= 0) continue;
        char chunk[4096];
        const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
        if (n <= 0) break;
        reply.append(chunk, static_cast<size_t>(n));
      }
    }
    ::close(fd);
    return reply.substr(0, reply.find('\n'));
  }

  st::TempDir dir_;
  st::Daemon daemon_;
};

TEST_F(ControlHygieneTest, RequestIdsComeBackOverTheSocketAsSent) {
  for (const std::string id : {"18446744073709551616", "-99999999999999999999999", "1.5", "1.50",
                               "1e-400", "-0", "12345678901234567890.000001", "42"}) {
    const std::string reply =
        exchange(R"({"jsonrpc":"2.0","id":)" + id + R"(,"method":"volume_list"})");
    EXPECT_NE(reply.find(R"("id":)" + id + ","), std::string::npos) << id << " -> " << reply;
    EXPECT_NE(reply.find(R"("result":[])"), std::string::npos) << reply;
  }
  const std::string batch = exchange(
      R"([{"jsonrpc":"2.0","id":18446744073709551616,"method":"volume_list"},)"
      R"({"jsonrpc":"2.0","id":"18446744073709551616","method":"volume_show","params":{}}])");
  EXPECT_NE(batch.find(R"("id":18446744073709551616,)"), std::string::npos) << batch;
  const Json parsed = Json::parse(batch, nullptr, false);
  ASSERT_TRUE(parsed.is_array()) << batch;
  ASSERT_EQ(parsed.size(), 2u) << batch;
  EXPECT_EQ(parsed[1]["id"], "18446744073709551616") << batch;
  EXPECT_EQ(parsed[1]["error"]["data"]["reason"], "invalid_params") << batch;
}

}  // namespace
