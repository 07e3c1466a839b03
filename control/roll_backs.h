// Internal to control/: undoing creates that failed (docs/state.md, "Creates and deletes").
// A volume_create that fails after it touched the store is undone at once; an undo that fails
// too (the store or the database refusing) is kept here and tried again before each later
// volume_create, so that half-made backing does not pile up until the next start (which
// finishes every intent anyway). Thread-safe.
#pragma once

#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>

namespace shareblk::control {

class RollBacks {
 public:
  // Undoes the create of `id`: nullopt when it is undone, else why not.
  using Undo = std::function<std::optional<std::string>(const std::string& id)>;
  explicit RollBacks(Undo undo) : undo_(std::move(undo)) {}

  // Undoes `id` now; when that fails, logs why and keeps it. True when undone.
  bool run_or_keep(const std::string& id);
  // Tries every kept one again (each is kept again if it still fails).
  void retry();
  size_t pending() const;

 private:
  Undo undo_;
  mutable std::mutex mutex_;
  std::set<std::string> pending_;
};

}  // namespace shareblk::control
