#include "tests/lvm_fixture.h"

#include <unistd.h>

namespace shareblk::testing {

std::string lvm_devices_config(const std::string& loop_device) {
  return "devices{filter=[\"a|^" + loop_device +
         "$|\",\"r|.*|\"] obtain_device_list_from_udev=0 use_devicesfile=0}";
}

std::string lvm_test_config(const std::string& loop_device) {
  return "global{activation=0} " + lvm_devices_config(loop_device);
}

bool lvm_available(std::string& why) {
  if (!is_root()) {
    why = "LVM tests need root (loop devices, pvcreate)";
    return false;
  }
  for (const char* tool : {"losetup", "pvcreate", "vgcreate", "lvs"}) {
    if (!have_program(tool)) {
      why = std::string("LVM tests need ") + tool + " (packages lvm2, util-linux)";
      return false;
    }
  }
  if (::access("/dev/loop-control", F_OK) != 0) {
    why = "LVM tests need loop devices (/dev/loop-control is missing)";
    return false;
  }
  return true;
}

LoopVolumeGroup::LoopVolumeGroup(const TempDir& dir, const std::string& vg, uint64_t size)
    : vg_(vg), file_(dir / (vg + ".pv")) {
  make_file(file_, size);
  RunResult r = run({"losetup", "--find", "--show", file_});
  if (r.status != 0) {
    why_ = "losetup: " + r.output;
    return;
  }
  loop_ = r.output.substr(0, r.output.find('\n'));
  r = lvm({"pvcreate", "-y", loop_});
  if (r.status != 0) {
    why_ = "pvcreate: " + r.output;
    return;
  }
  r = lvm({"vgcreate", vg_, loop_});
  if (r.status != 0) {
    why_ = "vgcreate: " + r.output;
    return;
  }
  vg_made_ = true;
}

LoopVolumeGroup::~LoopVolumeGroup() {
  if (vg_made_) lvm({"vgremove", "-f", "-y", vg_});
  if (!loop_.empty()) {
    lvm({"pvremove", "-f", "-y", loop_});
    run({"losetup", "-d", loop_});
  }
  ::unlink(file_.c_str());
}

RunResult LoopVolumeGroup::lvm(std::vector<std::string> argv) const {
  argv.insert(argv.begin() + 1, {"--config", lvm_test_config(loop_)});
  return run(argv);
}

}  // namespace shareblk::testing
