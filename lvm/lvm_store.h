// Internal to lvm/ and its unit tests: the LVM store with the way it runs lvm2 given, so that a
// test can drive it through a fake runner and see every command it issues.
#pragma once

#include <memory>
#include <string>

#include "lvm/command.h"
#include "lvm/volume_store.h"

namespace shareblk::lvm {

// make_lvm_store() of volume_store.h, with every lvm2 command going through `run_lvm` instead
// of run_command. Commands are argv[0], then "--config" and the store's config, then the rest.
std::unique_ptr<VolumeStore> make_lvm_store(const std::string& vg, const std::string& config,
                                            CommandRunner run_lvm, StoreError& error);

}  // namespace shareblk::lvm
