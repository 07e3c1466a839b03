// state_backup: a consistent copy of the state database while the daemon serves
// (docs/state.md, "Backup and restore").
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "control/service.h"

namespace shareblk::control {
namespace {

// Syncs `path` (a file or a directory); errno's value, 0 when it worked.
int sync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return errno;
  const int err = ::fsync(fd) == 0 ? 0 : errno;
  ::close(fd);
  return err;
}

[[noreturn]] void fail(int err, const std::string& what) {
  throw ApiError(err == ENOSPC || err == EDQUOT ? "no_space" : "internal",
                 what + ": " + std::strerror(err));
}

}  // namespace

Json Service::state_backup(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (!target.is_absolute() || target.filename().empty()) {
    throw ApiError("invalid_params",
                   "'path' must be an absolute path to a file, not '" + path + "'");
  }
  std::error_code ec;
  if (!fs::is_directory(target.parent_path(), ec)) {
    throw ApiError("invalid_params", "no directory " + target.parent_path().string());
  }
  if (fs::symlink_status(target, ec).type() != fs::file_type::not_found) {
    throw ApiError("invalid_params", path + " exists: a backup never replaces a file");
  }
  // Written aside and renamed into place, so that `path` is a whole backup or nothing. Mode 0600:
  // it holds export names, which admit clients.
  const std::string partial = path + ".partial-" + random_hex(4);
  const int fd = ::open(partial.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) fail(errno, "cannot create " + partial);
  ::close(fd);
  auto discard = [&] { ::unlink(partial.c_str()); };
  try {
    db_.backup_into(partial);
  } catch (const DbError& e) {
    discard();
    throw ApiError(e.disk_full() ? "no_space" : "internal", e.what());
  }
  int err = sync_path(partial, O_RDONLY);
  if (err == 0 &&
      ::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0) {
    err = errno;
  }
  if (err != 0) {
    discard();
    if (err == EEXIST)
      throw ApiError("invalid_params", path + " exists: a backup never replaces a file");
    fail(err, "cannot write " + path);
  }
  if ((err = sync_path(target.parent_path().string(), O_RDONLY | O_DIRECTORY)) != 0) {
    fail(err, "cannot sync " + target.parent_path().string());
  }
  Json result{{"path", path},
              {"size", fs::file_size(target, ec)},
              {"schema_version", kSchemaVersion},
              {"taken_at", now_iso()}};
  {
    Database::Transaction tx(db_);
    result["volumes"] = tx.volumes().size();
    result["attachments"] = tx.attachments().size();
  }
  spdlog::info("control: state database backed up to {} ({} bytes)", path,
               result["size"].get<uint64_t>());
  return result;
}

}  // namespace shareblk::control
