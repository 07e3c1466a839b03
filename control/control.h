// control: the attachment API (JSON-RPC 2.0 over a local Unix socket, one JSON object per
// line each way), its state in SQLite, and the export catalog the NBD target resolves
// client export names against.
//
// The semantics follow OpenStack Cinder's attachment API (microversions 3.44-3.50): a volume is
// attached through attachments, each with its own mode and export name; a volume that is not
// multiattach holds at most one live attachment; all changes to one volume's attachments are
// serialized.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "rights/rights.h"
#include "store/gateways.h"
#include "store/volume_store.h"
#include "target/target.h"

namespace shareblk::control {

inline constexpr const char* kDefaultFuseMountRoot = "/run/shareblk/mounts";

struct Policy {
  bool allow_multiattach = true;           // may volumes be (made) multiattach at all
  bool allow_multiattach_bootable = true;  // may a bootable volume have several attachments
  // May root reach a unix attachment whose connector binds another uid (--nbd-allow-root).
  bool nbd_allow_root = false;
  // TLS on the NBD listeners (shareblkd --tls). With On, attachments whose connector asks
  // ("tls", "tls_dn") are TLS-only; with Require, all are. A TLS-only attachment without a DN
  // binding has a PSK of its own (docs/api.md, "Connector" and "connection_info").
  target::TlsOptions::Mode tls = target::TlsOptions::Mode::Off;
  bool tls_x509 = false;  // --tls-x509-dir given: connectors may bind a client certificate's DN
  // FUSE attachments mount only strictly below this directory (--fuse-mount-root); fixed at
  // start, a reload keeps it.
  std::string fuse_mount_root = kDefaultFuseMountRoot;
};

// Where NBD clients reach this daemon; connection_info URIs are built from it.
struct Endpoints {
  std::string unix_socket;  // empty: no Unix listener
  std::string tcp;          // "HOST:PORT", empty: no TCP listener
};

// A control-socket client that can be sent notifications (JSON-RPC requests without an id)
// after its call returned: export_resolve's callers learn of revoked attachments this way.
class Subscriber {
 public:
  virtual ~Subscriber() = default;
  virtual void notify(const std::string& line) = 0;
  // After an attachment_revoked notice: waits until the subscriber has closed its connection,
  // which it does once its requests in flight have finished (the nbdkit plugin), or until
  // `deadline`, when its connection is cut and this returns false. A subscriber that cannot
  // be waited for (the caller itself) returns at once.
  virtual bool wait_gone(std::chrono::steady_clock::time_point /*deadline*/) { return true; }
};

// One live attachment's I/O since the daemon started, and its live NBD connections (the
// `stats` method and /metrics; docs/metrics.md).
struct AttachmentStats {
  std::string attachment_id;
  std::string volume_id;
  std::string mode;  // "rw" or "ro"
  target::GroupStats figures;
};

// What a control-socket caller may call. Each method of the table needs one role (docs/api.md,
// "Roles"); a caller with none is refused at connect.
enum class Role { None, Read, Admin };

// Who gets which role, from the options: root and the daemon's own user are Admin; so are the
// members of `admin_group` (--control-socket-group); the members of `read_group`
// (--control-readonly-group) are Read; anyone else who manages to connect is None.
struct Roles {
  std::optional<gid_t> admin_group;
  std::optional<gid_t> read_group;
};
Role role_of(const rights::Credentials& who, const Roles& roles);

// Who called, from SO_PEERCRED and SO_PEERGROUPS; logged with every call. A path the caller
// names is used with these rights (rights/rights.h), never with the daemon's.
struct Caller {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;
  // In-process calls (the tests, the fuzzer) are the daemon's own; the control socket sets it
  // from role_of().
  Role role = Role::Admin;
  std::weak_ptr<Subscriber> subscriber;  // empty: the caller takes no notifications

  rights::Credentials credentials() const { return {uid, gid, groups}; }
};

class ControlPlane {
 public:
  // Opens (creating when new) the state database at `db_path`. Attachments that were being
  // detached when the daemon died are completed as detached. `gateways`: how the gateways of
  // a shared store coordinate (store/gateways.h), null for a store this daemon alone serves.
  // Throws std::runtime_error.
  ControlPlane(const std::string& db_path, store::VolumeStore& store, Policy policy,
               store::Gateways* gateways = nullptr);
  ~ControlPlane();
  ControlPlane(const ControlPlane&) = delete;
  ControlPlane& operator=(const ControlPlane&) = delete;

  // The catalog the NBD server resolves export names with: live attachments only.
  std::shared_ptr<target::ExportCatalog> catalog();

  // Must be called before serving: detach closes connections through `server`.
  void bind(target::Server* server, Endpoints endpoints);

  // A reload (SIGHUP): the policy's multiattach rules and nbd_allow_root take effect for the
  // calls and handshakes that follow; TLS stays as started. Returns what changed ("" if nothing).
  std::string set_policy(const Policy& policy);

  // Every live attachment's figures, in the order attachment_list gives. Throws
  // std::runtime_error when the database cannot be read.
  std::vector<AttachmentStats> stats();

  // One JSON-RPC request (or batch) in, the response line out ("" for notifications).
  std::string handle(const std::string& line, const Caller& caller);

  // Serves the control socket at `path` (with `access`: only its owner by default) on a
  // thread of its own, with a thread per client. A client beyond `max_clients` at once, or one no
  // thread can be started for, gets one JSON-RPC error line (reason "internal") and is closed; the
  // daemon goes on.
  // Each client gets its role from `roles` when it connects; one with none gets one error line
  // (reason "forbidden") and is closed.
  std::error_code listen(const std::string& path, size_t max_clients,
                         target::SocketAccess access = {0600, std::nullopt}, Roles roles = {});
  // The same on a socket already listening, which this takes: its descriptor is closed at
  // stop(). `socket_path` is the file stop() removes: the path target::listen_unix bound (a
  // daemon that binds before dropping root and serves after), empty for a socket systemd
  // passed (socket activation), which is neither shut down nor removed.
  std::error_code serve(int listening_fd, size_t max_clients, Roles roles = {},
                        const std::string& socket_path = {});
  void stop();
  // After stop() and the NBD server's: makes every write acknowledged to a client durable
  // (fdatasync of each open volume). False, logged, when a volume could not be flushed.
  bool flush_volumes();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace shareblk::control
