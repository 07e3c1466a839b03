// ceph-cluster: the tests' throwaway Ceph cluster (ceph_cluster.h) as a command, for the
// benchmarks (bench/rbd-compare). Starts it, prints "conf PATH" and "pool NAME" on stdout
// once RBD images can be made, and stops it on SIGTERM or SIGINT (or when stdin closes).
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <iostream>

#include "tests/ceph_cluster.h"

int main() {
  using shareblk::testing::CephCluster;
  const std::string missing = CephCluster::missing_programs();
  if (!missing.empty()) {
    std::cerr << "ceph-cluster: needs " << missing << "\n";
    return 1;
  }
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  sigprocmask(SIG_BLOCK, &stop, nullptr);
  CephCluster ceph;
  const std::string why = ceph.start();
  if (!why.empty()) {
    std::cerr << "ceph-cluster: " << why << "\n";
    return 1;
  }
  std::cout << "conf " << ceph.conf_path() << "\npool " << ceph.pool() << std::endl;
  // Until the signal, or stdin's end (the parent went away).
  for (;;) {
    pollfd in{STDIN_FILENO, POLLIN, 0};
    timespec tick{0, 200 * 1000 * 1000};
    siginfo_t info{};
    if (sigtimedwait(&stop, &info, &tick) > 0) break;
    if (::poll(&in, 1, 0) > 0) {
      char c;
      if (::read(STDIN_FILENO, &c, 1) <= 0) break;
    }
  }
  ceph.stop();
  return 0;
}
