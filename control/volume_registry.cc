#include "control/volume_registry.h"

#include <spdlog/spdlog.h>

#include <set>

#include "control/api_error.h"

namespace shareblk::control {

namespace {

bool is_missing(const lvm::StoreError& e) {
  return e.code.value() == ENOENT;
}

ApiError store_error(const lvm::StoreError& e) {
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

void VolumeRegistry::create(const std::string& id, uint64_t size) {
  if (lvm::StoreError e = store_.create(id, size)) throw store_error(e);
}

void VolumeRegistry::extend(const std::string& id, uint64_t size) {
  if (lvm::StoreError e = store_.extend(id, size)) throw store_error(e);
}

void VolumeRegistry::refresh(const std::string& id, uint64_t size) {
  std::lock_guard lock(open_mutex_);
  auto it = open_.find(id);
  if (it == open_.end()) return;
  if (lvm::StoreError e = store_.refresh(id, size, *it->second)) {
    // New connections reopen it; live ones keep the old size.
    spdlog::error("control: volume {} grew but its open handle did not: {}", id, e.message);
    open_.erase(it);
  }
}

void VolumeRegistry::remove(const std::string& id) {
  {
    std::lock_guard lock(open_mutex_);
    open_.erase(id);
  }
  // Already gone is removed: a delete that a crash interrupted is finished so.
  if (lvm::StoreError e = store_.remove(id); e && !is_missing(e)) throw store_error(e);
}

std::shared_ptr<backend::Volume> VolumeRegistry::open(const std::string& id, uint64_t size) {
  std::lock_guard lock(open_mutex_);
  auto& v = open_[id];
  if (!v) {
    if (lvm::StoreError e = store_.open(id, size, v)) {
      open_.erase(id);
      spdlog::error("control: cannot open volume {}: {}", id, e.message);
      return nullptr;
    }
  }
  return v;
}

void VolumeRegistry::reconcile(
    const std::vector<std::pair<std::string, std::string>>& known_ids_and_names) {
  std::vector<std::string> ids;
  if (lvm::StoreError e = store_.list(ids)) {
    spdlog::error("control: cannot list the {} store: {}", store_.kind(), e.message);
    return;
  }
  const std::set<std::string> backed(ids.begin(), ids.end());
  std::set<std::string> known;
  for (const auto& [id, name] : known_ids_and_names) {
    known.insert(id);
    if (backed.count(id) == 0) {
      spdlog::error("control: volume {} ({}) has no backing in the {} store", id, name,
                    store_.kind());
    }
  }
  for (const std::string& id : ids) {
    if (known.count(id) == 0) {
      spdlog::warn("control: the {} store holds {} which no volume owns; left untouched",
                   store_.kind(), id);
    }
  }
}

}  // namespace shareblk::control
