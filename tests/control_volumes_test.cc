// The control plane in-process, its volumes: create, params, unknown ids, delete, extend, update.
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/statfs.h>

#include <cstdint>
#include <regex>
#include <string>
#include <utility>

#include "tests/control_fixture.h"

namespace shareblk::testing::control_unit {
namespace {

// --- Volumes ---

TEST_F(ControlPlaneTest, VolumeCreateAcceptsBytesAndSuffixes) {
  const std::pair<Json, uint64_t> cases[] = {
      {"1G", uint64_t{1} << 30},
      {1048576, 1048576},
      {"10M", 10 * (uint64_t{1} << 20)},
      {"4K", 4096},
      {"512", 512},
      {"2k", 2048},
  };
  for (const auto& [size, bytes] : cases) {
    Json v = create_volume(size);
    EXPECT_EQ(v["size"], bytes) << size;
    EXPECT_EQ(fs::file_size(backing(v["id"])), bytes) << size;
  }
}

TEST_F(ControlPlaneTest, VolumeCreateHasTheDocumentedFields) {
  Json v = ok("volume_create", {{"name", "data"}, {"size", "1M"}});
  EXPECT_TRUE(std::regex_match(v["id"].get<std::string>(),
                               std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-"
                                          "[0-9a-f]{12}")))
      << v["id"];
  EXPECT_EQ(v["name"], "data");
  EXPECT_EQ(v["size"], 1048576);
  EXPECT_EQ(v["multiattach"], false);
  EXPECT_EQ(v["bootable"], false);
  EXPECT_EQ(v["status"], "available");
  EXPECT_EQ(v["attachments"], Json::array());
  // A new volume reads as zeroes.
  EXPECT_EQ(shareblk::testing::read_file(backing(v["id"]), 0, 4096), std::string(4096, '\0'));
}

TEST_F(ControlPlaneTest, VolumeCreateRejectsBadSizes) {
  const Json bad_sizes[] = {0,
                            1000,
                            "-5",
                            "1X",
                            -512,
                            "",
                            "0",
                            "1.5G",
                            1.5,
                            true,
                            "513",
                            Json(nullptr),
                            "99999999999999999999",
                            "100000000T"};
  for (const Json& size : bad_sizes) {
    EXPECT_EQ(reason("volume_create", {{"name", "v"}, {"size", size}}), "invalid_params") << size;
  }
  EXPECT_EQ(reason("volume_create", {{"name", "v"}}), "invalid_params");
  EXPECT_EQ(reason("volume_create", {{"size", "1M"}}), "invalid_params");
  EXPECT_EQ(reason("volume_create", {{"name", ""}, {"size", "1M"}}), "invalid_params");
  EXPECT_EQ(reason("volume_create", {{"name", std::string(256, 'n')}, {"size", "1M"}}),
            "invalid_params");
  EXPECT_EQ(reason("volume_create", {{"name", "v"}, {"size", "1M"}, {"multiattach", "yes"}}),
            "invalid_params");
  // A refused create leaves no volume and no backing behind.
  EXPECT_EQ(ok("volume_list", Json::object()), Json::array());
  EXPECT_TRUE(fs::is_empty(volumes_dir()));
}

// A size the file system cannot hold is no_space, and leaves no backing behind. Only where
// the file system refuses at once (ext4: past its largest file; tmpfs: past its size), never
// by filling a disk.
TEST_F(ControlPlaneTest, VolumeCreateBeyondTheStoreIsNoSpace) {
  struct statfs fs_info {};
  ASSERT_EQ(::statfs(volumes_dir().c_str(), &fs_info), 0);
  if (fs_info.f_type != EXT4_SUPER_MAGIC && fs_info.f_type != TMPFS_MAGIC) {
    GTEST_SKIP() << "the volume directory is on neither ext4 nor tmpfs";
  }
  EXPECT_EQ(reason("volume_create", {{"name", "huge"}, {"size", "1000T"}}), "no_space");
  EXPECT_EQ(ok("volume_list", Json::object()), Json::array());
  EXPECT_TRUE(fs::is_empty(volumes_dir()));
}

TEST_F(ControlPlaneTest, UnknownParametersAreRefused) {
  Json v = create_volume();
  const std::string id = v["id"];
  EXPECT_EQ(reason("volume_create", {{"name", "v"}, {"size", "1M"}, {"sise", "1M"}}),
            "invalid_params");
  EXPECT_EQ(reason("volume_list", {{"all", true}}), "invalid_params");
  EXPECT_EQ(reason("volume_show", {{"volume_id", id}, {"verbose", true}}), "invalid_params");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}, {"size", "2M"}, {"force", true}}),
            "invalid_params");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}, {"x", 1}}),
            "invalid_params");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id},
                                         {"instance_uuid", "i"},
                                         {"connector", {{"host", "h"}, {"colour", "red"}}}}),
            "invalid_params");
  // Nothing was attached by the refused calls.
  EXPECT_EQ(volume_status(id), "available");
  EXPECT_EQ(ok("volume_show", {{"volume_id", id}})["size"], 1048576);
}

TEST_F(ControlPlaneTest, BadParameterValuesAreRefused) {
  const std::string id = create_volume()["id"];
  EXPECT_EQ(reason("volume_show", Json::object()), "invalid_params");
  EXPECT_EQ(reason("volume_show", {{"volume_id", 42}}), "invalid_params");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", id}}), "invalid_params");
  EXPECT_EQ(
      reason("attachment_create", {{"volume_id", id}, {"instance_uuid", "i"}, {"mode", "wr"}}),
      "invalid_params");
  const Json bad_connectors[] = {
      "compute-1",                                         // not an object
      Json::object(),                                      // no host
      {{"host", "h"}, {"transport", "rdma"}},              // unknown transport
      {{"host", "h"}, {"ip", "not-an-ip"}},                // not an address
      {{"host", "h"}, {"transport", "tcp"}, {"ip", 127}},  // not a string
  };
  for (const Json& connector : bad_connectors) {
    EXPECT_EQ(reason("attachment_create",
                     {{"volume_id", id}, {"instance_uuid", "i"}, {"connector", connector}}),
              "invalid_params")
        << connector;
  }
  EXPECT_EQ(volume_status(id), "available");
  const std::string attachment = attach(id, "i")["id"];
  EXPECT_EQ(reason("attachment_update", {{"attachment_id", attachment}}), "invalid_params");
  EXPECT_EQ(reason("attachment_update",
                   {{"attachment_id", attachment}, {"connector", {{"transport", "unix"}}}}),
            "invalid_params");
  EXPECT_EQ(attach_status(attachment), "reserved");
}

TEST_F(ControlPlaneTest, UnknownIdsAreNotFound) {
  const std::string nobody = "00000000-0000-4000-8000-000000000000";
  EXPECT_EQ(reason("volume_show", {{"volume_id", nobody}}), "not_found");
  EXPECT_EQ(reason("volume_delete", {{"volume_id", nobody}}), "not_found");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", nobody}, {"size", "2M"}}), "not_found");
  EXPECT_EQ(reason("volume_update", {{"volume_id", nobody}, {"name", "x"}}), "not_found");
  EXPECT_EQ(reason("volume_detach", {{"volume_id", nobody}}), "not_found");
  EXPECT_EQ(reason("attachment_create", {{"volume_id", nobody}, {"instance_uuid", "i"}}),
            "not_found");
  EXPECT_EQ(reason("attachment_list", {{"volume_id", nobody}}), "not_found");
  EXPECT_EQ(reason("attachment_show", {{"attachment_id", nobody}}), "not_found");
  EXPECT_EQ(
      reason("attachment_update", {{"attachment_id", nobody}, {"connector", unix_connector()}}),
      "not_found");
  EXPECT_EQ(reason("attachment_complete", {{"attachment_id", nobody}}), "not_found");
  EXPECT_EQ(reason("attachment_delete", {{"attachment_id", nobody}}), "not_found");
}

TEST_F(ControlPlaneTest, VolumeDeleteIsRefusedWhileAttached) {
  const std::string id = create_volume()["id"];
  ASSERT_TRUE(fs::exists(backing(id)));
  const std::string attachment = attach(id, "instance-1")["id"];  // reserved is live too
  EXPECT_EQ(reason("volume_delete", {{"volume_id", id}}), "volume_in_use");
  ok("attachment_update", {{"attachment_id", attachment}, {"connector", unix_connector()}});
  EXPECT_EQ(reason("volume_delete", {{"volume_id", id}}), "volume_in_use");
  ok("attachment_complete", {{"attachment_id", attachment}});
  EXPECT_EQ(reason("volume_delete", {{"volume_id", id}}), "volume_in_use");
  EXPECT_TRUE(fs::exists(backing(id)));
  EXPECT_EQ(volume_status(id), "in-use");

  ok("attachment_delete", {{"attachment_id", attachment}});
  Json deleted = ok("volume_delete", {{"volume_id", id}, {"wait", true}});
  EXPECT_EQ(deleted["id"], id);
  EXPECT_EQ(deleted["deleted"], true);
  EXPECT_FALSE(fs::exists(backing(id)));
  EXPECT_EQ(reason("volume_show", {{"volume_id", id}}), "not_found");
  EXPECT_EQ(reason("attachment_show", {{"attachment_id", attachment}}), "not_found");
  EXPECT_EQ(ok("volume_list", Json::object()), Json::array());
  EXPECT_EQ(ok("attachment_list", Json::object()), Json::array());
}

TEST_F(ControlPlaneTest, VolumeExtendOnlyGrows) {
  const std::string id = create_volume("1M")["id"];
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}, {"size", "1M"}}), "invalid_params");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}, {"size", "512K"}}), "invalid_params");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}, {"size", "3000"}}), "invalid_params");
  EXPECT_EQ(reason("volume_extend", {{"volume_id", id}}), "invalid_params");
  EXPECT_EQ(fs::file_size(backing(id)), 1048576u);

  Json grown = ok("volume_extend", {{"volume_id", id}, {"size", "3M"}});
  EXPECT_EQ(grown["size"], 3 * 1048576);
  EXPECT_EQ(fs::file_size(backing(id)), 3u * 1048576);
  EXPECT_EQ(ok("volume_show", {{"volume_id", id}})["size"], 3 * 1048576);
  // The new bytes read as zeroes.
  EXPECT_EQ(shareblk::testing::read_file(backing(id), 2 * 1048576, 4096), std::string(4096, '\0'));

  // Grows while attached too: the hypervisor rescans.
  const std::string attachment = attach(id, "i", {{"connector", unix_connector()}})["id"];
  Json bigger = ok("volume_extend", {{"volume_id", id}, {"size", 4 * 1048576}});
  EXPECT_EQ(bigger["size"], 4 * 1048576);
  EXPECT_EQ(bigger["attachments"][0]["connection_info"]["data"]["size"], 4 * 1048576);
  EXPECT_EQ(
      ok("attachment_show", {{"attachment_id", attachment}})["connection_info"]["data"]["size"],
      4 * 1048576);
}

TEST_F(ControlPlaneTest, VolumeUpdateChangesMultiattachOnlyWhileAvailable) {
  const std::string id = create_volume()["id"];
  Json v = ok("volume_update", {{"volume_id", id}, {"multiattach", true}});
  EXPECT_EQ(v["multiattach"], true);
  v = ok("volume_update", {{"volume_id", id}, {"multiattach", false}, {"name", "renamed"}});
  EXPECT_EQ(v["multiattach"], false);
  EXPECT_EQ(v["name"], "renamed");

  const std::string attachment = attach(id, "instance-1")["id"];
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"multiattach", true}}), "volume_in_use");
  ok("attachment_update", {{"attachment_id", attachment}, {"connector", unix_connector()}});
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"multiattach", true}}), "volume_in_use");
  ok("attachment_complete", {{"attachment_id", attachment}});
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"multiattach", true}}), "volume_in_use");
  EXPECT_EQ(ok("volume_show", {{"volume_id", id}})["multiattach"], false);

  // Other fields may change while attached, and "changing" multiattach to its value is no change.
  v = ok("volume_update", {{"volume_id", id}, {"name", "still-attached"}, {"bootable", true}});
  EXPECT_EQ(v["name"], "still-attached");
  EXPECT_EQ(v["bootable"], true);
  EXPECT_EQ(v["status"], "in-use");
  ok("volume_update", {{"volume_id", id}, {"multiattach", false}});

  ok("attachment_delete", {{"attachment_id", attachment}});
  v = ok("volume_update", {{"volume_id", id}, {"multiattach", true}});
  EXPECT_EQ(v["multiattach"], true);
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"name", ""}}), "invalid_params");
  EXPECT_EQ(reason("volume_update", {{"volume_id", id}, {"multiattach", 1}}), "invalid_params");
}

}  // namespace
}  // namespace shareblk::testing::control_unit
