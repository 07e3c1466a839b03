#include "control/roll_backs.h"

#include <spdlog/spdlog.h>

namespace shareblk::control {

bool RollBacks::run_or_keep(const std::string& id) {
  const std::optional<std::string> failed = undo_(id);
  if (!failed) return true;
  spdlog::error(
      "control: volume {} could not be rolled back ({}); the next volume_create or start tries "
      "again",
      id, *failed);
  const std::lock_guard lock(mutex_);
  pending_.insert(id);
  return false;
}

void RollBacks::retry() {
  std::set<std::string> ids;
  {
    const std::lock_guard lock(mutex_);
    ids.swap(pending_);
  }
  for (const std::string& id : ids) {
    if (run_or_keep(id)) {
      spdlog::info("control: the failed volume_create of volume {} is rolled back now", id);
    }
  }
}

size_t RollBacks::pending() const {
  const std::lock_guard lock(mutex_);
  return pending_.size();
}

}  // namespace shareblk::control
