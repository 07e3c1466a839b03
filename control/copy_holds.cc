#include "control/copy_holds.h"

#include <functional>
#include <utility>

#include "control/api_error.h"

namespace shareblk::control {

namespace {

// Undoes what it was made for when the last holder lets go. Made in place only: a copy would
// undo it twice.
class OnRelease {
 public:
  explicit OnRelease(std::function<void()> release) : release_(std::move(release)) {}
  ~OnRelease() { release_(); }
  OnRelease(const OnRelease&) = delete;
  OnRelease& operator=(const OnRelease&) = delete;

 private:
  std::function<void()> release_;
};

}  // namespace

std::shared_ptr<void> CopyHolds::quiesce(const std::string& volume_id, Accesses accesses) {
  {
    std::lock_guard lock(mutex_);
    if (!quiesced_.emplace(volume_id, accesses).second) {
      throw ApiError("volume_busy",
                     "volume " + volume_id + " is being copied already; try again once that ends");
    }
  }
  for (const auto& access : accesses) access->pause();
  return std::make_shared<OnRelease>([this, volume_id] {
    Accesses resumed;
    {
      std::lock_guard lock(mutex_);
      auto it = quiesced_.find(volume_id);
      resumed = std::move(it->second);
      quiesced_.erase(it);
    }
    for (const auto& access : resumed) access->resume();
  });
}

void CopyHolds::hold_if_quiesced(const std::string& volume_id,
                                 std::shared_ptr<backend::WriteAccess> access) {
  if (!access) return;
  std::lock_guard lock(mutex_);
  auto it = quiesced_.find(volume_id);
  if (it == quiesced_.end()) return;
  access->pause();  // a new attachment: nothing in flight to wait for
  it->second.push_back(std::move(access));
}

bool CopyHolds::quiesced(const std::string& volume_id) const {
  std::lock_guard lock(mutex_);
  return quiesced_.count(volume_id) != 0;
}

std::shared_ptr<void> CopyHolds::read_by_copy(const std::string& id) {
  std::lock_guard lock(mutex_);
  sources_.insert(id);
  return std::make_shared<OnRelease>([this, id] {
    std::lock_guard inner(mutex_);
    sources_.erase(sources_.find(id));
  });
}

bool CopyHolds::is_copy_source(const std::string& id) const {
  std::lock_guard lock(mutex_);
  return sources_.count(id) != 0;
}

std::shared_ptr<void> CopyHolds::hold_for_copy(const std::string& volume_id, Accesses accesses) {
  std::shared_ptr<void> source = read_by_copy(volume_id);
  return std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(
      std::move(source), quiesce(volume_id, std::move(accesses)));
}

}  // namespace shareblk::control
