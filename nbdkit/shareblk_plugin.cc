// nbdkit-shareblk-plugin: shareblkd's attachments, served by nbdkit.
//
//   nbdkit shareblk control=/path/to/shareblk.sock
//
// serves every live attachment of that daemon under its export name. At open, the export name
// the client asked for is resolved through the daemon's control socket (export_resolve): which
// attachment, in which mode, and where the volume's bytes are. I/O then goes through the same
// backend library as shareblkd, one backend::Handle per connection, so the read-only rule and
// the range checks are the backend's, not this plugin's.
//
// Revocation. The control connection that resolved the name stays open, and the daemon writes
// an attachment_revoked notification on it when the attachment is deleted, and when its mode or
// write access changes (a takeover; docs/fencing.md). A watcher thread per connection takes
// it at once: from then on every request is refused with ESHUTDOWN, and once the writes that
// had already started are done (the connection's backend::WriteAccess is revoked, which waits
// for them) the watcher closes the control link. The daemon waits for that close before its
// call returns, so when attachment_delete or volume_takeover returns, no write of this
// connection can still land. The plugin cannot close nbdkit's client connections itself (nbdkit
// 1.32 has no such call); refusing every request has the same effect on the data, and clients
// reconnect to learn the attachment's new state.
//
// A control connection that breaks (the daemon stopped or restarted) is treated like a
// revocation: from then on the plugin could not learn of one, so it fails closed. Clients
// reconnect and resolve their names again, as they would after shareblkd itself restarted.
#define NBDKIT_API_VERSION 2
#include <fcntl.h>
#include <nbdkit-plugin.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "rpc/client.h"

// Requests of one connection may run at once: backend::Handle is thread-safe and the control
// link takes its own lock.
#define THREAD_MODEL NBDKIT_THREAD_MODEL_PARALLEL

namespace {

namespace backend = shareblk::backend;
namespace rpc = shareblk::rpc;
using Json = nlohmann::json;

// A daemon that takes longer than this to answer export_resolve is treated as gone, so that a
// hung daemon cannot hang nbdkit's handshakes forever.
constexpr std::chrono::seconds kControlTimeout{30};
// Extents returned per block-status request at most; the client asks again for the rest.
constexpr size_t kMaxExtents = 1024;

// Absolute, because nbdkit changes directory to / when it daemonizes.
std::string control_path;

// The control-socket connection of one nbdkit connection: it resolves the export name, then
// carries the attachment's revocation.
class ControlLink {
 public:
  ControlLink() = default;
  ~ControlLink();  // stops the watcher
  ControlLink(const ControlLink&) = delete;
  ControlLink& operator=(const ControlLink&) = delete;

  // Connects to the daemon and calls export_resolve for `export_name`, then starts watching
  // the link. On failure returns false with a message for nbdkit's log in `error`.
  bool resolve(const std::string& export_name, Json& result, std::string& error);

  // 0 while the attachment is live; ESHUTDOWN once it was revoked or the daemon went away.
  int check();
  // The connection's write access: revoked (and drained) with the attachment.
  const std::shared_ptr<backend::WriteAccess>& write_access() const { return access_; }

 private:
  // The watcher thread: takes each notice as it arrives, until revoked or stopped.
  void watch();
  // Takes what the daemon sent (revocation notices) and the link's state. Under mutex_.
  void take_news();
  void revoke(const std::string& why);

  rpc::Client client_;
  std::string attachment_id_;
  std::atomic<bool> revoked_{false};
  std::shared_ptr<backend::WriteAccess> access_ = std::make_shared<backend::WriteAccess>(true);
  std::mutex mutex_;        // client_'s reads
  int stop_[2] = {-1, -1};  // a pipe: the destructor wakes the watcher
  std::thread watcher_;
};

ControlLink::~ControlLink() {
  if (watcher_.joinable()) {
    (void)!::write(stop_[1], "x", 1);
    watcher_.join();
  }
  for (int fd : stop_) {
    if (fd >= 0) ::close(fd);
  }
}

void ControlLink::watch() {
  while (!revoked_.load(std::memory_order_acquire)) {
    pollfd ready[2] = {{client_.native_handle(), POLLIN, 0}, {stop_[0], POLLIN, 0}};
    const int n = ::poll(ready, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || ready[1].revents != 0) return;
    std::lock_guard lock(mutex_);
    if (!revoked_.load(std::memory_order_relaxed)) take_news();
  }
}

bool ControlLink::resolve(const std::string& export_name, Json& result, std::string& error) {
  if (const std::error_code ec = client_.connect(control_path, kControlTimeout)) {
    error = "cannot connect to shareblkd's control socket " + control_path + ": " + ec.message();
    return false;
  }
  const rpc::Outcome reply = client_.call("export_resolve", {{"export_name", export_name}});
  if (reply.error) {
    // The export name is a capability: it is left out of the log.
    error = reply.error->reason == "not_found"
                ? std::string("no live shareblk attachment has this export name")
                : "export_resolve failed: " + reply.error->describe();
    return false;
  }
  if (!reply.result.is_object() || !reply.result.contains("attachment_id") ||
      !reply.result["attachment_id"].is_string()) {
    error = "export_resolve: unexpected reply " + reply.result.dump();
    return false;
  }
  result = reply.result;
  attachment_id_ = result["attachment_id"].get<std::string>();
  // A revocation may already have followed the reply.
  take_news();
  if (::pipe2(stop_, O_CLOEXEC) != 0) {
    error = std::string("cannot watch the control link: ") + std::strerror(errno);
    return false;
  }
  watcher_ = std::thread([this] { watch(); });
  return true;
}

int ControlLink::check() {
  if (revoked_.load(std::memory_order_acquire)) return ESHUTDOWN;
  // The notification is in our receive queue before attachment_delete returns, so this look
  // at the socket, not a reader thread that may not have run yet, is what makes "the next
  // request" exact.
  if (!client_.has_news()) return 0;
  try {
    std::lock_guard lock(mutex_);
    if (!revoked_.load(std::memory_order_relaxed)) take_news();
  } catch (const std::exception&) {  // out of memory for the message: this request fails only
    return ENOMEM;
  }
  return revoked_.load(std::memory_order_acquire) ? ESHUTDOWN : 0;
}

void ControlLink::take_news() {
  std::vector<rpc::Notification> notices;
  const std::error_code link = client_.poll(notices);
  for (const rpc::Notification& notice : notices) {
    if (notice.method != "attachment_revoked" || !notice.params.is_object()) continue;
    if (notice.params.value("attachment_id", Json()) == Json(attachment_id_)) {
      revoke("the attachment was deleted");
    }
  }
  // A broken link (the daemon closed it, cut it, or sent an over-long line) could no longer
  // carry a revocation: fail closed.
  if (link) revoke("the control connection to shareblkd broke: " + link.message());
}

void ControlLink::revoke(const std::string& why) {
  if (revoked_.exchange(true, std::memory_order_acq_rel)) return;
  nbdkit_debug("shareblk: attachment %s: %s; its requests are refused from now on",
               attachment_id_.c_str(), why.c_str());
  access_->revoke();  // waits for the writes that had started
  // Letting go: the daemon waits for this before its revoking call returns.
  ::shutdown(client_.native_handle(), SHUT_RDWR);
}

// One nbdkit connection: the attachment it resolved to, and the volume as that attachment sees
// it.
struct Connection {
  ControlLink control;
  backend::Handle io;
};

Connection* as_connection(void* handle) {
  return static_cast<Connection*>(handle);
}

// Fails the current request with `err`. Errors the client caused (a refused write, a range past
// the end, a fast zero that would be slow, a revoked attachment) are only debug output; the
// others are the device's and go to nbdkit's log.
int fail(int err, const char* what) {
  switch (err) {
    case EPERM:
    case EROFS:
    case EINVAL:
    case ENOSPC:
    case ENOTSUP:
    case ESHUTDOWN:
      nbdkit_debug("shareblk: %s: %s", what, std::strerror(err));
      break;
    default:
      nbdkit_error("shareblk: %s: %s", what, std::strerror(err));
  }
  nbdkit_set_error(err);
  return -1;
}

// --- Configuration ---

int shareblk_config(const char* key, const char* value) {
  if (std::strcmp(key, "control") == 0) {
    char* path = nbdkit_absolute_path(value);
    if (path == nullptr) return -1;
    control_path = path;
    std::free(path);  // NOLINT(cppcoreguidelines-no-malloc): nbdkit allocated it with malloc
    return 0;
  }
  nbdkit_error("shareblk: unknown parameter '%s' (the plugin takes control=PATH)", key);
  return -1;
}

int shareblk_config_complete() {
  if (control_path.empty()) {
    nbdkit_error("shareblk: control=PATH (shareblkd's control socket) is required");
    return -1;
  }
  if (control_path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    nbdkit_error("shareblk: control socket path %s is too long for a Unix socket",
                 control_path.c_str());
    return -1;
  }
  return 0;
}

// --- Connections ---

void* shareblk_open(int readonly) {
  try {
    auto connection = std::make_unique<Connection>();
    const char* name = nbdkit_export_name();
    Json resolved;
    std::string error;
    if (!connection->control.resolve(name != nullptr ? name : "", resolved, error)) {
      nbdkit_error("shareblk: %s", error.c_str());
      return nullptr;
    }
    const Json& backing = resolved.at("backing");
    std::vector<backend::MappedSegment> segments;
    for (const Json& s : backing.at("segments")) {
      segments.push_back({s.at("path").get<std::string>(), s.at("offset").get<uint64_t>(),
                          s.at("length").get<uint64_t>()});
    }
    std::error_code ec;
    std::shared_ptr<backend::Volume> volume;
    if (backing.at("mapped").get<bool>()) {
      volume = backend::Volume::open_mapped(segments, ec);
    } else if (segments.size() == 1 && segments[0].offset == 0) {
      volume = backend::Volume::open(segments[0].path, ec);
    } else {
      ec = std::make_error_code(std::errc::invalid_argument);
    }
    if (!volume) {
      nbdkit_error("shareblk: attachment %s: cannot open volume %s: %s",
                   resolved.at("attachment_id").get<std::string>().c_str(),
                   resolved.value("volume_id", "?").c_str(), ec.message().c_str());
      return nullptr;
    }
    // nbdkit -r makes every attachment read-only; it never makes one writable. Neither does
    // the daemon while the attachment has no write access (a single-writer volume's
    // standby): it tells us to let go when that changes, and the client connects again.
    const bool read_only = readonly != 0 ||
                           backend::parse_attach_mode(resolved.at("mode").get<std::string>()) !=
                               backend::AttachMode::ReadWrite ||
                           !resolved.value("write_access", true);
    connection->io = read_only ? backend::Handle(std::move(volume), backend::AttachMode::ReadOnly)
                               : backend::Handle(std::move(volume), backend::AttachMode::ReadWrite,
                                                 connection->control.write_access());
    nbdkit_debug("shareblk: attachment %s of volume %s, %s",
                 resolved.at("attachment_id").get<std::string>().c_str(),
                 resolved.value("volume_id", "?").c_str(), read_only ? "read-only" : "read-write");
    return connection.release();
  } catch (const std::exception& e) {
    // A reply without a field we need (Json's exceptions) or no memory: refuse this client.
    nbdkit_error("shareblk: open: %s", e.what());
    return nullptr;
  }
}

void shareblk_close(void* handle) {
  delete as_connection(handle);  // closing the control link ends the daemon's subscription
}

int64_t shareblk_get_size(void* handle) {
  return static_cast<int64_t>(as_connection(handle)->io.volume()->size());
}

int shareblk_is_rotational(void* handle) {
  return as_connection(handle)->io.volume()->rotational() ? 1 : 0;
}

// What the connection may do is the backend's rule (backend::capabilities), the same the NBD
// handshake and FUSE follow; nbdkit asks each part through its own callback.
backend::Capabilities capabilities_of(void* handle) {
  return as_connection(handle)->io.capabilities();
}
int shareblk_can_write(void* handle) {
  return capabilities_of(handle).read_only ? 0 : 1;
}
int shareblk_can_flush(void* handle) {
  return capabilities_of(handle).flush ? 1 : 0;
}
int shareblk_can_trim(void* handle) {
  return capabilities_of(handle).trim ? 1 : 0;
}
int shareblk_can_zero(void* handle) {
  return capabilities_of(handle).zero ? 1 : 0;
}
int shareblk_can_fast_zero(void* handle) {
  return capabilities_of(handle).fast_zero ? 1 : 0;
}
int shareblk_can_fua(void* handle) {
  return capabilities_of(handle).fua ? NBDKIT_FUA_NATIVE : NBDKIT_FUA_NONE;
}
int shareblk_can_multi_conn(void* handle) {
  return capabilities_of(handle).multi_conn ? 1 : 0;
}
int shareblk_can_extents(void* handle) {
  return capabilities_of(handle).block_status ? 1 : 0;
}

// --- Data ---

// nbdkit's FUA flag as the backend's.
uint32_t fua(uint32_t flags) {
  return (flags & NBDKIT_FLAG_FUA) ? uint32_t{backend::kFua} : 0;
}

int shareblk_pread(void* handle, void* buf, uint32_t count, uint64_t offset, uint32_t /*flags*/) {
  Connection& c = *as_connection(handle);
  if (int err = c.control.check()) return fail(err, "read");
  if (int err = c.io.read(buf, count, offset)) return fail(err, "read");
  return 0;
}

int shareblk_pwrite(void* handle, const void* buf, uint32_t count, uint64_t offset,
                    uint32_t flags) {
  Connection& c = *as_connection(handle);
  if (int err = c.control.check()) return fail(err, "write");
  const uint32_t io_flags = fua(flags);
  if (int err = c.io.write(buf, count, offset, io_flags)) return fail(err, "write");
  return 0;
}

int shareblk_flush(void* handle, uint32_t /*flags*/) {
  Connection& c = *as_connection(handle);
  if (int err = c.control.check()) return fail(err, "flush");
  if (int err = c.io.flush()) return fail(err, "flush");
  return 0;
}

int shareblk_trim(void* handle, uint32_t count, uint64_t offset, uint32_t flags) {
  Connection& c = *as_connection(handle);
  if (int err = c.control.check()) return fail(err, "trim");
  const uint32_t io_flags = fua(flags);
  if (int err = c.io.trim(count, offset, io_flags)) return fail(err, "trim");
  return 0;
}

int shareblk_zero(void* handle, uint32_t count, uint64_t offset, uint32_t flags) {
  Connection& c = *as_connection(handle);
  if (int err = c.control.check()) return fail(err, "write zeroes");
  uint32_t io_flags = fua(flags);
  if (!(flags & NBDKIT_FLAG_MAY_TRIM)) io_flags |= backend::kNoHole;  // NBD_CMD_FLAG_NO_HOLE
  if (flags & NBDKIT_FLAG_FAST_ZERO) io_flags |= backend::kFastZero;
  if (int err = c.io.write_zeroes(count, offset, io_flags)) return fail(err, "write zeroes");
  return 0;
}

int shareblk_extents(void* handle, uint32_t count, uint64_t offset, uint32_t flags,
                     nbdkit_extents* extents) {
  Connection& c = *as_connection(handle);
  if (int err = c.control.check()) return fail(err, "block status");
  try {
    std::vector<backend::Extent> found;
    const size_t most = (flags & NBDKIT_FLAG_REQ_ONE) ? 1 : kMaxExtents;
    if (int err = c.io.extents(offset, count, most, found)) return fail(err, "block status");
    if (found.empty()) return fail(EINVAL, "block status");  // only for an empty range
    uint64_t at = offset;
    for (const backend::Extent& e : found) {
      const uint32_t type = e.hole ? NBDKIT_EXTENT_HOLE | NBDKIT_EXTENT_ZERO : 0;
      if (nbdkit_add_extent(extents, at, e.length, type) == -1) return -1;
      at += e.length;
    }
    return 0;
  } catch (const std::bad_alloc&) {
    return fail(ENOMEM, "block status");
  }
}

nbdkit_plugin plugin = [] {
  nbdkit_plugin p{};
  p.name = "shareblk";
  p.longname = "shareblk attachments";
  p.version = SHAREBLK_VERSION;
  p.description = "Serves the live attachments of a shareblkd daemon under their export names";
  p.config = shareblk_config;
  p.config_complete = shareblk_config_complete;
  p.config_help = "control=<SOCKET>  (required) shareblkd's control socket";
  p.magic_config_key = "control";
  p.open = shareblk_open;
  p.close = shareblk_close;
  p.get_size = shareblk_get_size;
  p.is_rotational = shareblk_is_rotational;
  p.can_write = shareblk_can_write;
  p.can_flush = shareblk_can_flush;
  p.can_trim = shareblk_can_trim;
  p.can_zero = shareblk_can_zero;
  p.can_fast_zero = shareblk_can_fast_zero;
  p.can_fua = shareblk_can_fua;
  p.can_multi_conn = shareblk_can_multi_conn;
  p.can_extents = shareblk_can_extents;
  p.pread = shareblk_pread;
  p.pwrite = shareblk_pwrite;
  p.flush = shareblk_flush;
  p.trim = shareblk_trim;
  p.zero = shareblk_zero;
  p.extents = shareblk_extents;
  return p;
}();

}  // namespace

NBDKIT_REGISTER_PLUGIN(plugin)
