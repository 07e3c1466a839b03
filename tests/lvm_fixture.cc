#include "tests/lvm_fixture.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

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

namespace {
// lvm2 prints warnings before its JSON report.
nlohmann::json report(const RunResult& r) {
  const size_t start = r.output.find('{');
  if (r.status != 0 || start == std::string::npos) {
    throw std::runtime_error("lvm2 failed: " + r.output);
  }
  return nlohmann::json::parse(r.output.substr(start))["report"][0];
}
uint64_t number(const nlohmann::json& v) {
  return std::stoull(v.get<std::string>());
}
}  // namespace

std::vector<LoopVolumeGroup::Range> LoopVolumeGroup::ranges(const std::string& lv) const {
  nlohmann::json pv = report(lvm({"pvs", "--reportformat", "json", "--units", "b", "--nosuffix",
                                  "-o", "pe_start,vg_extent_size", loop_}))["pv"][0];
  nlohmann::json segs =
      report(lvm({"lvs", "--reportformat", "json", "--units", "b", "--nosuffix", "--segments", "-o",
                  "seg_start,seg_size,seg_pe_ranges", vg_ + "/" + lv}))["seg"];
  const uint64_t pe_start = number(pv["pe_start"]);
  const uint64_t extent = number(pv["vg_extent_size"]);
  std::vector<Range> out;
  for (const auto& seg : segs) {
    const std::string r = seg["seg_pe_ranges"].get<std::string>();  // "/dev/loop0:4-5"
    const uint64_t first = std::stoull(r.substr(r.rfind(':') + 1));
    out.push_back({number(seg["seg_start"]), pe_start + first * extent, number(seg["seg_size"])});
  }
  return out;
}

std::string LoopVolumeGroup::read(const std::string& lv, uint64_t offset, size_t length) const {
  std::string out;
  for (const Range& r : ranges(lv)) {
    if (out.size() == length) break;
    if (offset >= r.logical + r.length || offset < r.logical) continue;
    const uint64_t n = std::min<uint64_t>(length - out.size(), r.logical + r.length - offset);
    out += read_file(loop_, r.physical + (offset - r.logical), n);
    offset += n;
  }
  return out;
}

uint64_t LoopVolumeGroup::size(const std::string& lv) const {
  return number(report(lvm({"lvs", "--reportformat", "json", "--units", "b", "--nosuffix", "-o",
                            "lv_size", vg_ + "/" + lv}))["lv"][0]["lv_size"]);
}

}  // namespace shareblk::testing
