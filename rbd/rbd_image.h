// Internal to rbd/: a connection to the cluster, and one open image as a backend::RemoteImage.
#pragma once

#include <rados/librados.h>
#include <rbd/librbd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace shareblk::rbd {

// librados' handle and the pool's I/O context. Images keep it alive: librados must not shut
// down under an open image, and the last image may close after the store is gone (a ring lets
// go of its image only once the volume is gone).
struct Cluster {
  ~Cluster();
  rados_t rados = nullptr;
  rados_ioctx_t io = nullptr;
  std::string pool;
  std::function<void()> on_fenced;  // ClusterOptions::on_fenced
  std::atomic<bool> fenced{false};
  // Looks at a failed result (< 0): the first that says this client is blocklisted calls
  // on_fenced.
  void note(int rc);
};

// A positive errno for the wire from a librbd or librados result (< 0). A request that timed
// out, or whose client the cluster has blocklisted, is EIO: the client can do nothing else.
int to_errno(int rc);

class RbdImage final : public backend::RemoteImage {
 public:
  // Opens image `name` of the cluster's pool, its completions told through an eventfd.
  // Returns 0 or errno.
  static int open(std::shared_ptr<Cluster> cluster, const std::string& name,
                  std::shared_ptr<RbdImage>& out);
  ~RbdImage() override;
  RbdImage(const RbdImage&) = delete;
  RbdImage& operator=(const RbdImage&) = delete;

  int start(backend::Op op, uint32_t flags, uint64_t offset, uint64_t length, char* buf,
            void* tag) override;
  size_t poll(Completed* out, size_t max) override;
  int event_fd() const override { return event_fd_; }
  void orphan() override;
  bool orphaned() const override { return orphaned_.load(std::memory_order_acquire); }
  int execute(backend::Op op, uint32_t flags, uint64_t offset, uint64_t length, char* buf) override;
  int extents(uint64_t offset, uint64_t length, size_t max_extents,
              std::vector<backend::Extent>& out) override;
  int size(uint64_t& out) override;
  bool writable() const override { return true; }
  // The image's exclusive lock as a single-writer volume's writer lock (store::Gateways'
  // claim_writer, fence_writer, lock_owner, release_writer say what each does).
  int claim_writer();
  int fence_writer(std::string& fenced, const std::string& only);
  int lock_owner(std::string& out);
  void release_writer();

 private:
  RbdImage() = default;
  // The clients other than this image's that hold its exclusive lock (none when it holds it
  // or nobody does). Returns 0 or a librbd error (< 0).
  int owners_elsewhere(std::vector<std::string>& out);
  // Every client that holds the lock, this image's included. Returns 0 or a librbd error.
  int holders(std::vector<std::string>& out);
  // to_errno(), having let the cluster note a fence.
  int failed(int rc) const;
  std::shared_ptr<Cluster> cluster_;
  rbd_image_t image_ = nullptr;
  int event_fd_ = -1;
  std::atomic<bool> orphaned_{false};
};

}  // namespace shareblk::rbd
