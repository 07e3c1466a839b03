// What callers send, given back intact and shown harmless, through the real daemon: request ids
// come back over the control socket exactly as sent, and the shareblk CLI's tables escape the
// strings callers stored (names, instance_uuid, attached_host), so that none can forge a row
// or send the terminal a sequence (issue 19, item 5).
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

  st::RunResult cli(std::vector<std::string> args) {
    std::vector<std::string> argv{SHAREBLK_CLI_PATH, "--socket", control()};
    argv.insert(argv.end(), args.begin(), args.end());
    return st::run(argv, std::chrono::seconds(30));
  }

  st::TempDir dir_;
  st::Daemon daemon_;
};

// Bytes a terminal would act on, or that would split a line or a column.
std::string unprintable_in(const std::string& output) {
  std::string found;
  for (unsigned char c : output) {
    if ((c < 0x20 && c != '\n') || c >= 0x7f) found += "\\x" + std::to_string(c) + " ";
  }
  return found;
}

size_t lines_in(const std::string& output) {
  return static_cast<size_t>(std::count(output.begin(), output.end(), '\n'));
}

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

TEST_F(ControlHygieneTest, CliTablesEscapeWhatCallersStored) {
  // A newline that would start a forged row, a tab that would shift columns, ESC sequences
  // (colour, a window title, clear screen), BEL, DEL and a C1 CSI (U+009B).
  const std::string name =
      "vol\nforged-id  forged  1 GiB  available\tx\x1b[31mred\x1b]0;t\x07\x7f\xc2\x9b"
      "2J";
  const std::string volume = st::rpc_ok(
      control(), "volume_create", {{"name", name}, {"size", "1M"}, {"multiattach", true}})["id"];
  const std::string instance = "inst\r\n\x1b[2Jgone";
  const std::string host = "host\tof\x1b[1mbold";
  st::rpc_ok(control(), "attachment_create",
             {{"volume_id", volume}, {"instance_uuid", instance}, {"attached_host", host}});
  st::rpc_ok(control(), "attachment_create", {{"volume_id", volume}, {"instance_uuid", "plain"}});

  const std::string escaped_name =
      "vol\\nforged-id  forged  1 GiB  available\\x09x\\x1b[31mred\\x1b]0;t\\x07\\x7f\\xc2\\x9b2J";
  const st::RunResult volumes = cli({"volume-list"});
  ASSERT_EQ(volumes.status, 0) << volumes.output;
  EXPECT_EQ(unprintable_in(volumes.output), "") << volumes.output;
  EXPECT_EQ(lines_in(volumes.output), 2u) << volumes.output;  // the header and one row
  EXPECT_NE(volumes.output.find(escaped_name), std::string::npos) << volumes.output;

  const st::RunResult attachments = cli({"attachment-list"});
  ASSERT_EQ(attachments.status, 0) << attachments.output;
  EXPECT_EQ(unprintable_in(attachments.output), "") << attachments.output;
  EXPECT_EQ(lines_in(attachments.output), 3u) << attachments.output;
  EXPECT_NE(attachments.output.find("inst\\x0d\\n\\x1b[2Jgone"), std::string::npos)
      << attachments.output;
  EXPECT_NE(attachments.output.find("host\\x09of\\x1b[1mbold"), std::string::npos)
      << attachments.output;

  // A volume's fields, then its attachments.
  const st::RunResult shown = cli({"volume-show", volume});
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_EQ(unprintable_in(shown.output), "") << shown.output;
  EXPECT_NE(shown.output.find(escaped_name), std::string::npos) << shown.output;

  // --json keeps every value exact, in ASCII.
  const st::RunResult json = cli({"--json", "volume-list"});
  ASSERT_EQ(json.status, 0) << json.output;
  EXPECT_EQ(unprintable_in(json.output), "") << json.output;
  const Json listed = Json::parse(json.output, nullptr, false);
  ASSERT_TRUE(listed.is_array()) << json.output;
  EXPECT_EQ(listed[0]["name"], name);

  // A refusal that quotes the caller's string.
  const st::RunResult missing = cli({"volume-show", "no\x1b[2Jsuch"});
  EXPECT_EQ(missing.status, 1) << missing.output;
  EXPECT_EQ(unprintable_in(missing.output), "") << missing.output;
  EXPECT_NE(missing.output.find("no\\x1b[2Jsuch"), std::string::npos) << missing.output;
}

}  // namespace
