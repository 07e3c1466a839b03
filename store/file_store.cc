// The embedded default store: one file per volume, sparse unless the daemon preallocates.
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "store/volume_store.h"

namespace shareblk::store {

namespace {

namespace fs = std::filesystem;

class FileVolumeStore final : public VolumeStore {
 public:
  FileVolumeStore(fs::path dir, bool preallocate)
      : dir_(std::move(dir)), preallocate_(preallocate) {}

  std::string kind() const override { return "file"; }

  StoreError create(const std::string& id, uint64_t size) override {
    const std::string path = path_of(id);
    int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) return StoreError::from_errno(errno, "create " + path);
    int err = grow(fd, 0, size);
    if (err == 0 && ::fsync(fd) != 0) err = errno;
    ::close(fd);
    if (err != 0) {
      ::unlink(path.c_str());
      return StoreError::from_errno(err, "allocate " + std::to_string(size) + " bytes for " + path);
    }
    return {};
  }

  StoreError extend(const std::string& id, uint64_t size) override {
    const std::string path = path_of(id);
    int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return StoreError::from_errno(errno, "open " + path);
    struct stat st {};
    int err = ::fstat(fd, &st) == 0 ? 0 : errno;
    if (err == 0 && static_cast<uint64_t>(st.st_size) < size) {
      err = grow(fd, static_cast<uint64_t>(st.st_size), size);
    }
    if (err == 0 && ::fsync(fd) != 0) err = errno;
    ::close(fd);
    return err ? StoreError::from_errno(err, "extend " + path) : StoreError{};
  }

  // Unlinking is enough: a new file reads zeroes wherever it was not written.
  StoreError remove(const std::string& id, const Progress& progress) override {
    const std::string path = path_of(id);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      return StoreError::from_errno(errno, "remove " + path);
    if (progress) progress(1, 1);
    return {};
  }

  StoreError open(const std::string& id, uint64_t /*size*/,
                  std::shared_ptr<backend::Volume>& out) override {
    std::error_code ec;
    out = backend::Volume::open(path_of(id), ec);
    if (!out) return {ec, "open " + path_of(id) + ": " + ec.message()};
    return {};
  }

  StoreError refresh(const std::string& id, uint64_t /*size*/, backend::Volume& volume) override {
    if (int err = volume.refresh_size())
      return StoreError::from_errno(err, "refresh " + path_of(id));
    return {};
  }

  // FICLONE (XFS with reflink, btrfs). Not with --preallocate: shared blocks need new space when
  // either side writes them, which is what preallocation promises never to need.
  StoreError clone(const std::string& from, const std::string& to, uint64_t size) override {
    if (preallocate_) return StoreError::from_errno(ENOTSUP, "clone (the store preallocates)");
    const std::string source = path_of(from);
    const std::string path = path_of(to);
    const int in = ::open(source.c_str(), O_RDONLY | O_CLOEXEC);
    if (in < 0) return StoreError::from_errno(errno, "open " + source);
    const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) {
      const int err = errno;
      ::close(in);
      return StoreError::from_errno(err, "create " + path);
    }
    int err = ::ioctl(fd, FICLONE, in) == 0 ? 0 : errno;
    ::close(in);
    if (err == EOPNOTSUPP || err == ENOTTY || err == EXDEV || err == EINVAL) err = ENOTSUP;
    struct stat st {};
    if (err == 0 && ::fstat(fd, &st) != 0) err = errno;
    if (err == 0 && static_cast<uint64_t>(st.st_size) < size &&
        ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      err = errno;
    }
    if (err == 0 && ::fsync(fd) != 0) err = errno;
    ::close(fd);
    if (err != 0) {
      ::unlink(path.c_str());
      return StoreError::from_errno(err, "clone " + source + " to " + path);
    }
    return {};
  }

  StoreError list(std::vector<std::string>& ids) override {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir_, ec)) {
      if (entry.path().extension() == ".img") ids.push_back(entry.path().stem().string());
    }
    if (ec) return {ec, "list " + dir_.string() + ": " + ec.message()};
    return {};
  }

 private:
  // Makes the file `size` bytes long from `from`; returns errno. Sparse: the file system finds
  // blocks as they are written, so the space is shared by what volumes really hold, and a
  // write may meet a full file system (ENOSPC to the client). Preallocated: the blocks are
  // reserved now, so a full disk is an error of the create rather than of a guest's write.
  int grow(int fd, uint64_t from, uint64_t size) const {
    if (preallocate_) {
      int err = ::posix_fallocate(fd, static_cast<off_t>(from), static_cast<off_t>(size - from));
      if (err != EOPNOTSUPP && err != EINVAL) return err;  // else no fallocate here: sparse
    }
    return ::ftruncate(fd, static_cast<off_t>(size)) == 0 ? 0 : errno;
  }
  std::string path_of(const std::string& id) const { return (dir_ / (id + ".img")).string(); }
  fs::path dir_;
  bool preallocate_;
};

}  // namespace

StoreError VolumeStore::clone(const std::string& /*from*/, const std::string& /*to*/,
                              uint64_t /*size*/) {
  return StoreError::from_errno(ENOTSUP, "clone");
}

std::unique_ptr<VolumeStore> make_file_store(const std::string& dir, bool preallocate,
                                             StoreError& error) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    error = {ec, "create " + dir + ": " + ec.message()};
    return nullptr;
  }
  return std::make_unique<FileVolumeStore>(dir, preallocate);
}

}  // namespace shareblk::store
