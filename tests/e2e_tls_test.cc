// TLS end to end (issue 18): a real daemon, real GnuTLS handshakes with QEMU's and libnbd's
// TLS clients (qemu-io, nbdinfo, nbdcopy, python's nbd), PSK per attachment and x509 with a DN
// binding, over TCP and Unix sockets; and the attacks: the clear text, another attachment's
// key, a wrong key, garbage and a stall inside the TLS handshake, a forged record after it.
#include <arpa/inet.h>
#include <gnutls/gnutls.h>
#include <gtest/gtest.h>
#include <libnbd.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"
#include "tests/managed_daemon.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
using Json = nlohmann::json;

constexpr uint32_t kRepAck = 1;
constexpr uint32_t kRepErrTlsReqd = (1u << 31) | 5;
constexpr uint32_t kOptExportName = 1;
constexpr uint32_t kOptList = 3;
constexpr uint32_t kOptStartTls = 5;
constexpr uint32_t kOptInfo = 6;
constexpr uint32_t kOptGo = 7;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

// The NBD handshake by hand, for what no real client sends.
class RawClient {
 public:
  explicit RawClient(const std::string& unix_path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, unix_path.c_str(), sizeof addr.sun_path - 1);
    ok_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    uint8_t greeting[18];
    ok_ = ok_ && read_all(greeting, sizeof greeting);
    const uint32_t flags = htonl(3);  // fixed newstyle, no zeroes
    ok_ = ok_ && send_all(&flags, 4);
  }
  ~RawClient() { ::close(fd_); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool ok() const { return ok_; }
  int fd() const { return fd_; }
  bool option(uint32_t option, const std::string& data = {}) {
    std::string msg = "IHAVEOPT";
    const uint32_t be[2] = {htonl(option), htonl(static_cast<uint32_t>(data.size()))};
    msg.append(reinterpret_cast<const char*>(be), sizeof be);
    msg += data;
    return send_all(msg.data(), msg.size());
  }
  // The type of the next option reply (its payload skipped); 0 when the server closed.
  uint32_t reply_type() {
    uint8_t header[20];
    if (!read_all(header, sizeof header)) return 0;
    uint32_t type = 0;
    uint32_t length = 0;
    std::memcpy(&type, header + 12, 4);
    std::memcpy(&length, header + 16, 4);
    std::string payload(ntohl(length), '\0');
    if (!payload.empty() && !read_all(payload.data(), payload.size())) return 0;
    return ntohl(type);
  }
  // True when the server closes the connection within `timeout`.
  bool closed_within(std::chrono::milliseconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    char byte = 0;
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) > 0) {
        const ssize_t n = ::recv(fd_, &byte, 1, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN)) return true;
      }
    }
    return false;
  }
  bool send_all(const void* buf, size_t n) {
    const auto* p = static_cast<const char*>(buf);
    while (n > 0) {
      const ssize_t sent = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (sent <= 0) return false;
      p += sent;
      n -= static_cast<size_t>(sent);
    }
    return true;
  }

 private:
  bool read_all(void* buf, size_t n) {
    auto* p = static_cast<char*>(buf);
    while (n > 0) {
      pollfd pfd{fd_, POLLIN, 0};
      if (::poll(&pfd, 1, 10000) <= 0) return false;
      const ssize_t got = ::recv(fd_, p, n, 0);
      if (got <= 0) return false;
      p += got;
      n -= static_cast<size_t>(got);
    }
    return true;
  }
  int fd_ = -1;
  bool ok_ = false;
};

std::string info_payload(const std::string& name) {
  std::string data(4, '\0');
  const uint32_t length = htonl(static_cast<uint32_t>(name.size()));
  std::memcpy(data.data(), &length, 4);
  data += name;
  data += std::string(2, '\0');  // no information requests
  return data;
}

class TlsTest : public st::ManagedDaemonTest {
 protected:
  void SetUp() override {
    SHAREBLK_REQUIRE(st::have_program("nbdinfo") && st::have_program("nbdcopy"),
                     "needs nbdinfo and nbdcopy (libnbd-bin)");
    SHAREBLK_REQUIRE(st::have_program("qemu-io"), "needs qemu-io (qemu-utils)");
    SHAREBLK_REQUIRE(st::have_program("certtool"), "needs certtool (gnutls-bin)");
  }
  void TearDown() override {
    if (!daemon_) return;
    ManagedDaemonTest::TearDown();
    // No key and no export name in any log line.
    const std::string log = daemon_->log();
    for (const std::string& secret : secrets_) {
      EXPECT_EQ(log.find(secret), std::string::npos) << "a secret was logged: " << secret;
    }
  }
  std::string create_volume() { return ManagedDaemonTest::create_volume("8M"); }
  // Its export name and key join the secrets no log line may hold.
  Json attach(const std::string& volume, const std::string& instance, const Json& connector) {
    Json a = ManagedDaemonTest::attach(volume, instance, connector);
    const Json& data = a["connection_info"]["data"];
    secrets_.push_back(data["export_name"]);
    if (data.contains("tls_psk_key")) secrets_.push_back(data["tls_psk_key"]);
    return a;
  }
  static const Json& data_of(const Json& a) { return a["connection_info"]["data"]; }
  // A keys.psk file with the attachment's line, in a directory of its own (QEMU's layout).
  std::string psk_dir(const Json& a) {
    const std::string dir = scratch_ / a["id"].get<std::string>();
    std::filesystem::create_directories(dir);
    write_text(dir + "/keys.psk", data_of(a)["tls_psk_identity"].get<std::string>() + ":" +
                                      data_of(a)["tls_psk_key"].get<std::string>() + "\n");
    return dir;
  }
  static std::string with_query(const std::string& uri, const std::string& query) {
    return uri + (uri.find('?') == std::string::npos ? "?" : "&") + query;
  }

  // qemu-io on the attachment through QEMU's own TLS client: `creds` is a --object value.
  st::RunResult qemu_io(const Json& a, const std::string& creds,
                        const std::vector<std::string>& commands,
                        const std::string& extra_opts = "") {
    const std::string name = data_of(a)["export_name"];
    std::string opts = "driver=nbd,export=" + name + ",tls-creds=tls0";
    if (a["connector"]["transport"] == "unix") {
      opts += ",server.type=unix,server.path=" + nbd_socket();
    } else {
      opts += ",server.type=inet,server.host=127.0.0.1,server.port=" + std::to_string(tcp_port());
    }
    opts += extra_opts;
    std::vector<std::string> argv{"qemu-io", "--object", creds, "--image-opts", opts};
    for (const std::string& c : commands) {
      argv.push_back("-c");
      argv.push_back(c);
    }
    return st::run(argv, std::chrono::seconds(60));
  }

  st::TempDir scratch_;
  std::vector<std::string> secrets_;
};

// Every PSK client: QEMU (qemu-io), libnbd's tools (nbdinfo, nbdcopy) and python's nbd, on
// TCP and on the Unix socket, each with the key connection_info gave its attachment.
TEST_F(TlsTest, EachAttachmentsPskWorksWithQemuAndLibnbdOverTcpAndUnix) {
  start({"--tls", "on"});
  const std::string volume = create_volume();
  const Json on_tcp = attach(volume, "i-tcp", {{"host", "a"}, {"transport", "tcp"}, {"tls", true}});
  const Json on_unix =
      attach(volume, "i-unix", {{"host", "b"}, {"transport", "unix"}, {"tls", true}});
  ASSERT_EQ(data_of(on_tcp)["uri"].get<std::string>().rfind(
                "nbds://" + on_tcp["id"].get<std::string>() + "@127.0.0.1:", 0),
            0u)
      << on_tcp.dump();
  ASSERT_EQ(data_of(on_unix)["uri"].get<std::string>().rfind(
                "nbds+unix://" + on_unix["id"].get<std::string>() + "@/", 0),
            0u)
      << on_unix.dump();
  EXPECT_EQ(data_of(on_tcp)["tls"], true);
  EXPECT_EQ(data_of(on_tcp)["tls_psk_key"].get<std::string>().size(), 64u);

  const std::string data = scratch_ / "data";
  st::make_file(data, 8 << 20, 0x5a);
  int round = 0;
  for (const Json* a : {&on_tcp, &on_unix}) {
    SCOPED_TRACE(a->dump());
    const std::string dir = psk_dir(*a);
    const std::string uri = with_query(data_of(*a)["uri"], "tls-psk-file=" + dir + "/keys.psk");
    // QEMU writes, libnbd reads it back, and the other way round.
    const std::string creds = "tls-creds-psk,id=tls0,endpoint=client,dir=" + dir +
                              ",username=" + (*a)["id"].get<std::string>();
    const std::string fill = round == 0 ? "0x11" : "0x22";
    st::RunResult q = qemu_io(*a, creds, {"write -P " + fill + " 1M 256k", "flush"});
    EXPECT_EQ(q.status, 0) << q.output;
    st::RunResult info = st::run({"nbdinfo", uri});
    EXPECT_EQ(info.status, 0) << info.output;
    EXPECT_NE(info.output.find("with TLS"), std::string::npos) << info.output;
    const std::string copy = scratch_ / ("copy" + std::to_string(round));
    st::RunResult out = st::run({"nbdcopy", uri, copy});
    ASSERT_EQ(out.status, 0) << out.output;
    EXPECT_EQ(st::read_file(copy, 1 << 20, 256 << 10),
              std::string(256 << 10, fill == "0x11" ? 0x11 : 0x22));
    st::RunResult in = st::run({"nbdcopy", data, uri});
    ASSERT_EQ(in.status, 0) << in.output;
    q = qemu_io(*a, creds, {"read -P 0x5a 0 8M"});
    EXPECT_EQ(q.status, 0) << q.output;
    EXPECT_NE(q.output.find("read 8388608/8388608"), std::string::npos) << q.output;
    // python's nbd (Debian's python3-libnbd).
    {  // python3-libnbd is among ./dev's packages
      ASSERT_EQ(::access("/usr/bin/python3", X_OK), 0);
      const std::string script =
          "import nbd, sys\n"
          "h = nbd.NBD()\n"
          "h.set_uri_allow_local_file(True)\n"
          "h.connect_uri(sys.argv[1])\n"
          "assert h.get_size() == 8 << 20\n"
          "assert h.pread(4096, 4 << 20) == b'\\x5a' * 4096\n"
          "h.pwrite(b'\\x33' * 4096, 0)\n"
          "h.flush()\n"
          "assert h.pread(4096, 0) == b'\\x33' * 4096\n"
          "h.shutdown()\n";
      st::RunResult py = st::run({"/usr/bin/python3", "-c", script, uri});
      EXPECT_EQ(py.status, 0) << py.output;
    }
    ++round;
  }
  const std::string log = daemon_->log();
  EXPECT_NE(log.find("to attachment " + on_tcp["id"].get<std::string>() + " (rw, TLS)"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("to attachment " + on_unix["id"].get<std::string>() + " (rw, TLS)"),
            std::string::npos)
      << log;
}

// Attack attempts on a TLS-only attachment: each is refused, the daemon goes on serving.
TEST_F(TlsTest, TheClearTextAnotherAttachmentsKeyAndAWrongKeyAreRefused) {
  start({"--tls", "on"});
  const std::string volume = create_volume();
  const Json victim = attach(volume, "i-1", {{"host", "a"}, {"transport", "tcp"}, {"tls", true}});
  const Json other = attach(volume, "i-2", {{"host", "b"}, {"transport", "tcp"}, {"tls", true}});
  const Json plain = attach(volume, "i-3", {{"host", "c"}, {"transport", "tcp"}});
  const std::string victim_uri = data_of(victim)["uri"];
  const std::string name = data_of(victim)["export_name"];
  const std::string base = "127.0.0.1:" + std::to_string(tcp_port()) + "/";

  // 1. The name alone, in the clear: NBD_REP_ERR_TLS_REQD (SELECTIVETLS), nothing served.
  st::RunResult clear = st::run({"nbdinfo", "nbd://" + base + name});
  EXPECT_NE(clear.status, 0) << clear.output;
  // 2. Another attachment's valid PSK, asking for this name: as if the name did not exist.
  const std::string other_psk = psk_dir(other) + "/keys.psk";
  st::RunResult stolen = st::run({"nbdinfo", "nbds://" + other["id"].get<std::string>() + "@" +
                                                 base + name + "?tls-psk-file=" + other_psk});
  EXPECT_NE(stolen.status, 0) << stolen.output;
  EXPECT_NE(stolen.output.find("No such file or directory"), std::string::npos) << stolen.output;
  // ...and that PSK's session cannot reach an attachment without TLS either.
  st::RunResult sideways =
      st::run({"nbdinfo", "nbds://" + other["id"].get<std::string>() + "@" + base +
                              data_of(plain)["export_name"].get<std::string>() +
                              "?tls-psk-file=" + other_psk});
  EXPECT_NE(sideways.status, 0) << sideways.output;
  // 3. This attachment's identity with a wrong key: the TLS handshake fails.
  const std::string wrong = scratch_ / "wrong.psk";
  write_text(wrong, victim["id"].get<std::string>() + ":" + std::string(64, 'a') + "\n");
  st::RunResult bad_key = st::run({"nbdinfo", with_query(victim_uri, "tls-psk-file=" + wrong)});
  EXPECT_NE(bad_key.status, 0) << bad_key.output;
  // 4. An identity that is no attachment.
  write_text(wrong, "nobody:" + std::string(64, 'b') + "\n");
  st::RunResult nobody =
      st::run({"nbdinfo", "nbds://nobody@" + base + name + "?tls-psk-file=" + wrong});
  EXPECT_NE(nobody.status, 0) << nobody.output;

  // The attachment without TLS is still served in the clear, and the victim to its own key.
  EXPECT_EQ(st::run({"nbdinfo", "--size", data_of(plain)["uri"]}).status, 0);
  const std::string own = psk_dir(victim) + "/keys.psk";
  st::RunResult good =
      st::run({"nbdinfo", "--size", with_query(victim_uri, "tls-psk-file=" + own)});
  EXPECT_EQ(good.status, 0) << good.output;

  // After a detach the key opens nothing.
  st::rpc_ok(control(), "attachment_delete", {{"attachment_id", victim["id"]}});
  EXPECT_NE(st::run({"nbdinfo", "--size", with_query(victim_uri, "tls-psk-file=" + own)}).status,
            0);
  const std::string log = daemon_->log();
  EXPECT_NE(log.find("the export of attachment " + victim["id"].get<std::string>() +
                     ": TLS-only, asked for without TLS"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("the export of attachment " + victim["id"].get<std::string>() +
                     ": not the TLS identity"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("TLS handshake failed"), std::string::npos) << log;
}

// A hand-made GnuTLS PSK client on a RawClient's socket after NBD_OPT_STARTTLS, for what no
// real client sends: records that fail, and records sent together with other bytes.
class TlsPskClient {
 public:
  TlsPskClient(int fd, const std::string& identity, const std::string& hex_key) {
    gnutls_psk_allocate_client_credentials(&psk_);
    const gnutls_datum_t key{reinterpret_cast<unsigned char*>(const_cast<char*>(hex_key.data())),
                             static_cast<unsigned>(hex_key.size())};
    gnutls_psk_set_client_credentials(psk_, identity.c_str(), &key, GNUTLS_PSK_KEY_HEX);
    gnutls_init(&session_, GNUTLS_CLIENT);
    gnutls_priority_set_direct(session_, "NORMAL:+ECDHE-PSK:+PSK", nullptr);
    gnutls_credentials_set(session_, GNUTLS_CRD_PSK, psk_);
    gnutls_transport_set_int(session_, fd);
    int rc = 0;
    do {
      rc = gnutls_handshake(session_);
    } while (rc < 0 && gnutls_error_is_fatal(rc) == 0);
    ok_ = rc == 0;
  }
  ~TlsPskClient() {
    gnutls_deinit(session_);
    gnutls_psk_free_client_credentials(psk_);
  }
  TlsPskClient(const TlsPskClient&) = delete;
  TlsPskClient& operator=(const TlsPskClient&) = delete;

  bool ok() const { return ok_; }
  bool send(const std::string& bytes) {
    return gnutls_record_send(session_, bytes.data(), bytes.size()) ==
           static_cast<ssize_t>(bytes.size());
  }
  // The record(s) `bytes` would be sent as, returned instead of sent.
  std::string seal(const std::string& bytes, int fd) {
    std::string records;
    gnutls_transport_set_ptr2(session_, reinterpret_cast<gnutls_transport_ptr_t>(intptr_t{fd}),
                              &records);
    gnutls_transport_set_push_function(
        session_, [](gnutls_transport_ptr_t to, const void* data, size_t size) -> ssize_t {
          static_cast<std::string*>(to)->append(static_cast<const char*>(data), size);
          return static_cast<ssize_t>(size);
        });
    send(bytes);
    return records;
  }
  std::string recv(size_t n) {
    std::string out(n, '\0');
    for (size_t got = 0; got < n;) {
      const ssize_t r = gnutls_record_recv(session_, out.data() + got, n - got);
      if (r <= 0) return {};
      got += static_cast<size_t>(r);
    }
    return out;
  }
  // NBD_OPT_GO for `name`, its replies read until NBD_REP_ACK; false on an error reply.
  bool go(const std::string& name) {
    const std::string info = info_payload(name);
    if (!send("IHAVEOPT" + be32(kOptGo) + be32(static_cast<uint32_t>(info.size())) + info)) {
      return false;
    }
    for (uint32_t type = 0; type != kRepAck;) {
      const std::string header = recv(20);
      if (header.size() != 20) return false;
      uint32_t length = 0;
      std::memcpy(&type, header.data() + 12, 4);
      std::memcpy(&length, header.data() + 16, 4);
      type = ntohl(type);
      if ((type & (1u << 31)) != 0) return false;
      recv(ntohl(length));
    }
    return true;
  }
  static std::string be32(uint32_t v) {
    v = htonl(v);
    return {reinterpret_cast<const char*>(&v), 4};
  }
  // NBD_CMD_READ of 4 KiB at 0.
  static std::string read_request() {
    return be32(0x25609513) + std::string(4, '\0') + std::string(8, '\x01') + std::string(8, '\0') +
           be32(4096);
  }

 private:
  gnutls_psk_client_credentials_t psk_ = nullptr;
  gnutls_session_t session_ = nullptr;
  bool ok_ = false;
};

// A client with the right key that, once served, sends a record the session did not make (a
// forged or corrupted one: its MAC fails) loses its connection, and nothing else: the worker
// that decrypts its records serves the others on. So does one whose forged record comes in
// the same segment as a good one: the good one's request is served, and the failure is not
// left waiting for more bytes.
TEST_F(TlsTest, AForgedRecordAfterTheHandshakeCostsOnlyThatConnection) {
  start({"--tls", "on"});  // one worker, as every managed daemon has
  const std::string volume = create_volume();
  const Json a = attach(volume, "i-1", {{"host", "a"}, {"transport", "unix"}, {"tls", true}});
  const std::string uri = with_query(data_of(a)["uri"], "tls-psk-file=" + psk_dir(a) + "/keys.psk");
  // Another client on the same (only) worker, reading all along.
  st::RunResult other_out;
  const std::string script =
      "import nbd, sys, time\n"
      "h = nbd.NBD()\n"
      "h.set_uri_allow_local_file(True)\n"
      "h.connect_uri(sys.argv[1])\n"
      "end = time.time() + 3\n"
      "n = 0\n"
      "while time.time() < end:\n"
      "    assert h.pread(4096, 0) == bytes(4096)\n"
      "    n += 1\n"
      "print(n)\n";
  ASSERT_EQ(::access("/usr/bin/python3", X_OK), 0);
  std::thread other([&] { other_out = st::run({"/usr/bin/python3", "-c", script, uri}); });

  // An application-data record the session did not make.
  const std::string forged = std::string("\x17\x03\x03\x00\x40", 5) + std::string(64, '\x5a');
  for (const bool together : {false, true}) {
    SCOPED_TRACE(together ? "a good record and a forged one in one segment"
                          : "a forged record after a reply");
    RawClient raw(nbd_socket());
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw.option(kOptStartTls));
    ASSERT_EQ(raw.reply_type(), kRepAck);
    TlsPskClient tls(raw.fd(), a["id"].get<std::string>(),
                     data_of(a)["tls_psk_key"].get<std::string>());
    ASSERT_TRUE(tls.ok());
    ASSERT_TRUE(tls.go(data_of(a)["export_name"].get<std::string>()));
    if (together) {
      const std::string both = tls.seal(TlsPskClient::read_request(), raw.fd()) + forged;
      ASSERT_TRUE(raw.send_all(both.data(), both.size()));
    } else {
      // One read, answered: the session serves.
      ASSERT_TRUE(tls.send(TlsPskClient::read_request()));
      const std::string reply = tls.recv(16 + 4096);
      ASSERT_EQ(reply.size(), 16u + 4096u);
      EXPECT_EQ(reply.substr(0, 4), TlsPskClient::be32(0x67446698));
      ASSERT_TRUE(raw.send_all(forged.data(), forged.size()));
    }
    EXPECT_TRUE(raw.closed_within(std::chrono::seconds(5)));
  }

  other.join();
  EXPECT_EQ(other_out.status, 0) << other_out.output;
  EXPECT_GT(std::stoi("0" + other_out.output), 0) << other_out.output;
  st::RunResult after = st::run({"nbdinfo", "--size", uri});
  EXPECT_EQ(after.status, 0) << after.output;
  EXPECT_NE(daemon_->log().find("sent a TLS record that fails"), std::string::npos)
      << daemon_->log();
  // Both cut off, the others gone: nothing is left open.
  int connections = -1;
  for (int i = 0; i < 250 && connections != 0; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    connections =
        st::rpc_ok(control(), "attachment_show", {{"attachment_id", a["id"]}})["connections"];
  }
  EXPECT_EQ(connections, 0);
}

// Revocation reaches TLS connections too: a detach closes a live one, and the daemon stops
// cleanly with another still connected and idle.
TEST_F(TlsTest, ADetachCutsALiveTlsConnectionAndStopDoesNotWaitForIdleOnes) {
  SHAREBLK_REQUIRE(::access("/usr/bin/python3", X_OK) == 0,
                   "needs Debian's python3 (python3-libnbd)");
  start({"--tls", "on"});
  const std::string volume = create_volume();
  const Json cut = attach(volume, "i-1", {{"host", "a"}, {"transport", "tcp"}, {"tls", true}});
  const Json idle = attach(volume, "i-2", {{"host", "b"}, {"transport", "unix"}, {"tls", true}});
  // Reads every 20 ms for at most 20 s; exits 3 when the server cuts it off.
  const std::string script =
      "import nbd, sys, time\n"
      "h = nbd.NBD()\n"
      "h.set_uri_allow_local_file(True)\n"
      "h.connect_uri(sys.argv[1])\n"
      "open(sys.argv[2], 'w').write('connected')\n"
      "end = time.time() + 20\n"
      "try:\n"
      "    while time.time() < end:\n"
      "        h.pread(4096, 0)\n"
      "        time.sleep(0.02)\n"
      "except nbd.Error:\n"
      "    sys.exit(3)\n";
  auto client = [&](const Json& a, const std::string& flag, st::RunResult& out) {
    const std::string uri =
        with_query(data_of(a)["uri"], "tls-psk-file=" + psk_dir(a) + "/keys.psk");
    return std::thread([&out, script, uri, flag] {
      out = st::run({"/usr/bin/python3", "-c", script, uri, flag});
    });
  };
  auto wait_for = [](const std::string& path) {
    for (int i = 0; i < 500 && !std::filesystem::exists(path); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return std::filesystem::exists(path);
  };
  st::RunResult cut_out;
  st::RunResult idle_out;
  std::thread cut_client = client(cut, scratch_ / "cut.flag", cut_out);
  std::thread idle_client = client(idle, scratch_ / "idle.flag", idle_out);
  ASSERT_TRUE(wait_for(scratch_ / "cut.flag") && wait_for(scratch_ / "idle.flag"));
  EXPECT_EQ(st::rpc_ok(control(), "attachment_show", {{"attachment_id", cut["id"]}})["connections"],
            1);
  const auto began = std::chrono::steady_clock::now();
  st::rpc_ok(control(), "attachment_delete", {{"attachment_id", cut["id"]}});
  cut_client.join();
  EXPECT_EQ(cut_out.status, 3) << cut_out.output;
  EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(10));
  // The other one is still served; stopping the daemon ends it without waiting for it.
  EXPECT_EQ(
      st::rpc_ok(control(), "attachment_show", {{"attachment_id", idle["id"]}})["connections"], 1);
  const auto stopping = std::chrono::steady_clock::now();
  EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  EXPECT_LT(std::chrono::steady_clock::now() - stopping, std::chrono::seconds(10));
  idle_client.join();
  EXPECT_EQ(idle_out.status, 3) << idle_out.output;
  daemon_.reset();
}

// --tls require (FORCEDTLS): every option before STARTTLS but ABORT gets TLS_REQD, and
// NBD_OPT_EXPORT_NAME in the clear ends the connection; every attachment has a key.
TEST_F(TlsTest, RequireRefusesEveryOptionBeforeStartTls) {
  start({"--tls", "require"});
  const std::string volume = create_volume();
  const Json a = attach(volume, "i-1", {{"host", "a"}, {"transport", "unix"}});
  EXPECT_EQ(data_of(a)["tls"], true);
  ASSERT_TRUE(data_of(a).contains("tls_psk_key")) << a.dump();
  const std::string name = data_of(a)["export_name"];
  {
    RawClient c(nbd_socket());
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE(c.option(kOptList));
    EXPECT_EQ(c.reply_type(), kRepErrTlsReqd);
    ASSERT_TRUE(c.option(kOptInfo, info_payload(name)));
    EXPECT_EQ(c.reply_type(), kRepErrTlsReqd);
    ASSERT_TRUE(c.option(77));
    EXPECT_EQ(c.reply_type(), kRepErrTlsReqd);
    ASSERT_TRUE(c.option(kOptExportName, name));
    EXPECT_TRUE(c.closed_within(std::chrono::seconds(5)));
  }
  const std::string uri = with_query(data_of(a)["uri"], "tls-psk-file=" + psk_dir(a) + "/keys.psk");
  st::RunResult ok = st::run({"nbdinfo", "--size", uri});
  EXPECT_EQ(ok.status, 0) << ok.output;
  EXPECT_EQ(ok.output, "8388608\n");
}

// A client that sends garbage into the TLS handshake, or stops half way, costs its connection
// and at most the handshake timeout; others are served meanwhile and the daemon lives on.
TEST_F(TlsTest, GarbageOrAStallInTheTlsHandshakeCostsOnlyThatConnection) {
  start({"--tls", "on", "--handshake-timeout-ms", "1500"});
  const std::string volume = create_volume();
  const Json a = attach(volume, "i-1", {{"host", "a"}, {"transport", "unix"}, {"tls", true}});
  const std::string uri = with_query(data_of(a)["uri"], "tls-psk-file=" + psk_dir(a) + "/keys.psk");

  RawClient garbage(nbd_socket());
  ASSERT_TRUE(garbage.ok());
  ASSERT_TRUE(garbage.option(kOptStartTls));
  ASSERT_EQ(garbage.reply_type(), kRepAck);
  const std::string junk(3000, '\x16');  // looks like a handshake record, is not one
  garbage.send_all(junk.data(), junk.size());
  EXPECT_TRUE(garbage.closed_within(std::chrono::seconds(5)));

  RawClient stall(nbd_socket());
  ASSERT_TRUE(stall.ok());
  ASSERT_TRUE(stall.option(kOptStartTls));
  ASSERT_EQ(stall.reply_type(), kRepAck);
  // Half a TLS record header, then nothing.
  stall.send_all("\x16\x03\x01", 3);
  const auto began = std::chrono::steady_clock::now();
  // Served meanwhile.
  st::RunResult ok = st::run({"nbdinfo", "--size", uri});
  EXPECT_EQ(ok.status, 0) << ok.output;
  EXPECT_TRUE(stall.closed_within(std::chrono::seconds(10)));
  EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(5));

  // STARTTLS with a payload, and twice: NBD_REP_ERR_INVALID, the haggling goes on.
  RawClient twice(nbd_socket());
  ASSERT_TRUE(twice.ok());
  ASSERT_TRUE(twice.option(kOptStartTls, "x"));
  EXPECT_EQ(twice.reply_type(), (1u << 31) | 3);
  EXPECT_EQ(st::run({"nbdinfo", "--size", uri}).status, 0);
}

// x509: a certificate the CA signed, the DN binding, over TCP and Unix; a certificate with
// another DN, or from another CA, is refused.
TEST_F(TlsTest, X509ClientsAreVerifiedAndADnBindingAdmitsThatCertificateOnly) {
  const std::string pki = scratch_ / "pki";
  std::filesystem::create_directories(pki);
  auto certtool = [&](const std::vector<std::string>& args) {
    std::vector<std::string> argv{"certtool"};
    argv.insert(argv.end(), args.begin(), args.end());
    st::RunResult r = st::run(argv);
    EXPECT_EQ(r.status, 0) << r.output;
    return r.output;
  };
  auto key = [&](const std::string& path) {
    certtool({"--generate-privkey", "--key-type", "ecdsa", "--outfile", path});
  };
  auto make_ca = [&](const std::string& prefix, const std::string& cn) {
    key(pki + "/" + prefix + "-key.pem");
    write_text(pki + "/" + prefix + ".info", "cn = " + cn + "\nca\ncert_signing_key\n");
    certtool({"--generate-self-signed", "--load-privkey", pki + "/" + prefix + "-key.pem",
              "--template", pki + "/" + prefix + ".info", "--outfile",
              pki + "/" + prefix + "-cert.pem"});
  };
  auto issue = [&](const std::string& ca, const std::string& name, const std::string& info) {
    key(pki + "/" + name + "-key.pem");
    write_text(pki + "/" + name + ".info", info);
    certtool({"--generate-certificate", "--load-privkey", pki + "/" + name + "-key.pem",
              "--load-ca-certificate", pki + "/" + ca + "-cert.pem", "--load-ca-privkey",
              pki + "/" + ca + "-key.pem", "--template", pki + "/" + name + ".info", "--outfile",
              pki + "/" + name + "-cert.pem"});
  };
  make_ca("ca", "shareblk test CA");
  make_ca("rogue", "rogue CA");
  issue("ca", "server",
        "cn = localhost\norganization = Example\ndns_name = localhost\nip_address = 127.0.0.1\n"
        "tls_www_server\nencryption_key\nsigning_key\n");
  const std::string client_info = "tls_www_client\nencryption_key\nsigning_key\n";
  issue("ca", "client1", "cn = client1\norganization = Example\n" + client_info);
  issue("ca", "client2", "cn = client2\norganization = Example\n" + client_info);
  issue("rogue", "client3", "cn = client1\norganization = Example\n" + client_info);
  const std::string server_dir = scratch_ / "server";
  std::filesystem::create_directories(server_dir);
  for (const char* f : {"ca-cert.pem"}) std::filesystem::copy(pki + "/" + f, server_dir + "/" + f);
  std::filesystem::copy(pki + "/server-cert.pem", server_dir + "/server-cert.pem");
  std::filesystem::copy(pki + "/server-key.pem", server_dir + "/server-key.pem");
  // A client directory as QEMU and libnbd read it.
  auto client_dir = [&](const std::string& name) {
    const std::string d = scratch_ / ("client-" + name);
    std::filesystem::create_directories(d);
    std::filesystem::copy(pki + "/ca-cert.pem", d + "/ca-cert.pem");
    std::filesystem::copy(pki + "/" + name + "-cert.pem", d + "/client-cert.pem");
    std::filesystem::copy(pki + "/" + name + "-key.pem", d + "/client-key.pem");
    return d;
  };
  const std::string c1 = client_dir("client1");
  const std::string c2 = client_dir("client2");
  const std::string c3 = client_dir("client3");
  // The DN as the certificate says it (RFC 4514, most specific first).
  std::string dn = certtool({"-i", "--infile", pki + "/client1-cert.pem"});
  dn = dn.substr(dn.find("Subject: ") + 9);
  dn = dn.substr(0, dn.find('\n'));
  ASSERT_EQ(dn, "CN=client1,O=Example");

  start({"--tls", "on", "--tls-x509-dir", server_dir});
  const std::string volume = create_volume();
  const Json on_tcp = attach(volume, "i-1", {{"host", "a"}, {"transport", "tcp"}, {"tls_dn", dn}});
  const Json on_unix =
      attach(volume, "i-2", {{"host", "b"}, {"transport", "unix"}, {"tls_dn", dn}});
  EXPECT_FALSE(data_of(on_tcp).contains("tls_psk_key")) << on_tcp.dump();
  EXPECT_EQ(data_of(on_tcp)["tls"], true);

  for (const Json* a : {&on_tcp, &on_unix}) {
    SCOPED_TRACE((*a)["connector"].dump());
    const bool unix_socket = (*a)["connector"]["transport"] == "unix";
    // QEMU checks the server's name; over a Unix socket it must be told which (tls-hostname).
    const std::string hostname = unix_socket ? ",tls-hostname=localhost" : "";
    auto qemu = [&](const std::string& dir) {
      return qemu_io(*a, "tls-creds-x509,id=tls0,endpoint=client,dir=" + dir,
                     {"write -P 0x44 0 64k", "read -P 0x44 0 64k"}, hostname);
    };
    st::RunResult q1 = qemu(c1);
    EXPECT_EQ(q1.status, 0) << q1.output << daemon_->log();
    EXPECT_NE(qemu(c2).status, 0) << "another DN of the same CA";
    // (QEMU itself refuses to use a certificate its own CA file does not vouch for.)
    EXPECT_NE(qemu(c3).status, 0) << "the same DN from another CA";
    const std::string libnbd_query =
        std::string(unix_socket ? "tls-hostname=localhost&" : "") + "tls-certificates=";
    const std::string uri = data_of(*a)["uri"];
    st::RunResult n1 = st::run({"nbdinfo", "--size", with_query(uri, libnbd_query + c1)});
    EXPECT_EQ(n1.status, 0) << n1.output;
    EXPECT_NE(st::run({"nbdinfo", "--size", with_query(uri, libnbd_query + c2)}).status, 0);
    // libnbd does present it: the server's verification refuses it in the handshake.
    EXPECT_NE(st::run({"nbdinfo", "--size", with_query(uri, libnbd_query + c3)}).status, 0);
    EXPECT_NE(daemon_->log().find("TLS handshake failed"), std::string::npos) << daemon_->log();
  }
  // SIGHUP reads the credentials again: the operator moves client verification to another CA
  // (here the rogue one), and the handshakes that follow obey it; a broken file changes nothing.
  const std::string tcp_uri = data_of(on_tcp)["uri"];
  auto nbdinfo = [&](const std::string& dir) {
    return st::run({"nbdinfo", "--size", with_query(tcp_uri, "tls-certificates=" + dir)});
  };
  auto reload = [&](const std::string& expected) {
    const size_t seen = daemon_->log().size();
    ASSERT_EQ(::kill(daemon_->pid(), SIGHUP), 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (daemon_->log().find("SIGHUP: reloaded", seen) == std::string::npos &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_NE(daemon_->log().find(expected, seen), std::string::npos) << daemon_->log();
  };
  std::filesystem::copy(pki + "/rogue-cert.pem", server_dir + "/ca-cert.pem",
                        std::filesystem::copy_options::overwrite_existing);
  reload("TLS credentials reloaded");
  EXPECT_EQ(nbdinfo(c3).status, 0) << "the rogue CA is now the one the daemon trusts";
  EXPECT_NE(nbdinfo(c1).status, 0);
  write_text(server_dir + "/server-key.pem", "not a key\n");
  reload("TLS credentials not reloaded, the old ones stay");
  EXPECT_EQ(nbdinfo(c3).status, 0) << daemon_->log();

  // A connector may bind a DN only where the daemon has x509 credentials, and TLS only with TLS on.
  start({});
  EXPECT_EQ(st::rpc_reason(control(), "attachment_create",
                           {{"volume_id", volume},
                            {"instance_uuid", "i-3"},
                            {"connector", {{"host", "c"}, {"transport", "tcp"}, {"tls", true}}}}),
            "invalid_params");
  start({"--tls", "on"});
  EXPECT_EQ(st::rpc_reason(control(), "attachment_create",
                           {{"volume_id", volume},
                            {"instance_uuid", "i-3"},
                            {"connector", {{"host", "c"}, {"transport", "tcp"}, {"tls_dn", dn}}}}),
            "invalid_params");
}

}  // namespace
