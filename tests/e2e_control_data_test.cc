// The attachment contract end to end: data paths, export names, detach, extend, TCP connectors.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <libnbd.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e_control_fixture.h"

namespace shareblk::testing::control_e2e {
namespace {

// Every TEST_P of ControlE2eTest, in this file and in e2e_control_daemon_test.cc, on each store.
INSTANTIATE_TEST_SUITE_P(Stores, ControlE2eTest, ::testing::Values("file", "lvm", "rbd"),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param;
                         });

// --- Data paths ---

TEST_P(ControlE2eTest, DataWrittenThroughRwIsReadThroughRo) {
  const std::string vol = create_volume("shared", 4 * kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  EXPECT_NE(export_of(rw), export_of(ro));
  EXPECT_EQ(rw["connection_info"]["data"]["shareable"], true);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["status"], "in-use");

  NbdHandle writer = nbd_open(uri_of(rw));
  ASSERT_TRUE(writer) << nbd_get_error();
  NbdHandle reader = nbd_open(uri_of(ro));
  ASSERT_TRUE(reader) << nbd_get_error();
  st::expect_reader_sees_writer(writer.get(), reader.get());
  if (::testing::Test::HasFatalFailure()) return;
  // And the bytes are the volume's own.
  EXPECT_EQ(stored_bytes(vol, 0, k64K), pattern('\xab', k64K));
}

TEST_P(ControlE2eTest, ReadOnlyAttachmentRefusesEveryWrite) {
  const std::string vol = create_volume("guarded", 2 * kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  {
    NbdHandle writer = nbd_open(uri_of(rw));
    ASSERT_TRUE(writer) << nbd_get_error();
    const std::string data = pattern('\x77', 2 * kMiB);
    ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
    ASSERT_EQ(nbd_flush(writer.get(), 0), 0) << nbd_get_error();
  }
  const std::string before = stored_bytes(vol, 0, 2 * kMiB);
  ASSERT_EQ(before, pattern('\x77', 2 * kMiB));

  NbdHandle reader = nbd_open_unchecked(uri_of(ro));
  ASSERT_TRUE(reader) << nbd_get_error();
  ASSERT_EQ(nbd_is_read_only(reader.get()), 1);
  st::expect_every_write_refused(reader.get(), {{0, 512},
                                                {0, k64K},
                                                {kMiB + 4096, 4096},
                                                {123, 1000},
                                                {2 * kMiB - 512, 512},
                                                {2 * kMiB, 512},
                                                {0, 0}});
  // Flags no server accepts on these commands are refused too (the server may say EINVAL).
  const std::string junk = pattern('\x01', 4096);
  EXPECT_EQ(nbd_pwrite(reader.get(), junk.data(), 4096, 0, LIBNBD_CMD_FLAG_DF), -1);
  EXPECT_EQ(nbd_trim(reader.get(), 4096, 0, LIBNBD_CMD_FLAG_NO_HOLE), -1);
  EXPECT_EQ(nbd_zero(reader.get(), 4096, 0, LIBNBD_CMD_FLAG_REQ_ONE), -1);

  // The connection survives the refusals and still reads; flush is harmless.
  EXPECT_EQ(nbd_flush(reader.get(), 0), 0) << nbd_get_error();
  EXPECT_EQ(nbd_read(reader.get(), 0, k64K), pattern('\x77', k64K));
  reader.reset();
  EXPECT_EQ(stored_bytes(vol, 0, 2 * kMiB), before) << "a read-only write got through";
}

TEST_P(ControlE2eTest, QemuIoReadsThroughReadOnlyAttachment) {
  SHAREBLK_REQUIRE(st::have_program("qemu-io"), "qemu-io is not installed");
  const std::string vol = create_volume("qemu", 2 * kMiB, true)["id"];
  Json rw = attach(vol, "writer", "rw");
  Json ro = attach(vol, "reader", "ro");
  {
    NbdHandle writer = nbd_open(uri_of(rw));
    ASSERT_TRUE(writer) << nbd_get_error();
    const std::string data = pattern('\x5a', k64K);
    ASSERT_EQ(nbd_pwrite(writer.get(), data.data(), data.size(), 0, 0), 0) << nbd_get_error();
    ASSERT_EQ(nbd_flush(writer.get(), 0), 0) << nbd_get_error();
  }
  st::RunResult read =
      st::run({"qemu-io", "-f", "raw", "-r", uri_of(ro), "-c", "read -P 0x5a 0 64k"});
  EXPECT_EQ(read.status, 0) << read.output;
  EXPECT_NE(read.output.find("read 65536/65536 bytes"), std::string::npos) << read.output;
  EXPECT_EQ(read.output.find("Pattern verification failed"), std::string::npos) << read.output;
  // The check above can fail: the wrong pattern is noticed.
  st::RunResult wrong =
      st::run({"qemu-io", "-f", "raw", "-r", uri_of(ro), "-c", "read -P 0x00 0 64k"});
  EXPECT_NE(wrong.output.find("Pattern verification failed"), std::string::npos) << wrong.output;

  // qemu cannot write through the read-only attachment either.
  const std::string before = stored_bytes(vol, 0, 2 * kMiB);
  st::RunResult write = st::run({"qemu-io", "-f", "raw", uri_of(ro), "-c", "write -P 0x11 0 64k"});
  EXPECT_EQ(write.output.find("wrote 65536/65536"), std::string::npos) << write.output;
  EXPECT_EQ(stored_bytes(vol, 0, 2 * kMiB), before);
}

// --- Export names are capabilities ---

TEST_P(ControlE2eTest, ExportNamesAreNeitherListedNorGuessable) {
  const std::string vol = create_volume("secret", kMiB, true)["id"];
  Json unix_rw = attach(vol, "a", "rw");
  Json tcp_ro = attach(vol, "b", "ro", "tcp");
  const std::vector<std::string> names{export_of(unix_rw), export_of(tcp_ro)};

  // NBD_OPT_LIST, on both listeners.
  for (const std::string& uri : {"nbd+unix:///?socket=" + nbd_socket(),
                                 uri_of(tcp_ro).substr(0, uri_of(tcp_ro).rfind('/') + 1)}) {
    NbdHandle h = new_handle();
    ASSERT_EQ(nbd_set_opt_mode(h.get(), true), 0);
    ASSERT_EQ(nbd_connect_uri(h.get(), uri.c_str()), 0) << uri << ": " << nbd_get_error();
    std::vector<std::string> listed;
    nbd_list_callback collect{[](void* user, const char* name, const char*) {
                                static_cast<std::vector<std::string>*>(user)->push_back(name);
                                return 0;
                              },
                              &listed, nullptr};
    const int count = nbd_opt_list(h.get(), collect);
    // A server may refuse to list at all; what it must not do is reveal a name.
    if (count != -1) {
      EXPECT_EQ(count, 0) << uri;
    }
    for (const std::string& name : listed) {
      for (const std::string& secret : names) EXPECT_EQ(name.find(secret), std::string::npos);
    }
    nbd_opt_abort(h.get());
  }
  if (st::have_program("nbdinfo")) {
    st::RunResult list = st::run({"nbdinfo", "--list", "nbd+unix:///?socket=" + nbd_socket()});
    for (const std::string& secret : names) {
      EXPECT_EQ(list.output.find(secret), std::string::npos) << list.output;
    }
  }

  // An unknown name, a near miss and the empty name are refused.
  const std::string unix_uri = uri_of(unix_rw);
  std::string near_miss = names[0];
  near_miss.back() = near_miss.back() == '0' ? '1' : '0';
  for (const std::string& name :
       {std::string("0123456789abcdef0123456789abcdef"), near_miss, std::string()}) {
    int err = 0;
    EXPECT_FALSE(nbd_open("nbd+unix:///" + name + "?socket=" + nbd_socket(), &err)) << name;
    EXPECT_EQ(err, ENOENT) << "'" << name << "' should be NBD_REP_ERR_UNKNOWN";
  }
  // A deleted attachment's name is refused from then on.
  ASSERT_TRUE(nbd_open(unix_uri)) << nbd_get_error();
  ok("attachment_delete", {{"attachment_id", unix_rw["id"]}});
  int err = 0;
  EXPECT_FALSE(nbd_open(unix_uri, &err));
  EXPECT_EQ(err, ENOENT);
  // A reserved attachment has no export yet; one that is attaching serves already.
  Json reserved = ok("attachment_create", {{"volume_id", vol}, {"instance_uuid", "c"}});
  EXPECT_EQ(reserved["connection_info"], nullptr);
  Json attaching = ok("attachment_update", {{"attachment_id", reserved["id"]},
                                            {"connector", {{"host", "h"}, {"transport", "unix"}}}});
  EXPECT_TRUE(nbd_open(uri_of(attaching))) << nbd_get_error();
}

// --- Detach ---

TEST_P(ControlE2eTest, DeleteClosesLiveConnections) {
  const std::string vol = create_volume("detach", kMiB, false)["id"];
  Json a = attach(vol, "instance", "rw");
  const std::string id = a["id"];
  NbdHandle h = nbd_open(uri_of(a));
  ASSERT_TRUE(h) << nbd_get_error();
  const std::string data = pattern('\x42', 4096);
  ASSERT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 0, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  ASSERT_TRUE(wait_connections(id, 1)) << connections(id);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["attachments"][0]["connections"], 1);

  Json deleted = ok("attachment_delete", {{"attachment_id", id}});
  EXPECT_EQ(deleted["attach_status"], "detached");
  EXPECT_EQ(deleted["connections"], 0);
  EXPECT_EQ(connections(id), 0u);
  EXPECT_EQ(ok("volume_show", {{"volume_id", vol}})["status"], "available");

  // The connection is gone: the handle's next request fails.
  std::string buf(4096, '\0');
  EXPECT_EQ(nbd_pread(h.get(), buf.data(), buf.size(), 0, 0), -1);
  // The name is dead, and what was written before the detach is on the volume.
  int err = 0;
  EXPECT_FALSE(nbd_open(uri_of(a), &err));
  EXPECT_EQ(err, ENOENT);
  EXPECT_EQ(stored_bytes(vol, 0, 4096), data);

  // volume_detach does the same for the volume's one attachment.
  Json again = attach(vol, "instance", "ro");
  NbdHandle second = nbd_open(uri_of(again));
  ASSERT_TRUE(second) << nbd_get_error();
  ASSERT_TRUE(wait_connections(again["id"], 1));
  Json detached = ok("volume_detach", {{"volume_id", vol}});
  EXPECT_EQ(detached["id"], again["id"]);
  EXPECT_EQ(detached["connections"], 0);
  EXPECT_EQ(nbd_pread(second.get(), buf.data(), buf.size(), 0, 0), -1);
  EXPECT_FALSE(nbd_open(uri_of(again), &err));
  EXPECT_EQ(err, ENOENT);
}

// Requests the server has taken are answered before the connection closes, and no other is
// carried out. A client writes one chunk after another while the attachment is deleted: the
// chunks acknowledged are on the volume, and the write that failed is not.
TEST_P(ControlE2eTest, DeleteAnswersRequestsInFlight) {
  constexpr size_t kChunk = 4096;
  constexpr size_t kChunks = 16 * kMiB / kChunk;
  const std::string vol = create_volume("inflight", kChunks * kChunk, false)["id"];
  Json a = attach(vol, "instance", "rw");
  NbdHandle h = nbd_open(uri_of(a));
  ASSERT_TRUE(h) << nbd_get_error();
  ASSERT_TRUE(wait_connections(a["id"], 1));

  auto chunk = [](size_t i) { return pattern(static_cast<char>('A' + i % 26), kChunk); };
  std::atomic<size_t> acknowledged{0};
  std::latch writing(1);
  std::thread writer([&] {
    for (size_t i = 0; i < kChunks; ++i) {
      const std::string data = chunk(i);
      if (nbd_pwrite(h.get(), data.data(), kChunk, i * kChunk, LIBNBD_CMD_FLAG_FUA) == -1) break;
      acknowledged = i + 1;
      if (i == 8) writing.count_down();
    }
    if (acknowledged <= 8) writing.count_down();
  });
  writing.wait();
  Json deleted = ok("attachment_delete", {{"attachment_id", a["id"]}});
  writer.join();
  EXPECT_EQ(deleted["connections"], 0);
  ASSERT_LT(acknowledged, kChunks) << "the writer finished before the detach";

  const size_t done = acknowledged;
  const std::string bytes = stored_bytes(vol, 0, (done + 1) * kChunk);
  for (size_t i = 0; i < done; ++i) {
    ASSERT_EQ(bytes.substr(i * kChunk, kChunk), chunk(i)) << "acknowledged write " << i;
  }
  EXPECT_EQ(bytes.substr(done * kChunk, kChunk), pattern('\0', kChunk))
      << "write " << done << " failed but reached the volume";
  RecordProperty("acknowledged", static_cast<int>(done));
}

TEST_P(ControlE2eTest, ExtendIsSeenByNewConnections) {
  const std::string vol = create_volume("grow", kMiB, false)["id"];
  Json a = attach(vol, "instance", "rw");
  NbdHandle before = nbd_open(uri_of(a));
  ASSERT_TRUE(before) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(before.get()), static_cast<int64_t>(kMiB));

  Json grown = ok("volume_extend", {{"volume_id", vol}, {"size", "2M"}});
  EXPECT_EQ(grown["size"], 2 * kMiB);
  EXPECT_EQ(grown["attachments"][0]["connection_info"]["data"]["size"], 2 * kMiB);
  EXPECT_GE(stored_size(vol), 2 * kMiB);  // an LV is whole extents

  NbdHandle after = nbd_open(uri_of(a));
  ASSERT_TRUE(after) << nbd_get_error();
  EXPECT_EQ(nbd_get_size(after.get()), static_cast<int64_t>(2 * kMiB));
  const std::string data = pattern('\x6b', 4096);
  ASSERT_EQ(nbd_pwrite(after.get(), data.data(), data.size(), kMiB + kMiB / 2, 0), 0)
      << nbd_get_error();
  ASSERT_EQ(nbd_flush(after.get(), 0), 0);
  EXPECT_EQ(stored_bytes(vol, kMiB + kMiB / 2, 4096), data);
  EXPECT_EQ(reason("volume_extend", {{"volume_id", vol}, {"size", "1M"}}), "invalid_params");
}

// A connector with multi_conn: several connections at once (without it a new one replaces the
// older ones: tests/e2e_fencing_test.cc).
TEST_P(ControlE2eTest, SeveralConnectionsPerAttachment) {
  const std::string vol = create_volume("multiconn", kMiB, false)["id"];
  Json a = attach(vol, "instance", "rw", "unix", "", /*multi_conn=*/true);
  const std::string id = a["id"];
  NbdHandle first = nbd_open(uri_of(a));
  NbdHandle second = nbd_open(uri_of(a));
  ASSERT_TRUE(first && second) << nbd_get_error();
  ASSERT_TRUE(wait_connections(id, 2)) << connections(id);

  const std::string one = pattern('\x11', 4096);
  const std::string two = pattern('\x22', 4096);
  ASSERT_EQ(nbd_pwrite(first.get(), one.data(), one.size(), 0, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_pwrite(second.get(), two.data(), two.size(), 8192, 0), 0) << nbd_get_error();
  ASSERT_EQ(nbd_flush(first.get(), 0), 0);
  ASSERT_EQ(nbd_flush(second.get(), 0), 0);
  EXPECT_EQ(nbd_read(second.get(), 0, 4096), one);
  EXPECT_EQ(nbd_read(first.get(), 8192, 4096), two);

  first.reset();
  ASSERT_TRUE(wait_connections(id, 1)) << connections(id);
  Json deleted = ok("attachment_delete", {{"attachment_id", id}});
  EXPECT_EQ(deleted["connections"], 0);
  std::string buf(512, '\0');
  EXPECT_EQ(nbd_pread(second.get(), buf.data(), buf.size(), 0, 0), -1);
}

// --- TCP and the connector's address ---

// Connects from `source` (a loopback address) to the TCP export in `uri`.
NbdHandle nbd_open_tcp_from(const std::string& uri, const std::string& source) {
  // nbd://HOST:PORT/NAME
  const std::string rest = uri.substr(std::strlen("nbd://"));
  const std::string hostport = rest.substr(0, rest.find('/'));
  const std::string name = rest.substr(rest.find('/') + 1);
  const std::string host = hostport.substr(0, hostport.rfind(':'));
  const int port = std::stoi(hostport.substr(hostport.rfind(':') + 1));
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &to.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
    ADD_FAILURE() << "connect from " << source << ": " << std::strerror(errno);
    ::close(fd);
    return NbdHandle(nullptr, &nbd_close);
  }
  NbdHandle h = new_handle();
  nbd_set_export_name(h.get(), name.c_str());
  if (nbd_connect_socket(h.get(), fd) == -1) return NbdHandle(nullptr, &nbd_close);
  return h;
}

TEST_P(ControlE2eTest, TcpConnectorIpLimitsWhoConnects) {
  const std::string vol = create_volume("tcp", kMiB, true)["id"];
  Json local = attach(vol, "local", "rw", "tcp", "127.0.0.1");
  Json other = attach(vol, "other", "ro", "tcp", "127.0.0.2");
  ASSERT_EQ(uri_of(local).rfind("nbd://127.0.0.1:", 0), 0u) << uri_of(local);

  NbdHandle h = nbd_open(uri_of(local));
  ASSERT_TRUE(h) << nbd_get_error();
  const std::string data = pattern('\x3c', 4096);
  ASSERT_EQ(nbd_pwrite(h.get(), data.data(), data.size(), 0, LIBNBD_CMD_FLAG_FUA), 0);
  EXPECT_EQ(nbd_read(h.get(), 0, 4096), data);

  // From 127.0.0.1 the attachment bound to 127.0.0.2 is refused...
  EXPECT_FALSE(nbd_open(uri_of(other)));
  EXPECT_EQ(connections(other["id"]), 0u);
  // ...and reached from 127.0.0.2, which also may not use the other one.
  NbdHandle from_other = nbd_open_tcp_from(uri_of(other), "127.0.0.2");
  ASSERT_TRUE(from_other) << nbd_get_error();
  EXPECT_EQ(nbd_read(from_other.get(), 0, 4096), data);
  EXPECT_FALSE(nbd_open_tcp_from(uri_of(local), "127.0.0.2"));
}

// The connector's address is compared as an address, not as text: the IPv4-mapped form of
// 127.0.0.1 is 127.0.0.1.
TEST_P(ControlE2eTest, TcpConnectorIpIsComparedAsAnAddress) {
  const std::string vol = create_volume("mapped", kMiB, true)["id"];
  Json mapped = attach(vol, "mapped", "rw", "tcp", "::ffff:127.0.0.1");
  NbdHandle h = nbd_open(uri_of(mapped));
  EXPECT_TRUE(h) << nbd_get_error();
  Json other = attach(vol, "other", "rw", "tcp", "::ffff:127.0.0.2");
  EXPECT_FALSE(nbd_open(uri_of(other)));
}

}  // namespace
}  // namespace shareblk::testing::control_e2e
