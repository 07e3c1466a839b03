#include "control/export_registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <vector>

#include "control/api_error.h"

namespace shareblk::control {

size_t ExportRegistry::connections(const std::string& attachment_id) const {
  return server_ != nullptr ? server_->connections(attachment_id) : 0;
}

void ExportRegistry::mount(const std::string& attachment_id, const std::string& mountpoint,
                           const std::string& root, const backend::Handle& handle) {
  unmount(attachment_id);
  std::string error;
  auto mount = fuse::LocalAttach::mount(mountpoint, root, handle, error);
  if (!mount) invalid(error);
  std::lock_guard lock(mounts_mutex_);
  mounts_[attachment_id] = std::move(mount);
}

bool ExportRegistry::unmount(const std::string& attachment_id) {
  std::unique_ptr<fuse::LocalAttach> mount;
  {
    std::lock_guard lock(mounts_mutex_);
    auto it = mounts_.find(attachment_id);
    if (it == mounts_.end()) return false;
    mount = std::move(it->second);
    mounts_.erase(it);
  }
  const bool lazy = mount->unmount();
  if (lazy) {
    spdlog::warn("control: {} was busy; detached lazily (no I/O goes through it any more)",
                 mount->mountpoint());
  }
  return lazy;
}

void ExportRegistry::subscribe(const std::string& attachment_id,
                               const std::weak_ptr<Subscriber>& subscriber) {
  std::lock_guard lock(subscribers_mutex_);
  // Every nbdkit connection resolves and then goes away: drop the subscribers that are gone,
  // and register a client once per attachment, or the table grows with each call.
  std::erase_if(subscribers_, [](const auto& entry) { return entry.second.expired(); });
  auto [first, last] = subscribers_.equal_range(attachment_id);
  const bool known = std::any_of(first, last, [&](const auto& entry) {
    return !entry.second.owner_before(subscriber) && !subscriber.owner_before(entry.second);
  });
  if (known) return;
  if (subscribers_.size() >= max_subscribers_) {
    throw ApiError("internal", "too many subscribed connections (" +
                                   std::to_string(max_subscribers_) +
                                   "); the rest of the control connections are kept for "
                                   "operators");
  }
  subscribers_.emplace(attachment_id, subscriber);
}

void ExportRegistry::set_max_subscribers(size_t n) {
  std::lock_guard lock(subscribers_mutex_);
  max_subscribers_ = n;
}

size_t ExportRegistry::subscriber_count() const {
  std::lock_guard lock(subscribers_mutex_);
  return subscribers_.size();
}

size_t ExportRegistry::notify_revoked(const std::string& attachment_id) {
  std::vector<std::shared_ptr<Subscriber>> targets;
  {
    std::lock_guard lock(subscribers_mutex_);
    auto [first, last] = subscribers_.equal_range(attachment_id);
    for (auto it = first; it != last; ++it) {
      if (auto s = it->second.lock()) targets.push_back(std::move(s));
    }
    subscribers_.erase(first, last);
  }
  const std::string line = nlohmann::json{{"jsonrpc", "2.0"},
                                          {"method", "attachment_revoked"},
                                          {"params", {{"attachment_id", attachment_id}}}}
                               .dump();
  for (const auto& s : targets) s->notify(line);
  // Each closes its link once the requests it had started are done: then none of them can
  // still change the volume (docs/fencing.md, "Frontends").
  const auto deadline = std::chrono::steady_clock::now() + kSubscriberGrace;
  size_t late = 0;
  for (const auto& s : targets) late += s->wait_gone(deadline) ? 0 : 1;
  if (late > 0) {
    spdlog::error(
        "control: attachment {}: {} nbdkit connection(s) did not let go within {} s; writes "
        "they had started may still land",
        attachment_id, late, kSubscriberGrace.count());
  }
  return targets.size();
}

void ExportRegistry::mark_revoked(const std::string& attachment_id) {
  std::lock_guard lock(revoked_mutex_);
  revoked_.insert(attachment_id);
}

void ExportRegistry::forget_revoked(const std::string& attachment_id) {
  std::lock_guard lock(revoked_mutex_);
  revoked_.erase(attachment_id);
}

bool ExportRegistry::is_revoked(const std::string& attachment_id) const {
  std::lock_guard lock(revoked_mutex_);
  return revoked_.count(attachment_id) != 0;
}

std::shared_ptr<backend::WriteAccess> ExportRegistry::write_access(
    const std::string& attachment_id) const {
  std::lock_guard lock(access_mutex_);
  auto it = access_.find(attachment_id);
  return it == access_.end() ? nullptr : it->second;
}

bool ExportRegistry::set_write_access(const std::string& attachment_id, bool granted) {
  std::shared_ptr<backend::WriteAccess> access;
  {
    std::lock_guard lock(access_mutex_);
    auto& slot = access_[attachment_id];
    if (!slot) {
      slot = std::make_shared<backend::WriteAccess>(granted);
      return true;
    }
    access = slot;
  }
  if (access->granted() == granted) return false;
  if (granted) {
    access->grant();
  } else {
    access->revoke();  // waits for the changes in flight: not under the table's lock
  }
  return true;
}

void ExportRegistry::forget_write_access(const std::string& attachment_id) {
  std::lock_guard lock(access_mutex_);
  access_.erase(attachment_id);
}

size_t ExportRegistry::reconnect(const std::string& attachment_id) {
  const size_t n = connections(attachment_id);
  if (server_ != nullptr) server_->close_connections(attachment_id);
  return n;
}

bool ExportRegistry::revoke(const std::string& attachment_id) {
  mark_revoked(attachment_id);
  const size_t told = notify_revoked(attachment_id);
  if (auto access = write_access(attachment_id)) access->revoke();  // FUSE's changes too
  const size_t closed = connections(attachment_id);
  if (server_ != nullptr) server_->close_group(attachment_id);
  const bool lazy = unmount(attachment_id);
  spdlog::info(
      "control: revoked attachment {}: {} nbdkit connection(s) told, {} NBD "
      "connection(s) closed",
      attachment_id, told, closed);
  return lazy;
}

}  // namespace shareblk::control
