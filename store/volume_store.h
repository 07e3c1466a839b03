// store: where volumes' bytes live. A VolumeStore creates, grows, deletes and opens the backing
// of a volume by id, and holds nothing but bytes: the control plane's SQLite state is the source
// of truth for volume metadata. This part keeps the interface and the embedded default, one file
// per volume; lvm/ keeps a logical volume per volume, rbd/ an RBD image. What gateways that
// share a store keep beside the bytes to coordinate is another interface (store/gateways.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "backend/backend.h"

namespace shareblk::store {

// A store operation's failure: an errno-style code (ENOSPC, ENOENT, EEXIST, or anything for
// "internal") and the words an operator needs, such as lvm2's message.
struct StoreError {
  std::error_code code;
  std::string message;
  explicit operator bool() const { return static_cast<bool>(code); }
  // `err`, said as "what: strerror".
  static StoreError from_errno(int err, const std::string& what) {
    return {std::error_code(err, std::generic_category()),
            what + ": " + std::generic_category().message(err)};
  }
};

// Told how far a long operation has come: `done` of `total` bytes. Returns false to stop it
// (the daemon is stopping): the operation then fails with ECANCELED and may be run again.
using Progress = std::function<bool(uint64_t done, uint64_t total)>;

class VolumeStore {
 public:
  virtual ~VolumeStore() = default;

  // "file", "lvm:VG" or "rbd:POOL".
  virtual std::string kind() const = 0;
  // True when a volume's bytes lie in local files or devices (Volume::layout()): what
  // fill_from_image (qemu-img) and the nbdkit plugin open. False for a remote store, whose
  // volumes copy_volume still copies (through the image's own calls).
  virtual bool local() const { return true; }

  // Makes backing for `size` bytes that reads as zeroes. Fails with EEXIST if `id` has one.
  virtual StoreError create(const std::string& id, uint64_t size) = 0;
  // Grows the backing to `size` bytes; the new bytes read as zeroes.
  virtual StoreError extend(const std::string& id, uint64_t size) = 0;
  // Discards the backing; its bytes are never visible to a later volume. May take long (the
  // LVM store zeroes every extent first), telling `progress`; other volumes' calls go on
  // meanwhile. Removing backing that is already gone succeeds.
  virtual StoreError remove(const std::string& id, const Progress& progress) = 0;
  // Opens the first `size` bytes of the backing for I/O.
  virtual StoreError open(const std::string& id, uint64_t size,
                          std::shared_ptr<backend::Volume>& out) = 0;
  // After extend(): makes an open volume see `size` bytes.
  virtual StoreError refresh(const std::string& id, uint64_t size, backend::Volume& volume) = 0;
  // Ids that have backing, to reconcile with the control plane's state at start-up.
  virtual StoreError list(std::vector<std::string>& ids) = 0;
  // Makes backing `to` of `size` bytes (at least `from`'s) that holds `from`'s bytes by sharing
  // its blocks (a reflink), in a moment whatever the size; the rest reads as zeroes. ENOTSUP
  // where the store or its file system cannot: the caller then creates `to` and copies
  // (copy_volume). EEXIST if `to` has backing.
  virtual StoreError clone(const std::string& from, const std::string& to, uint64_t size);
};

// Copies the first `length` bytes of `from` into `to`, a freshly made backing that reads as
// zeroes: what reads as zeroes (holes, zero blocks) is skipped, not written, so a sparse volume
// stays sparse. Either may be a remote image (read and written with its synchronous calls,
// its holes from its allocation). Syncs `to` before it returns; tells `progress` (ECANCELED
// when it says stop).
StoreError copy_volume(const backend::Volume& from, const backend::Volume& to, uint64_t length,
                       const Progress& progress);

// Volumes as files `<dir>/<id>.img`: sparse (blocks are allocated as they are written, so a
// write may find the file system full), or with every block reserved at create and extend
// when `preallocate` (posix_fallocate; a full disk is then an error of the create).
std::unique_ptr<VolumeStore> make_file_store(const std::string& dir, bool preallocate,
                                             StoreError& error);

// A disk image that a new volume is filled from (volume_create's `from_image`).
struct ImageInfo {
  std::string format;  // "raw" or "qcow2", as qemu-img finds it
  uint64_t virtual_size = 0;
};

// The image a caller named, already open for reading with the caller's rights
// (rights::open_as). qemu-img reads it through this descriptor alone (as its standard input),
// never by the path, which the caller could point elsewhere meanwhile: what the daemon reads is
// what the caller could read.
struct ImageSource {
  std::string path;  // as the caller named it: for messages
  int fd = -1;       // a regular file or a block device; its owner closes it
};

// Reads what `qemu-img info` says of the image. EINVAL when it is not a regular file or block
// device, qemu-img cannot read it, it is of another format than raw or qcow2, or it has a
// backing or external data file (filling would then read a file the caller did not name).
StoreError inspect_image(const ImageSource& image, ImageInfo& out);

// Writes the image's contents into the first bytes of `volume` (a freshly made one: it must
// read as zeroes) with `qemu-img convert`, telling `progress`. ENOTSUP when the volume's bytes
// are not in one file, device or segment (an LV mapped onto several pieces).
StoreError fill_from_image(const backend::Volume& volume, const ImageSource& image,
                           const ImageInfo& info, const Progress& progress);

}  // namespace shareblk::store
