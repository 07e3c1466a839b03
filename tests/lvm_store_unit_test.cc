// The LVM store driven through a fake lvm2: the commands it issues for each operation, how it
// reads lvm2's JSON reports, and which errno each of lvm2's failures becomes. lvm2's words
// here are what lvm2 2.03.16 (Debian 12) prints; e2e_lvm_tests runs the real thing.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "lvm/lvm_store.h"
#include "tests/support.h"

namespace shareblk::lvm {
namespace {

constexpr char kVg[] = "vg0";
constexpr char kConfig[] = "devices{filter=[\"a|^/dev/loop7$|\",\"r|.*|\"]}";
constexpr uint64_t kExtent = 64 * 1024;  // small extents keep the fake PV small
constexpr uint64_t kPeStart = 4096;

CommandResult ok(std::string out = {}) {
  return {.status = 0, .exec_errno = 0, .out = std::move(out), .err = {}};
}

// What lvm2 prints on failure: exit status 5, the warning it prints on every call without
// device-mapper, then the error.
CommandResult fails(const std::string& error) {
  return {.status = 5,
          .exec_errno = 0,
          .out = {},
          .err =
              "  WARNING: Activation disabled. No device-mapper interaction will be attempted.\n"
              "  " +
              error + "\n"};
}

std::string lv_report(const std::string& rows) {
  return R"({"report": [{"lv": [)" + rows + "]}]}";
}

// lvs --segments for one LV: each segment is {segtype, seg_start, seg_size, seg_pe_ranges}.
std::string seg_report(const std::string& name, const std::string& tags,
                       const std::vector<std::vector<std::string>>& segments) {
  std::string rows;
  for (const auto& s : segments) {
    if (!rows.empty()) rows += ", ";
    rows.append(R"({"lv_name":")").append(name).append(R"(", "lv_tags":")").append(tags);
    rows.append(R"(", "lv_size":"0", "segtype":")").append(s[0]).append(R"(", "seg_start":")");
    rows.append(s[1]).append(R"(", "seg_size":")").append(s[2]).append(R"(", "seg_pe_ranges":")");
    rows.append(s[3]).append(R"("})");
  }
  return R"({"report": [{"seg": [)" + rows + "]}]}";
}

std::string pv_report(const std::string& pv) {
  return R"({"report": [{"pv": [{"pv_name":")" + pv + R"(", "pe_start":")" +
         std::to_string(kPeStart) + R"(", "vg_extent_size":")" + std::to_string(kExtent) +
         R"("}]}]})";
}

// lvm2 as a script: each tool answers with the results queued for it, in order, and every
// command is recorded without its --config pair (checked to be there, holding the store's
// config). A command nothing was queued for fails the test.
class FakeLvm {
 public:
  void answer(const std::string& tool, CommandResult result) {
    queued_[tool].push_back(std::move(result));
  }

  CommandRunner runner() {
    return [this](const std::vector<std::string>& argv) { return run(argv); };
  }

  // Every command so far, then forgets them.
  std::vector<std::vector<std::string>> take_calls() { return std::exchange(calls_, {}); }

  bool all_answered() const {
    for (const auto& [tool, results] : queued_) {
      if (!results.empty()) return false;
    }
    return true;
  }

 private:
  CommandResult run(const std::vector<std::string>& argv) {
    std::vector<std::string> call = argv;
    if (argv.size() >= 3 && argv[1] == "--config") {
      // Without device-mapper the store puts activation=0 in front of the operator's config.
      EXPECT_TRUE(argv[2].ends_with(config_)) << argv[2];
      EXPECT_FALSE(argv[2].empty()) << "lvm2 refuses an empty --config";
      call.erase(call.begin() + 1, call.begin() + 3);
    } else if (!config_.empty()) {
      ADD_FAILURE() << argv[0] << " was run without --config";
    }
    calls_.push_back(call);
    auto& results = queued_[argv[0]];
    if (results.empty()) {
      ADD_FAILURE() << "unexpected lvm2 command: " << ::testing::PrintToString(argv);
      return fails("(the fake has no answer)");
    }
    CommandResult result = std::move(results.front());
    results.pop_front();
    return result;
  }

  std::map<std::string, std::deque<CommandResult>> queued_;
  std::vector<std::vector<std::string>> calls_;

 public:
  std::string config_ = kConfig;  // the operator's config the store was given
};

using Argv = std::vector<std::string>;

const Argv kListCall = {"lvs", "--reportformat", "json", "-o", "lv_name,lv_tags", kVg};

Argv lvs_segments_call(const std::string& id) {
  return {"lvs",
          "--reportformat",
          "json",
          "--units",
          "b",
          "--nosuffix",
          "--segments",
          "-o",
          "lv_name,lv_tags,lv_size,segtype,seg_start,seg_size,seg_pe_ranges",
          std::string(kVg) + "/volume-" + id};
}

const Argv kPvsCall = {"pvs",  "--reportformat",
                       "json", "--units",
                       "b",    "--nosuffix",
                       "-o",   "pv_name,pe_start,vg_extent_size",
                       "-S",   std::string("vg_name=") + kVg};

class LvmStoreUnit : public ::testing::Test {
 protected:
  // A store on the fake, past its start-up check (an lvs of the VG).
  std::unique_ptr<VolumeStore> make_store() {
    lvm_.answer("lvs", ok(lv_report("")));
    StoreError error;
    auto store = make_lvm_store(kVg, kConfig, lvm_.runner(), /*device_mapper=*/false, error);
    EXPECT_TRUE(store) << error.message;
    EXPECT_EQ(lvm_.take_calls(), std::vector<Argv>{kListCall});
    return store;
  }

  void TearDown() override { EXPECT_TRUE(lvm_.all_answered()) << "a queued answer went unused"; }

  FakeLvm lvm_;
};

TEST_F(LvmStoreUnit, StartUpFailsWhenTheVolumeGroupIsMissing) {
  lvm_.answer("lvs", fails("Volume group \"vg0\" not found\n  Cannot process volume group vg0"));
  StoreError error;
  EXPECT_FALSE(make_lvm_store(kVg, kConfig, lvm_.runner(), /*device_mapper=*/false, error));
  EXPECT_EQ(error.code.value(), ENOENT);
  EXPECT_NE(error.message.find("Volume group \"vg0\" not found"), std::string::npos)
      << error.message;
  // lvm2's warning on every call would bury the message an operator needs.
  EXPECT_EQ(error.message.find("WARNING"), std::string::npos) << error.message;
  EXPECT_EQ(lvm_.take_calls(), std::vector<Argv>{kListCall});
}

TEST_F(LvmStoreUnit, StartUpSaysWhenLvm2IsNotInstalled) {
  lvm_.answer("lvs", CommandResult{.status = -1, .exec_errno = ENOENT, .out = {}, .err = {}});
  StoreError error;
  EXPECT_FALSE(make_lvm_store(kVg, kConfig, lvm_.runner(), /*device_mapper=*/false, error));
  EXPECT_EQ(error.code.value(), ENOSYS);
  EXPECT_NE(error.message.find("lvm2 is not installed"), std::string::npos) << error.message;
}

TEST_F(LvmStoreUnit, KindNamesTheVolumeGroup) {
  EXPECT_EQ(make_store()->kind(), "lvm:vg0");
}

TEST_F(LvmStoreUnit, CreateMakesATaggedLogicalVolumeOfTheSizeInBytes) {
  auto store = make_store();
  lvm_.answer("lvcreate", ok());
  EXPECT_FALSE(store->create("a1", 5 * 1024 * 1024 + 512));
  EXPECT_EQ(lvm_.take_calls(),
            (std::vector<Argv>{{"lvcreate", "-y", "-Zn", "-an", "--addtag", "shareblk", "-n",
                                "volume-a1", "-L", "5243392b", "vg0"}}));
}

TEST_F(LvmStoreUnit, CreateInAFullVolumeGroupIsNoSpace) {
  auto store = make_store();
  lvm_.answer(
      "lvcreate",
      fails("Volume group \"vg0\" has insufficient free space (13 extents): 256 required."));
  StoreError e = store->create("a1", 1024 * 1024 * 1024);
  EXPECT_EQ(e.code.value(), ENOSPC);
  EXPECT_NE(e.message.find("insufficient free space (13 extents)"), std::string::npos) << e.message;
}

// VolumeStore's contract: create fails with EEXIST if the id has backing.
TEST_F(LvmStoreUnit, CreateOfAnExistingVolumeIsEexist) {
  auto store = make_store();
  lvm_.answer("lvcreate",
              fails("Logical Volume \"volume-a1\" already exists in volume group \"vg0\""));
  StoreError e = store->create("a1", 1024 * 1024);
  EXPECT_EQ(e.code.value(), EEXIST) << e.message;
  EXPECT_NE(e.message.find("already exists"), std::string::npos) << e.message;
}

TEST_F(LvmStoreUnit, AnyOtherLvm2FailureIsEioWithLvm2sWords) {
  auto store = make_store();
  lvm_.answer("lvcreate", fails("Something unforeseen."));
  StoreError e = store->create("a1", 1024 * 1024);
  EXPECT_EQ(e.code.value(), EIO);
  EXPECT_EQ(e.message, "lvcreate vg0/volume-a1: Something unforeseen.");
}

TEST_F(LvmStoreUnit, ExtendRunsLvextendOnlyWhenTheExtentsDoNotHoldTheNewSize) {
  auto store = make_store();
  const Argv size_call = {"lvs", "--reportformat", "json",         "--units", "b", "--nosuffix",
                          "-o",  "lv_size",        "vg0/volume-a1"};
  // The LV is whole extents: 8 MiB already holds 7 MiB + 1, and lvextend would refuse a
  // resize that changes nothing.
  lvm_.answer("lvs", ok(lv_report(R"({"lv_size":"8388608"})")));
  EXPECT_FALSE(store->extend("a1", 7 * 1024 * 1024 + 1));
  EXPECT_EQ(lvm_.take_calls(), std::vector<Argv>{size_call});

  lvm_.answer("lvs", ok(lv_report(R"({"lv_size":"8388608"})")));
  lvm_.answer("lvextend", ok());
  EXPECT_FALSE(store->extend("a1", 8 * 1024 * 1024 + 1));
  EXPECT_EQ(lvm_.take_calls(),
            (std::vector<Argv>{size_call, {"lvextend", "-L", "8388609b", "vg0/volume-a1"}}));
}

TEST_F(LvmStoreUnit, ExtendPastTheFreeSpaceIsNoSpace) {
  auto store = make_store();
  lvm_.answer("lvs", ok(lv_report(R"({"lv_size":"8388608"})")));
  lvm_.answer("lvextend",
              fails("Insufficient free space: 254 extents needed, but only 13 available"));
  StoreError e = store->extend("a1", 1024 * 1024 * 1024);
  EXPECT_EQ(e.code.value(), ENOSPC);
  EXPECT_NE(e.message.find("254 extents needed"), std::string::npos) << e.message;
}

// lvm2 says "Failed to find logical volume" for an LV that is not there; the store's callers
// tell a missing volume (not_found) from a broken one (internal) by ENOENT.
TEST_F(LvmStoreUnit, ExtendOfAMissingVolumeIsEnoent) {
  auto store = make_store();
  lvm_.answer("lvs", fails("Failed to find logical volume \"vg0/volume-a1\""));
  StoreError e = store->extend("a1", 1024 * 1024);
  EXPECT_EQ(e.code.value(), ENOENT) << e.message;
}

TEST_F(LvmStoreUnit, AnUnreadableReportIsEio) {
  auto store = make_store();
  lvm_.answer("lvs", ok("{\"report\": [{\"lv\": []}]}"));  // no row for the LV
  EXPECT_EQ(store->extend("a1", 1024 * 1024).code.value(), EIO);
  lvm_.answer("lvs", ok("not json"));
  std::vector<std::string> ids;
  EXPECT_EQ(store->list(ids).code.value(), EIO);
}

TEST_F(LvmStoreUnit, ListReturnsTheIdsOfTaggedVolumesOnly) {
  auto store = make_store();
  lvm_.answer("lvs", ok(lv_report(R"({"lv_name":"volume-a1", "lv_tags":"shareblk"},
                                     {"lv_name":"root", "lv_tags":""},
                                     {"lv_name":"volume-b2", "lv_tags":"backup,shareblk"},
                                     {"lv_name":"volume-c3", "lv_tags":""})")));
  std::vector<std::string> ids;
  EXPECT_FALSE(store->list(ids));
  // volume-c3 looks like ours but lacks the tag: logged and left alone, never adopted.
  EXPECT_EQ(ids, (std::vector<std::string>{"a1", "b2"}));
  EXPECT_EQ(lvm_.take_calls(), std::vector<Argv>{kListCall});
}

// A fake physical volume: a file with the extents of a logical volume at pe_start + n extents.
class LvmStoreOnAFile : public LvmStoreUnit {
 protected:
  void SetUp() override { testing::make_file(pv_, kPeStart + 8 * kExtent, 0x5a); }

  // The LV of `id` as two linear segments, out of order on the PV: extents 5-6, then 2.
  void answer_layout(const std::string& id, const std::string& tags = "shareblk",
                     const std::string& segtype = "linear") {
    lvm_.answer("lvs", ok(seg_report("volume-" + id, tags,
                                     {{segtype, "0", std::to_string(2 * kExtent), pv_ + ":5-6"},
                                      {"linear", std::to_string(2 * kExtent),
                                       std::to_string(kExtent), pv_ + ":2-2"}})));
    lvm_.answer("pvs", ok(pv_report(pv_)));
  }

  testing::TempDir dir_;
  std::string pv_ = dir_ / "pv.img";
};

TEST_F(LvmStoreOnAFile, OpenServesTheLinearSegmentsAtTheirOffsetsOnThePhysicalVolume) {
  auto store = make_store();
  answer_layout("a1");
  std::shared_ptr<backend::Volume> volume;
  ASSERT_FALSE(store->open("a1", 3 * kExtent, volume));
  EXPECT_EQ(lvm_.take_calls(), (std::vector<Argv>{lvs_segments_call("a1"), kPvsCall}));
  ASSERT_TRUE(volume);
  EXPECT_TRUE(volume->is_mapped());
  EXPECT_EQ(volume->size(), 3 * kExtent);

  // Across the seam: the end of extent 6, then the start of extent 2.
  backend::Handle handle(volume, backend::AttachMode::ReadWrite);
  const std::string data(8192, 'w');
  ASSERT_EQ(handle.write(data.data(), data.size(), 2 * kExtent - 4096, 0), 0);
  volume.reset();
  EXPECT_EQ(testing::read_file(pv_, kPeStart + 7 * kExtent - 4096, 4096), std::string(4096, 'w'));
  EXPECT_EQ(testing::read_file(pv_, kPeStart + 2 * kExtent, 4096), std::string(4096, 'w'));
  EXPECT_EQ(testing::read_file(pv_, kPeStart + 7 * kExtent, 4096), std::string(4096, 0x5a));
}

TEST_F(LvmStoreOnAFile, OpenRefusesALogicalVolumeWithoutOurTag) {
  auto store = make_store();
  answer_layout("a1", "");
  std::shared_ptr<backend::Volume> volume;
  StoreError e = store->open("a1", kExtent, volume);
  EXPECT_EQ(e.code.value(), EEXIST);
  EXPECT_NE(e.message.find("is not shareblk's"), std::string::npos) << e.message;
  EXPECT_FALSE(volume);
}

TEST_F(LvmStoreOnAFile, OpenRefusesSegmentsThatAreNotLinear) {
  auto store = make_store();
  answer_layout("a1", "shareblk", "striped");
  std::shared_ptr<backend::Volume> volume;
  StoreError e = store->open("a1", kExtent, volume);
  EXPECT_EQ(e.code.value(), ENOTSUP);
  EXPECT_NE(e.message.find("striped"), std::string::npos) << e.message;
}

TEST_F(LvmStoreOnAFile, OpenOfAVolumeLargerThanItsLogicalVolumeIsEio) {
  auto store = make_store();
  answer_layout("a1");
  std::shared_ptr<backend::Volume> volume;
  StoreError e = store->open("a1", 4 * kExtent, volume);
  EXPECT_EQ(e.code.value(), EIO);
  EXPECT_NE(e.message.find("is smaller"), std::string::npos) << e.message;
}

TEST_F(LvmStoreOnAFile, RemoveZeroesEveryExtentThenRemovesTheLogicalVolume) {
  auto store = make_store();
  answer_layout("a1");
  lvm_.answer("lvremove", ok());
  EXPECT_FALSE(store->remove("a1", {}));
  EXPECT_EQ(
      lvm_.take_calls(),
      (std::vector<Argv>{lvs_segments_call("a1"), kPvsCall, {"lvremove", "-y", "vg0/volume-a1"}}));
  EXPECT_EQ(testing::read_file(pv_, kPeStart + 5 * kExtent, 2 * kExtent),
            std::string(2 * kExtent, '\0'));
  EXPECT_EQ(testing::read_file(pv_, kPeStart + 2 * kExtent, kExtent), std::string(kExtent, '\0'));
  // Extents of other volumes keep their bytes.
  EXPECT_EQ(testing::read_file(pv_, kPeStart + 3 * kExtent, 2 * kExtent),
            std::string(2 * kExtent, 0x5a));
  EXPECT_EQ(testing::read_file(pv_, kPeStart + 7 * kExtent, kExtent), std::string(kExtent, 0x5a));
}

// The zeroing reports its progress, and stops (ECANCELED, the LV kept) when told to: the daemon
// is stopping, and the next start deletes it again.
TEST_F(LvmStoreOnAFile, RemoveReportsProgressAndStopsWhenToldTo) {
  auto store = make_store();
  answer_layout("a1");
  std::vector<std::pair<uint64_t, uint64_t>> reports;
  StoreError stopped = store->remove("a1", [&](uint64_t done, uint64_t total) {
    reports.emplace_back(done, total);
    return false;
  });
  EXPECT_EQ(stopped.code.value(), ECANCELED) << stopped.message;
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].first, 0u);
  EXPECT_EQ(lvm_.take_calls(), (std::vector<Argv>{lvs_segments_call("a1"), kPvsCall}))
      << "no lvremove after a stop";

  answer_layout("a1");
  lvm_.answer("lvremove", ok());
  reports.clear();
  EXPECT_FALSE(store->remove("a1", [&](uint64_t done, uint64_t total) {
    reports.emplace_back(done, total);
    return true;
  }));
  ASSERT_FALSE(reports.empty());
  EXPECT_EQ(reports.back().first, reports.back().second);
  EXPECT_EQ(reports.back().second, 3 * kExtent);
  lvm_.take_calls();
}

// A delete retried after the LV went (a crash between lvremove and the database, say) must
// succeed, or the volume could never be deleted.
TEST_F(LvmStoreUnit, RemoveOfAVolumeAlreadyGoneIsANoOp) {
  auto store = make_store();
  lvm_.answer("lvs", fails("Failed to find logical volume \"vg0/volume-a1\""));
  StoreError e = store->remove("a1", {});
  EXPECT_FALSE(e) << e.message;
  EXPECT_EQ(lvm_.take_calls(), std::vector<Argv>{lvs_segments_call("a1")});
}

TEST_F(LvmStoreUnit, RemoveReportsALvremoveFailure) {
  auto store = make_store();
  testing::TempDir dir;
  const std::string pv = dir / "pv.img";
  testing::make_file(pv, kPeStart + kExtent);
  lvm_.answer("lvs", ok(seg_report("volume-a1", "shareblk",
                                   {{"linear", "0", std::to_string(kExtent), pv + ":0-0"}})));
  lvm_.answer("pvs", ok(pv_report(pv)));
  lvm_.answer("lvremove", fails("Logical volume vg0/volume-a1 in use."));
  StoreError e = store->remove("a1", {});
  EXPECT_EQ(e.code.value(), EIO);
  EXPECT_NE(e.message.find("in use"), std::string::npos) << e.message;
}

// With device-mapper and no operator config there is no config at all: lvm2 refuses
// `--config ""` ("Failed to set overridden configuration entries").
TEST_F(LvmStoreUnit, WithDeviceMapperAndNoConfigNoConfigIsPassed) {
  lvm_.config_ = "";
  lvm_.answer("lvs", ok(lv_report("")));
  StoreError error;
  auto store = make_lvm_store(kVg, "", lvm_.runner(), /*device_mapper=*/true, error);
  ASSERT_TRUE(store) << error.message;
  lvm_.answer("lvcreate", ok());
  EXPECT_FALSE(store->create("a1", 4 * 1024 * 1024));
  for (const Argv& call : lvm_.take_calls()) {
    EXPECT_EQ(std::find(call.begin(), call.end(), "--config"), call.end())
        << ::testing::PrintToString(call);
  }
}

// Without device-mapper and no operator config, activation=0 alone.
TEST_F(LvmStoreUnit, WithoutDeviceMapperActivationIsOff) {
  lvm_.config_ = "";
  std::vector<std::string> seen;
  StoreError error;
  auto store = make_lvm_store(
      kVg, "",
      [&seen](const std::vector<std::string>& argv) {
        seen = argv;
        return ok(lv_report(""));
      },
      /*device_mapper=*/false, error);
  ASSERT_TRUE(store) << error.message;
  EXPECT_EQ(seen, (Argv{"lvs", "--config", "global{activation=0} ", "--reportformat", "json", "-o",
                        "lv_name,lv_tags", kVg}));
}

// The kernel is asked, not the file system: a node with device-mapper's numbers and no driver
// behind it (what installing lvm2 leaves on a kernel without device-mapper), another
// device's node, and no node at all are all "no device-mapper".
TEST(DeviceMapper, ANodeThatDoesNotAnswerIsNoDeviceMapper) {
  EXPECT_FALSE(device_mapper_answers("/nonexistent/mapper/control"));
  EXPECT_FALSE(device_mapper_answers("/dev/null"));
  SHAREBLK_REQUIRE(testing::is_root(), "mknod needs root");
  std::ifstream misc("/proc/misc");
  bool kernel_has_it = false;
  for (std::string line; std::getline(misc, line);) {
    if (line.ends_with(" device-mapper")) kernel_has_it = true;
  }
  testing::TempDir dir;
  const std::string node = dir / "control";
  ASSERT_EQ(::mknod(node.c_str(), S_IFCHR | 0600, ::makedev(10, 236)), 0) << std::strerror(errno);
  // On a kernel with device-mapper 10:236 is its node, and it answers.
  EXPECT_EQ(device_mapper_answers(node), kernel_has_it);
}

// The privileged helper runs a command for the store only when check_lvm2_request() allows it:
// every command the store issues must pass, and the near misses must not.
TEST_F(LvmStoreUnit, EveryCommandTheStoreIssuesIsOneThePrivilegedHelperAllows) {
  const std::string id = "0b6c1a2e-3f4d-4e5f-8a9b-0c1d2e3f4a5b";
  auto store = make_store();
  lvm_.answer("lvcreate", ok());
  EXPECT_FALSE(store->create(id, 5 * 1024 * 1024));
  lvm_.answer("lvs", ok(lv_report(R"({"lv_size":"8388608"})")));
  lvm_.answer("lvextend", ok());
  EXPECT_FALSE(store->extend(id, 9 * 1024 * 1024));
  lvm_.answer("lvs", ok(lv_report("")));
  std::vector<std::string> ids;
  EXPECT_FALSE(store->list(ids));
  std::vector<Argv> calls = lvm_.take_calls();
  calls.insert(calls.end(), {kListCall,
                             lvs_segments_call(id),
                             kPvsCall,
                             {"lvremove", "-y", std::string(kVg) + "/volume-" + id},
                             {"pvs", "--reportformat", "json", "-o", "pv_name", "-S",
                              std::string("vg_name=") + kVg}});
  for (const Argv& call : calls) {
    std::string why;
    EXPECT_TRUE(check_lvm2_request(kVg, call, why)) << ::testing::PrintToString(call) << why;
  }
  const std::vector<Argv> refused = {
      {"lvremove", "-y", kVg},
      {"lvcreate", "-y", "-n", "volume-" + id, "-L", "1b", "other"},
      {"lvs", std::string(kVg) + "/volume-A1"},
      {"lvs", "--config", "x", kVg},
      {"lvs", "-o", "lv_name,lv_path", kVg},
      {"pvs", "-S", "vg_name=other"},
      {"lvextend", "-L", "+100%FREE", std::string(kVg) + "/volume-" + id},
  };
  for (const Argv& call : refused) {
    std::string why;
    EXPECT_FALSE(check_lvm2_request(kVg, call, why)) << ::testing::PrintToString(call);
    EXPECT_FALSE(why.empty());
  }
}

TEST(LvmDevices, OnlyTheGroupsPhysicalVolumesAndVolumeLvsOpen) {
  const std::vector<std::string> pvs = {"/dev/loop7"};
  const std::string lv = "/dev/vg0/volume-0b6c1a2e-3f4d-4e5f-8a9b-0c1d2e3f4a5b";
  std::string why;
  EXPECT_TRUE(check_lvm2_device("vg0", pvs, "/dev/loop7", O_RDWR | O_DIRECT | O_CLOEXEC, why));
  EXPECT_TRUE(check_lvm2_device("vg0", pvs, lv, O_RDONLY, why));
  EXPECT_FALSE(check_lvm2_device("vg0", pvs, "/dev/loop8", O_RDONLY, why));
  EXPECT_FALSE(check_lvm2_device("vg0", pvs, "/dev/vg0/../../etc/shadow", O_RDONLY, why));
  EXPECT_FALSE(check_lvm2_device("vg0", pvs, "/dev/vg1/volume-0b6c1a2e-3f4d-4e5f-8a9b-0c1d2e3f4a5b",
                                 O_RDONLY, why));
  EXPECT_FALSE(check_lvm2_device("vg0", pvs, "/dev/loop7", O_RDWR | O_TRUNC, why));
  EXPECT_FALSE(check_lvm2_device("vg0", pvs, "/dev/loop7", O_WRONLY | O_CREAT, why));
}

}  // namespace
}  // namespace shareblk::lvm
