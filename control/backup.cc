// state_backup: a consistent copy of the state database while the daemon serves
// (docs/state.md, "Backup and restore").
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "control/service.h"
#include "rights/rights.h"

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

// Runs as the caller (rights::run_as, after fork: system calls only): copies the finished
// backup from `from` into a new file `partial` that the caller creates, mode 0600, syncs it and
// renames it to `path` (never over a file), then syncs the directory. 0 or an errno value.
struct CopyOut {
  int from;
  const char* partial;
  const char* path;
  const char* directory;

  int operator()() const {
    const int out = ::open(partial, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (out < 0) return errno;
    int err = 0;
    off_t offset = 0;
    for (;;) {
      const ssize_t n = ::sendfile(out, from, &offset, 1 << 30);
      if (n == 0) break;
      if (n < 0 && errno != EINTR) {
        err = errno;
        break;
      }
    }
    if (err == 0 && ::fsync(out) != 0) err = errno;
    ::close(out);
    if (err == 0 && ::renameat2(AT_FDCWD, partial, AT_FDCWD, path, RENAME_NOREPLACE) != 0) {
      err = errno;
    }
    if (err != 0) {
      ::unlink(partial);
      return err;
    }
    return sync_path(directory, O_RDONLY | O_DIRECTORY);
  }
};

}  // namespace

Json Service::state_backup(const std::string& path, const rights::Credentials& writer) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (!target.is_absolute() || target.filename().empty()) {
    throw ApiError("invalid_params",
                   "'path' must be an absolute path to a file, not '" + path + "'");
  }
  // SQLite writes the copy into the state directory, the daemon's own; the caller's file gets
  // it from there with the caller's rights, so the daemon never creates, replaces or writes a
  // file where the caller could not (docs/security.md).
  const std::string own = (state_dir_ / ("backup-" + random_hex(4) + ".tmp")).string();
  const int created = ::open(own.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (created < 0) fail(errno, "cannot create " + own);
  ::close(created);
  struct Discard {
    const std::string& file;
    ~Discard() { ::unlink(file.c_str()); }
  } discard{own};
  try {
    db_.backup_into(own);
  } catch (const DbError& e) {
    throw ApiError(e.disk_full() ? "no_space" : "internal", e.what());
  }
  const int from = ::open(own.c_str(), O_RDONLY | O_CLOEXEC);
  if (from < 0) fail(errno, "cannot read " + own);
  const std::string partial = path + ".partial-" + random_hex(4);
  const std::string directory = target.parent_path().string();
  const int err =
      rights::run_as(writer, CopyOut{from, partial.c_str(), path.c_str(), directory.c_str()});
  ::close(from);
  switch (err) {
    case 0:
      break;
    case EEXIST:
      throw ApiError("invalid_params", path + " exists: a backup never replaces a file");
    case ENOENT:
    case ENOTDIR:
      throw ApiError("invalid_params", "no directory " + directory);
    case EACCES:
    case EPERM:
    case EROFS:
      throw ApiError("forbidden", rights::refusal(writer, "write", path, err));
    default:
      fail(err, "cannot write " + path);
  }
  std::error_code ec;
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
