// One of scsi/'s public headers (scsi/scsi.h includes both): decode() turns one CDB into what
// the frontend does next, from the logical unit's description (LunInfo) alone.
//
// The outcome is one of:
//   - Immediate: the answer is built already (data-in bytes, truncated to the CDB's ALLOCATION
//     LENGTH, never refused for it), status GOOD;
//   - a media operation (Read, Write, WriteSame, Unmap, CompareAndWrite, Verify,
//     SynchronizeCache) whose range is checked against the capacity and the block limits, for
//     the frontend to run on the volume through its own engine;
//   - ModeSelect or RequestSense, which need data-out or the I_T nexus's pending sense: the
//     frontend finishes them with parse_mode_select() or request_sense_data();
//   - Sense: CHECK CONDITION with that sense data.
// A read-only LUN's writes come back as WRITE PROTECTED here, before any data-out is asked
// for (writes_medium() is the one list of what a read-only LUN refuses).
//
// A CDB shorter than its operation code's length (SPC-5: 6, 10, 12 or 16 bytes by group code)
// is refused here with INVALID FIELD IN CDB pointing at the OPERATION CODE, so decode() is safe
// on any span; a longer one (iSCSI pads CDBs to 16 bytes) is fine.
//
// Unit attentions are the frontend's: it keeps them per I_T nexus, reports one instead of
// running a command when unit_attention_applies(cdb), and answers REQUEST SENSE with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "scsi/sense.h"

namespace shareblk::scsi {

// The block limits the Block Limits VPD page advertises (SBC-4) and decode() enforces.
// Counts are in logical blocks; 0 means "no limit reported" where SBC-4 says so.
struct BlockLimits {
  uint32_t max_transfer_blocks = 2048;  // READ, WRITE, VERIFY with BYTCHK (1 MiB at 512)
  uint32_t optimal_transfer_blocks = 2048;
  uint16_t optimal_transfer_granularity = 8;  // 4 KiB at 512
  // 1 Mi blocks: libiscsi's conformance suite holds an explicit limit to at most 2^20.
  uint32_t max_unmap_lba_count = 0x100000;  // per UNMAP command, all descriptors together
  uint32_t max_unmap_descriptors = 256;
  uint32_t unmap_granularity = 8;
  uint64_t max_write_same_blocks = 0x400000;
  uint8_t max_compare_and_write_blocks = 1;  // VMFS's ATS uses one block
};

// What one logical unit is, as the frontend knows it from the attachment and the store.
struct LunInfo {
  std::string volume_id;  // the volume's UUID: the unit serial and the device identifiers
  uint64_t block_count = 0;
  uint32_t block_size = 512;
  uint8_t physical_block_exponent = 3;  // logical blocks per physical block, log2 (4 KiB)
  bool read_only = false;               // the attachment's mode: WP, and writes_medium() refused
  bool write_cache = false;         // the caching mode page's WCE (MODE SELECT cannot change it)
  bool thin = true;                 // LBPME, UNMAP, WRITE SAME with UNMAP (SBC-4 provisioning)
  bool unmapped_reads_zero = true;  // LBPRZ
  BlockLimits limits;
  // The 24-bit IEEE company ID in the NAA 6 designator (SPC-5, NAA IEEE Registered Extended).
  // AC-DE-48 is an IEEE-reserved private value; a deployment that owns an OUI sets its own here.
  uint32_t ieee_company_id = 0xacde48;
  std::string product = "shareblk volume";  // INQUIRY PRODUCT IDENTIFICATION, 16 bytes used
  std::string revision = "0001";            // PRODUCT REVISION LEVEL, 4 bytes used
  // Target port designators of VPD page 0x83 (association 1), each left out when 0 / empty.
  uint16_t relative_target_port = 1;
  uint16_t target_port_group = 0;
  std::string target_port_name;  // iSCSI: "iqn...,t,0x0001" (SPC-5 SCSI name string)
  std::string target_name;       // iSCSI target name, the target device's designator
  // REPORT LUNS: the LUNs the target has for this I_T nexus (SAM-5 single level LUNs, < 16384).
  std::vector<uint16_t> luns{0};
};

struct Read {
  uint64_t lba = 0;
  uint32_t blocks = 0;  // 0: nothing to read, answer GOOD
  bool fua = false;
  bool operator==(const Read&) const = default;
};

struct Write {
  uint64_t lba = 0;
  uint32_t blocks = 0;  // 0: nothing to write, answer GOOD
  bool fua = false;
  bool operator==(const Write&) const = default;
};

// WRITE SAME (10)/(16) (SBC-4): one block of data-out (none with NDOB, zeros) written to
// every block of the range, or the range unmapped when `unmap` (reads then give zeros: LBPRZ).
struct WriteSame {
  uint64_t lba = 0;
  uint64_t blocks = 0;  // never 0: WSNZ is advertised
  bool unmap = false;
  bool ndob = false;
  bool operator==(const WriteSame&) const = default;
};

// UNMAP (SBC-4): `param_len` bytes of data-out, to be read with parse_unmap().
struct Unmap {
  uint32_t param_len = 0;  // 0: nothing to do, answer GOOD
  bool operator==(const Unmap&) const = default;
};

// COMPARE AND WRITE (SBC-4): data-out is 2 x blocks: the verify instance, then the write
// instance. The frontend reads, compares (MISCOMPARE with miscompare_at(offset) on a
// difference, nothing written) and writes, atomically with respect to other writes.
struct CompareAndWrite {
  uint64_t lba = 0;
  uint32_t blocks = 0;  // 0: nothing to do, answer GOOD
  bool fua = false;
  bool operator==(const CompareAndWrite&) const = default;
};

// VERIFY (10)/(16) (SBC-4). bytchk 0: only check the medium can be read; 1: data-out holds
// `blocks` blocks to compare; 3: one block compared against each block of the range.
struct Verify {
  uint64_t lba = 0;
  uint32_t blocks = 0;
  uint8_t bytchk = 0;
  bool operator==(const Verify&) const = default;
};

// SYNCHRONIZE CACHE (10)/(16) (SBC-4); blocks 0 in the CDB is "to the last block", so
// `blocks` here is always the whole range. IMMED may answer before the flush ends.
struct SynchronizeCache {
  uint64_t lba = 0;
  uint64_t blocks = 0;
  bool immed = false;
  bool operator==(const SynchronizeCache&) const = default;
};

// MODE SELECT (6)/(10) (SPC-5): `param_len` bytes of data-out for parse_mode_select().
struct ModeSelect {
  uint32_t param_len = 0;
  bool ten_byte = false;
  bool operator==(const ModeSelect&) const = default;
};

// REQUEST SENSE (SPC-5): the frontend answers with request_sense_data() and its nexus's
// pending sense.
struct RequestSense {
  bool descriptor_format = false;
  uint32_t allocation_length = 0;
  bool operator==(const RequestSense&) const = default;
};

struct Immediate {
  std::vector<uint8_t> data;  // data-in, already truncated to the allocation length
  bool operator==(const Immediate&) const = default;
};

using Command = std::variant<Immediate, Read, Write, WriteSame, Unmap, CompareAndWrite, Verify,
                             SynchronizeCache, ModeSelect, RequestSense, Sense>;

Command decode(std::span<const uint8_t> cdb, const LunInfo& lun);

// What a read-only LUN refuses: every command that changes the medium (WRITE, WRITE SAME,
// UNMAP, COMPARE AND WRITE). The one home of that rule; decode() applies it.
bool writes_medium(const Command& command);

// How many bytes of data-out the command takes (0 for those that take none) and of data-in it
// returns from the medium (Read only; Immediate carries its own). The frontend bounds a
// command's transfer with these before it asks for R2Ts.
uint64_t data_out_length(const Command& command, const LunInfo& lun);
uint64_t data_in_length(const Command& command, const LunInfo& lun);

struct UnmapDescriptor {
  uint64_t lba = 0;
  uint32_t blocks = 0;
  bool operator==(const UnmapDescriptor&) const = default;
};
using ParsedUnmap = std::variant<std::vector<UnmapDescriptor>, Sense>;

// UNMAP's parameter list (SBC-4, UNMAP parameter list): the descriptors to unmap, in order,
// descriptors of 0 blocks left out; or PARAMETER LIST LENGTH ERROR (a list of 1-7 bytes), INVALID
// FIELD IN PARAMETER LIST (more descriptors or blocks than the block limits), LBA OUT OF RANGE.
ParsedUnmap parse_unmap(std::span<const uint8_t> list, const LunInfo& lun);

// MODE SELECT's parameter list: nullopt when accepted. Nothing here is changeable (the
// changeable-values masks MODE SENSE returns are all zero), so a list is accepted only when it
// changes nothing: an optional block descriptor with our block length, and pages equal to the
// current ones. Anything else is INVALID FIELD IN PARAMETER LIST pointing at the first byte
// that differs, or PARAMETER LIST LENGTH ERROR for a page cut short.
std::optional<Sense> parse_mode_select(std::span<const uint8_t> list, const ModeSelect& command,
                                       const LunInfo& lun);

// REQUEST SENSE's data-in: `pending` (a deferred error or unit attention the frontend kept
// for this nexus) or NO SENSE, in the format asked for, truncated to the allocation length.
std::vector<uint8_t> request_sense_data(const std::optional<Sense>& pending,
                                        const RequestSense& command);

// Whether a pending unit attention is reported instead of running this CDB: every command but
// INQUIRY, REPORT LUNS and REQUEST SENSE (SAM-5, unit attention condition).
bool unit_attention_applies(std::span<const uint8_t> cdb);

// The answer for a LUN the nexus does not have (SPC-5, INQUIRY's PERIPHERAL QUALIFIER): the
// standard INQUIRY data gets peripheral qualifier 3 and type 1Fh, REPORT LUNS is answered from
// `luns` like any LUN's, REQUEST SENSE reports LOGICAL UNIT NOT SUPPORTED, and any other
// command (VPD pages too) is refused with it.
Command decode_absent_lun(std::span<const uint8_t> cdb, const std::vector<uint16_t>& luns);

}  // namespace shareblk::scsi
