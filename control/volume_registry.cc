#include "control/volume_registry.h"

#include <cstring>

#include <spdlog/spdlog.h>

#include <set>

#include "control/api_error.h"
#include "control/params.h"

namespace shareblk::control {

namespace {

bool is_missing(const store::StoreError& e) {
  return e.code.value() == ENOENT;
}

ApiError store_error(const store::StoreError& e) {
  const int code = e.code.value();
  if (code == ENOSPC || code == EDQUOT || code == EFBIG) return ApiError("no_space", e.message);
  if (code == ENOENT) return ApiError("not_found", e.message);
  return ApiError("internal", e.message);
}

}  // namespace

VolumeLock VolumeRegistry::lock(const std::string& volume_id) {
  std::shared_ptr<std::mutex> m;
  {
    std::lock_guard table(locks_mutex_);
    std::weak_ptr<std::mutex>& entry = locks_[volume_id];
    m = entry.lock();
    if (!m) {
      // Every holder and waiter shares one mutex; the last one out removes the entry.
      m = std::shared_ptr<std::mutex>(new std::mutex, [this, volume_id](std::mutex* last) {
        {
          std::lock_guard inner(locks_mutex_);
          auto it = locks_.find(volume_id);
          if (it != locks_.end() && it->second.expired()) locks_.erase(it);
        }
        delete last;
      });
      entry = m;
    }
  }
  return VolumeLock(std::move(m));  // waits outside the table's lock
}

size_t VolumeRegistry::lock_count() const {
  std::lock_guard table(locks_mutex_);
  return locks_.size();
}

void VolumeRegistry::require_local(const std::string& what) const {
  if (!store_.local()) {
    throw ApiError("not_supported", what + " is not supported on the " + store_.kind() +
                                        " store (docs/scale-out.md)");
  }
}

void VolumeRegistry::create(const std::string& id, uint64_t size) {
  if (store::StoreError e = store_.create(id, size)) throw store_error(e);
}

void VolumeRegistry::extend(const std::string& id, uint64_t size) {
  if (store::StoreError e = store_.extend(id, size)) {
    if (is_missing(e)) set_missing(id, e.message);
    throw store_error(e);
  }
}

void VolumeRegistry::refresh(const std::string& id, uint64_t size) {
  std::lock_guard lock(open_mutex_);
  auto it = open_.find(id);
  if (it == open_.end()) return;
  if (store::StoreError e = store_.refresh(id, size, *it->second)) {
    // New connections reopen it; live ones keep the old size.
    spdlog::error("control: volume {} grew but its open handle did not: {}", id, e.message);
    open_.erase(it);
  }
}

void VolumeRegistry::close(const std::string& id) {
  std::lock_guard lock(open_mutex_);
  open_.erase(id);
}

void VolumeRegistry::remove(const std::string& id, const store::Progress& progress) {
  close(id);
  // Already gone is removed: a delete that a crash interrupted is finished so, and so is a
  // volume whose backing went missing.
  if (store::StoreError e = store_.remove(id, progress); e && !is_missing(e)) throw store_error(e);
  std::lock_guard lock(missing_mutex_);
  missing_.erase(id);
}

void VolumeRegistry::fill(const std::string& id, uint64_t size, const store::ImageSource& image,
                          const store::ImageInfo& info, const store::Progress& progress) {
  std::shared_ptr<backend::Volume> volume;  // its own: no connection has it while it fills
  if (store::StoreError e = store_.open(id, size, volume)) throw store_error(e);
  if (store::StoreError e = store::fill_from_image(*volume, image, info, progress)) {
    throw store_error(e);
  }
}

void VolumeRegistry::copy(const std::string& from, uint64_t length, const std::string& to,
                          uint64_t size, const store::Progress& progress) {
  const store::StoreError cloned = store_.clone(from, to, size);
  if (!cloned) {
    if (progress) progress(size, size);
    return;
  }
  if (cloned.code.value() != ENOTSUP) throw store_error(cloned);
  create(to, size);
  std::shared_ptr<backend::Volume> source;  // their own handles: no connection has the target
  std::shared_ptr<backend::Volume> target;
  if (store::StoreError e = store_.open(from, length, source)) throw store_error(e);
  if (store::StoreError e = store_.open(to, size, target)) throw store_error(e);
  if (store::StoreError e = store::copy_volume(*source, *target, length, progress)) {
    throw store_error(e);
  }
}

std::shared_ptr<backend::Volume> VolumeRegistry::open(const std::string& id, uint64_t size) {
  std::lock_guard lock(open_mutex_);
  auto& v = open_[id];
  if (!v) {
    if (store::StoreError e = store_.open(id, size, v)) {
      open_.erase(id);
      spdlog::error("control: cannot open volume {}: {}", id, e.message);
      if (is_missing(e)) set_missing(id, e.message);
      return nullptr;
    }
  }
  return v;
}

std::optional<std::string> VolumeRegistry::check(const std::string& id, uint64_t size) {
  std::shared_ptr<backend::Volume> fresh;
  const store::StoreError e = store_.open(id, size, fresh);  // outside the locks: it may be slow
  if (e && !is_missing(e)) throw store_error(e);
  {
    std::lock_guard lock(open_mutex_);
    if (e) {
      open_.erase(id);  // its connections keep it; new ones are refused
    } else if (!store_.local()) {
      // Kept open only by its users (close()): another gateway may want to remove it.
    } else if (auto& cached = open_[id]; !cached) {
      cached = std::move(fresh);  // saves the next user an open
    }
  }
  if (e) return set_missing(id, e.message);
  std::lock_guard lock(missing_mutex_);
  missing_.erase(id);
  return std::nullopt;
}

std::optional<std::string> VolumeRegistry::missing(const std::string& id) const {
  std::lock_guard lock(missing_mutex_);
  auto it = missing_.find(id);
  if (it == missing_.end()) return std::nullopt;
  return it->second;
}

std::string VolumeRegistry::set_missing(const std::string& id, const std::string& why) {
  std::lock_guard lock(missing_mutex_);
  auto [it, added] = missing_.insert_or_assign(
      id, "its backing is missing from the " + store_.kind() + " store (" + why + ")");
  if (added) spdlog::error("control: volume {}: {}", id, it->second);
  return it->second;
}

void VolumeRegistry::reconcile(
    const std::vector<std::pair<std::string, std::string>>& known_ids_and_names,
    const std::set<std::string>& deleting) {
  std::vector<std::string> ids;
  if (store::StoreError e = store_.list(ids)) {
    spdlog::error("control: cannot list the {} store: {}", store_.kind(), e.message);
    return;
  }
  const std::set<std::string> backed(ids.begin(), ids.end());
  std::set<std::string> known;
  for (const auto& [id, name] : known_ids_and_names) {
    known.insert(id);
    if (backed.count(id) == 0 && deleting.count(id) == 0) {
      spdlog::error(
          "control: volume {} ({}) has no backing in the {} store; its status is "
          "error",
          id, printable(name), store_.kind());
      std::lock_guard lock(missing_mutex_);
      missing_[id] = "its backing is missing from the " + store_.kind() + " store (at start-up)";
    }
  }
  for (const std::string& id : ids) {
    if (known.count(id) == 0) {
      spdlog::warn("control: the {} store holds {} which no volume owns; left untouched",
                   store_.kind(), id);
    }
  }
}

std::vector<std::pair<std::string, std::string>> VolumeRegistry::flush_all() {
  std::map<std::string, std::shared_ptr<backend::Volume>> open;
  {
    std::lock_guard lock(open_mutex_);
    open = open_;
  }
  std::vector<std::pair<std::string, std::string>> failed;
  for (const auto& [id, volume] : open) {
    const int err = backend::Handle(volume, backend::AttachMode::ReadOnly).flush();
    if (err != 0) failed.emplace_back(id, std::strerror(err));
  }
  return failed;
}

}  // namespace shareblk::control
