// Internal to lvm/ and its unit tests: the LVM store with the way it runs lvm2 given, so that a
// test can drive it through a fake runner and see every command it issues.
#pragma once

#include <memory>
#include <string>

#include "lvm/command.h"
#include "lvm/volume_store.h"

namespace shareblk::lvm {

// Whether the kernel's device-mapper answers at `control`: the node opens and the DM_VERSION
// ioctl succeeds (which needs CAP_SYS_ADMIN, as lvm2 does). A node without the driver behind
// it -- lvm2's postinst makes /dev/mapper/control on kernels that have none -- does not.
bool device_mapper_answers(const std::string& control = "/dev/mapper/control");

// make_lvm_store() of volume_store.h, with every lvm2 command going through `run_lvm` instead
// of run_command, and `device_mapper` (device_mapper_answers() there) given instead of asked.
// Without device-mapper the store's config starts with global{activation=0}. Commands are
// argv[0], then "--config" and the store's config when it has any (lvm2 refuses an empty
// one), then the rest.
std::unique_ptr<VolumeStore> make_lvm_store(const std::string& vg, const std::string& config,
                                            CommandRunner run_lvm, bool device_mapper,
                                            StoreError& error);

}  // namespace shareblk::lvm
