// A gtest suite that shares one throwaway Ceph cluster (ceph_cluster.h) among its tests: started
// once for the suite, stopped after its last test. A test that cannot have it skips with the
// reason (a failure under CI=true), or fails with why the cluster did not come up.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "tests/ceph_cluster.h"

namespace shareblk::testing {

class CephSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!CephCluster::missing_programs().empty()) return;
    ceph_ = std::make_unique<CephCluster>();
    why_down_ = ceph_->start();
  }
  static void TearDownTestSuite() { ceph_.reset(); }  // stops the daemons

  // Call first in SetUp(); then ASSERT_FALSE(HasFatalFailure()) or return on a skip.
  static void require_cluster() {
    const std::string missing = CephCluster::missing_programs();
    SHAREBLK_REQUIRE(missing.empty(),
                     "the RBD store's tests need " + missing + " (ceph-mon ceph-osd ceph-common)");
    ASSERT_TRUE(why_down_.empty()) << why_down_;
  }

  static inline std::unique_ptr<CephCluster> ceph_;
  static inline std::string why_down_;
};

}  // namespace shareblk::testing
