// The throwaway Ceph cluster (ceph_cluster.h) through the client libraries a volume store on RBD
// would use: an image made, written, read back and removed with librados and librbd.
#include <gtest/gtest.h>
#include <rados/librados.h>
#include <rbd/librbd.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <string>

#include "tests/ceph_cluster.h"
#include "tests/support.h"

namespace shareblk::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

// The handles close in reverse order of opening, whatever assertion ends the test, and all
// before the cluster stops: a client whose cluster is gone waits for it on shutdown.
struct Rados {
  ~Rados() {
    if (cluster) rados_shutdown(cluster);
  }
  rados_t cluster = nullptr;
};
struct IoCtx {
  ~IoCtx() {
    if (io) rados_ioctx_destroy(io);
  }
  rados_ioctx_t io = nullptr;
};
struct Image {
  ~Image() {
    if (image) rbd_close(image);
  }
  rbd_image_t image = nullptr;
};

std::string error(int code) {
  return std::to_string(code) + " (" + std::strerror(-code) + ")";
}

long long ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start)
      .count();
}

TEST(CephCluster, RbdImageRoundTrip) {
  const std::string missing = CephCluster::missing_programs();
  SHAREBLK_REQUIRE(missing.empty(),
                   "the Ceph tests need " + missing + " (packages ceph-mon ceph-osd ceph-common)");
  CephCluster ceph;
  const auto begin = std::chrono::steady_clock::now();
  const std::string why = ceph.start();
  ASSERT_TRUE(why.empty()) << why;
  const long long started_ms = ms_since(begin);

  Rados rados;
  ASSERT_EQ(rados_create(&rados.cluster, nullptr), 0);
  ASSERT_EQ(rados_conf_read_file(rados.cluster, ceph.conf_path().c_str()), 0);
  // A cluster that stops answering fails the test in seconds rather than at ctest's timeout.
  ASSERT_EQ(rados_conf_set(rados.cluster, "client_mount_timeout", "30"), 0);
  ASSERT_EQ(rados_conf_set(rados.cluster, "rados_osd_op_timeout", "30"), 0);
  ASSERT_EQ(rados_conf_set(rados.cluster, "rados_mon_op_timeout", "30"), 0);
  int rc = rados_connect(rados.cluster);
  ASSERT_EQ(rc, 0) << "rados_connect: " << error(rc);
  const long long answering_ms = ms_since(begin);
  std::cout << "[ stats    ] cluster started in " << started_ms << " ms, answering librados in "
            << answering_ms << " ms\n";
  RecordProperty("ceph_start_ms", std::to_string(started_ms));
  RecordProperty("ceph_answering_ms", std::to_string(answering_ms));

  IoCtx ioctx;
  rc = rados_ioctx_create(rados.cluster, ceph.pool().c_str(), &ioctx.io);
  ASSERT_EQ(rc, 0) << "rados_ioctx_create: " << error(rc);
  int order = 0;  // the default: 4 MiB objects
  rc = rbd_create(ioctx.io, "smoke", 64 * kMiB, &order);
  ASSERT_EQ(rc, 0) << "rbd_create: " << error(rc);
  {
    Image image;
    rc = rbd_open(ioctx.io, "smoke", &image.image, nullptr);
    ASSERT_EQ(rc, 0) << "rbd_open: " << error(rc);
    // 1 MiB across the boundary of the first two objects, so two objects are written.
    const uint64_t offset = 4 * kMiB - 512 * 1024;
    std::string pattern(kMiB, '\0');
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>((i * 131 + 7) % 251);
    ASSERT_EQ(rbd_write(image.image, offset, pattern.size(), pattern.data()),
              static_cast<ssize_t>(pattern.size()));
    rc = rbd_flush(image.image);
    ASSERT_EQ(rc, 0) << "rbd_flush: " << error(rc);

    std::string back(pattern.size(), 'x');
    ASSERT_EQ(rbd_read(image.image, offset, back.size(), back.data()),
              static_cast<ssize_t>(back.size()));
    EXPECT_TRUE(back == pattern) << "the pattern read back differs";
    // Never written: zeros.
    std::string hole(4096, 'x');
    ASSERT_EQ(rbd_read(image.image, 32 * kMiB, hole.size(), hole.data()),
              static_cast<ssize_t>(hole.size()));
    EXPECT_EQ(hole, std::string(hole.size(), '\0'));
  }
  rc = rbd_remove(ioctx.io, "smoke");
  ASSERT_EQ(rc, 0) << "rbd_remove: " << error(rc);
  rbd_image_t gone = nullptr;
  EXPECT_EQ(rbd_open(ioctx.io, "smoke", &gone, nullptr), -ENOENT);
  std::cout << "[ stats    ] image made, written, read and removed " << ms_since(begin)
            << " ms after start()\n";
}

}  // namespace
}  // namespace shareblk::testing
