// Internal to control/: the attachment API's actions. Each public member is one method of
// docs/api.md, with its params already decoded (control/methods.cc); it looks up, acts, and
// returns the JSON view. Refusals are ApiError; a broken database is DbError.
//
// Who does what: attachment states change only through transition() (attachment_state.h);
// volume bytes are reached only through the VolumeRegistry; an attachment is exposed and
// revoked only through the ExportRegistry. Every change to one volume or its attachments holds
// that volume's lock, and then the database's transaction.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "api/status.h"
#include "control/api_error.h"
#include "control/control.h"
#include "control/copy_holds.h"
#include "control/db.h"
#include "control/export_registry.h"
#include "control/gateway_records.h"
#include "control/params.h"
#include "control/psk_keys.h"
#include "control/qos.h"
#include "control/revocation_journal.h"
#include "control/roll_backs.h"
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
  void learn_volume(const std::string& id);

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
  // For tests.
  size_t volume_lock_count() const { return volumes_.lock_count(); }
  size_t running_job_count() const { return jobs_.running(); }
  size_t subscriber_count() const { return exports_.subscriber_count(); }
  // NBD clients refused since start: names that are no live export; and clients refused a
  // live export by its connector's binding (transport, ip, uid).
  uint64_t refused_unknown() const { return refused_unknown_.load(std::memory_order_relaxed); }
  uint64_t refused_by_binding() const {
    return refused_by_binding_.load(std::memory_order_relaxed);
  }

 private:
  // attachments.cc
  void connect(Database::Transaction& tx, AttachmentRow& a, const VolumeRow& v,
               const Json& connector);
  void refuse_taken_mountpoint(Database::Transaction& tx, const AttachmentRow& a,
                               const std::string& mountpoint);
  Json detach(const std::string& volume_id, const std::string& attachment_id);
  // writers.cc
  Json change_mode(const std::string& id, backend::AttachMode mode);
  // A single-writer volume in a shared store: its writer's gateway holds the image's lock
  // (docs/scale-out.md, "Fencing across gateways"). claim: false when another gateway holds
  // it; fence: cuts that gateway off in the cluster first. Both throw ApiError (internal)
  // when the cluster cannot say; release only logs. Nothing for other volumes and stores.
  bool claim_shared_writer(const VolumeRow& v);
  // Returns the fenced gateway's client as the cluster names it, "" for none.
  std::string fence_shared_writer(const VolumeRow& v);
  void release_shared_writer(const VolumeRow& v);
  // Another gateway's live attachment found by its id alone (through the store's link to its
  // volume): its volume and Attachment; nullopt when no other gateway has it. Throws ApiError
  // (internal) when the cluster cannot say.
  std::optional<std::pair<std::string, Json>> find_elsewhere(const std::string& attachment_id);
  // A reservation's host, given later by its connector: refused as a duplicate of another
  // gateway's attachment too (duplicate_attachment), then written into its entry with a
  // guarded write. Throws ApiError.
  void share_host(const std::string& volume_id, const AttachmentRow& a, const std::string& host);
  // At start: this gateway's entries whose attachments are no longer live here go; the
  // records of the volumes it serves are watched, and read once for revocations.
  void prune_shared();
  // Revocations written by other gateways (volume_detach of an attachment served here), on
  // records_' revoker thread: detaches what the volume's record marks revoked.
  void act_on_revocations(const std::string& volume_id);
  // volume_detach of an attachment another gateway serves: marks it revoked in the record,
  // notifies, and waits (up to 10 s) for that gateway to take it out.
  Json detach_elsewhere(const std::string& volume_id, const std::string& attachment_id);
  // At start, for a writer recorded here: takes the lock back. Another gateway took it over
  // meanwhile: no writer now (recorded in `tx`). False when the cluster could not say: the
  // writer keeps its place, without write access until a takeover or the next start.
  bool reclaim_shared_writer(Database::Transaction& tx, VolumeRow& v);
  // Makes every write the volume acknowledged durable; throws ApiError (internal).
  void flush_volume(const VolumeRow& v, const std::string& why);
  // The same, returning the errno of a flush that failed (0 when it did not).
  int try_flush(const VolumeRow& v);
  bool commit_stands(const VolumeRow& v);
  // At start: the gates of the live attachments, from the database, and no writer that is
  // not a live attachment.
  void load_write_access(Database::Transaction& tx);
  // At start: the takeovers that only the revocation journal recorded go into the database, or,
  // while it still cannot record them, stand as the database's pending writers.
  void settle_journaled_writers();
  // volumes.cc: the long parts of a delete (of a volume or a snapshot) and of a create that
  // copies bytes in (from an image, a snapshot or a volume), run by jobs_.
  void start_delete(const std::string& id);
  std::optional<ApiError> finish_delete(const std::string& id, const store::Progress& progress);
  // Runs `work`, which writes the bytes of the volume or snapshot `id` (created at
  // `created_at`; `what` says from where, for the log), then drops its intent: it is available.
  using Populate = std::function<void(const store::Progress&)>;
  std::optional<ApiError> populate(const std::string& id, const std::string& created_at,
                                   const std::string& what, const Populate& work,
                                   const store::Progress& progress);
  // Starts populate() on a job; a job that cannot start leaves the intent with why (status
  // error).
  void start_populate(const std::string& id, const std::string& created_at, const std::string& what,
                      Populate work);
  // snapshots.cc. The write gates of the volume's live attachments, for copies_ to hold.
  CopyHolds::Accesses write_accesses(const std::vector<AttachmentRow>& attachments);
  // The job that copies the first `length` bytes of `from` into new backing `to` of `size`
  // bytes, letting go of `held` (the source's hold) as soon as the copy ends, before the
  // database is written.
  Populate copy_job(const std::string& from, uint64_t length, const std::string& to, uint64_t size,
                    std::shared_ptr<void> held);
  // Undoes a create (a failed volume_create, or one a crash interrupted): removes whatever
  // backing it made, its row if it has one (a fill's or a snapshot's) and its intent. What
  // went wrong when the store or the database cannot: then the intent stays.
  std::optional<std::string> roll_back_create(const std::string& id);
  // Refuses (volume_busy) a change to a volume that a delete or a fill is under way on.
  void refuse_busy(Database::Transaction& tx, const VolumeRow& v, const char* what);
  // service.cc
  void reconcile();
  void finish_intents();
  // Refuses to `use` ("attached", "copied") the volume or snapshot `id` of `size` bytes
  // (`what`: "volume" or "snapshot") while it is being deleted or filled (volume_busy), or
  // when its status is error (volume_error): a delete or fill of it failed, or its backing is
  // missing (looked for afresh in the store).
  void refuse_unusable(Database::Transaction& tx, const char* what, const std::string& id,
                       uint64_t size, const char* use) {
    refuse_pending(tx, what, id, use);
    refuse_missing(what, id, size, use);
  }
  void refuse_unusable(Database::Transaction& tx, const VolumeRow& v, const char* use) {
    refuse_unusable(tx, "volume", v.id, v.size, use);
  }
  // Its two halves: the database's (an intent: being deleted or filled, or failed) and the
  // store's (the backing, looked for afresh: a call that can wait on a remote store, made
  // outside the transaction where the caller can).
  void refuse_pending(Database::Transaction& tx, const char* what, const std::string& id,
                      const char* use);
  void refuse_missing(const char* what, const std::string& id, uint64_t size, const char* use);
  // Why the volume's status is error, or nullopt; `intent` is the volume's, if it has one. A
  // volume with an intent and no error is being deleted or created (filled from an image).
  std::optional<std::string> error_of(const std::optional<IntentRow>& intent,
                                      const std::string& volume_id);
  void remount(const AttachmentRow& a, const VolumeRow& v);
  std::string volume_of(const std::string& attachment_id);
  bool known_here(const std::string& attachment_id);  // a row in this gateway's database
  // Throws ApiError (not_found). A volume another gateway made is found once learn_volume()
  // has added it.
  VolumeRow find_volume(Database::Transaction& tx, const std::string& id);
  // Saves the volume's definition with its backing when the store is shared (volumes.cc).
  // Throws ApiError.
  void publish(const VolumeRow& v);
  // After a change is committed here: publish(), a failure only logged (gateways that learn
  // the volume later see the definition before the change).
  void republish(const VolumeRow& v);
  // After this gateway's writer of a single-writer volume in a shared store changed (made,
  // taken over, gone, taken back at start): records it, with the lock holder that backs it,
  // in the definition's writer part; a failure only logged.
  void publish_writer(const VolumeRow& v);
  static AttachmentRow find_attachment(Database::Transaction& tx, const std::string& id);
  // views.cc
  Json volume_json(Database::Transaction& tx, const VolumeRow& v);
  // From rows already read (volume_list reads them all at once, and builds the JSON after its
  // transaction: other calls need not wait for that).
  Json volume_json(const VolumeRow& v, const std::vector<AttachmentRow>& attachments,
                   const std::optional<IntentRow>& intent);
  // An Attachment (docs/api.md) as any gateway knows it, from its row: what only the serving
  // gateway knows (connector, connection_info, connections, write access, QoS) is null.
  // Another gateway's attachment (a.gateway set) is shown this way.
  Json attachment_view(const AttachmentRow& a) const;
  // This gateway's attachment: attachment_view with what this gateway knows filled in.
  Json attachment_json(const AttachmentRow& a, const VolumeRow& v);
  Json snapshot_json(const SnapshotRow& s, const std::optional<IntentRow>& intent);
  Json connection_info(const AttachmentRow& a, const VolumeRow& v, const Json& connector);

  // True when other gateways serve the store's volumes too (rbd): each volume's definition is
  // saved with its backing, its attachments are in records all gateways share, and its writer
  // holds the image's lock (shared_store.cc).
  bool shared() const { return records_ != nullptr; }

  Database db_;
  VolumeRegistry volumes_;
  // Only for a shared store; named by STATE_DIR/gateway-id there (docs/state.md). Its revoker
  // thread calls act_on_revocations(): ~Service() stops it first.
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
  std::atomic<uint64_t> refused_unknown_{0};
  std::atomic<uint64_t> refused_by_binding_{0};
  // Creates whose roll-back (roll_back_create) failed, tried again by each volume_create.
  RollBacks roll_backs_{[this](const std::string& id) { return roll_back_create(id); }};
  CopyHolds copies_;  // what snapshots' and clones' copies hold (snapshots.cc)
  // Last: its threads use the members above, and its destructor stops and joins them first.
  VolumeJobs jobs_;
};

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
