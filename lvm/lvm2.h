// lvm2: how the LVM store reaches lvm2's tools and its volume group's devices. Both need root.
// A daemon that runs as root reaches them itself (local_lvm2); one that runs as its own user
// asks the privileged helper (privsep/), which runs only the commands check_lvm2_request()
// allows and opens only the devices check_lvm2_device() allows.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "store/command.h"
#include "store/volume_store.h"

namespace shareblk::lvm {

using store::CommandResult;
using store::CommandRunner;
using store::Progress;
using store::StoreError;
using store::VolumeStore;

struct Lvm2 {
  // Runs one of lvm2's tools, argv[0] being the tool ("lvs", "lvcreate", ...); whoever runs it
  // adds the operator's --config (and global{activation=0} where there is no device-mapper).
  CommandRunner run;
  // Opens a physical volume of the group or one of its LVs' devices; empty: open(2).
  backend::DeviceOpener open_device;
  // Whether device-mapper answers, so that lvm2 activates LVs and /dev/VG/LV may exist.
  bool device_mapper = false;
};

// Whether the kernel's device-mapper answers at `control`: the node opens and the DM_VERSION
// ioctl succeeds (which needs CAP_SYS_ADMIN, as lvm2 does). A node without the driver behind
// it -- lvm2's postinst makes /dev/mapper/control on kernels that have none -- does not.
bool device_mapper_answers(const std::string& control = "/dev/mapper/control");

// lvm2 run by this process, each command with `config` added to its --config.
Lvm2 local_lvm2(const std::string& config);

// Whether `argv` is one of the commands the LVM store issues for volume group `vg` (and so one
// the privileged helper may run as root): lvs, pvs, lvcreate, lvextend or lvremove, each with
// the store's own options, on `vg` or its `volume-<uuid>` LVs alone, never with --config.
// False with `why` saying what was refused.
bool check_lvm2_request(const std::string& vg, const std::vector<std::string>& argv,
                        std::string& why);

// Whether `path` is a device the LVM store of `vg` may open: /dev/<vg>/volume-<uuid>, or one of
// `physical_volumes` (the group's, as pvs reports them). `flags` may only be O_RDWR or
// O_RDONLY with O_CLOEXEC and O_DIRECT.
bool check_lvm2_device(const std::string& vg, const std::vector<std::string>& physical_volumes,
                       const std::string& path, int flags, std::string& why);

// The physical volumes of `vg`, as pvs names them: what check_lvm2_device() is given.
StoreError physical_volumes(const Lvm2& lvm2, const std::string& vg, std::vector<std::string>& out);

// Volumes as logical volumes `volume-<id>` tagged "shareblk" in volume group `vg`, reached
// through `lvm2`.
std::unique_ptr<VolumeStore> make_lvm_store(const std::string& vg, Lvm2 lvm2, StoreError& error);

}  // namespace shareblk::lvm
