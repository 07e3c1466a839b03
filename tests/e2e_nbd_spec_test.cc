// End-to-end checks of rules of proto.md that shareblkd once broke, through the client that
// noticed: libnbd, with its own checks off (strict mode 0) so that every request reaches the
// server as sent. tests/connection_test.cc pins the same rules byte by byte.
#include <gtest/gtest.h>
#include <libnbd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tests/support.h"

namespace shareblk::testing {
namespace {

constexpr uint64_t kDiskSize = 4 << 20;

struct NbdClose {
  void operator()(nbd_handle* h) const { nbd_close(h); }
};
using Nbd = std::unique_ptr<nbd_handle, NbdClose>;

class E2eSpecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    disk_ = dir_ / "disk.img";
    socket_ = dir_ / "nbd.sock";
    make_file(disk_, kDiskSize, 'd');
    daemon_ = std::make_unique<Daemon>(
        std::vector<std::string>{"--export", "disk=" + disk_, "--listen-unix", socket_}, socket_);
  }

  void TearDown() override {
    const int status = daemon_->stop(SIGTERM);
    EXPECT_EQ(status, 0) << "shareblkd did not exit cleanly; its log:\n" << daemon_->log();
  }

  // A handle on "disk" with structured replies and base:allocation; null (and a failure) if not.
  Nbd connect() {
    Nbd h(nbd_create());
    if (!h) {
      ADD_FAILURE() << "nbd_create: " << nbd_get_error();
      return nullptr;
    }
    nbd_set_strict_mode(h.get(), 0);
    nbd_set_export_name(h.get(), "disk");
    nbd_add_meta_context(h.get(), LIBNBD_CONTEXT_BASE_ALLOCATION);
    if (nbd_connect_unix(h.get(), socket_.c_str()) == -1) {
      ADD_FAILURE() << "nbd_connect_unix: " << nbd_get_error();
      return nullptr;
    }
    EXPECT_EQ(nbd_get_structured_replies_negotiated(h.get()), 1);
    return h;
  }

  // The connection still serves: a READ gets the file's bytes.
  static void expect_usable(nbd_handle* h) {
    std::string data(4096, '\0');
    ASSERT_EQ(nbd_pread(h, data.data(), data.size(), 0, 0), 0) << nbd_get_error();
    EXPECT_EQ(data, std::string(4096, 'd'));
  }

  TempDir dir_;
  std::string disk_;
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
};

int ignore_extents(void* /*data*/, const char* /*context*/, uint64_t /*offset*/,
                   uint32_t* /*entries*/, size_t /*count*/, int* /*error*/) {
  return 0;
}

// proto.md "Command flags": with NBD_FLAG_SEND_FUA advertised, FUA is valid on every command.
TEST_F(E2eSpecTest, FuaIsAcceptedOnCommandsThatWriteNothing) {
  Nbd h = connect();
  ASSERT_TRUE(h);
  ASSERT_EQ(nbd_can_fua(h.get()), 1);
  std::string data(4096, '\0');
  EXPECT_EQ(nbd_pread(h.get(), data.data(), data.size(), 0, LIBNBD_CMD_FLAG_FUA), 0)
      << nbd_get_error();
  EXPECT_EQ(data, std::string(4096, 'd'));
  EXPECT_EQ(nbd_flush(h.get(), LIBNBD_CMD_FLAG_FUA), 0) << nbd_get_error();
  EXPECT_EQ(nbd_cache(h.get(), 4096, 0, LIBNBD_CMD_FLAG_FUA), 0) << nbd_get_error();
  EXPECT_EQ(
      nbd_block_status(h.get(), 4096, 0, nbd_extent_callback{ignore_extents, nullptr, nullptr},
                       LIBNBD_CMD_FLAG_FUA),
      0)
      << nbd_get_error();
  expect_usable(h.get());
}

// A zero-length READ past the end is refused with EINVAL. Its error chunk carried the
// request's offset, which no empty request contains (proto.md "Structured reply types");
// libnbd 1.14 took that for a server bug and dropped the connection.
TEST_F(E2eSpecTest, ZeroLengthReadPastTheEndFailsAndTheConnectionGoesOn) {
  Nbd h = connect();
  ASSERT_TRUE(h);
  char byte = 0;
  EXPECT_EQ(nbd_pread(h.get(), &byte, 0, kDiskSize + 4096, 0), -1);
  EXPECT_EQ(nbd_get_errno(), EINVAL) << nbd_get_error();
  EXPECT_EQ(nbd_aio_is_ready(h.get()), 1) << "the connection is gone: " << nbd_get_error();
  expect_usable(h.get());
}

}  // namespace
}  // namespace shareblk::testing
