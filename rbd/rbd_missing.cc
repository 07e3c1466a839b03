// The RBD store of a build without librbd.
#include <cerrno>

#include "rbd/rbd_store.h"

namespace shareblk::rbd {

bool available() {
  return false;
}

std::unique_ptr<lvm::VolumeStore> make_rbd_store(const ClusterOptions&, lvm::StoreError& error) {
  error = lvm::StoreError::from_errno(ENOTSUP, "this shareblkd was built without librbd");
  return nullptr;
}

}  // namespace shareblk::rbd
