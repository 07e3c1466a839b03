// The embedded default store: one file per volume, sparse unless the daemon preallocates.
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "lvm/lvm2.h"
#include "lvm/volume_store.h"

namespace shareblk::lvm {

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

StoreError VolumeStore::save_definition(const std::string& /*id*/, DefinitionPart /*part*/,
                                        const std::string& /*text*/) {
  return {};
}

StoreError VolumeStore::read_record(const std::string& /*id*/, std::string& text,
                                    uint64_t& version) {
  text.clear();
  version = 0;
  return {};
}

StoreError VolumeStore::write_record(const std::string& /*id*/, const std::string& /*text*/,
                                     uint64_t /*version*/) {
  return {};
}

StoreError VolumeStore::watch_record(const std::string& /*id*/, const RecordChanged& /*changed*/) {
  return {};
}

void VolumeStore::unwatch_record(const std::string& /*id*/) {}

StoreError VolumeStore::notify_record(const std::string& /*id*/,
                                      std::chrono::milliseconds /*timeout*/) {
  return {};
}

StoreError VolumeStore::link_attachment(const std::string& /*attachment_id*/,
                                        const std::string& /*volume_id*/) {
  return {};
}

StoreError VolumeStore::linked_volume(const std::string& attachment_id,
                                      std::string& /*volume_id*/) {
  return StoreError::from_errno(ENOENT, "no shared link of attachment " + attachment_id);
}

StoreError VolumeStore::unlink_attachment(const std::string& /*attachment_id*/) {
  return {};
}

StoreError VolumeStore::load_definition(const std::string& id, DefinitionPart /*part*/,
                                        std::string& /*text*/) {
  return StoreError::from_errno(ENOENT, "no shared definition of volume " + id);
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

std::unique_ptr<VolumeStore> make_store(const std::string& spec, const std::string& state_dir,
                                        const std::string& lvm_config, bool preallocate,
                                        StoreError& error, const Lvm2* lvm2) {
  if (spec == "file") {
    return make_file_store((fs::path(state_dir) / "volumes").string(), preallocate, error);
  }
  if (spec.rfind("lvm:", 0) == 0 && spec.size() > 4) {
    return make_lvm_store(spec.substr(4), lvm2 != nullptr ? *lvm2 : local_lvm2(lvm_config), error);
  }
  error = {std::make_error_code(std::errc::invalid_argument),
           "--store wants 'file', 'lvm:VG' or 'rbd:POOL', got '" + spec + "'"};
  return nullptr;
}

}  // namespace shareblk::lvm
