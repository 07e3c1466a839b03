// A shareblkd in managed mode for end-to-end tests of the attachment API and its clients: its
// state in a temp directory, its NBD socket outside it (the state directory is the daemon's
// alone, 0700), TCP on a port it picks, one worker.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/control_client.h"
#include "tests/support.h"

namespace shareblk::testing {

class ManagedDaemonTest : public ::testing::Test {
 protected:
  using Json = nlohmann::json;

  void TearDown() override {
    if (!daemon_) return;
    EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  }
  // (Re)starts the daemon on the same state, with `extra` options.
  void start(const std::vector<std::string>& extra = {}) {
    if (daemon_) daemon_->stop(SIGTERM);
    std::vector<std::string> args{
        "--state-dir",  dir_.path().string(), "--listen-unix", nbd_socket(),
        "--listen-tcp", "127.0.0.1:0",        "--workers",     "1"};
    if (!control_socket_.empty()) args.insert(args.end(), {"--control-socket", control_socket_});
    args.insert(args.end(), extra.begin(), extra.end());
    daemon_ = std::make_unique<Daemon>(args, control());
  }
  // The state directory is the daemon's alone (0700): a test whose callers are other users
  // puts the control socket elsewhere.
  std::string control() const {
    return control_socket_.empty() ? dir_ / "shareblk.sock" : control_socket_;
  }
  std::string nbd_socket() const { return socket_dir_ / "nbd.sock"; }
  int tcp_port() const { return logged_tcp_port(*daemon_, "127.0.0.1"); }

  // A multiattach volume named "v" of `size`.
  std::string create_volume(const std::string& size) {
    return rpc_ok(control(), "volume_create",
                  {{"name", "v"}, {"size", size}, {"multiattach", true}})["id"];
  }
  Json attach(const std::string& volume, const std::string& instance, const Json& connector) {
    return rpc_ok(control(), "attachment_create",
                  {{"volume_id", volume}, {"instance_uuid", instance}, {"connector", connector}});
  }

  TempDir dir_;
  TempDir socket_dir_;
  std::string control_socket_;  // empty: in the state directory
  std::unique_ptr<Daemon> daemon_;
};

}  // namespace shareblk::testing
