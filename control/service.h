// Internal to control/: the attachment API's actions. Each public member is one method of
// docs/api.md, with its params already decoded (control/methods.cc); it looks up, acts, and
// returns the JSON view. Refusals are ApiError; a broken database is DbError.
//
// Service orchestrates Cinder's semantics over objects that each do one job, and says in which
// order: attachment states change only through transition() (attachment_state.h); volume bytes
// are reached only through the VolumeRegistry; an attachment is exposed and revoked only
// through the ExportRegistry; whether a volume may be used now is VolumeChecks'; what the API
// shows is Views'; the other gateways of a shared store are reached only through SharedStore;
// the long parts of creates and deletes are BackingJobs'; the start's recovery is Recovery's.
// Every change to one volume or its attachments holds that volume's lock, and then the
// database's transaction.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "api/status.h"
#include "control/api_error.h"
#include "control/backing_jobs.h"
#include "control/control.h"
#include "control/copy_holds.h"
#include "control/db.h"
#include "control/export_registry.h"
#include "control/gateway_records.h"
#include "control/params.h"
#include "control/psk_keys.h"
#include "control/qos.h"
#include "control/recovery.h"
#include "control/revocation_journal.h"
#include "control/roll_backs.h"
#include "control/shared_store.h"
#include "control/views.h"
#include "control/volume_checks.h"
#include "control/volume_jobs.h"
#include "control/volume_registry.h"

namespace shareblk::control {

struct VolumeSpec {
  std::string name;
  uint64_t size = 0;
  bool multiattach = false;
  bool bootable = false;
  WriterPolicy writer_policy = WriterPolicy::Multi;
  // What it starts as (at most one; "" for none, when it reads as zeroes): an image on the
  // daemon's host, a snapshot's copy, or a copy of another volume (docs/snapshots.md).
  std::string from_image;
  rights::Credentials image_reader;  // from_image is opened with these rights: the caller's
  std::string from_snapshot;
  std::string from_volume;
  target::QosSpec qos;  // docs/qos.md
};

// Decoded by volume_update itself, once the volume is found, in the order name, multiattach,
// bootable: which refusal a caller gets when several apply is part of the API.
struct VolumeChange {
  std::string id;
  const Json* params = nullptr;  // the call's params
};

struct AttachmentSpec {
  std::string volume_id;
  std::string instance_uuid;
  std::string attached_host;  // "" when neither it nor the connector's host was given
  backend::AttachMode mode = backend::AttachMode::ReadWrite;
  // Points into the call's params; nullptr or null: a reservation. Checked by
  // decode_connector() once the volume is known, so that not_found comes first.
  const Json* connector = nullptr;
};

class Service {
 public:
  // `gateways`: as ControlPlane's.
  Service(const std::string& db_path, store::VolumeStore& store, Policy policy,
          store::Gateways* gateways = nullptr);
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // The NBD server that serves attachments, and where clients reach it. Mounts the FUSE
  // attachments that were live when the daemon stopped.
  void bind(target::Server* server, Endpoints endpoints);

  // A volume another gateway of a shared store made, named by a call: its definition is read
  // from the store and its row added before the call runs (the dispatcher calls this), so
  // that no transaction waits on the cluster. Nothing when the volume is known here or the
  // store is not shared. Throws ApiError (internal) when the cluster cannot say.
  void learn_volume(const std::string& id) { shared_.learn_volume(id); }

  Json volume_create(const VolumeSpec& spec);
  Json volume_list();
  Json volume_show(const std::string& id);
  // Starts the delete and returns at once (status "deleting"), or with `wait` once it is done.
  Json volume_delete(const std::string& id, bool wait);
  Json volume_extend(const std::string& id, uint64_t size);
  Json volume_update(const VolumeChange& change);
  Json volume_detach(const std::string& volume_id, std::optional<std::string> attachment_id);

  Json attachment_create(const AttachmentSpec& spec);
  // A new connector, or (mode set, connector nullptr) a live change of mode.
  Json attachment_update(const std::string& id, const Json* connector,
                         std::optional<backend::AttachMode> mode);
  // A live change of the attachment's QoS limits (docs/qos.md).
  Json attachment_qos(const std::string& id, const target::QosSpec& spec);
  Json attachment_complete(const std::string& id);
  Json attachment_delete(const std::string& id);
  Json attachment_list(const std::string& volume_id);  // "" for all
  Json attachment_show(const std::string& id);
  // Moves a single-writer volume's write access to the attachment (writers.cc).
  Json volume_takeover(const std::string& volume_id, const std::string& attachment_id);
  // I/O figures since start (stats.cc): of one attachment, one volume's, or all ("" for none).
  Json stats(const std::string& attachment_id, const std::string& volume_id);
  std::vector<AttachmentStats> attachment_stats(const std::string& attachment_id,
                                                const std::string& volume_id);

  // snapshots.cc: point-in-time copies of a volume (docs/snapshots.md).
  Json snapshot_create(const std::string& volume_id, const std::string& name);
  Json snapshot_list(const std::string& volume_id);  // "" for all
  Json snapshot_show(const std::string& id);
  Json snapshot_delete(const std::string& id, bool wait);

  // A consistent copy of the state database at `path` (absolute; must not exist), written
  // aside and renamed into place (backup.cc).
  // Writes the backup with `writer`'s rights (the caller's): the file is theirs, mode 0600.
  Json state_backup(const std::string& path, const rights::Credentials& writer);

  // For another process that serves the attachment (nbdkit): where its bytes are, in which
  // mode; subscribes the caller to its revocation.
  Json export_resolve(const std::string& export_name, const Caller& caller);
  // For the NBD handshake.
  target::ExportCatalog::Lookup resolve(const std::string& export_name, const target::Peer& peer);
  // For the TLS handshake: the PSK key of the live TLS-only attachment with this id.
  std::optional<std::string> psk_key(const std::string& attachment_id);

  // The policy in force: what shareblkd's options said at start or at the last reload.
  Policy policy() const;
  // A reload (SIGHUP): takes the new policy's multiattach rules and nbd_allow_root. TLS stays
  // as the daemon started (its listeners were set up for it); returns what changed, for the log.
  std::string set_policy(const Policy& policy);

  // At shutdown, once no NBD client is left: flushes every open volume; false (logged) when one
  // could not be.
  bool flush_volumes();

  // Subscribers (nbdkit connections) at most, so that they cannot take every control
  // connection from the operators.
  void set_max_subscribers(size_t n) { exports_.set_max_subscribers(n); }
  // For tests: what is held now (all 0 when no call and no job runs).
  struct Counts {
    size_t volume_locks = 0;
    size_t running_jobs = 0;
    size_t subscribers = 0;
  };
  Counts counts() const;

 private:
  // attachments.cc
  void connect(Database::Transaction& tx, AttachmentRow& a, const VolumeRow& v,
               const Json& connector);
  // A FUSE mountpoint that overlaps another live attachment's or the state directory:
  // invalid_params.
  void refuse_taken_mountpoint(Database::Transaction& tx, const AttachmentRow& a,
                               const std::string& mountpoint);
  Json detach(const std::string& volume_id, const std::string& attachment_id);
  // writers.cc: a live change of mode (attachment_update with mode).
  Json change_mode(const std::string& id, backend::AttachMode mode);
  // service.cc: a FUSE attachment's mount, again (at start, or after a change to read-write).
  void remount(const AttachmentRow& a, const VolumeRow& v);

  Database db_;
  VolumeRegistry volumes_;
  // Only for a shared store; named by STATE_DIR/gateway-id there (docs/state.md). Its revoker
  // thread calls shared_.act_on_revocations(): ~Service() stops it first.
  std::unique_ptr<GatewayRecords> records_;
  ExportRegistry exports_;
  QosRegistry qos_;
  RevocationJournal journal_;  // STATE_DIR/revocations
  // SIGHUP replaces it (set_policy); calls read a copy, under the mutex.
  mutable std::mutex policy_mutex_;
  Policy policy_;
  PskKeys psk_;  // STATE_DIR/tls-psk.secret, when TLS is on
  Endpoints endpoints_;
  // The database's directory: the daemon's state directory (--state-dir), where no FUSE
  // attachment may be mounted.
  std::filesystem::path state_dir_;
  const std::chrono::system_clock::time_point started_ = std::chrono::system_clock::now();
  // The objects the actions are made of: each says what it needs, and jobs_ (last) is only
  // referred to before it is made.
  VolumeChecks checks_{volumes_, jobs_};
  Views views_{
      {exports_, checks_, jobs_, psk_, endpoints_, [this] { return policy(); }, records_.get()}};
  SharedStore shared_{
      db_, volumes_, records_.get(), views_,
      [this](const std::string& volume_id, const std::string& id) { detach(volume_id, id); }};
  BackingJobs backing_{db_, volumes_, shared_, jobs_};
  // Creates whose roll-back failed, tried again by each volume_create.
  RollBacks roll_backs_{[this](const std::string& id) { return backing_.roll_back_create(id); }};
  CopyHolds copies_;  // what snapshots' and clones' copies hold (snapshots.cc)
  // Last: its threads use the members above, and its destructor stops and joins them first.
  VolumeJobs jobs_;
};

// The write gates of `attachments`' live ones, for CopyHolds to hold (snapshots.cc).
CopyHolds::Accesses live_write_accesses(const ExportRegistry& exports,
                                        const std::vector<AttachmentRow>& attachments);

// Whether the attachment may write, as the database says: live, read-write, and the volume's
// writer when the volume has one writer at most. The one rule; ExportRegistry's gates follow it.
bool may_write(const AttachmentRow& a, const VolumeRow& v);
// Makes `a` the writer of `v`: the generation goes up; `now` is when.
void make_writer(VolumeRow& v, const std::string& attachment_id, const std::string& now);

// Helpers shared by the action files.
std::string new_uuid();
std::string random_hex(size_t bytes);
std::string now_iso();  // UTC, ISO 8601 with microseconds: sorts as it happened
// The gateway's id in `state_dir` (the file gateway-id), made at the first call; throws
// std::runtime_error when it can be neither read nor made.
std::string gateway_id(const std::filesystem::path& state_dir);
// A path as mountpoints are compared: absolute, with the symlinks of its existing part
// resolved, no "." or "..", no trailing "/".
std::filesystem::path comparable_path(const std::filesystem::path& path);
// A volume's status, derived on every read and never stored (docs/api.md, "Volume"): error
// when `error`; else the job's when `intent` (deleting or creating); else the most advanced
// state of its attachments: in-use > attaching > reserved > detaching > available. A
// snapshot's the same, with no attachments.
api::VolumeStatus derive_status(bool error, const std::optional<IntentRow>& intent,
                                const std::vector<AttachmentRow>& attachments);
// For the crash tests (tests/e2e_crash_test.cc) only: when the environment variable
// SHAREBLK_TEST_KILL_AT names `point`, the daemon kills itself there with SIGKILL, as a
// kill -9 at that moment would. Only in a build with SHAREBLK_TEST_HOOKS (the test presets);
// elsewhere it does nothing.
void crash_point(const char* point);
// For the tests of long operations only: when SHAREBLK_TEST_JOB_PAUSE_MS is set, a delete's
// zeroing and a fill wait that many milliseconds at each report of progress, so that a test can
// act (and kill the daemon) while one runs. Only with SHAREBLK_TEST_HOOKS, like crash_point.
void test_pause();
// For the takeover tests only: EIO while the file that SHAREBLK_TEST_FAIL_FLUSH names exists, as
// a volume's flush on failing storage would return; 0 otherwise. Only with SHAREBLK_TEST_HOOKS.
int test_flush_error();

}  // namespace shareblk::control
