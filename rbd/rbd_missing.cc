// The RBD store of a build without librbd.
#include <cerrno>

#include "rbd/rbd_store.h"

namespace shareblk::rbd {

bool available() {
  return false;
}

std::unique_ptr<store::VolumeStore> make_rbd_store(const ClusterOptions&,
                                                   std::unique_ptr<store::Gateways>& /*gateways*/,
                                                   store::StoreError& error) {
  error = store::StoreError::from_errno(ENOTSUP, "this shareblkd was built without librbd");
  return nullptr;
}

}  // namespace shareblk::rbd
