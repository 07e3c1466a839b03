// Internal to lvm/ and its unit tests: the LVM store with the way it runs lvm2 given, so that a
// test can drive it through a fake runner and see every command it issues.
#pragma once

#include <memory>
#include <string>

#include "lvm/lvm2.h"
#include "store/volume_store.h"

namespace shareblk::lvm {

// The Lvm2 that local_lvm2(config) makes, with every command going through `run_lvm` instead
// of run_command, and `device_mapper` (device_mapper_answers() there) given instead of asked.
// Without device-mapper the config starts with global{activation=0}. Commands are argv[0],
// then "--config" and the config when it has any (lvm2 refuses an empty one), then the rest.
Lvm2 configured_lvm2(const std::string& config, CommandRunner run_lvm, bool device_mapper);

// make_lvm_store(vg, configured_lvm2(config, run_lvm, device_mapper), error).
std::unique_ptr<VolumeStore> make_lvm_store(const std::string& vg, const std::string& config,
                                            CommandRunner run_lvm, bool device_mapper,
                                            StoreError& error);

}  // namespace shareblk::lvm
