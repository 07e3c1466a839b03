// rbd: volumes as RBD images in a Ceph pool (docs/scale-out.md), for gateways whose volumes
// outgrow one host. Each volume is the image `volume-<id>` of POOL, made, grown and removed
// with librbd; its I/O goes through librbd's asynchronous calls, reaped on the io_uring worker
// that serves the volume (backend::RemoteImage). The control plane sees an ordinary
// store::VolumeStore, and the store::Gateways through which the gateways of the pool coordinate.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "store/gateways.h"
#include "store/volume_store.h"

namespace shareblk::rbd {

// False when this build has no librbd (librbd-dev was missing): make_rbd_store() then fails
// with ENOTSUP.
bool available();

// How to reach the cluster: the daemon's --store rbd:POOL, --ceph-conf, --ceph-id and
// --ceph-timeout.
struct ClusterOptions {
  std::string pool;
  std::string conf_path;  // empty: librados' own search (CEPH_CONF, /etc/ceph/ceph.conf)
  std::string client_id;  // the cephx user without "client."; empty: "admin"
  // Connecting, and every request to a monitor or an OSD, fails after this long (then EIO
  // to the client) rather than waiting for the cluster for ever.
  std::chrono::seconds timeout{30};
  // Called once, on whichever thread first sees it and without blocking it for long, when
  // the cluster refuses this client as blocklisted: a takeover on another gateway has fenced
  // this one, and every request of this client will fail from now on (docs/scale-out.md,
  // "A fenced gateway").
  std::function<void()> on_fenced;
};

// Connects to the cluster and opens the pool. A cluster that does not answer within the
// timeout is an error that names the monitors tried; a missing pool is ENOENT.
// The images are opened with librbd's cache off (rbd_cache = false, whatever the
// configuration says): librbd then acknowledges a write only once the OSDs have it durable,
// which makes FUA and FLUSH hold without a cache to drain, and keeps no bytes of a shared
// volume in one gateway's memory (docs/scale-out.md, "Durability"). Unless the configuration
// says otherwise, librbd also starts each request on the calling worker's thread
// (rbd_non_blocking_aio = false; docs/scale-out.md, "I/O").
// `gateways` is set with the store: the pool's records, and its images' locks as writer locks.
std::unique_ptr<store::VolumeStore> make_rbd_store(const ClusterOptions& options,
                                                   std::unique_ptr<store::Gateways>& gateways,
                                                   store::StoreError& error);

}  // namespace shareblk::rbd
