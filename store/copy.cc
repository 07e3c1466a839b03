// Copying one volume's bytes into another's backing (snapshots and clones, docs/snapshots.md).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "store/volume_store.h"

namespace shareblk::store {

namespace {

constexpr uint64_t kChunk = 1 << 20;
constexpr uint64_t kBlock = 64 << 10;  // what is skipped when it reads as zeroes

bool all_zero(const char* p, size_t n) {
  return n == 0 || (p[0] == 0 && std::memcmp(p, p + 1, n - 1) == 0);
}

// Moves `n` bytes between `buf` and `volume` at `offset`, piece by piece as they lie on its
// devices, or as one call of its remote image. Returns errno.
int transfer(const backend::Volume& volume, bool write, char* buf, uint64_t n, uint64_t offset) {
  if (volume.remote()) {
    return volume.remote()->execute(write ? backend::Op::Write : backend::Op::Read, 0, offset, n,
                                    buf);
  }
  for (uint64_t done = 0; done < n;) {
    const backend::Volume::Location at = volume.locate(offset + done, n - done, buf + done);
    if (at.fd < 0) return EIO;
    const auto pos = static_cast<off_t>(at.offset);
    const ssize_t got = write ? ::pwrite(at.fd, buf + done, at.length, pos)
                              : ::pread(at.fd, buf + done, at.length, pos);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return EIO;  // the backing is shorter than the volume
    done += static_cast<uint64_t>(got);
  }
  return 0;
}

// Where the next data at or after `offset` begins in a file volume (SEEK_DATA), so that holes
// are skipped without being read; `offset` itself for anything else.
uint64_t next_data(const backend::Volume& volume, uint64_t offset, uint64_t length) {
  if (volume.remote()) {  // the store says what was never written
    std::vector<backend::Extent> first;
    if (volume.remote()->extents(offset, length - offset, 1, first) != 0 || first.empty() ||
        !first[0].hole) {
      return offset;
    }
    return std::min(length, offset + first[0].length);
  }
  if (volume.is_block_device() || volume.is_mapped() || !volume.may_have_holes()) return offset;
  const backend::Volume::Location at = volume.locate_buffered(offset, length - offset);
  if (at.fd < 0) return offset;
  const off_t data = ::lseek(at.fd, static_cast<off_t>(at.offset), SEEK_DATA);
  if (data < 0) return errno == ENXIO ? length : offset;  // ENXIO: nothing but hole to the end
  return std::min(length, static_cast<uint64_t>(data));
}

}  // namespace

StoreError copy_volume(const backend::Volume& from, const backend::Volume& to, uint64_t length,
                       const Progress& progress) {
  // Aligned, so that both sides use their O_DIRECT descriptors: a copy passes through no page
  // cache, and leaves none of the volume's bytes there.
  std::unique_ptr<char, decltype(&std::free)> buf(
      static_cast<char*>(std::aligned_alloc(4096, kChunk)), &std::free);
  if (!buf) return StoreError::from_errno(ENOMEM, "copy buffer");
  uint64_t offset = 0;
  while (offset < length) {
    if (progress && !progress(offset, length))
      return StoreError::from_errno(ECANCELED, "copy stopped");
    const uint64_t data = next_data(from, offset, length);
    if (data != offset) {             // a hole: the new backing reads zeroes there already
      offset = data & ~(kChunk - 1);  // still whole chunks: `offset` was one's start
      if (offset >= length) break;
    }
    const uint64_t n = std::min(kChunk, length - offset);
    if (int err = transfer(from, false, buf.get(), n, offset)) {
      return StoreError::from_errno(err, "read " + from.path());
    }
    // Runs of non-zero blocks only, so that zeroes inside a chunk stay unallocated too.
    const auto zero_block = [&](uint64_t at) {
      return all_zero(buf.get() + at, std::min(kBlock, n - at));
    };
    for (uint64_t at = 0, end = 0; at < n; at = end) {
      const bool zero = zero_block(at);
      end = at + std::min(kBlock, n - at);
      while (end < n && zero_block(end) == zero) end += std::min(kBlock, n - end);
      if (zero) continue;
      if (int err = transfer(to, true, buf.get() + at, end - at, offset + at)) {
        return StoreError::from_errno(err, "write " + to.path());
      }
    }
    offset += n;
  }
  if (to.remote()) {
    if (int err = to.remote()->execute(backend::Op::Flush, 0, 0, 0, nullptr))
      return StoreError::from_errno(err, "flush " + to.path());
  }
  for (size_t i = 0; i < to.device_count(); ++i) {
    if (::fdatasync(to.device_fd(i)) != 0)
      return StoreError::from_errno(errno, "sync " + to.path());
  }
  if (progress) progress(length, length);
  return {};
}

}  // namespace shareblk::store
