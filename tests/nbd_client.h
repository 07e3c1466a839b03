// libnbd for the end-to-end suites that drive a server (shareblkd's listener, nbdkit with the
// plugin) as a client would: connections, reads, and the checks both suites make.
#pragma once

#include <gtest/gtest.h>
#include <libnbd.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shareblk::testing {

using NbdHandle = std::unique_ptr<nbd_handle, decltype(&nbd_close)>;

// A fresh, unconnected handle.
NbdHandle new_handle();

struct NbdOptions {
  bool strict = true;            // false: libnbd's own checks off, every request reaches the server
  bool base_allocation = false;  // ask for the base:allocation metadata context
};

// Connects to `uri`; null when the server refuses, with libnbd's errno in *errnum (ENOENT when
// the server answered NBD_REP_ERR_UNKNOWN).
NbdHandle nbd_connect(const std::string& uri, int* errnum = nullptr, NbdOptions options = {});

// `length` bytes at `offset`; a test failure (and an empty string) when the read fails.
std::string nbd_read(nbd_handle* h, uint64_t offset, size_t length);

// `length` copies of `byte`.
inline std::string pattern(char byte, size_t length) {
  return std::string(length, byte);
}

// `length` bytes that differ from one offset to the next and from one `seed` to another, so
// that a block read back from the wrong place or the wrong write shows.
inline std::string patterned(size_t length, int seed) {
  std::string s(length, '\0');
  for (size_t i = 0; i < length; ++i) s[i] = static_cast<char>((i * 31 + seed) % 251);
  return s;
}

struct ByteRange {
  uint64_t offset;
  uint64_t length;
};

// Every write, trim and write-zeroes through `h` over each of `ranges`, with every flag a client
// may send on them, fails with EPERM: the read-only rule, whatever the client advertised.
void expect_every_write_refused(nbd_handle* h, const std::vector<ByteRange>& ranges);

// Two attachments of one 4 MiB volume: what `writer` writes and flushes, `reader` (read-only)
// reads back, and an unwritten range reads as zeroes. Writes 64 KiB of 0xab at 0 and 4 KiB of
// 0xcd at 3 MiB + 512.
void expect_reader_sees_writer(nbd_handle* writer, nbd_handle* reader);

}  // namespace shareblk::testing
