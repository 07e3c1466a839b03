// Requests that storage holds for seconds, when the daemon stops or the attachment is detached
// (issue 40; docs/operations.md "Signals", docs/nbd.md "Connection endings"). The storage is a
// FUSE file (nbdfuse over nbdkit's memory plugin and delay filter). Before: SIGTERM cut every
// connection off at once, so the client of a write held 3 s saw its connection end while the
// daemon waited for the write, which landed all the same; and a detach cut a client whose read
// storage held past the 10 s grace off, then waited for that read anyway.
#include <gtest/gtest.h>
#include <libnbd.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/control_client.h"
#include "tests/managed_daemon.h"
#include "tests/nbd_client.h"
#include "tests/support.h"

namespace {

namespace st = shareblk::testing;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool slow_storage_possible() {
  return st::is_root() && ::access("/dev/fuse", R_OK | W_OK) == 0 && st::have_program("nbdfuse") &&
         st::have_program("fusermount3") && st::have_program("nbdkit") &&
         st::run({"nbdkit", "--filter=delay", "null", "--dump-plugin"}, 10s).status == 0;
}

// A file of `size` bytes whose every read (write) storage holds for `read_s` (`write_s`)
// seconds before it completes.
class SlowFile {
 public:
  SlowFile(const std::string& dir, const std::string& size, int read_s, int write_s)
      : mountpoint_(dir + "/mnt"), path_(mountpoint_ + "/disk") {
    std::filesystem::create_directories(mountpoint_);
    const std::vector<std::string> argv{"nbdfuse",
                                        path_,
                                        "[",
                                        "nbdkit",
                                        "--exit-with-parent",
                                        "--filter=delay",
                                        "memory",
                                        size,
                                        "rdelay=" + std::to_string(read_s),
                                        "wdelay=" + std::to_string(write_s),
                                        "]"};
    pid_ = ::fork();
    if (pid_ == 0) {
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
    const auto give_up = Clock::now() + 10s;
    struct stat st {};
    while (Clock::now() < give_up && (::stat(path_.c_str(), &st) != 0 || st.st_size == 0)) {
      std::this_thread::sleep_for(50ms);
    }
    ok_ = ::stat(path_.c_str(), &st) == 0 && st.st_size > 0;
  }
  ~SlowFile() {
    st::run({"fusermount3", "-u", mountpoint_}, 10s);
    if (pid_ > 0) st::wait_exit(pid_, 10s);
  }
  SlowFile(const SlowFile&) = delete;
  SlowFile& operator=(const SlowFile&) = delete;

  bool ok() const { return ok_; }
  const std::string& path() const { return path_; }

 private:
  std::string mountpoint_;
  std::string path_;
  pid_t pid_ = -1;
  bool ok_ = false;
};

// How an asynchronous libnbd command ended: -1 while it runs, else its errno (0: success).
int record_end(void* user_data, int* error) {
  *static_cast<int*>(user_data) = *error;
  return 1;
}

// Polls `h` until every `ends` entry is set or `limit` passes; false then.
bool wait_for(nbd_handle* h, const std::vector<const int*>& ends, std::chrono::seconds limit) {
  const auto give_up = Clock::now() + limit;
  auto all = [&] {
    for (const int* e : ends) {
      if (*e < 0) return false;
    }
    return true;
  };
  while (!all()) {
    if (Clock::now() >= give_up || nbd_poll(h, 100) < 0) return all();
  }
  return true;
}

// The server ends the connection within `limit`.
bool closed_within(nbd_handle* h, std::chrono::seconds limit) {
  const auto give_up = Clock::now() + limit;
  while (Clock::now() < give_up) {
    if (nbd_aio_is_closed(h) != 0 || nbd_aio_is_dead(h) != 0) return true;
    if (nbd_poll(h, 100) < 0) return true;
  }
  return false;
}

// SIGTERM with a write in storage: the write is carried out and answered, a request that comes
// while the daemon stops is answered ESHUTDOWN, then the connection closes and the daemon
// exits 0, all well within the unit's TimeoutStopSec (60 s). The write is on the disk.
TEST(SlowStorage, SigtermAnswersTheWriteStorageHoldsThenCloses) {
  SHAREBLK_REQUIRE(slow_storage_possible(),
                   "slow storage needs root, /dev/fuse, nbdfuse, fusermount3 and nbdkit's delay "
                   "filter");
  st::TempDir dir;
  SlowFile slow(dir.path().string(), "8M", 0, 3);
  ASSERT_TRUE(slow.ok()) << "nbdfuse did not mount " << slow.path();
  const std::string socket = dir / "nbd.sock";
  st::Daemon daemon({"--export", "disk=" + slow.path(), "--listen-unix", socket, "--workers", "1"},
                    socket);
  st::NbdHandle h = st::nbd_connect("nbd+unix:///disk?socket=" + socket);
  ASSERT_TRUE(h) << daemon.log();

  const std::string data = st::patterned(64 << 10, 40);
  int write_end = -1;
  ASSERT_GE(nbd_aio_pwrite(h.get(), data.data(), data.size(), 0,
                           nbd_completion_callback{record_end, &write_end, nullptr}, 0),
            0)
      << nbd_get_error();
  ASSERT_TRUE(!wait_for(h.get(), {&write_end}, 1s)) << "storage did not hold the write";
  const auto term = Clock::now();
  ASSERT_EQ(::kill(daemon.pid(), SIGTERM), 0);
  const auto give_up = Clock::now() + 5s;
  while (daemon.log().find("stopping") == std::string::npos && Clock::now() < give_up) {
    std::this_thread::sleep_for(20ms);
  }
  std::this_thread::sleep_for(300ms);  // the stop reaches the connections

  std::vector<char> buf(4096);
  int read_end = -1;
  ASSERT_GE(nbd_aio_pread(h.get(), buf.data(), buf.size(), 0,
                          nbd_completion_callback{record_end, &read_end, nullptr}, 0),
            0)
      << nbd_get_error();
  ASSERT_TRUE(wait_for(h.get(), {&write_end, &read_end}, 10s))
      << "unanswered after SIGTERM: write " << write_end << ", read " << read_end << "\n"
      << nbd_get_error() << "\n"
      << daemon.log();
  const double answered = seconds_since(term);
  EXPECT_EQ(write_end, 0) << "the write storage held was not answered as done";
  EXPECT_EQ(read_end, ESHUTDOWN) << "a request that came during the stop";
  EXPECT_TRUE(closed_within(h.get(), 5s)) << "the connection stayed open after its replies";
  EXPECT_EQ(daemon.stop(0), 0) << daemon.log();
  const double exited = seconds_since(term);
  EXPECT_GE(answered, 1.5) << "answered before storage completed the write";
  EXPECT_LT(exited, 10.0) << daemon.log();
  std::cout << "SIGTERM to write answered: " << answered << " s; to exit: " << exited << " s\n";
  EXPECT_EQ(st::read_file(slow.path(), 0, data.size()), data) << "the write is not on the disk";
}

class SlowStorageDetach : public st::ManagedDaemonTest {
 protected:
  void TearDown() override {
    st::ManagedDaemonTest::TearDown();
    daemon_.reset();
    if (!bound_.empty()) ::umount2(bound_.c_str(), MNT_DETACH);  // a test that failed early
  }
  std::string bound_;
};

// A detach waits for the requests storage holds, however long, and their client gets their
// replies: only a client that takes no reply is cut off at the 10 s grace. The call returns
// once storage has completed them (here a read held 12 s), so no request of the attachment
// can run after it returns.
TEST_F(SlowStorageDetach, ADetachAnswersTheReadStorageHoldsAndReturnsAfterIt) {
  SHAREBLK_REQUIRE(slow_storage_possible(),
                   "slow storage needs root, /dev/fuse, nbdfuse, fusermount3 and nbdkit's delay "
                   "filter");
  st::TempDir storage;
  SlowFile slow(storage.path().string(), "1M", 12, 0);
  ASSERT_TRUE(slow.ok()) << "nbdfuse did not mount " << slow.path();
  start();
  const std::string volume = create_volume("1M");
  // The volume's file becomes the slow one before anything opens it.
  const std::string file = dir_ / ("volumes/" + volume + ".img");
  ASSERT_EQ(::mount(slow.path().c_str(), file.c_str(), nullptr, MS_BIND, nullptr), 0)
      << file << ": " << std::strerror(errno);
  bound_ = file;
  const Json a = attach(volume, "i1", {{"host", "h1"}, {"transport", "unix"}});
  st::NbdHandle h = st::nbd_connect(a["connection_info"]["data"]["uri"]);
  ASSERT_TRUE(h) << daemon_->log();

  std::vector<char> buf(4096);
  int read_end = -1;
  ASSERT_GE(nbd_aio_pread(h.get(), buf.data(), buf.size(), 0,
                          nbd_completion_callback{record_end, &read_end, nullptr}, 0),
            0)
      << nbd_get_error();
  ASSERT_TRUE(!wait_for(h.get(), {&read_end}, 1s)) << "storage did not hold the read";
  const auto start = Clock::now();
  std::thread client([&] { wait_for(h.get(), {&read_end}, 30s); });
  const Json detached = st::rpc_ok(control(), "attachment_delete", {{"attachment_id", a["id"]}});
  const double returned = seconds_since(start);
  client.join();
  EXPECT_EQ(detached["attach_status"], "detached") << detached;
  EXPECT_EQ(read_end, 0) << "the client lost its read (cut off) instead of getting its reply\n"
                         << daemon_->log();
  EXPECT_GE(returned, 9.0) << "the detach returned before storage completed the read";
  EXPECT_LT(returned, 20.0);
  std::cout << "detach returned after " << returned << " s\n";
  EXPECT_NE(daemon_->log().find("waiting for the storage to complete them"), std::string::npos)
      << daemon_->log();
  // Stopped and unbound while the slow file is still there (the flush at the stop reaches it).
  EXPECT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  daemon_.reset();
  ::umount2(bound_.c_str(), MNT_DETACH);
  bound_.clear();
}

}  // namespace
