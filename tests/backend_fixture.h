// What the backend suite (tests/backend_*_test.cc, in unit_tests) shares: helpers, its fixture.
//
// The backend: the admission rule, synchronous I/O, allocation status, and the io_uring path,
// each checked against what pread(2) and fstat(2) see in the file afterwards.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "backend/backend.h"
#include "tests/support.h"

namespace shareblk::testing::backend_io {

using backend::AttachMode;
using backend::Extent;
using backend::Handle;
using backend::Op;
using backend::Volume;

inline constexpr uint64_t kSize = 1 << 20;
inline constexpr uint64_t kMax = UINT64_MAX;

// A heap buffer aligned for O_DIRECT. Offsetting into it gives deliberately unaligned ones.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size) : size_(size) {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, size + 4096) != 0) std::abort();
    data_.reset(static_cast<char*>(p));
    std::memset(data_.get(), 0, size + 4096);
  }
  char* data() { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data_;
  size_t size_;
};

// Bytes that differ at every offset, so that a transfer landing in the wrong place shows.
inline std::string pattern(size_t length, unsigned seed) {
  std::string s(length, '\0');
  for (size_t i = 0; i < length; ++i)
    s[i] = static_cast<char>((i * 131 + seed * 17 + i / 251) & 0xff);
  return s;
}

// What the file holds, read through a descriptor of our own.
inline std::string pread_file(const std::string& path, uint64_t offset, size_t length) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "<cannot open>";
  std::string data(length, '\0');
  ssize_t n = ::pread(fd, data.data(), length, static_cast<off_t>(offset));
  ::close(fd);
  data.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return data;
}

// Writes `data` into the file behind the backend's back.
inline bool pwrite_file(const std::string& path, const std::string& data, uint64_t offset) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = ::pwrite(fd, data.data(), data.size(), static_cast<off_t>(offset));
  ::close(fd);
  return n == static_cast<ssize_t>(data.size());
}

inline uint64_t allocated_bytes(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

inline uint64_t file_size(const std::string& path) {
  return std::filesystem::file_size(path);
}

inline std::string extents_text(const std::vector<Extent>& extents) {
  std::string s;
  for (const Extent& e : extents)
    s += (e.hole ? "hole:" : "data:") + std::to_string(e.length) + " ";
  return s;
}

// An IoRequest that records how it ended.
struct RecordingRequest final : backend::IoRequest {
  int calls = 0;
  int err = -1;
  void done(int e) override {
    ++calls;
    err = e;
  }
};

inline RecordingRequest make_request(Op op, uint64_t offset, uint32_t length, char* buf = nullptr,
                                     uint32_t flags = 0) {
  RecordingRequest r;
  r.op = op;
  r.offset = offset;
  r.length = length;
  r.buf = buf;
  r.flags = flags;
  return r;
}

// Turns the ring until every request in `requests` is done; false on an engine error or after
// ten seconds.
inline bool pump(backend::Ring& ring, const std::vector<RecordingRequest*>& requests) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    bool all = true;
    for (const RecordingRequest* r : requests) all = all && r->calls > 0;
    if (all) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    if (ring.run_once(100) < 0) return false;
  }
}

// --- Fixture: a fully allocated 1 MiB file of 0xab bytes in the temp directory ---

class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_ / "volume.img";
    testing::make_file(path_, kSize, 0xab);
    std::error_code ec;
    volume_ = Volume::open(path_, ec);
    ASSERT_TRUE(volume_) << ec.message();
    rw_ = Handle(volume_, AttachMode::ReadWrite);
    ro_ = Handle(volume_, AttachMode::ReadOnly);
  }

  std::string on_disk(uint64_t offset, size_t length) { return pread_file(path_, offset, length); }

  testing::TempDir dir_;
  std::string path_;
  std::shared_ptr<Volume> volume_;
  Handle rw_;
  Handle ro_;
};

}  // namespace shareblk::testing::backend_io
