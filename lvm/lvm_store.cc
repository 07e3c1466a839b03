// Volumes as LVM logical volumes `volume-<id>` in one volume group, driven through the lvm2
// command-line tools with JSON reports.
//
// Data path: where device-mapper has activated the LV, its block device. Where there is no
// device-mapper (containers), the LV's segment map from lvm2 -- physical volume, extent
// ranges, pe_start, extent size -- and I/O straight to the physical volumes at the mapped
// offsets. Only linear segments are served that way.
#include <fcntl.h>
#include <linux/dm-ioctl.h>
#include <spdlog/spdlog.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "lvm/lvm_store.h"

namespace shareblk::lvm {

namespace {

using Json = nlohmann::json;
constexpr char kTag[] = "shareblk";

StoreError failure(int code, std::string message) {
  return {std::error_code(code, std::generic_category()), std::move(message)};
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  size_t start = s.find_first_not_of(" \n");
  return start == std::string::npos ? std::string() : s.substr(start);
}

// lvm2's words for the failures an operator must tell apart.
StoreError classify(const std::string& what, const CommandResult& r) {
  if (r.exec_errno == ENOENT) return failure(ENOSYS, what + ": lvm2 is not installed");
  if (r.exec_errno != 0) return failure(r.exec_errno, what + ": cannot run lvm2");
  std::string message = trim(r.err);
  // Drop the warning lvm2 prints on every call when activation is off.
  for (size_t at; (at = message.find("WARNING: Activation disabled")) != std::string::npos;) {
    size_t end = message.find('\n', at);
    message.erase(at, end == std::string::npos ? std::string::npos : end - at + 1);
  }
  message = trim(message);
  const std::string text = what + ": " + (message.empty() ? "lvm2 failed" : message);
  if (message.find("nsufficient free") != std::string::npos ||
      message.find("free space") != std::string::npos) {
    return failure(ENOSPC, text);
  }
  // lvm2 2.03 says 'Failed to find logical volume "VG/LV"' for a missing LV and 'Volume group
  // "VG" not found' for a missing VG.
  if (message.find("not found") != std::string::npos ||
      message.find("Failed to find") != std::string::npos) {
    return failure(ENOENT, text);
  }
  if (message.find("already exists") != std::string::npos) return failure(EEXIST, text);
  return failure(EIO, text);
}

uint64_t as_u64(const Json& v) {
  if (v.is_string()) return std::stoull(v.get<std::string>());
  return v.get<uint64_t>();
}

class LvmVolumeStore final : public VolumeStore {
 public:
  LvmVolumeStore(std::string vg, Lvm2 lvm2) : vg_(std::move(vg)), lvm2_(std::move(lvm2)) {
    open_options_.open_device = lvm2_.open_device;
  }

  std::string kind() const override { return "lvm:" + vg_; }

  StoreError create(const std::string& id, uint64_t size) override {
    std::lock_guard lock(mutex_);
    // -Zn: lvm2 cannot zero an LV it cannot activate; deleted volumes are zeroed instead.
    CommandResult r = lvm({"lvcreate", "-y", "-Zn", "-an", "--addtag", kTag, "-n", lv(id), "-L",
                           std::to_string(size) + "b", vg_});
    if (r.status != 0) return classify("lvcreate " + vg_ + "/" + lv(id), r);
    return {};
  }

  StoreError extend(const std::string& id, uint64_t size) override {
    std::lock_guard lock(mutex_);
    // LVs are whole extents: the one a volume has may already hold the new size, and
    // lvextend refuses a resize that changes nothing.
    CommandResult current = lvm({"lvs", "--reportformat", "json", "--units", "b", "--nosuffix",
                                 "-o", "lv_size", vg_ + "/" + lv(id)});
    if (current.status != 0) return classify("lvs " + vg_ + "/" + lv(id), current);
    try {
      const Json report = Json::parse(current.out);
      if (as_u64(report.at("report").at(0).at("lv").at(0).at("lv_size")) >= size) return {};
    } catch (const std::exception& e) {
      return failure(EIO, std::string("lvs: unexpected report: ") + e.what());
    }
    CommandResult r = lvm({"lvextend", "-L", std::to_string(size) + "b", vg_ + "/" + lv(id)});
    if (r.status != 0) return classify("lvextend " + vg_ + "/" + lv(id), r);
    return {};
  }

  // The zeroing holds no lock of the store's: other volumes' creates, opens and removes go
  // on meanwhile. The LV keeps its extents until lvremove, so no other volume can get them.
  StoreError remove(const std::string& id, const Progress& progress) override {
    std::vector<backend::MappedSegment> segments;
    std::string block_device;
    {
      std::lock_guard lock(mutex_);
      if (StoreError e = layout(id, UINT64_MAX, segments, block_device)) {
        if (e.code.value() == ENOENT) return {};  // already gone: removing again is a no-op
        return e;
      }
    }
    if (StoreError e = zero(id, segments, block_device, progress)) return e;
    std::lock_guard lock(mutex_);
    CommandResult r = lvm({"lvremove", "-y", vg_ + "/" + lv(id)});
    if (r.status != 0) return classify("lvremove " + vg_ + "/" + lv(id), r);
    return {};
  }

  StoreError open(const std::string& id, uint64_t size,
                  std::shared_ptr<backend::Volume>& out) override {
    std::lock_guard lock(mutex_);
    std::vector<backend::MappedSegment> segments;
    std::string block_device;
    if (StoreError e = layout(id, size, segments, block_device)) return e;
    std::error_code ec;
    out = block_device.empty() ? backend::Volume::open_mapped(segments, ec, open_options_)
                               : backend::Volume::open(block_device, ec, open_options_);
    if (!out) return failure(ec.value(), "open " + lv(id) + ": " + ec.message());
    return {};
  }

  StoreError refresh(const std::string& id, uint64_t size, backend::Volume& volume) override {
    if (!volume.is_mapped())
      return StoreError{std::error_code(volume.refresh_size(), std::generic_category()),
                        "refresh " + lv(id)};
    std::lock_guard lock(mutex_);
    std::vector<backend::MappedSegment> segments;
    std::string block_device;
    if (StoreError e = layout(id, size, segments, block_device)) return e;
    if (int err = volume.remap(segments)) {
      return failure(err, "remap " + lv(id) + ": the new map does not extend the old one");
    }
    return {};
  }

  StoreError list(std::vector<std::string>& ids) override {
    std::lock_guard lock(mutex_);
    CommandResult r = lvm({"lvs", "--reportformat", "json", "-o", "lv_name,lv_tags", vg_});
    if (r.status != 0) return classify("lvs " + vg_, r);
    try {
      const Json report = Json::parse(r.out);  // named: a range-for would not keep a temporary
      for (const Json& row : report.at("report").at(0).at("lv")) {
        const std::string name = row.at("lv_name").get<std::string>();
        if (name.rfind("volume-", 0) != 0) continue;
        if (row.at("lv_tags").get<std::string>().find(kTag) == std::string::npos) {
          spdlog::error("lvm: {}/{} looks like a shareblk volume but lacks the '{}' tag", vg_, name,
                        kTag);
          continue;
        }
        ids.push_back(name.substr(7));
      }
    } catch (const std::exception& e) {
      return failure(EIO, std::string("lvs: unexpected report: ") + e.what());
    }
    return {};
  }

 private:
  static std::string lv(const std::string& id) { return "volume-" + id; }

  // Zeroes every extent, so that no later volume on them sees this one's data; a piece at a
  // time, telling `progress` after each.
  StoreError zero(const std::string& id, const std::vector<backend::MappedSegment>& segments,
                  const std::string& block_device, const Progress& progress) {
    std::error_code ec;
    std::shared_ptr<backend::Volume> volume =
        block_device.empty() ? backend::Volume::open_mapped(segments, ec, open_options_)
                             : backend::Volume::open(block_device, ec, open_options_);
    if (!volume) return failure(ec.value(), "open " + lv(id) + " to zero it: " + ec.message());
    backend::Handle handle(volume, backend::AttachMode::ReadWrite);
    const uint64_t total = volume->size();
    constexpr uint64_t kPiece = 64ULL << 20;
    for (uint64_t done = 0; done < total;) {
      if (progress && !progress(done, total)) {
        return failure(ECANCELED, "zeroing " + lv(id) + " stopped at " + std::to_string(done) +
                                      " of " + std::to_string(total) + " bytes");
      }
      const uint64_t length = std::min(kPiece, total - done);
      if (int err = handle.write_zeroes(length, done, backend::kNoHole)) {
        return failure(err, "zero " + lv(id) + ": " + std::generic_category().message(err));
      }
      done += length;
    }
    if (int err = handle.flush()) {
      return failure(err, "flush " + lv(id) + ": " + std::generic_category().message(err));
    }
    if (progress) progress(total, total);
    return {};
  }

  CommandResult lvm(const std::vector<std::string>& argv) { return lvm2_.run(argv); }

  // Where the bytes of `id`'s first `size` bytes are: its block device when device-mapper
  // has it, else the segment map. Refuses LVs that are not ours and segment types we cannot
  // map by hand.
  StoreError layout(const std::string& id, uint64_t size,
                    std::vector<backend::MappedSegment>& segments, std::string& block_device) {
    CommandResult r = lvm(
        {"lvs", "--reportformat", "json", "--units", "b", "--nosuffix", "--segments", "-o",
         "lv_name,lv_tags,lv_size,segtype,seg_start,seg_size,seg_pe_ranges", vg_ + "/" + lv(id)});
    if (r.status != 0) return classify("lvs " + vg_ + "/" + lv(id), r);
    CommandResult p = lvm({"pvs", "--reportformat", "json", "--units", "b", "--nosuffix", "-o",
                           "pv_name,pe_start,vg_extent_size", "-S", "vg_name=" + vg_});
    if (p.status != 0) return classify("pvs " + vg_, p);
    try {
      std::map<std::string, uint64_t> pe_start;
      uint64_t extent_size = 0;
      const Json pvs = Json::parse(p.out);  // named: a range-for would not keep a temporary
      for (const Json& pv : pvs.at("report").at(0).at("pv")) {
        pe_start[pv.at("pv_name").get<std::string>()] = as_u64(pv.at("pe_start"));
        extent_size = as_u64(pv.at("vg_extent_size"));
      }
      const Json rows = Json::parse(r.out).at("report").at(0).at("seg");
      if (rows.empty()) return failure(ENOENT, lv(id) + " not found in " + vg_);
      if (rows.at(0).at("lv_tags").get<std::string>().find(kTag) == std::string::npos) {
        return failure(EEXIST, vg_ + "/" + lv(id) + " exists but is not shareblk's (no '" +
                                   std::string(kTag) + "' tag); refusing to use it");
      }
      const std::string dev = "/dev/" + vg_ + "/" + lv(id);
      if (lvm2_.device_mapper && ::access(dev.c_str(), F_OK) == 0) {
        block_device = dev;
        return {};
      }
      uint64_t covered = 0;
      for (const Json& seg : rows) {
        const std::string type = seg.at("segtype").get<std::string>();
        if (type != "linear") {
          return failure(ENOTSUP, vg_ + "/" + lv(id) + " has a " + type +
                                      " segment; without device-mapper only linear LVs are served");
        }
        // "/dev/loop0:4-5": physical extents 4 to 5 of that PV.
        const std::string ranges = seg.at("seg_pe_ranges").get<std::string>();
        const size_t colon = ranges.rfind(':');
        const size_t dash = ranges.find('-', colon);
        if (colon == std::string::npos || dash == std::string::npos ||
            ranges.find(' ') != std::string::npos) {
          return failure(ENOTSUP, "unexpected extent range '" + ranges + "' in " + lv(id));
        }
        const std::string pv = ranges.substr(0, colon);
        const uint64_t first = std::stoull(ranges.substr(colon + 1, dash - colon - 1));
        const uint64_t last = std::stoull(ranges.substr(dash + 1));
        if (pe_start.count(pv) == 0 || extent_size == 0) {
          return failure(EIO, "no pe_start for " + pv + " in " + vg_);
        }
        const uint64_t start = as_u64(seg.at("seg_start"));
        uint64_t length = (last - first + 1) * extent_size;
        if (start != covered || length != as_u64(seg.at("seg_size"))) {
          return failure(EIO, "segments of " + lv(id) + " do not add up");
        }
        if (covered >= size) break;
        length = std::min(length, size - covered);
        segments.push_back({pv, pe_start[pv] + first * extent_size, length});
        covered += length;
      }
      if (size != UINT64_MAX && covered < size) {
        return failure(EIO, lv(id) + " is smaller (" + std::to_string(covered) +
                                " bytes) than its volume (" + std::to_string(size) + ")");
      }
    } catch (const std::exception& e) {
      return failure(EIO, std::string("lvm2: unexpected report: ") + e.what());
    }
    return {};
  }

  std::string vg_;
  Lvm2 lvm2_;
  backend::OpenOptions open_options_;  // through lvm2_.open_device
  std::mutex mutex_;                   // one lvm2 command of ours at a time
};

}  // namespace

bool device_mapper_answers(const std::string& control) {
  const int fd = ::open(control.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;
  dm_ioctl request{};
  request.version[0] = DM_VERSION_MAJOR;  // the kernel refuses another major, answers any minor
  request.data_size = sizeof request;
  const bool answered = ::ioctl(fd, DM_VERSION, &request) == 0;
  ::close(fd);
  return answered;
}

Lvm2 configured_lvm2(const std::string& config, CommandRunner run_lvm, bool device_mapper) {
  // lvm2 complains about every descriptor it inherits from whoever started the daemon; its
  // complaints would bury the message an operator needs.
  ::setenv("LVM_SUPPRESS_FD_WARNINGS", "1", 0);
  // Without device-mapper nothing can be activated: tell lvm2 not to try.
  const std::string full = device_mapper ? config : "global{activation=0} " + config;
  Lvm2 lvm2;
  lvm2.device_mapper = device_mapper;
  lvm2.run = [full, run_lvm = std::move(run_lvm)](const std::vector<std::string>& argv) {
    std::vector<std::string> with = argv;
    if (!full.empty() && !with.empty()) with.insert(with.begin() + 1, {"--config", full});
    return run_lvm(with);
  };
  return lvm2;
}

Lvm2 local_lvm2(const std::string& config) {
  return configured_lvm2(
      config, [](const std::vector<std::string>& argv) { return store::run_command(argv); },
      device_mapper_answers());
}

std::unique_ptr<VolumeStore> make_lvm_store(const std::string& vg, const std::string& config,
                                            CommandRunner run_lvm, bool device_mapper,
                                            StoreError& error) {
  return make_lvm_store(vg, configured_lvm2(config, std::move(run_lvm), device_mapper), error);
}

std::unique_ptr<VolumeStore> make_lvm_store(const std::string& vg, Lvm2 lvm2, StoreError& error) {
  auto store = std::make_unique<LvmVolumeStore>(vg, std::move(lvm2));
  std::vector<std::string> ids;
  if (StoreError e = store->list(ids)) {  // the VG must exist and lvm2 must answer
    error = e;
    return nullptr;
  }
  return store;
}

namespace {

// "volume-" and a lowercase UUID: the names the store gives its LVs (control/ makes the ids).
bool is_volume_lv(std::string_view name) {
  constexpr std::string_view kPrefix = "volume-";
  if (!name.starts_with(kPrefix)) return false;
  const std::string_view id = name.substr(kPrefix.size());
  if (id.size() != 36) return false;
  for (size_t i = 0; i < id.size(); ++i) {
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    const char c = id[i];
    if (dash ? c != '-' : !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool is_size_in_bytes(std::string_view text) {
  if (text.size() < 2 || text.size() > 21 || text.back() != 'b') return false;
  return std::all_of(text.begin(), text.end() - 1, [](char c) { return c >= '0' && c <= '9'; });
}

// The report fields the store asks lvs and pvs for.
bool is_report_fields(std::string_view list) {
  static const std::set<std::string_view> kFields = {
      "lv_name",  "lv_tags",       "lv_size", "segtype",  "seg_start",
      "seg_size", "seg_pe_ranges", "pv_name", "pe_start", "vg_extent_size"};
  while (true) {
    const size_t comma = list.find(',');
    if (kFields.count(list.substr(0, comma)) == 0) return false;
    if (comma == std::string_view::npos) return true;
    list.remove_prefix(comma + 1);
  }
}

}  // namespace

bool check_lvm2_request(const std::string& vg, const std::vector<std::string>& argv,
                        std::string& why) {
  const auto refuse = [&](const std::string& what) {
    why = what;
    return false;
  };
  if (argv.empty()) return refuse("an empty command");
  const std::string& tool = argv[0];
  static const std::set<std::string> kTools = {"lvs", "pvs", "lvcreate", "lvextend", "lvremove"};
  if (kTools.count(tool) == 0) return refuse("'" + tool + "' is not a command the LVM store runs");
  const std::string lv_prefix = vg + "/";
  std::vector<std::string> positional;
  bool named = false;
  bool selected = false;
  for (size_t i = 1; i < argv.size(); ++i) {
    const std::string& arg = argv[i];
    if (arg == "-y" || arg == "-Zn" || arg == "-an" || arg == "--nosuffix" || arg == "--segments") {
      continue;
    }
    const bool has_value = arg == "--addtag" || arg == "-n" || arg == "-L" ||
                           arg == "--reportformat" || arg == "--units" || arg == "-o" ||
                           arg == "-S";
    if (!has_value) {
      if (!arg.empty() && arg[0] == '-') return refuse("option '" + arg + "' is not the store's");
      positional.push_back(arg);
      continue;
    }
    if (++i == argv.size()) return refuse("option '" + arg + "' has no value");
    const std::string& value = argv[i];
    const bool ok =
        (arg == "--addtag" && value == kTag) || (arg == "-n" && (named = is_volume_lv(value))) ||
        (arg == "-L" && is_size_in_bytes(value)) || (arg == "--reportformat" && value == "json") ||
        (arg == "--units" && value == "b") || (arg == "-o" && is_report_fields(value)) ||
        (arg == "-S" && (selected = value == "vg_name=" + vg));
    if (!ok) {
      std::string what = "'" + arg;
      what.append("' with '").append(value).append("' is not the store's");
      return refuse(what);
    }
  }
  // Each tool acts on the group or on one of its volumes' LVs, never on anything else: an
  // lvremove of the bare group would remove every LV in it.
  const auto one_lv = positional.size() == 1 && positional[0].starts_with(lv_prefix) &&
                      is_volume_lv(std::string_view(positional[0]).substr(lv_prefix.size()));
  const auto the_group = positional.size() == 1 && positional[0] == vg;
  bool shaped = false;
  if (tool == "lvs") shaped = one_lv || the_group;
  if (tool == "pvs") shaped = positional.empty() && selected;
  if (tool == "lvcreate") shaped = the_group && named;
  if (tool == "lvextend" || tool == "lvremove") shaped = one_lv;
  if (!shaped) return refuse(tool + " may act on volume group " + vg + " and its volume LVs only");
  return true;
}

StoreError physical_volumes(const Lvm2& lvm2, const std::string& vg,
                            std::vector<std::string>& out) {
  CommandResult r =
      lvm2.run({"pvs", "--reportformat", "json", "-o", "pv_name", "-S", "vg_name=" + vg});
  if (r.status != 0) return classify("pvs " + vg, r);
  try {
    const Json report = Json::parse(r.out);  // named: a range-for would not keep a temporary
    for (const Json& pv : report.at("report").at(0).at("pv")) {
      out.push_back(pv.at("pv_name").get<std::string>());
    }
  } catch (const std::exception& e) {
    return failure(EIO, std::string("pvs: unexpected report: ") + e.what());
  }
  return {};
}

bool check_lvm2_device(const std::string& vg, const std::vector<std::string>& physical_volumes,
                       const std::string& path, int flags, std::string& why) {
  const int access = flags & O_ACCMODE;
  if ((flags & ~(O_ACCMODE | O_CLOEXEC | O_DIRECT)) != 0 ||
      (access != O_RDWR && access != O_RDONLY)) {
    why = "open flags " + std::to_string(flags) + " are not the store's";
    return false;
  }
  const std::string lv_prefix = "/dev/" + vg + "/";
  if (path.starts_with(lv_prefix) && is_volume_lv(std::string_view(path).substr(lv_prefix.size())))
    return true;
  if (std::find(physical_volumes.begin(), physical_volumes.end(), path) != physical_volumes.end())
    return true;
  why = path + " is neither a physical volume of " + vg + " nor one of its volumes' LVs";
  return false;
}

}  // namespace shareblk::lvm
