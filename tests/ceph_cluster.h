// A throwaway Ceph cluster for tests of RBD-backed volumes: one monitor and one OSD from the
// distribution's packages (ceph-mon, ceph-osd, ceph-common), all of it under a temp directory,
// up in about a second. No cephx and no manager; the OSD keeps its data in memory (memstore),
// so nothing outlives stop(). Two clusters in two processes do not clash: each monitor gets a
// port found free, the OSD picks its own.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "tests/support.h"

namespace shareblk::testing {

class CephCluster {
 public:
  // The programs start() runs that are not on PATH, space-separated; empty when all are there.
  static std::string missing_programs();

  // Makes the temp directory; starts nothing.
  CephCluster();
  // stop(): a failed test leaves no daemon behind. Should the process die without getting here,
  // the daemons die with the thread that called start() (PR_SET_PDEATHSIG); the directory stays.
  ~CephCluster();
  CephCluster(const CephCluster&) = delete;
  CephCluster& operator=(const CephCluster&) = delete;

  // Makes the cluster and starts its daemons; returns once pool() takes RBD images. Empty when
  // the cluster is up, otherwise why not, with the tail of the failed step's log (the logs go
  // with the temp directory). Call it once.
  std::string start();
  // The ceph.conf to give every client (rados_conf_read_file, `ceph -c`, `rbd -c`): the
  // monitor's address, no authentication, client logs in the temp directory.
  std::string conf_path() const { return dir_ / "ceph.conf"; }
  // A pool of one replica, initialised for RBD.
  const std::string& pool() const { return pool_; }
  // A daemon stopped with SIGSTOP for as long as this lives (SIGCONT when it goes, or at
  // reset()): a hung or partitioned host, whose sockets stay open and say nothing.
  class Frozen {
   public:
    explicit Frozen(pid_t pid);
    ~Frozen() { reset(); }
    Frozen(const Frozen&) = delete;
    Frozen& operator=(const Frozen&) = delete;
    void reset();

   private:
    pid_t pid_;
  };
  // The OSD: requests get no answer while the monitor goes on.
  [[nodiscard]] Frozen freeze_osd() const { return Frozen(osd_); }
  // The monitor: the OSD goes on serving clients that have the cluster's maps.
  [[nodiscard]] Frozen freeze_monitor() const { return Frozen(mon_); }
  // Stops the OSD and then the monitor (an OSD going down tells its monitor, and waits 5 s for
  // one that is gone): SIGTERM, SIGKILL after 10 s. Idempotent.
  void stop();

 private:
  RunResult ceph(std::vector<std::string> args) const;
  void write_conf() const;
  // Starts the monitor on a new port; `clash` is set when the port turned out to be taken.
  std::string start_monitor(bool& clash);
  std::string start_osd();
  // `what` failed: the command's `output` and the tail of the daemon `name`'s logs ("mon.a").
  std::string failure(const std::string& what, const std::string& output,
                      const std::string& name) const;

  TempDir dir_;
  std::string fsid_;
  std::string pool_ = "rbd";
  int port_ = 0;
  pid_t mon_ = -1;
  pid_t osd_ = -1;
};

}  // namespace shareblk::testing
