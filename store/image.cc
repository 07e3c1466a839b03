// Filling a new volume from a disk image: qemu-img reads the image's format and writes its
// contents into the volume's backing, so that shareblk holds no image-format code of its own.
#include <sys/stat.h>

#include <cerrno>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "store/command.h"
#include "store/volume_store.h"

namespace shareblk::store {

namespace {

using Json = nlohmann::json;

StoreError failure(int code, std::string message) {
  return {std::error_code(code, std::generic_category()), std::move(message)};
}

std::string last_line(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  const size_t nl = s.rfind('\n');
  return nl == std::string::npos ? s : s.substr(nl + 1);
}

StoreError qemu_img_failed(const std::string& what, const CommandResult& r) {
  if (r.exec_errno == ENOENT) return failure(ENOSYS, what + ": qemu-img is not installed");
  if (r.exec_errno != 0) return failure(r.exec_errno, what + ": cannot run qemu-img");
  return failure(EINVAL, what + ": " + last_line(r.err));
}

// How qemu-img names the image: the descriptor it got as its standard input, which the kernel
// reopens as the file the caller opened, whatever its path names by now.
constexpr const char* kInput = "/dev/stdin";

// An image-opts value: commas are doubled.
std::string opt_value(const std::string& s) {
  std::string out;
  for (char c : s) {
    out += c;
    if (c == ',') out += ',';
  }
  return out;
}

}  // namespace

StoreError inspect_image(const ImageSource& image, ImageInfo& out) {
  const std::string& path = image.path;
  struct stat st {};
  if (::fstat(image.fd, &st) != 0) {
    return failure(errno, path + ": " + std::generic_category().message(errno));
  }
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
    return failure(EINVAL, path + " is not a file or a block device");
  }
  // qemu-img probes the format itself.
  CommandResult r = run_command({"qemu-img", "info", "--output=json", kInput},
                                std::chrono::seconds(120), image.fd);
  if (r.status != 0) return qemu_img_failed("qemu-img info " + path, r);
  try {
    const Json info = Json::parse(r.out);
    out.format = info.at("format").get<std::string>();
    out.virtual_size = info.at("virtual-size").get<uint64_t>();
    if (out.format != "raw" && out.format != "qcow2") {
      return failure(EINVAL, path + " is a " + out.format + " image; raw or qcow2 only");
    }
    // The daemon would read those files too, which the caller did not name.
    if (info.contains("backing-filename")) {
      return failure(EINVAL, path + " has a backing file; flatten it first (qemu-img convert)");
    }
    const Json* data = info.contains("format-specific") ? &info["format-specific"] : nullptr;
    if (data != nullptr && data->contains("data") && (*data)["data"].contains("data-file")) {
      return failure(EINVAL, path + " has an external data file; flatten it first");
    }
  } catch (const std::exception& e) {
    return failure(EIO, "qemu-img info " + path + ": unexpected report: " + e.what());
  }
  if (out.virtual_size == 0) return failure(EINVAL, path + " is an empty image");
  return {};
}

StoreError fill_from_image(const backend::Volume& volume, const ImageSource& source,
                           const ImageInfo& info, const Progress& progress) {
  const std::string& image = source.path;
  const std::vector<backend::MappedSegment> layout = volume.layout();
  if (volume.remote()) {
    return failure(ENOTSUP, volume.path() + " is a remote image; qemu-img fills local ones only");
  }
  if (!volume.opened_by_path()) {
    return failure(ENOTSUP,
                   "the volume's devices were opened for the daemon by its privileged helper, "
                   "and qemu-img cannot open them; create the volume empty and write the image "
                   "through an attachment (qemu-img convert -n IMAGE nbd+unix://...)");
  }
  if (layout.size() != 1) {
    return failure(ENOTSUP, "the volume lies in " + std::to_string(layout.size()) +
                                " pieces; qemu-img can fill one only");
  }
  const backend::MappedSegment& target = layout[0];
  const char* driver = volume.is_block_device() || volume.is_mapped() ? "host_device" : "file";
  const std::string opts = "driver=raw,offset=" + std::to_string(target.offset) +
                           ",size=" + std::to_string(target.length) + ",file.driver=" + driver +
                           ",file.filename=" + opt_value(target.path);
  // -n: the backing exists; --target-is-zero: it reads as zeroes, so zeroes need no writing;
  // -t writeback: qemu-img syncs the target before it exits; -p: "(12.34/100%)" as it goes.
  // setpriv --pdeathsig: qemu-img dies with the daemon, so that none goes on writing into
  // extents that the next start's rollback frees for other volumes.
  std::string line;
  bool stopped = false;
  CommandResult r = run_command_watched(
      {"setpriv", "--pdeathsig", "KILL", "--", "qemu-img", "convert", "-p", "-n",
       "--target-is-zero", "-t", "writeback", "-f", info.format, "--target-image-opts", kInput,
       opts},
      [&](std::string_view chunk) {
        for (char c : chunk) {
          if (c != '\r' && c != '\n') {
            line += c;
            continue;
          }
          const size_t open = line.find('(');
          const size_t slash = line.find('/', open);
          if (open != std::string::npos && slash != std::string::npos && progress) {
            const double percent = std::strtod(line.c_str() + open + 1, nullptr);
            const auto done =
                static_cast<uint64_t>(percent / 100.0 * static_cast<double>(info.virtual_size));
            if (!progress(done, info.virtual_size)) stopped = true;
          }
          line.clear();
        }
        return !stopped;
      },
      source.fd);
  if (stopped) return failure(ECANCELED, "filling from " + image + " stopped");
  if (r.status != 0) return qemu_img_failed("qemu-img convert " + image, r);
  if (progress) progress(info.virtual_size, info.virtual_size);
  return {};
}

}  // namespace shareblk::store
