// The RBD volume store: images `volume-<id>` in one pool, managed with librbd.
#include "rbd/rbd_store.h"

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "rbd/rbd_image.h"

namespace shareblk::rbd {

namespace {

constexpr const char* kPrefix = "volume-";
// The image metadata keys that hold a volume's definition (save_definition).
const char* definition_key(store::Gateways::DefinitionPart part) {
  return part == store::Gateways::DefinitionPart::Writer ? "shareblk.writer" : "shareblk.volume";
}
// The RADOS object of a volume's shared record (read_record), and its version's xattr.
constexpr const char* kRecordPrefix = "shareblk.volume.";
constexpr const char* kRecordVersion = "shareblk.version";
// The RADOS object that names an attachment's volume (link_attachment).
constexpr const char* kLinkPrefix = "shareblk.attachment.";

store::StoreError failure(int rc, const std::string& what) {
  return store::StoreError::from_errno(-rc, what);
}

// A librados configuration value, or "" when it has none.
std::string conf_value(rados_t rados, const char* key) {
  char value[1024] = {};
  return rados_conf_get(rados, key, value, sizeof value - 1) == 0 ? value : "";
}

// An image opened for a control call (resize), closed at the end of the scope.
struct ScopedImage {
  ~ScopedImage() {
    if (image) rbd_close(image);
  }
  rbd_image_t image = nullptr;
};

// What the store and the gateways' records share: the pool's client, how they name the
// pool's objects, and how they report a failure.
class PoolClient {
 protected:
  explicit PoolClient(std::shared_ptr<Cluster> cluster) : cluster_(std::move(cluster)) {}

  // Calls fail as the images' requests do: a blocklisted client is noted.
  store::StoreError failure(int rc, const std::string& what) const {
    cluster_->note(rc);
    return rbd::failure(rc, what);
  }
  static std::string record_name(const std::string& id) { return kRecordPrefix + id; }
  static std::string image_name(const std::string& id) { return kPrefix + id; }
  std::string where(const std::string& name) const { return cluster_->pool + "/" + name; }

  std::shared_ptr<Cluster> cluster_;
};

class RbdVolumeStore final : public store::VolumeStore, private PoolClient {
 public:
  explicit RbdVolumeStore(std::shared_ptr<Cluster> cluster) : PoolClient(std::move(cluster)) {}

  std::string kind() const override { return "rbd:" + cluster_->pool; }
  bool local() const override { return false; }

  store::StoreError create(const std::string& id, uint64_t size) override {
    const std::string name = image_name(id);
    // The pool's (or the cluster's) default features: with exclusive-lock, one gateway at a
    // time writes, which the fencing of several gateways builds on.
    rbd_image_options_t opts = nullptr;
    rbd_image_options_create(&opts);
    const int rc = rbd_create4(cluster_->io, name.c_str(), size, opts);
    rbd_image_options_destroy(opts);
    if (rc < 0) return failure(rc, "create RBD image " + where(name));
    return {};
  }

  store::StoreError extend(const std::string& id, uint64_t size) override {
    const std::string name = image_name(id);
    ScopedImage image;
    if (int rc = rbd_open(cluster_->io, name.c_str(), &image.image, nullptr); rc < 0) {
      return failure(rc, "open RBD image " + where(name));
    }
    uint64_t now = 0;
    if (int rc = rbd_get_size(image.image, &now); rc < 0) return failure(rc, "size of " + name);
    if (now >= size) return {};
    // The gateway's open image hears of the new size from the header's watch.
    if (int rc = rbd_resize2(image.image, size, false, nullptr, nullptr); rc < 0) {
      return failure(rc, "resize RBD image " + where(name));
    }
    return {};
  }

  store::StoreError remove(const std::string& id, const store::Progress&) override {
    const std::string name = image_name(id);
    // The ring that served the volume closes its image as soon as it wakes (RemoteImage::
    // orphan): until then the image has a watcher, and librbd refuses with EBUSY.
    for (int attempt = 0;; ++attempt) {
      const int rc = rbd_remove(cluster_->io, name.c_str());
      if (rc == 0 || rc == -ENOENT) {
        rados_remove(cluster_->io, record_name(id).c_str());  // absent, mostly: no attachment
        return {};
      }
      if (rc != -EBUSY || attempt == 100) return failure(rc, "remove RBD image " + where(name));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  store::StoreError open(const std::string& id, uint64_t size,
                         std::shared_ptr<backend::Volume>& out) override {
    const std::string name = image_name(id);
    std::shared_ptr<RbdImage> image;
    if (int err = RbdImage::open(cluster_, name, image)) {
      return store::StoreError::from_errno(err, "open RBD image " + where(name));
    }
    uint64_t actual = 0;
    if (int err = image->size(actual)) return store::StoreError::from_errno(err, "size of " + name);
    if (actual < size) {
      // Shrunk behind our back: serving the recorded size would read past its end.
      return {std::error_code(EIO, std::generic_category()),
              "RBD image " + where(name) + " holds " + std::to_string(actual) +
                  " bytes, less than the volume's " + std::to_string(size) +
                  " (it was resized outside shareblk)"};
    }
    out = backend::Volume::open_remote(std::move(image), "rbd:" + where(name), size);
    return {};
  }

  store::StoreError refresh(const std::string& id, uint64_t size,
                            backend::Volume& volume) override {
    if (int err = volume.refresh_size()) {
      return store::StoreError::from_errno(err, "size of " + image_name(id));
    }
    if (volume.size() < size) {
      return store::StoreError::from_errno(
          EIO, "RBD image " + where(image_name(id)) + " did not grow to " + std::to_string(size));
    }
    return {};
  }

  store::StoreError list(std::vector<std::string>& ids) override {
    ids.clear();
    std::vector<rbd_image_spec_t> images(64);
    size_t count = images.size();
    int rc = 0;
    while ((rc = rbd_list2(cluster_->io, images.data(), &count)) == -ERANGE) {
      images.resize(count);
    }
    if (rc < 0) return failure(rc, "list RBD images of pool " + cluster_->pool);
    for (size_t i = 0; i < count; ++i) {
      const std::string name = images[i].name;
      if (name.rfind(kPrefix, 0) == 0) ids.push_back(name.substr(std::strlen(kPrefix)));
    }
    rbd_image_spec_list_cleanup(images.data(), count);
    return {};
  }
};

// The gateways' records of the pool's volumes: RADOS objects and image metadata beside the
// images, and the images' exclusive locks as the writer lock.
class RbdGateways final : public store::Gateways, private PoolClient {
 public:
  explicit RbdGateways(std::shared_ptr<Cluster> cluster) : PoolClient(std::move(cluster)) {}

  // The volume's image holds the lock; the store opens nothing else.
  int claim_writer(backend::Volume& volume) override {
    RbdImage* image = image_of(volume);
    return image ? image->claim_writer() : EINVAL;
  }
  int fence_writer(backend::Volume& volume, std::string& fenced, const std::string& only) override {
    RbdImage* image = image_of(volume);
    return image ? image->fence_writer(fenced, only) : EINVAL;
  }
  int lock_owner(backend::Volume& volume, std::string& out) override {
    RbdImage* image = image_of(volume);
    return image ? image->lock_owner(out) : EINVAL;
  }
  void release_writer(backend::Volume& volume) override {
    if (RbdImage* image = image_of(volume)) image->release_writer();
  }

  // In the image's own metadata: it goes with the image, and librbd sends the write to the
  // gateway holding the image's lock, if another does.
  store::StoreError save_definition(const std::string& id, DefinitionPart part,
                                    const std::string& text) override {
    const std::string name = image_name(id);
    ScopedImage image;
    if (int rc = rbd_open(cluster_->io, name.c_str(), &image.image, nullptr); rc < 0) {
      return failure(rc, "open RBD image " + where(name));
    }
    if (int rc = rbd_metadata_set(image.image, definition_key(part), text.c_str()); rc < 0) {
      return failure(rc, "record the volume's definition in RBD image " + where(name));
    }
    return {};
  }

  store::StoreError load_definition(const std::string& id, DefinitionPart part,
                                    std::string& text) override {
    const std::string name = image_name(id);
    ScopedImage image;
    if (int rc = rbd_open_read_only(cluster_->io, name.c_str(), &image.image, nullptr); rc < 0) {
      return failure(rc, "open RBD image " + where(name));
    }
    std::string value(4096, '\0');
    size_t length = value.size();
    int rc = 0;
    while ((rc = rbd_metadata_get(image.image, definition_key(part), value.data(), &length)) ==
           -ERANGE) {
      value.resize(length);
    }
    if (rc < 0) return failure(rc, "the volume's definition in RBD image " + where(name));
    value.resize(length > 0 ? length - 1 : 0);  // the length counts the final NUL
    text = std::move(value);
    return {};
  }

  // A RADOS object of the pool beside the image; its version in an xattr, which a write
  // compares and bumps in the same operation as it replaces the data (one atomic OSD op).
  store::StoreError read_record(const std::string& id, std::string& text,
                                uint64_t& version) override {
    const std::string oid = record_name(id);
    std::string data(64 * 1024, '\0');
    for (;;) {
      rados_read_op_t op = rados_create_read_op();
      size_t got = 0;
      int read_rc = 0;
      int xattrs_rc = 0;
      rados_xattrs_iter_t xattrs = nullptr;
      rados_read_op_read(op, 0, data.size(), data.data(), &got, &read_rc);
      rados_read_op_getxattrs(op, &xattrs, &xattrs_rc);
      const int rc = rados_read_op_operate(op, cluster_->io, oid.c_str(), 0);
      rados_release_read_op(op);
      if (rc == -ENOENT) {
        if (xattrs) rados_getxattrs_end(xattrs);
        text.clear();
        version = 0;
        return {};
      }
      version = 0;
      if (rc == 0 && xattrs_rc == 0 && xattrs) {
        const char* name = nullptr;
        const char* value = nullptr;
        size_t length = 0;
        while (rados_getxattrs_next(xattrs, &name, &value, &length) == 0 && name != nullptr) {
          if (std::strcmp(name, kRecordVersion) == 0) {
            version = std::strtoull(std::string(value, length).c_str(), nullptr, 10);
          }
        }
      }
      if (xattrs) rados_getxattrs_end(xattrs);
      if (rc < 0) return failure(rc, "read " + where(oid));
      if (read_rc < 0) return failure(read_rc, "read " + where(oid));
      if (got < data.size()) {
        text.assign(data.data(), got);
        return {};
      }
      data.resize(data.size() * 4);  // it may hold more
    }
  }

  store::StoreError write_record(const std::string& id, const std::string& text,
                                 uint64_t version) override {
    const std::string oid = record_name(id);
    const std::string was = std::to_string(version);
    const std::string next = std::to_string(version + 1);
    rados_write_op_t op = rados_create_write_op();
    if (version == 0) {
      rados_write_op_create(op, LIBRADOS_CREATE_EXCLUSIVE, nullptr);
    } else {
      rados_write_op_cmpxattr(op, kRecordVersion, LIBRADOS_CMPXATTR_OP_EQ, was.data(), was.size());
    }
    rados_write_op_setxattr(op, kRecordVersion, next.data(), next.size());
    rados_write_op_write_full(op, text.data(), text.size());
    int rc = rados_write_op_operate(op, cluster_->io, oid.c_str(), nullptr, 0);
    rados_release_write_op(op);
    // Another gateway wrote first: it made the object (EEXIST), or changed its version.
    if (rc == -EEXIST || rc == -ECANCELED || (version != 0 && rc == -ENOENT)) rc = -ECANCELED;
    if (rc < 0) return failure(rc, "write " + where(oid) + " (version " + was + ")");
    return {};
  }

  // A RADOS watch on the record's object; its callbacks run on librados' threads and only
  // call `changed`, which must not block, then acknowledge the notify.
  store::StoreError watch_record(const std::string& id, const RecordChanged& changed) override {
    std::lock_guard lock(watches_mutex_);
    if (watches_.count(id) != 0) return {};
    auto watch = std::make_unique<Watch>(Watch{cluster_.get(), id, record_name(id), changed, 0});
    const int rc = rados_watch3(cluster_->io, watch->oid.c_str(), &watch->cookie, on_notify,
                                on_watch_error, 30, watch.get());
    if (rc < 0) return failure(rc, "watch " + where(watch->oid));
    watches_.emplace(id, std::move(watch));
    return {};
  }

  void unwatch_record(const std::string& id) override {
    std::unique_ptr<Watch> watch;
    {
      std::lock_guard lock(watches_mutex_);
      auto it = watches_.find(id);
      if (it == watches_.end()) return;
      watch = std::move(it->second);
      watches_.erase(it);
    }
    rados_unwatch2(cluster_->io, watch->cookie);
    rados_watch_flush(cluster_->rados);  // no callback of it runs after this
  }

  store::StoreError notify_record(const std::string& id,
                                  std::chrono::milliseconds timeout) override {
    const std::string oid = record_name(id);
    char* reply = nullptr;
    size_t reply_length = 0;
    const int rc = rados_notify2(cluster_->io, oid.c_str(), "", 0,
                                 static_cast<uint64_t>(timeout.count()), &reply, &reply_length);
    if (reply) rados_buffer_free(reply);
    if (rc < 0) return failure(rc, "notify the watchers of " + where(oid));
    return {};
  }

  // A small object per attachment naming its volume; written once, removed at its detach.
  store::StoreError link_attachment(const std::string& attachment_id,
                                    const std::string& volume_id) override {
    const std::string oid = kLinkPrefix + attachment_id;
    const int rc = rados_write_full(cluster_->io, oid.c_str(), volume_id.data(), volume_id.size());
    if (rc < 0) return failure(rc, "write " + where(oid));
    return {};
  }

  store::StoreError linked_volume(const std::string& attachment_id,
                                  std::string& volume_id) override {
    const std::string oid = kLinkPrefix + attachment_id;
    std::string data(512, '\0');
    const int rc = rados_read(cluster_->io, oid.c_str(), data.data(), data.size(), 0);
    if (rc < 0) return failure(rc, "read " + where(oid));
    volume_id.assign(data.data(), static_cast<size_t>(rc));
    return {};
  }

  store::StoreError unlink_attachment(const std::string& attachment_id) override {
    const std::string oid = kLinkPrefix + attachment_id;
    const int rc = rados_remove(cluster_->io, oid.c_str());
    if (rc < 0 && rc != -ENOENT) return failure(rc, "remove " + where(oid));
    return {};
  }

  ~RbdGateways() override {
    std::vector<std::string> ids;
    {
      std::lock_guard lock(watches_mutex_);
      for (const auto& [id, watch] : watches_) ids.push_back(id);
    }
    for (const std::string& id : ids) unwatch_record(id);
  }

 private:
  struct Watch {
    Cluster* cluster;
    std::string id;
    std::string oid;
    RecordChanged changed;
    uint64_t cookie;
  };
  static void on_notify(void* arg, uint64_t notify_id, uint64_t cookie, uint64_t /*notifier*/,
                        void* /*data*/, size_t /*length*/) {
    auto* watch = static_cast<Watch*>(arg);
    watch->changed(watch->id);
    rados_notify_ack(watch->cluster->io, watch->oid.c_str(), notify_id, cookie, nullptr, 0);
  }
  // The watch was lost for a while (an OSD moved, a reconnect): notifies may have been
  // missed, so the record is read again; librados renews the watch itself.
  static void on_watch_error(void* arg, uint64_t /*cookie*/, int err) {
    auto* watch = static_cast<Watch*>(arg);
    spdlog::warn("store: the watch on {} was interrupted ({}); reading it again", watch->oid,
                 std::strerror(-err));
    watch->changed(watch->id);
  }

  std::mutex watches_mutex_;
  std::map<std::string, std::unique_ptr<Watch>> watches_;
  static RbdImage* image_of(backend::Volume& volume) {
    return dynamic_cast<RbdImage*>(volume.remote().get());
  }
};

}  // namespace

bool available() {
  return true;
}

std::unique_ptr<store::VolumeStore> make_rbd_store(const ClusterOptions& options,
                                                   std::unique_ptr<store::Gateways>& gateways,
                                                   store::StoreError& error) {
  auto cluster = std::make_shared<Cluster>();
  cluster->pool = options.pool;
  cluster->on_fenced = options.on_fenced;
  const char* id = options.client_id.empty() ? nullptr : options.client_id.c_str();
  if (int rc = rados_create(&cluster->rados, id); rc < 0) {
    cluster->rados = nullptr;
    error = failure(rc, "librados");
    return nullptr;
  }
  // Defaults the configuration may change (rbd_store.h says why): librbd starts a request on
  // the worker's thread instead of handing it to its own first, a thread hop less per request;
  // the objecter's throttles, the one thing that could then make a worker wait, are set above
  // what the workers can have in flight (1 GiB of payload each, 256 requests a connection).
  rados_conf_set(cluster->rados, "rbd_non_blocking_aio", "false");
  rados_conf_set(cluster->rados, "objecter_inflight_ops", "1048576");
  rados_conf_set(cluster->rados, "objecter_inflight_op_bytes", "68719476736");
  const char* conf = options.conf_path.empty() ? nullptr : options.conf_path.c_str();
  if (int rc = rados_conf_read_file(cluster->rados, conf); rc < 0) {
    error = failure(
        rc, "read Ceph configuration " +
                (options.conf_path.empty() ? std::string("(default search)") : options.conf_path));
    return nullptr;
  }
  rados_conf_parse_env(cluster->rados, nullptr);
  const std::string timeout = std::to_string(options.timeout.count());
  for (const char* key : {"client_mount_timeout", "rados_mon_op_timeout", "rados_osd_op_timeout"}) {
    rados_conf_set(cluster->rados, key, timeout.c_str());
  }
  // librbd's cache off: a write is acknowledged once the OSDs have it durable (rbd_store.h).
  rados_conf_set(cluster->rados, "rbd_cache", "false");
  // A takeover's break of another gateway's lock blocklists it first: the fence
  // (RbdImage::fence_writer).
  rados_conf_set(cluster->rados, "rbd_blocklist_on_break_lock", "true");
  if (int rc = rados_connect(cluster->rados); rc < 0) {
    const std::string mons = conf_value(cluster->rados, "mon_host");
    error = failure(rc, "connect to the Ceph cluster at " +
                            (mons.empty() ? std::string("(no mon_host configured)") : mons) +
                            " within " + timeout + " s");
    return nullptr;
  }
  if (int rc = rados_ioctx_create(cluster->rados, options.pool.c_str(), &cluster->io); rc < 0) {
    cluster->io = nullptr;
    error = failure(rc, "open pool " + options.pool);
    return nullptr;
  }
  spdlog::info("store: RBD pool {} of the cluster at {} (client.{})", options.pool,
               conf_value(cluster->rados, "mon_host"),
               options.client_id.empty() ? "admin" : options.client_id);
  gateways = std::make_unique<RbdGateways>(cluster);
  return std::make_unique<RbdVolumeStore>(std::move(cluster));
}

}  // namespace shareblk::rbd
