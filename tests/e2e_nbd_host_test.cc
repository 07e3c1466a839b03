// End-to-end: the host around the daemon. A volume on tmpfs, a client host that goes silent, and
// a small locked-memory limit. These start daemons of their own.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/e2e_nbd_fixture.h"

namespace shareblk::testing::e2e {
namespace {

// `fallocate -l SIZE /dev/shm/vol` gives pages that tmpfs counts as holes until written, and
// its SEEK_DATA walks them one by one: looking up holes for each read cost a scan to the end of
// the file (1 GiB: ~120 reads/s with the worker thread at 100%). Reads must not depend on how
// far the next data is.
TEST(E2eTmpfs, ReadsOfAFallocatedTmpfsVolumeDoNotScanTheFile) {
  TempDir shm("/dev/shm", std::nothrow);
  SHAREBLK_REQUIRE(shm.ok(), "no writable /dev/shm");
  TempDir dir;
  const std::string vol = shm / "vol.img";
  const std::string socket = dir / "nbd.sock";
  constexpr uint64_t kSize = 512 * kMiB;
  {
    const int fd = ::open(vol.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fallocate(fd, 0, 0, static_cast<off_t>(kSize)), 0) << std::strerror(errno);
    ::close(fd);
  }
  Daemon daemon({"--export", "mem=" + vol, "--listen-unix", socket, "--workers", "1"}, socket);
  Nbd h = open_nbd(socket, "mem");
  ASSERT_TRUE(h);
  // Reads far from the end of the file (the first half) against reads in its last MiB, taken
  // in turn so that a slow or busy machine slows both alike: scanning, a far read cost 2-4 ms
  // here and a near one ~0.1 ms; without, both ~0.1 ms.
  constexpr int kReads = 200;
  std::vector<std::chrono::nanoseconds> far, near;
  for (int i = 0; i < kReads; ++i) {
    const uint64_t page = uint64_t(i) * 7919;
    const uint64_t far_offset = page % (kSize / 2 / (4 * kKiB)) * 4 * kKiB;
    const uint64_t near_offset = kSize - kMiB + page % (kMiB / (4 * kKiB)) * 4 * kKiB;
    for (const auto& [offset, times] : {std::pair{far_offset, &far}, {near_offset, &near}}) {
      const auto start = std::chrono::steady_clock::now();
      ASSERT_EQ(nbd_read(h.get(), offset, 4 * kKiB), std::string(4 * kKiB, '\0'));
      times->push_back(std::chrono::steady_clock::now() - start);
    }
  }
  for (auto* times : {&far, &near}) std::sort(times->begin(), times->end());
  const auto far_median = far[kReads / 2];
  const auto near_median = near[kReads / 2];
  EXPECT_LT(far_median, 3 * near_median + 200us)
      << "a read far from the end took "
      << std::chrono::duration_cast<std::chrono::microseconds>(far_median).count()
      << " µs (median), one near it "
      << std::chrono::duration_cast<std::chrono::microseconds>(near_median).count() << " µs";
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// --- Client hosts that go silent ---

// Another network host: a network namespace joined to this one by a veth pair. Taking its end
// of the link down makes it silent, as a crashed host or a cut cable is: every packet to it
// is lost and it sends no FIN or RST.
class PeerHost {
 public:
  PeerHost()
      : ns_("sbpeer" + std::to_string(::getpid())),
        host_if_("sbh" + std::to_string(::getpid() % 1000000)),
        peer_if_("sbp" + std::to_string(::getpid() % 1000000)),
        subnet_("198.18." + std::to_string(::getpid() % 250) + ".") {  // RFC 2544: for tests
    ok_ = ip({"netns", "add", ns_}) &&
          ip({"link", "add", host_if_, "type", "veth", "peer", "name", peer_if_, "netns", ns_}) &&
          ip({"addr", "add", subnet_ + "1/24", "dev", host_if_}) &&
          ip({"link", "set", host_if_, "up"}) &&
          ip({"-n", ns_, "addr", "add", subnet_ + "2/24", "dev", peer_if_}) &&
          ip({"-n", ns_, "link", "set", peer_if_, "up"});
  }
  ~PeerHost() {
    ip({"link", "del", host_if_});
    ip({"netns", "del", ns_});
  }
  PeerHost(const PeerHost&) = delete;
  PeerHost& operator=(const PeerHost&) = delete;

  bool ok() const { return ok_; }
  // This machine's address on the link.
  std::string our_address() const { return subnet_ + "1"; }
  bool go_silent() const { return ip({"-n", ns_, "link", "set", peer_if_, "down"}); }

  // A TCP connection made from inside the peer host to address:port; -1 on failure. The
  // socket belongs to the namespace it was made in, whichever thread uses it later.
  int connect(const std::string& address, int port) const {
    int fd = -1;
    std::thread([&] {
      const int ns = ::open(("/run/netns/" + ns_).c_str(), O_RDONLY | O_CLOEXEC);
      if (ns < 0) return;
      const bool joined = ::setns(ns, CLONE_NEWNET) == 0;
      ::close(ns);
      if (!joined) return;
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port));
      if (::inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) return;
      fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        ::close(fd);
        fd = -1;
      }
    }).join();
    return fd;
  }

 private:
  static bool ip(std::vector<std::string> args) {
    args.insert(args.begin(), "ip");
    return run(args, 10s).status == 0;
  }

  std::string ns_, host_if_, peer_if_, subnet_;
  bool ok_ = false;
};

// Established TCP connections on this machine whose local port is `port`.
int established_on_port(int port) {
  const RunResult r =
      run({"ss", "-Htn", "state", "established", "( sport = :" + std::to_string(port) + " )"}, 10s);
  return static_cast<int>(std::count(r.output.begin(), r.output.end(), '\n'));
}

// A client host that goes silent leaves an idle connection that the kernel alone would keep
// for ever (keepalive is off by default). With --peer-timeout-ms the daemon drops it, and
// says so; while the host still answers, an idle client is left alone.
TEST(E2ePeerTimeout, AClientHostThatGoesSilentIsDropped) {
  SHAREBLK_REQUIRE(is_root() && have_program("ip") && have_program("ss"),
                   "needs root and iproute2 (ip, ss) for a second network host");
  PeerHost peer;
  SHAREBLK_REQUIRE(peer.ok(), "cannot make a network namespace joined by a veth pair");
  TempDir dir;
  const std::string disk = dir / "disk.img";
  const std::string socket = dir / "nbd.sock";
  make_file(disk, kMiB);
  Daemon daemon({"--export", "disk=" + disk, "--listen-unix", socket, "--listen-tcp",
                 peer.our_address() + ":0", "--peer-timeout-ms", "2000"},
                socket);
  const int port = logged_tcp_port(daemon, peer.our_address());
  ASSERT_GT(port, 0) << daemon.log();

  RawClient c(peer.connect(peer.our_address(), port));
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(handshake(c, "disk"));
  std::this_thread::sleep_for(5s);  // idle for 2.5 timeouts, the host answering probes
  ASSERT_TRUE(send_request(c, nbd::kCmdRead, 1, 0, 4096));
  SimpleReply reply;
  ASSERT_TRUE(read_simple_reply(c, reply, {{1, 4096}})) << "an idle live client was dropped";
  EXPECT_EQ(reply.error, 0u);
  ASSERT_EQ(established_on_port(port), 1);

  ASSERT_TRUE(peer.go_silent());
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (established_on_port(port) > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_EQ(established_on_port(port), 0) << "the silent client's connection is still there";
  EXPECT_NE(daemon.log().find("lost a client of"), std::string::npos) << daemon.log();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// --- The TCP send buffer ---

// The send buffer of the daemon's side of its one TCP connection on `port` ("tb" in the
// socket memory `ss -m` shows, which is what the kernel made of SO_SNDBUF), or -1.
long daemon_send_buffer(int port) {
  const RunResult r = run(
      {"ss", "-Htnm", "state", "established", "( sport = :" + std::to_string(port) + " )"}, 10s);
  const size_t at = r.output.find(",tb");
  return at == std::string::npos ? -1 : std::strtol(r.output.c_str() + at + 3, nullptr, 10);
}

// A TCP connection gets the send buffer --tcp-send-buffer-kib asks for (512 KiB by default,
// doubled by the kernel), where the kernel's autotuning would give loopback connections its
// maximum at once: with a buffer that large, 1 MiB reads over TCP cost the daemon a third
// more CPU (bench/PROFILE.md). 0 leaves the buffer to the kernel.
TEST(E2eTcpSendBuffer, TcpConnectionsGetTheSendBufferAskedFor) {
  SHAREBLK_REQUIRE(is_root() && have_program("ss"),
                   "needs root (SO_SNDBUFFORCE passes wmem_max) and ss (iproute2)");
  TempDir dir;
  const std::string disk = dir / "disk.img";
  const std::string socket = dir / "nbd.sock";
  make_file(disk, kMiB);
  const long asked_by_default = 2 * 512 * 1024;
  for (const auto& [kib, expected] :
       {std::pair<std::string, long>{"", asked_by_default}, {"256", 2 * 256 * 1024}, {"0", 0}}) {
    std::vector<std::string> args = {"--export", "disk=" + disk, "--listen-unix",
                                     socket,     "--listen-tcp", "127.0.0.1:0"};
    if (!kib.empty()) args.insert(args.end(), {"--tcp-send-buffer-kib", kib});
    Daemon daemon(args, socket);
    const int port = logged_tcp_port(daemon, "127.0.0.1");
    ASSERT_GT(port, 0) << daemon.log();
    Nbd h(nbd_create());
    ASSERT_TRUE(h);
    const std::string uri = "nbd://127.0.0.1:" + std::to_string(port) + "/disk";
    ASSERT_EQ(nbd_connect_uri(h.get(), uri.c_str()), 0) << nbd_get_error();
    EXPECT_EQ(nbd_read(h.get(), 0, kMiB), std::string(kMiB, '\0'));
    const long buffer = daemon_send_buffer(port);
    if (expected != 0) {
      EXPECT_EQ(buffer, expected) << "--tcp-send-buffer-kib '" << kib << "'";
    } else {
      EXPECT_GT(buffer, 0);
      EXPECT_NE(buffer, asked_by_default) << "with 0 the kernel sizes the buffer";
    }
    h.reset();
    EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
  }
}

// --- Locked memory ---

// Runs what follows it with RLIMIT_MEMLOCK at `bytes` and without CAP_IPC_LOCK, which would
// lift the limit for root: the situation of a daemon under a service manager's small limit.
std::vector<std::string> with_locked_memory_limit(uint64_t bytes) {
  const std::string limit = std::to_string(bytes);
  return {"prlimit",
          "--memlock=" + limit + ":" + limit,
          "capsh",
          "--drop=cap_ipc_lock",
          "--",
          "-c",
          "exec \"$0\" \"$@\""};
}

// Each io_uring is locked memory (about 40 KiB on Linux 6.18). When the limit holds some
// rings but not all the workers asked for, the daemon used to refuse to start; now it runs
// the workers that fit, says so, and serves every connection with them. io_uring counts
// this memory per user, and a ring's teardown finishes a moment after its process exits:
// another daemon without CAP_IPC_LOCK started right before can make even the first ring fail.
TEST(E2eLockedMemory, RunsTheWorkersThatFitUnderTheLimit) {
  SHAREBLK_REQUIRE(is_root() && have_program("prlimit") && have_program("capsh"),
                   "needs root, prlimit and capsh to drop CAP_IPC_LOCK");
  TempDir dir;
  const std::string disk = dir / "disk.img";
  const std::string socket = dir / "nbd.sock";
  make_file(disk, 8 * kMiB);
  Daemon daemon({"--export", "disk=" + disk, "--listen-unix", socket, "--workers", "8"}, socket,
                with_locked_memory_limit(96 * kKiB));
  EXPECT_NE(daemon.log().find(" of 8 io_uring workers"), std::string::npos) << daemon.log();

  std::vector<Nbd> clients;  // more connections than workers: they share the ones running
  for (int i = 0; i < 4; ++i) {
    clients.push_back(open_nbd(socket, "disk"));
    ASSERT_TRUE(clients.back());
    const std::string data = random_bytes(64 * kKiB, static_cast<uint64_t>(i));
    ASSERT_TRUE(nbd_write(clients.back().get(), static_cast<uint64_t>(i) * kMiB, data));
    EXPECT_TRUE(same_bytes(
        nbd_read(clients.back().get(), static_cast<uint64_t>(i) * kMiB, data.size()), data));
  }
  clients.clear();
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// Below a single ring nothing can run: the daemon stops at once and says why.
TEST(E2eLockedMemory, SaysWhyWhenNotEvenOneRingFits) {
  SHAREBLK_REQUIRE(is_root() && have_program("prlimit") && have_program("capsh"),
                   "needs root, prlimit and capsh to drop CAP_IPC_LOCK");
  TempDir dir;
  const std::string disk = dir / "disk.img";
  make_file(disk, kMiB);
  std::vector<std::string> argv = with_locked_memory_limit(16 * kKiB);
  argv.insert(argv.end(),
              {Daemon::binary(), "--export", "disk=" + disk, "--listen-unix", dir / "nbd.sock"});
  const RunResult r = run(argv, 20s);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("io_uring worker: Cannot allocate memory"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace shareblk::testing::e2e
