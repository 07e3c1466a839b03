// lvm: where volumes' bytes live. A VolumeStore creates, grows, deletes and opens the backing
// of a volume by id. The embedded default keeps one file per volume; the LVM store keeps one
// logical volume per volume. The control plane's SQLite state is the source of truth for
// volume metadata; a store only holds bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "backend/backend.h"

namespace shareblk::lvm {

// A store operation's failure: an errno-style code (ENOSPC, ENOENT, EEXIST, or anything for
// "internal") and the words an operator needs, such as lvm2's message.
struct StoreError {
  std::error_code code;
  std::string message;
  explicit operator bool() const { return static_cast<bool>(code); }
};

class VolumeStore {
 public:
  virtual ~VolumeStore() = default;

  // "file" or "lvm:VG".
  virtual std::string kind() const = 0;

  // Makes backing for `size` bytes that reads as zeroes. Fails with EEXIST if `id` has one.
  virtual StoreError create(const std::string& id, uint64_t size) = 0;
  // Grows the backing to `size` bytes; the new bytes read as zeroes.
  virtual StoreError extend(const std::string& id, uint64_t size) = 0;
  // Discards the backing; its bytes are never visible to a later volume.
  virtual StoreError remove(const std::string& id) = 0;
  // Opens the first `size` bytes of the backing for I/O.
  virtual StoreError open(const std::string& id, uint64_t size,
                          std::shared_ptr<backend::Volume>& out) = 0;
  // After extend(): makes an open volume see `size` bytes.
  virtual StoreError refresh(const std::string& id, uint64_t size, backend::Volume& volume) = 0;
  // Ids that have backing, to reconcile with the control plane's state at start-up.
  virtual StoreError list(std::vector<std::string>& ids) = 0;
};

// Volumes as files `<dir>/<id>.img`, their space reserved at create (posix_fallocate).
std::unique_ptr<VolumeStore> make_file_store(const std::string& dir, StoreError& error);

// Volumes as logical volumes `volume-<id>` tagged "shareblk" in volume group `vg`. lvm2 runs
// with `config` added to its --config (and activation off where there is no device-mapper).
std::unique_ptr<VolumeStore> make_lvm_store(const std::string& vg, const std::string& config,
                                            StoreError& error);

// Parses `--store`: "file" (volumes under `state_dir`/volumes) or "lvm:VG".
std::unique_ptr<VolumeStore> make_store(const std::string& spec, const std::string& state_dir,
                                        const std::string& lvm_config, StoreError& error);

}  // namespace shareblk::lvm
