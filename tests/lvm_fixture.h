// A real volume group on a loop device for tests, made and torn down by the test itself.
#pragma once

#include <string>

#include "tests/support.h"

namespace shareblk::testing {

// lvm2 `devices{}` config that sees only `loop_device`, keeping the host's disks out of tests.
std::string lvm_devices_config(const std::string& loop_device);
// The config every test command uses: that, and no device-mapper.
std::string lvm_test_config(const std::string& loop_device);

class LoopVolumeGroup {
 public:
  // A sparse backing file of `size` bytes under `dir`, a loop device on it, a PV and a VG
  // named `vg`. ok() is false (with why()) when any step fails; the destructor undoes
  // whatever was done, even after a failed test.
  LoopVolumeGroup(const TempDir& dir, const std::string& vg, uint64_t size);
  ~LoopVolumeGroup();
  LoopVolumeGroup(const LoopVolumeGroup&) = delete;
  LoopVolumeGroup& operator=(const LoopVolumeGroup&) = delete;

  bool ok() const { return why_.empty(); }
  const std::string& why() const { return why_; }
  const std::string& vg() const { return vg_; }
  const std::string& device() const { return loop_; }
  // What shareblkd's --lvm-config gets (it turns activation off by itself).
  std::string daemon_config() const { return lvm_devices_config(loop_); }
  // Runs an lvm2 tool with this group's config: {"lvs", ...}.
  RunResult lvm(std::vector<std::string> argv) const;

  // A logical volume's extents as lvm2 reports them: where each piece lives on the PV.
  struct Range {
    uint64_t logical;   // offset in the LV
    uint64_t physical;  // offset on the PV
    uint64_t length;
  };
  std::vector<Range> ranges(const std::string& lv) const;
  // The LV's bytes [offset, offset+length), read from the PV where lvm2 says they are.
  std::string read(const std::string& lv, uint64_t offset, size_t length) const;
  uint64_t size(const std::string& lv) const;

 private:
  std::string vg_;
  std::string file_;
  std::string loop_;
  bool vg_made_ = false;
  std::string why_;
};

// Whether this machine can run the LVM tests at all, and if not, why.
bool lvm_available(std::string& why);

}  // namespace shareblk::testing
