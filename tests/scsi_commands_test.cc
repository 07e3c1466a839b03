// The SCSI command layer (scsi/scsi.h) as an initiator meets it: Linux's sd probe (INQUIRY and
// VPD pages 00h, 80h, 83h, B0h, B1h, B2h, READ CAPACITY(16), MODE SENSE(6), REPORT LUNS) gets
// well-formed data; each refusal carries the sense key, ASC/ASCQ and field pointer SPC-5/SBC-4
// give it; ALLOCATION LENGTH truncates and never refuses; a read-only LUN refuses every write
// kind before data-out and shows WP; ranges at the capacity's edge, and past 2^64, are checked.
#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "scsi/scsi.h"

namespace shareblk::scsi {
namespace {

using Bytes = std::vector<uint8_t>;

constexpr char kVolume[] = "6f1c2b9e-3d4a-4c5b-8e7f-0123456789ab";
constexpr char kOtherVolume[] = "0a9b8c7d-6e5f-4a3b-9c2d-1e0f9a8b7c6d";
constexpr uint64_t kBlocks = 1 << 21;  // 1 GiB of 512-byte blocks

LunInfo lun_of(const std::string& id = kVolume) {
  LunInfo lun;
  lun.volume_id = id;
  lun.block_count = kBlocks;
  lun.write_cache = true;
  lun.target_port_name = "iqn.2026-11.org.shareblk:vol1,t,0x0001";
  lun.target_name = "iqn.2026-11.org.shareblk:vol1";
  lun.luns = {0};
  return lun;
}

// A CDB of `length` bytes, opcode first, the given bytes at their offsets.
Bytes cdb(std::size_t length, uint8_t opcode,
          std::initializer_list<std::pair<std::size_t, uint64_t>> fields = {},
          std::initializer_list<std::size_t> widths = {}) {
  Bytes c(length, 0);
  c[0] = opcode;
  auto width = widths.begin();
  for (const auto& [at, value] : fields) {
    const std::size_t n = width != widths.end() ? *width++ : 1;
    for (std::size_t i = 0; i < n; ++i)
      c[at + i] = static_cast<uint8_t>(value >> (8 * (n - 1 - i)));
  }
  return c;
}

uint64_t be(const Bytes& b, std::size_t at, std::size_t n) {
  uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v = (v << 8) | b.at(at + i);
  return v;
}

Bytes data_of(const Command& c) {
  const auto* immediate = std::get_if<Immediate>(&c);
  EXPECT_NE(immediate, nullptr) << "not answered at once, index " << c.index();
  return immediate != nullptr ? immediate->data : Bytes{};
}

Sense sense_of(const Command& c) {
  const auto* sense = std::get_if<Sense>(&c);
  EXPECT_NE(sense, nullptr) << "not refused, index " << c.index();
  return sense != nullptr ? *sense : Sense{};
}

template <class T>
T as(const Command& c) {
  const auto* value = std::get_if<T>(&c);
  EXPECT_NE(value, nullptr) << "got index " << c.index();
  return value != nullptr ? *value : T{};
}

void expect_sense(const Command& c, SenseKey key, uint8_t asc, uint8_t ascq) {
  const Sense s = sense_of(c);
  EXPECT_EQ(s.key, key);
  EXPECT_EQ(s.asc, asc);
  EXPECT_EQ(s.ascq, ascq);
}

void expect_invalid_field(const Command& c, uint16_t byte, std::optional<uint8_t> bit = {}) {
  EXPECT_EQ(sense_of(c), invalid_field_in_cdb(byte, bit));
}

Bytes inquiry(const LunInfo& lun, bool evpd, uint8_t page, uint16_t allocation = 0xffff) {
  return data_of(
      decode(cdb(6, 0x12, {{1, evpd ? 1 : 0}, {2, page}, {3, allocation}}, {1, 1, 2}), lun));
}

Bytes read16(uint64_t lba, uint32_t blocks, uint8_t byte1 = 0) {
  return cdb(16, 0x88, {{1, byte1}, {2, lba}, {10, blocks}}, {1, 8, 4});
}

Bytes write16(uint64_t lba, uint32_t blocks) {
  return cdb(16, 0x8a, {{2, lba}, {10, blocks}}, {8, 4});
}

// --- Linux sd's probe -------------------------------------------------------------------------

TEST(ScsiProbe, StandardInquiry) {
  const Bytes d = inquiry(lun_of(), false, 0, 96);
  ASSERT_EQ(d.size(), 36U);
  EXPECT_EQ(d[0], 0x00);         // connected, direct access block device
  EXPECT_EQ(d[2], 0x07);         // SPC-5
  EXPECT_EQ(d[3], 0x12);         // HISUP, response data format 2
  EXPECT_EQ(d[4], 36 - 5);       // additional length
  EXPECT_EQ(d[7] & 0x02, 0x02);  // CMDQUE
  EXPECT_EQ(std::string(d.begin() + 8, d.begin() + 16), "SHAREBLK");
  EXPECT_EQ(std::string(d.begin() + 16, d.begin() + 32), "shareblk volume ");
  EXPECT_EQ(std::string(d.begin() + 32, d.begin() + 36), "0001");
}

TEST(ScsiProbe, SupportedVpdPagesAndEachPageIsWellFormed) {
  const LunInfo lun = lun_of();
  const Bytes d = inquiry(lun, true, 0x00);
  ASSERT_GE(d.size(), 4U);
  EXPECT_EQ(d[1], 0x00);
  ASSERT_EQ(be(d, 2, 2), d.size() - 4);
  EXPECT_EQ(Bytes(d.begin() + 4, d.end()), (Bytes{0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2}));
  for (std::size_t i = 4; i < d.size(); ++i) {
    const Bytes page = inquiry(lun, true, d[i]);
    ASSERT_GE(page.size(), 4U);
    EXPECT_EQ(page[0], 0x00);
    EXPECT_EQ(page[1], d[i]);
    EXPECT_EQ(be(page, 2, 2), page.size() - 4) << "page " << int{d[i]};
  }
  expect_invalid_field(decode(cdb(6, 0x12, {{1, 1}, {2, 0x86}, {4, 255}}), lun), 2);
  // Without EVPD, a page code is refused; CMDDT (byte 1 bit 1) too.
  expect_invalid_field(decode(cdb(6, 0x12, {{2, 0x80}, {4, 255}}), lun), 2);
  expect_invalid_field(decode(cdb(6, 0x12, {{1, 2}, {4, 255}}), lun), 1, 1);
}

TEST(ScsiProbe, UnitSerialIsTheVolumeId) {
  const Bytes d = inquiry(lun_of(), true, 0x80);
  EXPECT_EQ(std::string(d.begin() + 4, d.end()), kVolume);
}

struct Designator {
  uint8_t protocol_and_code_set;
  uint8_t piv_association_type;
  Bytes value;
};

std::vector<Designator> designators(const Bytes& page) {
  std::vector<Designator> out;
  std::size_t at = 4;
  while (at + 4 <= page.size()) {
    const std::size_t length = page[at + 3];
    EXPECT_LE(at + 4 + length, page.size());
    if (at + 4 + length > page.size()) break;
    out.push_back({page[at], page[at + 1],
                   Bytes(page.begin() + static_cast<long>(at + 4),
                         page.begin() + static_cast<long>(at + 4 + length))});
    at += 4 + length;
  }
  EXPECT_EQ(at, page.size());
  return out;
}

TEST(ScsiProbe, DeviceIdentificationIsStablePerVolumeAndDiffersBetweenVolumes) {
  const Bytes page = inquiry(lun_of(), true, 0x83);
  const auto ds = designators(page);
  ASSERT_GE(ds.size(), 2U);
  // NAA first: binary, logical unit association, type 3, 16 bytes, NAA 6.
  EXPECT_EQ(ds[0].protocol_and_code_set, 0x01);
  EXPECT_EQ(ds[0].piv_association_type, 0x03);
  ASSERT_EQ(ds[0].value.size(), 16U);
  EXPECT_EQ(ds[0].value[0] >> 4, 6);
  // The company id, then UUID digits without the version and variant digits.
  EXPECT_EQ(ds[0].value[0] & 0x0f, 0xa);
  EXPECT_EQ(ds[0].value[1], 0xcd);
  EXPECT_EQ(ds[0].value[2], 0xe4);
  EXPECT_EQ(ds[0].value[3], 0x86);  // company id's last digit, then the UUID's first: 6
  // T10 vendor id: ASCII, type 1, "SHAREBLK" and the volume id.
  EXPECT_EQ(ds[1].protocol_and_code_set, 0x02);
  EXPECT_EQ(ds[1].piv_association_type, 0x01);
  EXPECT_EQ(std::string(ds[1].value.begin(), ds[1].value.end()), std::string("SHAREBLK") + kVolume);
  bool relative_port = false;
  bool port_name = false;
  bool device_name = false;
  for (const auto& d : ds) {
    if (d.piv_association_type == 0x94) {
      relative_port = true;
      EXPECT_EQ(d.protocol_and_code_set, 0x51);  // iSCSI, binary
      EXPECT_EQ(d.value, (Bytes{0, 0, 0, 1}));
    }
    if (d.piv_association_type == 0x98 || d.piv_association_type == 0xa8) {
      (d.piv_association_type == 0x98 ? port_name : device_name) = true;
      EXPECT_EQ(d.protocol_and_code_set, 0x53);  // iSCSI, UTF-8
      EXPECT_EQ(d.value.size() % 4, 0U);
      EXPECT_EQ(d.value.back(), 0);
    }
  }
  EXPECT_TRUE(relative_port);
  EXPECT_TRUE(port_name);
  EXPECT_TRUE(device_name);

  // Same on every call (every gateway computes it from the id alone), other for another volume.
  EXPECT_EQ(inquiry(lun_of(), true, 0x83), page);
  LunInfo elsewhere = lun_of();
  elsewhere.relative_target_port = 7;  // another gateway's port: the LU's designators stay
  EXPECT_EQ(designators(inquiry(elsewhere, true, 0x83))[0].value, ds[0].value);
  const auto other = designators(inquiry(lun_of(kOtherVolume), true, 0x83));
  EXPECT_NE(other[0].value, ds[0].value);
  // An id that is not a UUID still gets a stable NAA, different from a UUID's.
  const auto named = designators(inquiry(lun_of("volume-one"), true, 0x83));
  EXPECT_EQ(named[0].value, designators(inquiry(lun_of("volume-one"), true, 0x83))[0].value);
  EXPECT_NE(named[0].value, designators(inquiry(lun_of("volume-two"), true, 0x83))[0].value);
  EXPECT_EQ(named[0].value[0] >> 4, 6);
}

TEST(ScsiProbe, BlockLimits) {
  LunInfo lun = lun_of();
  const Bytes d = inquiry(lun, true, 0xb0);
  ASSERT_EQ(d.size(), 64U);
  EXPECT_EQ(be(d, 2, 2), 0x3cU);
  EXPECT_EQ(d[4] & 1, 1);  // WSNZ
  EXPECT_EQ(d[5], lun.limits.max_compare_and_write_blocks);
  EXPECT_EQ(be(d, 6, 2), lun.limits.optimal_transfer_granularity);
  EXPECT_EQ(be(d, 8, 4), lun.limits.max_transfer_blocks);
  EXPECT_EQ(be(d, 12, 4), lun.limits.optimal_transfer_blocks);
  EXPECT_EQ(be(d, 20, 4), lun.limits.max_unmap_lba_count);
  // What libiscsi's conformance suite asks of an explicit UNMAP limit: at least a physical
  // block, at most 2^20.
  EXPECT_GE(be(d, 20, 4), 1U << lun.physical_block_exponent);
  EXPECT_LE(be(d, 20, 4), 1U << 20);
  EXPECT_LE(be(d, 24, 4), 1U << 20);
  EXPECT_EQ(be(d, 24, 4), lun.limits.max_unmap_descriptors);
  EXPECT_EQ(be(d, 28, 4), lun.limits.unmap_granularity);
  EXPECT_EQ(d[32] & 0x80, 0x80);  // UGAVALID
  EXPECT_EQ(be(d, 36, 8), lun.limits.max_write_same_blocks);
  lun.thin = false;  // a thick unit reports no unmap limits: UNMAP is not supported
  const Bytes thick = inquiry(lun, true, 0xb0);
  EXPECT_EQ(be(thick, 20, 4), 0U);
  EXPECT_EQ(be(thick, 24, 4), 0U);
}

TEST(ScsiProbe, CharacteristicsAndProvisioning) {
  const Bytes b1 = inquiry(lun_of(), true, 0xb1);
  ASSERT_EQ(b1.size(), 64U);
  EXPECT_EQ(be(b1, 4, 2), 1U);  // non-rotating
  const Bytes b2 = inquiry(lun_of(), true, 0xb2);
  ASSERT_EQ(b2.size(), 8U);
  EXPECT_EQ(b2[5], 0x80 | 0x40 | 0x20 | 0x04);  // LBPU, LBPWS, LBPWS10, LBPRZ 001b
  EXPECT_EQ(b2[6] & 0x07, 0x02);                // thin
  LunInfo lun = lun_of();
  lun.unmapped_reads_zero = false;
  EXPECT_EQ(inquiry(lun, true, 0xb2)[5], 0xe0);
  lun.thin = false;
  const Bytes thick = inquiry(lun, true, 0xb2);
  EXPECT_EQ(thick[5], 0);
  EXPECT_EQ(thick[6], 0);
}

TEST(ScsiProbe, ReadCapacity16) {
  const auto c = cdb(16, 0x9e, {{1, 0x10}, {13, 32}});
  const Bytes d = data_of(decode(c, lun_of()));
  ASSERT_EQ(d.size(), 32U);
  EXPECT_EQ(be(d, 0, 8), kBlocks - 1);
  EXPECT_EQ(be(d, 8, 4), 512U);
  EXPECT_EQ(d[13] & 0x0f, 3);     // 4 KiB physical blocks
  EXPECT_EQ(d[14] & 0xc0, 0xc0);  // LBPME, LBPRZ
  LunInfo thick = lun_of();
  thick.thin = false;
  EXPECT_EQ(data_of(decode(c, thick))[14], 0);
  // Allocation length 12 truncates; 0 returns nothing, and neither is an error.
  EXPECT_EQ(data_of(decode(cdb(16, 0x9e, {{1, 0x10}, {13, 12}}), lun_of())).size(), 12U);
  EXPECT_TRUE(data_of(decode(cdb(16, 0x9e, {{1, 0x10}}), lun_of())).empty());
  // An unknown service action of 9Eh.
  expect_invalid_field(decode(cdb(16, 0x9e, {{1, 0x11}, {13, 32}}), lun_of()), 1, 4);
}

TEST(ScsiProbe, ReadCapacity10SaysFfffffffWhenTooBig) {
  const Bytes small = data_of(decode(cdb(10, 0x25), lun_of()));
  ASSERT_EQ(small.size(), 8U);
  EXPECT_EQ(be(small, 0, 4), kBlocks - 1);
  EXPECT_EQ(be(small, 4, 4), 512U);
  LunInfo big = lun_of();
  big.block_count = (uint64_t{1} << 32) + 5;
  EXPECT_EQ(be(data_of(decode(cdb(10, 0x25), big)), 0, 4), 0xffffffffU);
  big.block_count = uint64_t{1} << 32;  // the last LBA is FFFFFFFFh itself
  EXPECT_EQ(be(data_of(decode(cdb(10, 0x25), big)), 0, 4), 0xffffffffU);
  // The LBA field without PMI must be zero.
  expect_invalid_field(decode(cdb(10, 0x25, {{5, 1}}), lun_of()), 2);
}

TEST(ScsiProbe, ModeSense6CachingAndAllPages) {
  const LunInfo lun = lun_of();
  // sd's cache probe: MODE SENSE(6), DBD, caching page, allocation 4 then full.
  const Bytes caching = data_of(decode(cdb(6, 0x1a, {{1, 0x08}, {2, 0x08}, {4, 255}}), lun));
  ASSERT_EQ(caching.size(), 4U + 20U);
  EXPECT_EQ(caching[0], caching.size() - 1);
  EXPECT_EQ(caching[2] & 0x80, 0);     // not write protected
  EXPECT_EQ(caching[2] & 0x10, 0x10);  // DPOFUA
  EXPECT_EQ(caching[3], 0);            // no block descriptor (DBD)
  EXPECT_EQ(caching[4] & 0x3f, 0x08);
  EXPECT_EQ(caching[5], 0x12);
  EXPECT_EQ(caching[6] & 0x04, 0x04);  // WCE, as LunInfo says
  LunInfo no_cache = lun;
  no_cache.write_cache = false;
  EXPECT_EQ(data_of(decode(cdb(6, 0x1a, {{1, 0x08}, {2, 0x08}, {4, 255}}), no_cache))[6], 0);

  const Bytes all = data_of(decode(cdb(6, 0x1a, {{2, 0x3f}, {4, 255}}), lun));
  ASSERT_EQ(all.size(), 4U + 8U + 20U + 12U + 12U);
  EXPECT_EQ(all[0], all.size() - 1);
  EXPECT_EQ(all[3], 8);  // a short block descriptor
  EXPECT_EQ(be(all, 4, 4), kBlocks);
  EXPECT_EQ(be(all, 9, 3), 512U);
  std::vector<uint8_t> codes;
  for (std::size_t at = 12; at + 2 <= all.size(); at += 2 + all[at + 1]) codes.push_back(all[at]);
  EXPECT_EQ(codes, (std::vector<uint8_t>{0x08, 0x0a, 0x1c}));
  // "All pages and subpages" is the same here.
  EXPECT_EQ(data_of(decode(cdb(6, 0x1a, {{2, 0x3f}, {3, 0xff}, {4, 255}}), lun)), all);
  // Truncated to the allocation length, never refused for it.
  EXPECT_EQ(data_of(decode(cdb(6, 0x1a, {{2, 0x3f}, {4, 4}}), lun)),
            Bytes(all.begin(), all.begin() + 4));
}

TEST(ScsiProbe, ModeSenseRefusalsAndPageControl) {
  const LunInfo lun = lun_of();
  expect_sense(decode(cdb(6, 0x1a, {{2, 0xc8}, {4, 255}}), lun), SenseKey::IllegalRequest, 0x39,
               0x00);  // saved values
  expect_invalid_field(decode(cdb(6, 0x1a, {{2, 0x19}, {4, 255}}), lun), 2, 5);
  expect_invalid_field(decode(cdb(6, 0x1a, {{2, 0x08}, {3, 1}, {4, 255}}), lun), 3);
  // Changeable values: nothing is.
  const Bytes changeable = data_of(decode(cdb(6, 0x1a, {{1, 8}, {2, 0x48}, {4, 255}}), lun));
  ASSERT_EQ(changeable.size(), 24U);
  for (std::size_t i = 6; i < changeable.size(); ++i) EXPECT_EQ(changeable[i], 0) << i;
  // Default values equal the current ones.
  EXPECT_EQ(data_of(decode(cdb(6, 0x1a, {{1, 8}, {2, 0x88}, {4, 255}}), lun)),
            data_of(decode(cdb(6, 0x1a, {{1, 8}, {2, 0x08}, {4, 255}}), lun)));
}

TEST(ScsiProbe, ModeSense10LongLba) {
  LunInfo lun = lun_of();
  lun.block_count = uint64_t{1} << 33;
  const Bytes d =
      data_of(decode(cdb(10, 0x5a, {{1, 0x10}, {2, 0x08}, {7, 0xffff}}, {1, 1, 2}), lun));
  ASSERT_EQ(d.size(), 8U + 16U + 20U);
  EXPECT_EQ(be(d, 0, 2), d.size() - 2);
  EXPECT_EQ(d[4] & 1, 1);  // LONGLBA
  EXPECT_EQ(be(d, 6, 2), 16U);
  EXPECT_EQ(be(d, 8, 8), lun.block_count);
  EXPECT_EQ(be(d, 20, 4), 512U);
  // The short descriptor of MODE SENSE(10) saturates.
  const Bytes s = data_of(decode(cdb(10, 0x5a, {{2, 0x08}, {7, 0xffff}}, {1, 1, 2}), lun));
  EXPECT_EQ(be(s, 8, 4), 0xffffffffU);
}

TEST(ScsiProbe, ReportLuns) {
  LunInfo lun = lun_of();
  lun.luns = {3, 0, 300};
  const Bytes d = data_of(decode(cdb(12, 0xa0, {{6, 4096}}, {4}), lun));
  ASSERT_EQ(d.size(), 8U + 3 * 8U);
  EXPECT_EQ(be(d, 0, 4), 24U);
  EXPECT_EQ(be(d, 8, 8), 0U);
  EXPECT_EQ(be(d, 16, 8), uint64_t{3} << 48);             // peripheral addressing
  EXPECT_EQ(be(d, 24, 8), uint64_t{0x4000 | 300} << 48);  // flat space addressing
  EXPECT_EQ(data_of(decode(cdb(12, 0xa0, {{2, 2}, {6, 4096}}, {1, 4}), lun)), d);
  const Bytes well_known = data_of(decode(cdb(12, 0xa0, {{2, 1}, {6, 4096}}, {1, 4}), lun));
  EXPECT_EQ(well_known, Bytes(8, 0));
  // Truncation, down to nothing; an unknown SELECT REPORT is refused.
  EXPECT_EQ(data_of(decode(cdb(12, 0xa0, {{6, 16}}, {4}), lun)).size(), 16U);
  EXPECT_EQ(data_of(decode(cdb(12, 0xa0, {{6, 3}}, {4}), lun)), Bytes(d.begin(), d.begin() + 3));
  EXPECT_TRUE(data_of(decode(cdb(12, 0xa0), lun)).empty());
  expect_invalid_field(decode(cdb(12, 0xa0, {{2, 9}, {6, 4096}}, {1, 4}), lun), 2);
}

TEST(ScsiProbe, InquiryTruncatesToAllocationLength) {
  EXPECT_EQ(inquiry(lun_of(), false, 0, 5).size(), 5U);
  EXPECT_EQ(inquiry(lun_of(), true, 0x83, 4).size(), 4U);
  EXPECT_TRUE(inquiry(lun_of(), true, 0x83, 0).empty());
}

// --- Sense data -------------------------------------------------------------------------------

TEST(ScsiSense, FixedFormatLayout) {
  const auto b = encode_fixed(invalid_field_in_cdb(13, 2));
  EXPECT_EQ(b[0], 0x70);
  EXPECT_EQ(b[2], 0x05);
  EXPECT_EQ(b[7], 10);
  EXPECT_EQ(b[12], 0x24);
  EXPECT_EQ(b[13], 0x00);
  EXPECT_EQ(b[15], 0x80 | 0x40 | 0x08 | 2);  // SKSV, C/D, BPV, bit 2
  EXPECT_EQ(b[16], 0);
  EXPECT_EQ(b[17], 13);
  const auto p = encode_fixed(invalid_field_in_parameter_list(260));
  EXPECT_EQ(p[15], 0x80);  // parameter list, no bit pointer
  EXPECT_EQ(p[16], 1);
  EXPECT_EQ(p[17], 4);
  const auto m = encode_fixed(miscompare_at(0x1234));
  EXPECT_EQ(m[0], 0xf0);  // VALID
  EXPECT_EQ(m[2], 0x0e);
  EXPECT_EQ(m[6], 0x34);
  EXPECT_EQ(m[12], 0x1d);
  // INFORMATION past 32 bits does not fit fixed format: VALID clear.
  EXPECT_EQ(encode_fixed(miscompare_at(uint64_t{1} << 40))[0], 0x70);
}

TEST(ScsiSense, BothFormatsDecodeBack) {
  for (const Sense& s : {kLbaOutOfRange, invalid_field_in_cdb(1, 7), miscompare_at(4097),
                         invalid_field_in_parameter_list(9), kCapacityDataHasChanged}) {
    const auto fixed = encode_fixed(s);
    EXPECT_EQ(decode_sense(fixed), s);
    const auto descriptor = encode_descriptor(s);
    EXPECT_EQ(descriptor[0], 0x72);
    EXPECT_EQ(descriptor[7], descriptor.size() - 8);
    EXPECT_EQ(decode_sense(descriptor), s);
  }
  const auto big = miscompare_at(uint64_t{1} << 40);
  EXPECT_EQ(decode_sense(encode_descriptor(big)), big);
}

TEST(ScsiSense, ErrnoMapping) {
  EXPECT_EQ(sense_for_errno(EIO, false), kUnrecoveredReadError);
  EXPECT_EQ(sense_for_errno(EIO, true), kWriteError);
  EXPECT_EQ(kWriteError.key, SenseKey::MediumError);
  EXPECT_EQ(kWriteError.asc, 0x0c);
  EXPECT_EQ(sense_for_errno(ENOSPC, true), kSpaceAllocationFailedWriteProtect);
  EXPECT_EQ(kSpaceAllocationFailedWriteProtect.key, SenseKey::DataProtect);
  EXPECT_EQ(kSpaceAllocationFailedWriteProtect.ascq, 0x07);
  EXPECT_EQ(sense_for_errno(EPERM, true), kWriteProtected);
  EXPECT_EQ(sense_for_errno(EINVAL, false).key, SenseKey::HardwareError);
}

TEST(ScsiSense, RequestSense) {
  const LunInfo lun = lun_of();
  const auto request = as<RequestSense>(decode(cdb(6, 0x03, {{4, 252}}), lun));
  const auto* rs = &request;
  const Bytes none = request_sense_data(std::nullopt, *rs);
  ASSERT_EQ(none.size(), 18U);
  EXPECT_EQ(none[0], 0x70);
  EXPECT_EQ(none[2], 0x00);
  EXPECT_EQ(none[12], 0x00);
  const Bytes pending = request_sense_data(kCapacityDataHasChanged, *rs);
  EXPECT_EQ(pending[2], 0x06);
  EXPECT_EQ(pending[12], 0x2a);
  EXPECT_EQ(pending[13], 0x09);
  EXPECT_EQ(request_sense_data(kPowerOnReset, RequestSense{true, 252})[0], 0x72);
  EXPECT_EQ(request_sense_data(kPowerOnReset, RequestSense{false, 8}).size(), 8U);
  expect_invalid_field(decode(cdb(6, 0x03, {{1, 2}, {4, 252}}), lun), 1, 1);
}

// --- Refusals ---------------------------------------------------------------------------------

TEST(ScsiRefusal, UnknownOpcodeShortCdbAndNaca) {
  const LunInfo lun = lun_of();
  EXPECT_EQ(sense_of(decode(cdb(6, 0x1b), lun)), kInvalidCommandOperationCode);
  EXPECT_EQ(sense_of(decode(cdb(16, 0xff), lun)), kInvalidCommandOperationCode);
  expect_invalid_field(decode(Bytes{}, lun), 0);
  // READ(16) sent as 10 bytes: the iSCSI layer gives what the initiator sent.
  const Bytes whole = read16(0, 1);
  expect_invalid_field(decode(Bytes(whole.begin(), whole.begin() + 10), lun), 0);
  // A longer span (padded to 16) is fine.
  Bytes padded = cdb(10, 0x28, {{8, 1}});
  padded.resize(16, 0xee);
  EXPECT_TRUE(std::holds_alternative<Read>(decode(padded, lun)));
  // NACA in the CONTROL byte.
  expect_invalid_field(decode(cdb(10, 0x28, {{8, 1}, {9, 0x04}}), lun), 9, 2);
  expect_invalid_field(decode(cdb(6, 0x00, {{5, 0x04}}), lun), 5, 2);
  EXPECT_EQ(decode(cdb(6, 0x00), lun), (Command{Immediate{}}));
}

TEST(ScsiRefusal, EveryOpcodeAtEveryLengthIsAnsweredOrRefused) {
  // An unknown opcode is INVALID COMMAND OPERATION CODE at any length; a known one cut shorter
  // than its group code's length is INVALID FIELD IN CDB at byte 0. ASan checks that nothing
  // reads past the span.
  const LunInfo lun = lun_of();
  constexpr std::size_t kLengthOfGroup[8] = {6, 10, 10, 0, 16, 12, 0, 0};
  int known = 0;
  for (int op = 0; op < 256; ++op) {
    const auto opcode = static_cast<uint8_t>(op);
    const bool unknown = decode(cdb(16, opcode), lun) == Command{kInvalidCommandOperationCode};
    if (!unknown) ++known;
    for (std::size_t length = 1; length < 16; ++length) {
      const Command got = decode(cdb(length, opcode), lun);
      if (unknown) {
        EXPECT_EQ(got, Command{kInvalidCommandOperationCode}) << op;
      } else if (length < kLengthOfGroup[opcode >> 5]) {
        EXPECT_EQ(got, Command{invalid_field_in_cdb(0)}) << op << " at " << length;
      } else {
        EXPECT_NE(got, Command{invalid_field_in_cdb(0)}) << op << " at " << length;
      }
    }
  }
  EXPECT_EQ(known, 26);  // kCommands in scsi/commands.cc
}

TEST(ScsiRefusal, CapacityEdges) {
  const LunInfo lun = lun_of();
  EXPECT_EQ(decode(read16(kBlocks - 1, 1), lun), (Command{Read{kBlocks - 1, 1, false}}));
  EXPECT_EQ(decode(read16(kBlocks - 8, 8), lun), (Command{Read{kBlocks - 8, 8, false}}));
  EXPECT_EQ(sense_of(decode(read16(kBlocks, 1), lun)), kLbaOutOfRange);
  EXPECT_EQ(sense_of(decode(read16(kBlocks - 1, 2), lun)), kLbaOutOfRange);
  EXPECT_EQ(sense_of(decode(write16(kBlocks, 1), lun)), kLbaOutOfRange);
  // lba + blocks wraps past 2^64.
  EXPECT_EQ(sense_of(decode(read16(UINT64_MAX, 2), lun)), kLbaOutOfRange);
  EXPECT_EQ(sense_of(decode(write16(UINT64_MAX - 1, 4), lun)), kLbaOutOfRange);
  // Zero blocks move nothing: in range at the capacity, out past it.
  EXPECT_EQ(decode(read16(kBlocks, 0), lun), (Command{Read{kBlocks, 0, false}}));
  EXPECT_EQ(sense_of(decode(read16(kBlocks + 1, 0), lun)), kLbaOutOfRange);
  // READ(10) and (12) have 32-bit LBAs.
  EXPECT_EQ(sense_of(decode(cdb(10, 0x28, {{2, kBlocks}, {7, 1}}, {4, 2}), lun)), kLbaOutOfRange);
  EXPECT_EQ(decode(cdb(12, 0xa8, {{2, 7}, {6, 9}}, {4, 4}), lun), (Command{Read{7, 9, false}}));
  EXPECT_EQ(decode(cdb(12, 0xaa, {{1, 8}, {2, 7}, {6, 9}}, {1, 4, 4}), lun),
            (Command{Write{7, 9, true}}));
}

TEST(ScsiRefusal, BlockLimitsAndProtectionFields) {
  const LunInfo lun = lun_of();
  const uint32_t max = lun.limits.max_transfer_blocks;
  EXPECT_TRUE(std::holds_alternative<Read>(decode(read16(0, max), lun)));
  expect_invalid_field(decode(read16(0, max + 1), lun), 10);
  expect_invalid_field(decode(cdb(10, 0x2a, {{7, max + 1}}, {2}), lun), 7);
  expect_invalid_field(decode(cdb(12, 0xa8, {{6, max + 1}}, {4}), lun), 6);
  // RDPROTECT / WRPROTECT without protection information.
  expect_invalid_field(decode(read16(0, 1, 0x20), lun), 1, 5);
  expect_invalid_field(decode(cdb(10, 0x2a, {{1, 0xe0}, {8, 1}}), lun), 1, 7);
}

TEST(ScsiCommand, ReadWrite6) {
  const LunInfo lun = lun_of();
  EXPECT_EQ(decode(cdb(6, 0x08, {{1, 0x01}, {2, 0xff00}, {4, 0}}, {1, 2, 1}), lun),
            (Command{Read{0x1ff00, 256, false}}));
  // The LBA is 21 bits: byte 1's top bits are reserved.
  LunInfo big = lun;
  big.block_count = uint64_t{1} << 40;
  EXPECT_EQ(decode(cdb(6, 0x08, {{1, 0x1f}, {2, 0xffff}, {4, 1}}, {1, 2, 1}), big),
            (Command{Read{0x1fffff, 1, false}}));
  EXPECT_EQ(decode(cdb(6, 0x0a, {{3, 5}, {4, 2}}), lun), (Command{Write{5, 2, false}}));
}

TEST(ScsiCommand, DataLengths) {
  const LunInfo lun = lun_of();
  EXPECT_EQ(data_in_length(decode(read16(0, 8), lun), lun), 4096U);
  EXPECT_EQ(data_out_length(decode(write16(0, 8), lun), lun), 4096U);
  EXPECT_EQ(data_out_length(decode(cdb(16, 0x89, {{13, 1}}), lun), lun), 1024U);
  EXPECT_EQ(data_out_length(decode(cdb(16, 0x93, {{1, 0x09}, {13, 8}}), lun), lun), 0U);
  EXPECT_EQ(data_out_length(decode(cdb(10, 0x41, {{8, 8}}), lun), lun), 512U);
  EXPECT_EQ(data_out_length(decode(cdb(10, 0x2f, {{1, 2}, {8, 8}}), lun), lun), 4096U);
  EXPECT_EQ(data_out_length(decode(cdb(10, 0x2f, {{1, 6}, {8, 8}}), lun), lun), 512U);
  EXPECT_EQ(data_out_length(decode(cdb(10, 0x42, {{8, 24}}), lun), lun), 24U);
}

TEST(ScsiCommand, WriteSame) {
  const LunInfo lun = lun_of();
  EXPECT_EQ(decode(cdb(16, 0x93, {{1, 0x08}, {2, 16}, {10, 64}}, {1, 8, 4}), lun),
            (Command{WriteSame{16, 64, true, false}}));
  EXPECT_EQ(decode(cdb(10, 0x41, {{2, 16}, {7, 64}}, {4, 2}), lun),
            (Command{WriteSame{16, 64, false, false}}));
  expect_invalid_field(decode(cdb(16, 0x93, {{2, 16}}, {8}), lun), 10);  // 0 blocks: WSNZ
  EXPECT_EQ(sense_of(decode(cdb(10, 0x41, {{2, kBlocks + 1}}, {4}), lun)), kLbaOutOfRange);
  expect_invalid_field(decode(cdb(10, 0x41, {{1, 0x10}, {8, 1}}), lun), 1, 4);  // ANCHOR
  expect_invalid_field(decode(cdb(10, 0x41, {{1, 0x01}, {8, 1}}), lun), 1, 0);  // no NDOB in 10
  expect_invalid_field(
      decode(cdb(16, 0x93, {{10, lun.limits.max_write_same_blocks + 1}}, {4}), lun), 10);
  EXPECT_EQ(sense_of(decode(cdb(16, 0x93, {{2, kBlocks - 1}, {10, 2}}, {8, 4}), lun)),
            kLbaOutOfRange);
  LunInfo thick = lun_of();
  thick.thin = false;
  expect_invalid_field(decode(cdb(16, 0x93, {{1, 0x08}, {13, 1}}), thick), 1, 3);
}

Bytes unmap_list(std::initializer_list<std::pair<uint64_t, uint32_t>> ranges) {
  Bytes b(8 + 16 * ranges.size(), 0);
  const std::size_t n = ranges.size() * 16;
  b[0] = static_cast<uint8_t>((n + 6) >> 8);
  b[1] = static_cast<uint8_t>(n + 6);
  b[2] = static_cast<uint8_t>(n >> 8);
  b[3] = static_cast<uint8_t>(n);
  std::size_t at = 8;
  for (const auto& [lba, blocks] : ranges) {
    for (std::size_t i = 0; i < 8; ++i) b[at + i] = static_cast<uint8_t>(lba >> (56 - 8 * i));
    for (std::size_t i = 0; i < 4; ++i)
      b[at + 8 + i] = static_cast<uint8_t>(blocks >> (24 - 8 * i));
    at += 16;
  }
  return b;
}

TEST(ScsiCommand, Unmap) {
  const LunInfo lun = lun_of();
  EXPECT_EQ(decode(cdb(10, 0x42, {{7, 40}}, {2}), lun), (Command{Unmap{40}}));
  EXPECT_EQ(decode(cdb(10, 0x42), lun), (Command{Unmap{0}}));
  EXPECT_EQ(sense_of(decode(cdb(10, 0x42, {{8, 7}}), lun)), kParameterListLengthError);
  expect_invalid_field(decode(cdb(10, 0x42, {{1, 1}, {8, 24}}), lun), 1, 0);  // ANCHOR
  LunInfo thick = lun_of();
  thick.thin = false;
  EXPECT_EQ(sense_of(decode(cdb(10, 0x42, {{8, 24}}), thick)), kInvalidCommandOperationCode);

  const auto parsed = parse_unmap(unmap_list({{0, 8}, {100, 0}, {kBlocks - 1, 1}}), lun);
  ASSERT_TRUE(std::holds_alternative<std::vector<UnmapDescriptor>>(parsed));
  EXPECT_EQ(std::get<std::vector<UnmapDescriptor>>(parsed),
            (std::vector<UnmapDescriptor>{{0, 8}, {kBlocks - 1, 1}}));
  EXPECT_TRUE(std::get<std::vector<UnmapDescriptor>>(parse_unmap({}, lun)).empty());
  EXPECT_EQ(std::get<Sense>(parse_unmap(Bytes(5, 0), lun)), kParameterListLengthError);
  // A descriptor length beyond what was sent.
  Bytes cut = unmap_list({{0, 8}});
  cut.resize(16);
  EXPECT_EQ(std::get<Sense>(parse_unmap(cut, lun)), kParameterListLengthError);
  // A trailing partial descriptor is ignored.
  Bytes partial = unmap_list({{0, 8}});
  partial[3] = 20;
  partial[1] = 26;
  partial.resize(28, 0);
  EXPECT_EQ(std::get<std::vector<UnmapDescriptor>>(parse_unmap(partial, lun)).size(), 1U);
  EXPECT_EQ(std::get<Sense>(parse_unmap(unmap_list({{kBlocks, 1}}), lun)), kLbaOutOfRange);
  EXPECT_EQ(std::get<Sense>(parse_unmap(unmap_list({{UINT64_MAX, 2}}), lun)), kLbaOutOfRange);
  LunInfo small = lun_of();
  small.limits.max_unmap_descriptors = 1;
  small.limits.max_unmap_lba_count = 10;
  EXPECT_EQ(std::get<Sense>(parse_unmap(unmap_list({{0, 1}, {5, 1}}), small)),
            invalid_field_in_parameter_list(2));
  EXPECT_EQ(std::get<Sense>(parse_unmap(unmap_list({{0, 11}}), small)),
            invalid_field_in_parameter_list(16));
}

TEST(ScsiCommand, CompareAndWriteVerifySync) {
  const LunInfo lun = lun_of();
  EXPECT_EQ(decode(cdb(16, 0x89, {{1, 0x08}, {2, 9}, {13, 1}}, {1, 8, 1}), lun),
            (Command{CompareAndWrite{9, 1, true}}));
  expect_invalid_field(decode(cdb(16, 0x89, {{13, 2}}), lun), 13);
  EXPECT_EQ(sense_of(decode(cdb(16, 0x89, {{2, kBlocks}, {13, 1}}, {8, 1}), lun)), kLbaOutOfRange);

  EXPECT_EQ(decode(cdb(16, 0x8f, {{1, 2}, {2, 5}, {10, 3}}, {1, 8, 4}), lun),
            (Command{Verify{5, 3, 1}}));
  EXPECT_EQ(decode(cdb(10, 0x2f, {{2, 5}, {7, 3}}, {4, 2}), lun), (Command{Verify{5, 3, 0}}));
  expect_invalid_field(decode(cdb(10, 0x2f, {{1, 4}, {8, 1}}), lun), 1, 2);  // BYTCHK 10b

  EXPECT_EQ(decode(cdb(10, 0x35, {{1, 2}, {2, 10}}, {1, 4}), lun),
            (Command{SynchronizeCache{10, kBlocks - 10, true}}));
  EXPECT_EQ(decode(cdb(16, 0x91, {{2, 0}, {10, 8}}, {8, 4}), lun),
            (Command{SynchronizeCache{0, 8, false}}));
  EXPECT_EQ(sense_of(decode(cdb(16, 0x91, {{2, kBlocks + 1}}, {8}), lun)), kLbaOutOfRange);
}

TEST(ScsiCommand, GetLbaStatusSaysMapped) {
  const LunInfo lun = lun_of();
  const Bytes d = data_of(decode(cdb(16, 0x9e, {{1, 0x12}, {2, 100}, {10, 64}}, {1, 8, 4}), lun));
  ASSERT_EQ(d.size(), 24U);
  EXPECT_EQ(be(d, 0, 4), 20U);
  EXPECT_EQ(be(d, 8, 8), 100U);
  EXPECT_EQ(be(d, 16, 4), kBlocks - 100);
  EXPECT_EQ(d[20] & 0x0f, 0);  // mapped
  EXPECT_EQ(sense_of(decode(cdb(16, 0x9e, {{1, 0x12}, {2, kBlocks}, {10, 64}}, {1, 8, 4}), lun)),
            kLbaOutOfRange);
  // Only deallocated blocks asked for: none.
  EXPECT_EQ(data_of(decode(cdb(16, 0x9e, {{1, 0x12}, {13, 64}, {14, 3}}, {1, 1, 1}), lun)).size(),
            8U);
}

TEST(ScsiCommand, ModeSelectAcceptsOnlyWhatChangesNothing) {
  const LunInfo lun = lun_of();
  const auto select = as<ModeSelect>(decode(cdb(6, 0x15, {{1, 0x10}, {4, 24}}), lun));
  const auto* ms = &select;
  EXPECT_EQ(ms->param_len, 24U);
  EXPECT_EQ(data_out_length(Command{*ms}, lun), 24U);
  // The caching page as MODE SENSE gave it, header zeroed as SPC-5 asks of a MODE SELECT.
  Bytes current = data_of(decode(cdb(6, 0x1a, {{1, 0x08}, {2, 0x08}, {4, 255}}), lun));
  current[0] = 0;
  current[2] = 0;
  EXPECT_EQ(parse_mode_select(current, *ms, lun), std::nullopt);
  EXPECT_EQ(parse_mode_select({}, *ms, lun), std::nullopt);
  Bytes flip = current;
  flip[6] ^= 0x04;  // WCE off
  EXPECT_EQ(parse_mode_select(flip, *ms, lun), invalid_field_in_parameter_list(6, 2));
  Bytes cut = current;
  cut.resize(12);
  EXPECT_EQ(parse_mode_select(cut, *ms, lun), kParameterListLengthError);
  Bytes unknown = current;
  unknown[4] = 0x19;
  EXPECT_EQ(parse_mode_select(unknown, *ms, lun), invalid_field_in_parameter_list(4, 5));
  // A block descriptor with another block length.
  Bytes with_descriptor = {0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0x10, 0x00};
  EXPECT_EQ(parse_mode_select(with_descriptor, *ms, lun), invalid_field_in_parameter_list(9));
  with_descriptor[10] = 0x02;
  EXPECT_EQ(parse_mode_select(with_descriptor, *ms, lun), std::nullopt);
  // SP: we save nothing.
  expect_invalid_field(decode(cdb(6, 0x15, {{1, 0x11}, {4, 24}}), lun), 1, 0);
  const auto select10 = as<ModeSelect>(decode(cdb(10, 0x55, {{1, 0x10}, {7, 28}}, {1, 2}), lun));
  const auto* ms10 = &select10;
  EXPECT_TRUE(ms10->ten_byte);
  Bytes ten(4, 0);
  ten.insert(ten.end(), current.begin(), current.end());
  ten[7] = 0;
  EXPECT_EQ(parse_mode_select(ten, *ms10, lun), std::nullopt);
}

// --- Write protection -------------------------------------------------------------------------

TEST(ScsiReadOnly, RefusesEveryWriteKindAndSetsWp) {
  LunInfo lun = lun_of();
  lun.read_only = true;
  const std::vector<Bytes> writes = {
      cdb(6, 0x0a, {{4, 1}}),
      cdb(10, 0x2a, {{8, 1}}),
      cdb(12, 0xaa, {{9, 1}}),
      write16(0, 1),
      cdb(10, 0x41, {{8, 1}}),
      cdb(16, 0x93, {{1, 0x08}, {13, 1}}),
      cdb(16, 0x93, {{1, 0x01}, {13, 1}}),
      cdb(10, 0x42, {{8, 24}}),
      cdb(10, 0x42),
      cdb(16, 0x89, {{13, 1}}),
  };
  for (const auto& c : writes) {
    const Command got = decode(c, lun);
    EXPECT_EQ(sense_of(got), kWriteProtected) << "opcode " << int{c[0]};
    EXPECT_EQ(encode_fixed(sense_of(got))[2], 0x07);
    EXPECT_EQ(encode_fixed(sense_of(got))[12], 0x27);
  }
  // What it may do.
  EXPECT_TRUE(std::holds_alternative<Read>(decode(read16(0, 1), lun)));
  EXPECT_TRUE(std::holds_alternative<Verify>(decode(cdb(10, 0x2f, {{8, 1}}), lun)));
  EXPECT_TRUE(std::holds_alternative<SynchronizeCache>(decode(cdb(10, 0x35), lun)));
  EXPECT_TRUE(std::holds_alternative<ModeSelect>(decode(cdb(6, 0x15, {{1, 0x10}}), lun)));
  EXPECT_FALSE(writes_medium(Command{Read{}}));
  EXPECT_TRUE(writes_medium(Command{CompareAndWrite{}}));
  // WP in MODE SENSE(6) and (10).
  EXPECT_EQ(data_of(decode(cdb(6, 0x1a, {{2, 0x3f}, {4, 255}}), lun))[2] & 0x80, 0x80);
  EXPECT_EQ(data_of(decode(cdb(10, 0x5a, {{2, 0x3f}, {8, 255}}), lun))[3] & 0x80, 0x80);
}

// --- The LUN a nexus does not have, and unit attentions ----------------------------------------

TEST(ScsiAbsentLun, AnswersAsSpcSays) {
  const std::vector<uint16_t> luns{0};
  const Bytes inq = data_of(decode_absent_lun(cdb(6, 0x12, {{4, 36}}), luns));
  ASSERT_EQ(inq.size(), 36U);
  EXPECT_EQ(inq[0], 0x7f);
  EXPECT_EQ(sense_of(decode_absent_lun(cdb(6, 0x12, {{1, 1}, {2, 0x83}, {4, 255}}), luns)),
            kLogicalUnitNotSupported);
  EXPECT_EQ(sense_of(decode_absent_lun(cdb(6, 0x00), luns)), kLogicalUnitNotSupported);
  EXPECT_EQ(sense_of(decode_absent_lun(read16(0, 1), luns)), kLogicalUnitNotSupported);
  const Bytes rs = data_of(decode_absent_lun(cdb(6, 0x03, {{4, 18}}), luns));
  ASSERT_EQ(rs.size(), 18U);
  EXPECT_EQ(rs[2], 0x05);
  EXPECT_EQ(rs[12], 0x25);
  EXPECT_EQ(data_of(decode_absent_lun(cdb(12, 0xa0, {{9, 64}}), luns)).size(), 16U);
}

TEST(ScsiUnitAttention, InquiryReportLunsAndRequestSenseAreNotHeldBack) {
  EXPECT_FALSE(unit_attention_applies(cdb(6, 0x12)));
  EXPECT_FALSE(unit_attention_applies(cdb(12, 0xa0)));
  EXPECT_FALSE(unit_attention_applies(cdb(6, 0x03)));
  EXPECT_TRUE(unit_attention_applies(cdb(6, 0x00)));
  EXPECT_TRUE(unit_attention_applies(read16(0, 1)));
  EXPECT_EQ(kCapacityDataHasChanged.key, SenseKey::UnitAttention);
  EXPECT_EQ(kReportedLunsDataHasChanged.asc, 0x3f);
  EXPECT_EQ(kReportedLunsDataHasChanged.ascq, 0x0e);
  EXPECT_EQ(kPowerOnReset.asc, 0x29);
}

}  // namespace
}  // namespace shareblk::scsi
