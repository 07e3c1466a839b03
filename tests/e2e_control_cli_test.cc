// The shareblk CLI end to end: commands, tables and JSON, lookups by name, help, exit statuses.
#include <gtest/gtest.h>
#include <libnbd.h>

#include <sstream>
#include <string>
#include <vector>

#include "tests/e2e_control_fixture.h"

namespace shareblk::testing::control_e2e {
namespace {

// The CLI does not depend on the store: it runs on the file store only.
class ControlCliTest : public ControlE2eTest {
 protected:
  std::string store() const override { return "file"; }
  st::RunResult cli(std::vector<std::string> args, const std::string& socket = "") {
    std::vector<std::string> argv{SHAREBLK_CLI_PATH, "--socket",
                                  socket.empty() ? control_socket() : socket};
    argv.insert(argv.end(), args.begin(), args.end());
    return st::run(argv, seconds(30));
  }
};

TEST_F(ControlCliTest, CommandsTablesAndJson) {
  st::RunResult created = cli({"volume-create", "cli-vol", "2M", "--multiattach"});
  ASSERT_EQ(created.status, 0) << created.output;
  EXPECT_NE(created.output.find("cli-vol"), std::string::npos) << created.output;

  st::RunResult listed = cli({"--json", "volume-list"});
  ASSERT_EQ(listed.status, 0) << listed.output;
  Json volumes = Json::parse(listed.output, nullptr, false);
  ASSERT_TRUE(volumes.is_array()) << listed.output;
  ASSERT_EQ(volumes.size(), 1u);
  EXPECT_EQ(volumes[0]["name"], "cli-vol");
  EXPECT_EQ(volumes[0]["size"], 2 * kMiB);
  EXPECT_EQ(volumes[0]["multiattach"], true);
  const std::string vol = volumes[0]["id"];

  st::RunResult table = cli({"volume-list"});
  ASSERT_EQ(table.status, 0) << table.output;
  EXPECT_NE(table.output.find(vol), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("available"), std::string::npos) << table.output;

  // An attachment through the CLI, used by a real client.
  st::RunResult attached = cli({"--json", "attachment-create", vol, "instance-1", "--mode", "ro",
                                "--connector-host", "h1", "--transport", "unix"});
  ASSERT_EQ(attached.status, 0) << attached.output;
  Json a = Json::parse(attached.output, nullptr, false);
  ASSERT_TRUE(a.is_object()) << attached.output;
  EXPECT_EQ(a["mode"], "ro");
  EXPECT_EQ(a["attach_status"], "attaching");
  NbdHandle h = nbd_open(uri_of(a));
  ASSERT_TRUE(h) << nbd_get_error();
  EXPECT_EQ(nbd_is_read_only(h.get()), 1);

  st::RunResult raw =
      cli({"--json", "call", "attachment_show", Json{{"attachment_id", a["id"]}}.dump()});
  ASSERT_EQ(raw.status, 0) << raw.output;
  EXPECT_EQ(Json::parse(raw.output, nullptr, false)["id"], a["id"]) << raw.output;

  st::RunResult shown = cli({"attachment-show", a["id"]});
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_NE(shown.output.find(uri_of(a)), std::string::npos) << shown.output;
  EXPECT_EQ(cli({"attachment-complete", a["id"]}).status, 0);
  st::RunResult in_use = cli({"volume-update", vol, "--multiattach", "false"});
  EXPECT_EQ(in_use.status, 1) << in_use.output;
  EXPECT_NE(in_use.output.find("volume_in_use"), std::string::npos) << in_use.output;
  st::RunResult detached = cli({"--json", "volume-detach", vol});
  ASSERT_EQ(detached.status, 0) << detached.output;
  EXPECT_EQ(Json::parse(detached.output, nullptr, false)["attach_status"], "detached")
      << detached.output;
  std::string buf(512, '\0');
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), buf.size(), 0, 0), -1);
  EXPECT_EQ(cli({"volume-update", vol, "--multiattach", "false", "--name", "renamed"}).status, 0);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["name"], "renamed");
}

// Volumes by name or id prefix, attachments by id prefix: what an operator types. Two matches
// are a usage error that lists them, and no call is made.
TEST_F(ControlCliTest, VolumesAndAttachmentsAreFoundByNameOrUniqueIdPrefix) {
  const std::string alpha = create_volume("alpha", kMiB, true)["id"];
  create_volume("twin", kMiB, false);
  create_volume("twin", kMiB, false);
  st::RunResult by_name = cli({"--json", "volume-show", "alpha"});
  ASSERT_EQ(by_name.status, 0) << by_name.output;
  EXPECT_EQ(Json::parse(by_name.output)["id"], alpha);
  st::RunResult by_prefix = cli({"--json", "volume-show", alpha.substr(0, 13)});
  ASSERT_EQ(by_prefix.status, 0) << by_prefix.output;
  EXPECT_EQ(Json::parse(by_prefix.output)["id"], alpha);

  st::RunResult twins = cli({"volume-delete", "twin"});
  EXPECT_EQ(twins.status, 2) << twins.output;
  EXPECT_NE(twins.output.find("'twin' matches 2 volumes"), std::string::npos) << twins.output;
  EXPECT_EQ(ok("volume_list", Json::object()).size(), 3u) << "nothing was deleted";

  st::RunResult attached = cli({"--json", "attachment-create", "alpha", "vm-1"});
  ASSERT_EQ(attached.status, 0) << attached.output;
  const std::string a = Json::parse(attached.output)["id"];
  EXPECT_EQ(Json::parse(attached.output)["volume_id"], alpha);
  st::RunResult shown = cli({"--json", "attachment-show", a.substr(0, 8)});
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_EQ(Json::parse(shown.output)["id"], a);
  st::RunResult gone = cli({"volume-show", "no-such-volume"});
  EXPECT_EQ(gone.status, 1) << gone.output;
  EXPECT_NE(gone.output.find("not_found"), std::string::npos) << gone.output;
}

// `shareblk help` lists every command; each has --help with a usage line and an example, and a
// missing argument names it.
TEST_F(ControlCliTest, EveryCommandHasHelpWithAnExample) {
  st::RunResult help = cli({"help"});
  ASSERT_EQ(help.status, 0) << help.output;
  std::vector<std::string> commands;
  std::istringstream lines(help.output);
  std::string line;
  while (std::getline(lines, line) && line != "commands:") {
  }
  while (std::getline(lines, line) && !line.empty()) {
    if (line.starts_with("  ")) {
      const std::string name = line.substr(2, line.find(' ', 2) - 2);
      if (name != "call" && name != "help") commands.push_back(name);
    }
  }
  EXPECT_GE(commands.size(), 15u) << help.output;
  for (const std::string& c : commands) {
    st::RunResult r = cli({c, "--help"});
    EXPECT_EQ(r.status, 0) << c << ": " << r.output;
    EXPECT_NE(r.output.find("usage: shareblk [--socket PATH] [--json] " + c), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("  shareblk " + c), std::string::npos) << "no example: " << r.output;
    EXPECT_EQ(cli({"help", c}).output, r.output);
  }
  st::RunResult missing = cli({"volume-show"});
  EXPECT_EQ(missing.status, 2);
  EXPECT_NE(missing.output.find("volume-show: missing VOLUME"), std::string::npos)
      << missing.output;
  st::RunResult old = cli({"volume_list"});
  EXPECT_EQ(old.status, 0) << old.output;
  EXPECT_NE(old.output.find("'volume_list' is now 'volume-list'"), std::string::npos);
}

TEST_F(ControlCliTest, ExitStatusTellsWhatWentWrong) {
  const std::string vol = create_volume("v", kMiB, false)["id"];
  ok("attachment_create", {{"volume_id", vol}, {"instance_uuid", "i"}});

  // Refused by the daemon: 1, with the reason.
  st::RunResult in_use = cli({"volume-delete", vol});
  EXPECT_EQ(in_use.status, 1) << in_use.output;
  EXPECT_NE(in_use.output.find("volume_in_use"), std::string::npos) << in_use.output;
  st::RunResult bad_size = cli({"volume-create", "x", "1000"});
  EXPECT_EQ(bad_size.status, 1) << bad_size.output;
  EXPECT_NE(bad_size.output.find("invalid_params"), std::string::npos) << bad_size.output;
  st::RunResult missing = cli({"volume-show", "00000000-0000-4000-8000-000000000000"});
  EXPECT_EQ(missing.status, 1) << missing.output;
  EXPECT_NE(missing.output.find("not_found"), std::string::npos) << missing.output;
  EXPECT_EQ(ok("volume_list", Json::object()).size(), 1u);

  // Bad usage: 2, without a call.
  EXPECT_EQ(cli({"volume-frobnicate"}).status, 2);
  EXPECT_EQ(cli({"volume-show"}).status, 2);
  EXPECT_EQ(cli({}).status, 2);

  // No daemon: 3.
  st::RunResult unreachable = cli({"volume-list"}, dir_ / "nobody-listens.sock");
  EXPECT_EQ(unreachable.status, 3) << unreachable.output;
}

}  // namespace
}  // namespace shareblk::testing::control_e2e
