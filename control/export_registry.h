// Internal to control/: the export registry. Everything through which a live attachment's
// volume is reached from outside the control plane, by attachment id: the NBD server's
// connections (a connection group per attachment), FUSE mounts, and the control-socket clients
// that serve the attachment themselves (the nbdkit plugin, subscribed by export_resolve).
// revoke() cuts all three; it is the only way the control plane takes an attachment away.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "backend/backend.h"
#include "control/control.h"
#include "fuse/local_attach.h"
#include "target/target.h"

namespace shareblk::control {

class ExportRegistry {
 public:
  // The NBD server whose connections revoke() closes; nullptr (tests): none to close.
  void bind_server(target::Server* server) { server_ = server; }
  // NBD connections of the attachment in transmission phase.
  size_t connections(const std::string& attachment_id) const;
  // The NBD server's figures of every group (attachment id); none without a server.
  std::vector<target::GroupStats> stats() const {
    return server_ != nullptr ? server_->stats() : std::vector<target::GroupStats>{};
  }

  // Mounts the attachment's FUSE file at `mountpoint`, strictly below `root`, replacing a
  // mount it had. Throws ApiError("invalid_params") with the mount's error.
  void mount(const std::string& attachment_id, const std::string& mountpoint,
             const std::string& root, const backend::Handle& handle);
  // Unmounts it if mounted; true when the mount was busy and detached lazily.
  bool unmount(const std::string& attachment_id);

  // `subscriber` is told (attachment_revoked) when the attachment is revoked. At most
  // set_max_subscribers() at once, or ApiError("internal"): they hold control connections.
  void subscribe(const std::string& attachment_id, const std::weak_ptr<Subscriber>& subscriber);
  void set_max_subscribers(size_t n);
  size_t subscriber_count() const;  // for tests

  // The attachment's write access (backend::WriteAccess): one gate for its NBD connections
  // and its FUSE mount. The Service sets it, under the volume's lock, from the attachment's
  // mode and the volume's writer; the catalog only looks it up. nullptr: none was set (the
  // attachment is not live in this run), and its export must be refused.
  std::shared_ptr<backend::WriteAccess> write_access(const std::string& attachment_id) const;
  // Makes it if missing, then grants it, or revokes it and waits until the attachment's
  // changes in flight have finished (WriteAccess::revoke). Returns whether it changed.
  bool set_write_access(const std::string& attachment_id, bool granted);
  void forget_write_access(const std::string& attachment_id);
  // Tells the subscribers that serve the attachment themselves (nbdkit) that they must let go
  // of it, and waits (at most kSubscriberGrace) until each has finished the requests it had
  // started and closed its link: they refuse the attachment from then on, and clients connect
  // again to learn its new mode or write access.
  size_t cut_subscribers(const std::string& attachment_id) { return notify_revoked(attachment_id); }
  // Closes the attachment's NBD connections, once their requests in flight are answered,
  // without refusing new ones: clients connect again and negotiate afresh (a mode change).
  size_t reconnect(const std::string& attachment_id);

  // Takes the attachment away from everyone who reaches it: subscribers are told first (they
  // refuse it from their next request; not waited for), then its NBD connections are closed
  // once their requests in flight are answered, then its FUSE mount goes. Returns whether the
  // mount was detached lazily.
  // From the first step on, is_revoked() says so: the catalog refuses the export at once,
  // before anything reaches the database.
  bool revoke(const std::string& attachment_id);
  // Revoked in this run, or found unfinished in the journal at start (mark_revoked()).
  bool is_revoked(const std::string& attachment_id) const;
  void mark_revoked(const std::string& attachment_id);
  // Once the database says it is detached, the catalog refuses it from there.
  void forget_revoked(const std::string& attachment_id);

 private:
  size_t notify_revoked(const std::string& attachment_id);  // how many were told

  target::Server* server_ = nullptr;
  std::mutex mounts_mutex_;
  std::map<std::string, std::unique_ptr<fuse::LocalAttach>> mounts_;
  mutable std::mutex subscribers_mutex_;
  std::multimap<std::string, std::weak_ptr<Subscriber>> subscribers_;
  size_t max_subscribers_ = SIZE_MAX;
  // How long a revocation waits for a subscriber to let go (as the NBD server's close grace).
  static constexpr std::chrono::seconds kSubscriberGrace{10};
  mutable std::mutex revoked_mutex_;
  std::set<std::string> revoked_;
  mutable std::mutex access_mutex_;
  std::map<std::string, std::shared_ptr<backend::WriteAccess>> access_;
};

}  // namespace shareblk::control
