// End-to-end: the clients users run. qemu-io, qemu-img and fio against the daemon.
#include <string>
#include <vector>

#include "tests/e2e_nbd_fixture.h"

namespace shareblk::testing::e2e {
namespace {

TEST_F(E2eTest, QemuIoWritesAndReadsPatterns) {
  SHAREBLK_REQUIRE(have_program("qemu-io"), "qemu-io (qemu-utils) is not installed");
  RunResult write =
      run({"qemu-io", "-f", "raw", "-c", "write -P 0xab 0 1M", "-c", "write -P 0xcd 1M 512k", "-c",
           "write -P 0x5e 3000000 77777", "-c", "flush", uri("disk")});
  ASSERT_EQ(write.status, 0) << write.output;

  RunResult read =
      run({"qemu-io", "-f", "raw", "-c", "read -P 0xab 0 1M", "-c", "read -P 0xcd 1M 512k", "-c",
           "read -P 0x5e 3000000 77777", "-c", "read -P 0 1572864 1427136", uri("disk")});
  EXPECT_EQ(read.status, 0) << read.output;
  EXPECT_EQ(read.output.find("verification failed"), std::string::npos) << read.output;

  // A wrong pattern is caught: the reads above really compared something.
  RunResult wrong = run({"qemu-io", "-f", "raw", "-c", "read -P 0xac 0 4k", uri("disk")});
  EXPECT_NE(wrong.status, 0) << wrong.output;
  EXPECT_NE(wrong.output.find("verification failed"), std::string::npos) << wrong.output;

  EXPECT_TRUE(same_bytes(read_file(disk_, 0, 1 * kMiB), std::string(1 * kMiB, '\xab')));
  EXPECT_TRUE(same_bytes(read_file(disk_, 3000000, 77777), std::string(77777, '\x5e')));
}

TEST_F(E2eTest, QemuIoOnReadOnlyExport) {
  SHAREBLK_REQUIRE(have_program("qemu-io"), "qemu-io (qemu-utils) is not installed");
  ASSERT_NO_FATAL_FAILURE(write_file_at(disk_, 0, std::string(1 * kMiB, '\x42')));

  RunResult read = run({"qemu-io", "-r", "-f", "raw", "-c", "read -P 0x42 0 1M", uri("ro")});
  EXPECT_EQ(read.status, 0) << read.output;

  RunResult write_ro = run({"qemu-io", "-r", "-f", "raw", "-c", "write -P 0x99 0 4k", uri("ro")});
  EXPECT_NE(write_ro.status, 0) << write_ro.output;
  // Without -r qemu asks for write access, which a read-only export does not give.
  RunResult write_rw = run({"qemu-io", "-f", "raw", "-c", "write -P 0x99 0 4k", uri("ro")});
  EXPECT_NE(write_rw.status, 0) << write_rw.output;

  EXPECT_TRUE(same_bytes(read_file(disk_, 0, 1 * kMiB), std::string(1 * kMiB, '\x42')));
}

TEST_F(E2eTest, QemuImgConvertThenCompare) {
  SHAREBLK_REQUIRE(have_program("qemu-img"), "qemu-img (qemu-utils) is not installed");
  // The export starts as all 0xff, so the zeroes of the source must really be written.
  Nbd h = open_nbd(socket_, "disk");
  ASSERT_TRUE(h);
  const std::string ones(4 * kMiB, '\xff');
  for (uint64_t offset = 0; offset < kDiskSize; offset += ones.size()) {
    ASSERT_TRUE(nbd_write(h.get(), offset, ones));
  }
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();

  // A sparse source with random data at aligned and unaligned places.
  const std::string local = dir_ / "local.img";
  make_file(local, kDiskSize);
  ASSERT_NO_FATAL_FAILURE(write_file_at(local, 0, random_bytes(3 * kMiB, 11)));
  ASSERT_NO_FATAL_FAILURE(write_file_at(local, 10 * kMiB + 123, random_bytes(1 * kMiB, 12)));
  ASSERT_NO_FATAL_FAILURE(write_file_at(local, 40 * kMiB, random_bytes(8 * kMiB, 13)));
  ASSERT_NO_FATAL_FAILURE(write_file_at(local, kDiskSize - 5000, random_bytes(5000, 14)));

  RunResult convert =
      run({"qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", local, uri("disk")});
  ASSERT_EQ(convert.status, 0) << convert.output;
  RunResult compare = run({"qemu-img", "compare", "-f", "raw", "-F", "raw", local, uri("disk")});
  EXPECT_EQ(compare.status, 0) << compare.output;
  for (uint64_t offset = 0; offset < kDiskSize; offset += 4 * kMiB) {
    ASSERT_TRUE(same_bytes(read_file(disk_, offset, 4 * kMiB), read_file(local, offset, 4 * kMiB)))
        << "at offset " << offset;
  }

  // One changed byte and compare notices: it really read the export.
  ASSERT_TRUE(nbd_write(h.get(), 20 * kMiB + 7, "x"));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  RunResult differ = run({"qemu-img", "compare", "-f", "raw", "-F", "raw", local, uri("disk")});
  EXPECT_EQ(differ.status, 1) << differ.output;
}

TEST_F(E2eTest, FioVerifiesDataAcrossFourConnections) {
  SHAREBLK_REQUIRE(have_program("fio"), "fio is not installed");
  SHAREBLK_REQUIRE(run({"fio", "--enghelp=nbd"}).status == 0, "fio has no nbd engine");
  // Four jobs, one connection each, every job in its own 4 MiB region so that what it
  // verifies is what it wrote.
  const std::vector<std::string> job{"fio",
                                     "--name=shareblk",
                                     "--ioengine=nbd",
                                     "--uri=" + uri("disk"),
                                     "--rw=randwrite",
                                     "--bs=4k",
                                     "--size=4M",
                                     "--offset_increment=4M",
                                     "--numjobs=4",
                                     "--iodepth=8",
                                     "--verify=crc32c",
                                     "--verify_fatal=1",
                                     "--verify_state_save=0",
                                     "--group_reporting"};
  std::vector<std::string> write_and_verify = job;
  write_and_verify.push_back("--do_verify=1");
  RunResult fio = run(write_and_verify);
  ASSERT_EQ(fio.status, 0) << fio.output;
  EXPECT_EQ(fio.output.find("verify:"), std::string::npos) << fio.output;
  EXPECT_NE(fio.output.find("err= 0"), std::string::npos) << fio.output;
  // Every block written was read back and verified.
  EXPECT_NE(fio.output.find("issued rwts: total=4096,4096,"), std::string::npos) << fio.output;

  // A block changed behind fio's back fails verification: the check has teeth.
  Nbd h = open_nbd(socket_, "disk");
  ASSERT_TRUE(h);
  ASSERT_TRUE(nbd_write(h.get(), 8 * kMiB + 40 * kKiB, random_bytes(4 * kKiB, 15)));
  ASSERT_EQ(nbd_flush(h.get(), 0), 0) << nbd_get_error();
  std::vector<std::string> verify_only = job;
  verify_only.push_back("--verify_only");
  RunResult corrupted = run(verify_only);
  EXPECT_NE(corrupted.status, 0) << corrupted.output;
  EXPECT_NE(corrupted.output.find("verify:"), std::string::npos) << corrupted.output;
}

}  // namespace
}  // namespace shareblk::testing::e2e
