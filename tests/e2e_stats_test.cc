// Observability end to end (issue 21): the `stats` method, `shareblk stats`, GET /metrics
// (checked by promtool) and --log-format json, against a real daemon after real NBD I/O.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <libnbd.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/control_client.h"
#include "tests/managed_daemon.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
using Json = nlohmann::json;

// The response to `GET path` from 127.0.0.1:port, headers and body; "" when it failed.
std::string http_get(int port, const std::string& path) {
  const int fd = st::connect_loopback(port);
  if (fd < 0) return "";
  const std::string request =
      "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    ::close(fd);
    return "";
  }
  std::string response;
  char buf[65536];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) response.append(buf, size_t(n));
  ::close(fd);
  return response;
}

// The value of the sample `name{labels}` whose labels include every one of `having`
// (`key="value"` strings); -1 when there is none.
double sample(const std::string& text, const std::string& name,
              const std::vector<std::string>& having) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + "{", 0) != 0) continue;
    bool all = true;
    for (const std::string& label : having) all = all && line.find(label) != std::string::npos;
    if (all) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return -1;
}

class StatsTest : public st::ManagedDaemonTest {
 protected:
  static std::string uri_of(const Json& a) { return a["connection_info"]["data"]["uri"]; }
  int metrics_port() {
    const std::regex line(R"(metrics on http://127\.0\.0\.1:(\d+)/metrics)");
    for (int i = 0; i < 100; ++i) {
      std::smatch m;
      const std::string log = daemon_->log();
      if (std::regex_search(log, m, line)) return std::stoi(m[1]);
      ::usleep(50'000);
    }
    return 0;
  }
};

// Known I/O through a read-write and a read-only attachment shows up, exactly, in the stats
// method, in `shareblk stats` and in /metrics, which promtool accepts.
TEST_F(StatsTest, FiguresMatchTheIoDoneInStatsAndMetrics) {
  SHAREBLK_REQUIRE(st::have_program("promtool"), "promtool (package prometheus) is missing");
  start({"--metrics-listen", "127.0.0.1:0"});
  const int port = metrics_port();
  ASSERT_NE(port, 0) << daemon_->log();
  const std::string volume = create_volume("4M");
  const Json rw = attach(volume, "i-rw", {{"host", "a"}, {"transport", "unix"}});
  const Json ro = st::rpc_ok(control(), "attachment_create",
                             {{"volume_id", volume},
                              {"instance_uuid", "i-ro"},
                              {"mode", "ro"},
                              {"connector", {{"host", "b"}, {"transport", "unix"}}}});
  const std::string rw_id = rw["id"];
  const std::string ro_id = ro["id"];

  st::NbdHandle writer = st::nbd_connect(uri_of(rw));
  ASSERT_TRUE(writer);
  const std::string data = st::pattern('x', 64 * 1024);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), uint64_t(i) * data.size(), 0), 0);
  }
  for (int i = 0; i < 2; ++i) EXPECT_EQ(st::nbd_read(writer.get(), 0, 128 * 1024).size(), 131072u);
  ASSERT_EQ(nbd_flush(writer.get(), 0), 0);
  ASSERT_EQ(nbd_trim(writer.get(), 1 << 20, 4096, 0), 0);

  st::NbdHandle reader = st::nbd_connect(uri_of(ro), nullptr, {.strict = false});
  ASSERT_TRUE(reader);
  EXPECT_EQ(st::nbd_read(reader.get(), 0, 4096).size(), 4096u);
  EXPECT_EQ(nbd_pwrite(reader.get(), data.data(), 4096, 0, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EPERM);

  // The stats method, by volume: both attachments, and their sum.
  const Json stats = st::rpc_ok(control(), "stats", {{"volume_id", volume}});
  ASSERT_EQ(stats["attachments"].size(), 2u) << stats.dump(2);
  std::map<std::string, Json> by_id;
  for (const Json& a : stats["attachments"]) by_id[a["attachment_id"]] = a;
  const Json& w = by_id[rw_id];
  EXPECT_EQ(w["mode"], "rw");
  EXPECT_EQ(w["ops"]["write"]["requests"], 3);
  EXPECT_EQ(w["ops"]["write"]["bytes"], 3 * 64 * 1024);
  EXPECT_EQ(w["ops"]["read"]["requests"], 2);
  EXPECT_EQ(w["ops"]["read"]["bytes"], 2 * 128 * 1024);
  EXPECT_EQ(w["ops"]["flush"]["requests"], 1);
  EXPECT_EQ(w["ops"]["trim"]["requests"], 1);
  EXPECT_EQ(w["ops"]["trim"]["bytes"], 1 << 20);
  EXPECT_GT(w["ops"]["write"]["time_seconds"].get<double>(), 0);
  uint64_t in_buckets = 0;
  for (const Json& b : w["ops"]["write"]["latency"]) in_buckets += b["count"].get<uint64_t>();
  EXPECT_EQ(in_buckets, 3u);
  EXPECT_EQ(w["refused_writes"], 0);
  ASSERT_EQ(w["connections"].size(), 1u);
  EXPECT_EQ(w["connections"][0]["peer"].get<std::string>().rfind(
                "unix pid " + std::to_string(::getpid()) + " uid ", 0),
            0u)
      << w["connections"];
  const Json& r = by_id[ro_id];
  EXPECT_EQ(r["mode"], "ro");
  EXPECT_EQ(r["ops"]["read"]["bytes"], 4096);
  EXPECT_EQ(r["ops"]["write"]["requests"], 1);
  EXPECT_EQ(r["ops"]["write"]["errors"], 1);
  EXPECT_EQ(r["ops"]["write"]["bytes"], 0);
  EXPECT_EQ(r["refused_writes"], 1);
  EXPECT_EQ(r["errors"]["EPERM"], 1);
  ASSERT_EQ(stats["volumes"].size(), 1u);
  EXPECT_EQ(stats["volumes"][0]["ops"]["read"]["bytes"], 2 * 128 * 1024 + 4096);
  EXPECT_EQ(stats["volumes"][0]["connections"], 2);
  // One attachment alone; an unknown one is not_found.
  EXPECT_EQ(st::rpc_ok(control(), "stats", {{"attachment_id", ro_id}})["attachments"].size(), 1u);
  EXPECT_EQ(st::rpc_reason(control(), "stats", {{"attachment_id", "nope"}}), "not_found");
  EXPECT_EQ(st::rpc_reason(control(), "stats", {{"attachment_id", ro_id}, {"volume_id", volume}}),
            "invalid_params");

  // The CLI's table: one row per attachment, the writer's 3 writes and the refused one.
  const st::RunResult table =
      st::run({SHAREBLK_CLI_PATH, "--socket", control(), "stats", "--volume-id", volume});
  ASSERT_EQ(table.status, 0) << table.output;
  EXPECT_NE(table.output.find("r_await"), std::string::npos) << table.output;
  EXPECT_NE(table.output.find(rw_id), std::string::npos) << table.output;
  EXPECT_NE(table.output.find(ro_id), std::string::npos) << table.output;
  const st::RunResult watched = st::run({SHAREBLK_CLI_PATH, "--socket", control(), "stats",
                                         "--json", "--watch", "0.2", "--count", "2"});
  ASSERT_EQ(watched.status, 0) << watched.output;
  std::istringstream reports(watched.output);
  int lines = 0;
  for (std::string line; std::getline(reports, line); ++lines) {
    EXPECT_EQ(Json::parse(line)["attachments"].size(), 2u);
  }
  EXPECT_EQ(lines, 2);

  // /metrics: promtool accepts it, and its numbers are the same.
  const std::string response = http_get(port, "/metrics");
  ASSERT_NE(response.find("HTTP/1.1 200"), std::string::npos) << response;
  EXPECT_NE(response.find("text/plain; version=0.0.4"), std::string::npos);
  const std::string body = response.substr(response.find("\r\n\r\n") + 4);
  const std::string file = dir_ / "metrics.txt";
  std::ofstream(file) << body;
  const st::RunResult promtool = st::run({"sh", "-c", "promtool check metrics < " + file});
  EXPECT_EQ(promtool.status, 0) << promtool.output;
  const std::string w_label = "attachment=\"" + rw_id + "\"";
  const std::string r_label = "attachment=\"" + ro_id + "\"";
  const std::string v_label = "volume=\"" + volume + "\"";
  EXPECT_EQ(
      sample(body, "shareblk_attachment_written_bytes_total", {w_label, v_label, "mode=\"rw\""}),
      3 * 64 * 1024);
  EXPECT_EQ(sample(body, "shareblk_attachment_writes_completed_total", {w_label}), 3);
  EXPECT_EQ(sample(body, "shareblk_attachment_reads_completed_total", {w_label}), 2);
  EXPECT_EQ(sample(body, "shareblk_attachment_read_bytes_total", {w_label}), 2 * 128 * 1024);
  EXPECT_EQ(sample(body, "shareblk_attachment_discarded_bytes_total", {w_label}), 1 << 20);
  EXPECT_EQ(sample(body, "shareblk_attachment_flush_requests_total", {w_label}), 1);
  EXPECT_GT(sample(body, "shareblk_attachment_write_time_seconds_total", {w_label}), 0);
  EXPECT_EQ(
      sample(body, "shareblk_attachment_request_duration_seconds_count", {w_label, "op=\"write\""}),
      3);
  EXPECT_EQ(sample(body, "shareblk_attachment_request_duration_seconds_bucket",
                   {w_label, "op=\"write\"", "le=\"+Inf\""}),
            3);
  EXPECT_EQ(sample(body, "shareblk_attachment_refused_writes_total", {r_label, "mode=\"ro\""}), 1);
  EXPECT_EQ(sample(body, "shareblk_attachment_errors_total", {r_label, "errno=\"EPERM\""}), 1);
  EXPECT_EQ(sample(body, "shareblk_attachment_connections", {w_label}), 1);
  EXPECT_NE(http_get(port, "/other").find("HTTP/1.1 404"), std::string::npos);

  // Connects and disconnects are logged with the attachment and the peer. A connection the
  // client closed counts until the daemon has seen it close: a moment.
  reader.reset();
  size_t live = 1;
  for (int i = 0; i < 100 && live != 0; ++i) {
    if (i > 0) ::usleep(50'000);
    live =
        st::rpc_ok(control(), "stats", {{"attachment_id", ro_id}})["attachments"][0]["connections"]
            .size();
  }
  EXPECT_EQ(live, 0u);
  const std::string log = daemon_->log();
  const std::string peer = "unix pid " + std::to_string(::getpid());
  EXPECT_NE(log.find(peer), std::string::npos);
  EXPECT_NE(log.find(" connected to " + ro_id), std::string::npos) << log;
  EXPECT_NE(log.find(" disconnected from " + ro_id), std::string::npos) << log;
}

// --log-format json: every line the daemon logs is one JSON object with its time, level and
// message.
TEST_F(StatsTest, JsonLogLinesParse) {
  start({"--log-format", "json"});
  const std::string volume = create_volume("1M");
  const Json a = attach(volume, "i", {{"host", "a"}, {"transport", "unix"}});
  { st::NbdHandle h = st::nbd_connect(uri_of(a)); }
  st::rpc_ok(control(), "attachment_delete", {{"attachment_id", a["id"]}});
  ASSERT_EQ(daemon_->stop(SIGTERM), 0);
  std::ifstream in(daemon_->log_path());
  int lines = 0;
  bool saw_connect = false;
  for (std::string line; std::getline(in, line); ++lines) {
    Json entry;
    ASSERT_NO_THROW(entry = Json::parse(line)) << line;
    EXPECT_TRUE(entry["time"].is_string()) << line;
    EXPECT_TRUE(entry["level"].is_string()) << line;
    EXPECT_TRUE(entry["message"].is_string()) << line;
    saw_connect =
        saw_connect || entry["message"].get<std::string>().find(
                           " connected to " + a["id"].get<std::string>()) != std::string::npos;
  }
  EXPECT_GT(lines, 5);
  EXPECT_TRUE(saw_connect);
  daemon_.reset();
}

}  // namespace

namespace {

// contrib/grafana/shareblk.json: every query is PromQL that promtool parses (as a recording
// rule, with Grafana's variables replaced), over metrics that docs/metrics.md lists.
TEST(GrafanaDashboard, QueriesParseAndNameDocumentedMetrics) {
  SHAREBLK_REQUIRE(st::have_program("promtool"), "promtool (package prometheus) is missing");
  std::ifstream in(std::string(SHAREBLK_SOURCE_DIR) + "/contrib/grafana/shareblk.json");
  ASSERT_TRUE(in.good());
  const Json dashboard = Json::parse(in);
  std::ifstream doc_in(std::string(SHAREBLK_SOURCE_DIR) + "/docs/metrics.md");
  const std::string doc((std::istreambuf_iterator<char>(doc_in)), {});
  st::TempDir dir;
  std::ofstream rules(dir / "rules.yml");
  rules << "groups:\n- name: dashboard\n  rules:\n";
  int n = 0;
  const std::regex metric(R"(shareblk_attachment_\w+)");
  for (const Json& panel : dashboard["panels"]) {
    for (const Json& target : panel["targets"]) {
      std::string expr = target["expr"];
      expr = std::regex_replace(expr, std::regex(R"(\$__rate_interval)"), "5m");
      expr = std::regex_replace(expr, std::regex(R"(\$\w+)"), ".*");
      for (std::sregex_iterator it(expr.begin(), expr.end(), metric), end; it != end; ++it) {
        std::string name = it->str();
        name = std::regex_replace(name, std::regex("_bucket$"), "");
        EXPECT_NE(doc.find("`" + name + "`"), std::string::npos) << name << " is not documented";
      }
      rules << "  - record: dashboard_" << n++ << "\n    expr: " << Json(expr).dump() << "\n";
    }
  }
  rules.close();
  EXPECT_GT(n, 5);
  const st::RunResult checked = st::run({"promtool", "check", "rules", dir / "rules.yml"});
  EXPECT_EQ(checked.status, 0) << checked.output;
}

}  // namespace
