// decode() and the parameter lists. One table, kCommands, lists every operation code this
// target supports with its CDB length and its decoder; an opcode not in it is INVALID COMMAND
// OPERATION CODE (SPC-5).
//
// Order of checks, for every command: the opcode is known; the CDB is as long as its group
// code says; the CONTROL byte's NACA bit is clear (we do not support ACA: SAM-5); the
// command's own fields (reserved bits SPC-5/SBC-4 tell a device server to check, protection
// fields we do not support, service actions, page codes); the transfer length against the
// block limits (INVALID FIELD IN CDB with the field pointer); the range against the capacity
// (LBA OUT OF RANGE); and last, in decode(), write protection. A range is out when
// lba + blocks > capacity, computed without overflow; a 0-block transfer at the capacity is
// in range (it moves nothing), as in Linux's LIO.
//
// Decisions the issue left open:
//   - MODE SELECT accepts only a list that changes nothing (parse_mode_select): nothing is
//     changeable, the write cache follows the store and the attachment, not the initiator.
//     Linux's "echo 'write back' > cache_type" then gets INVALID FIELD IN PARAMETER LIST,
//     which sd reports and keeps the old mode.
//   - GET LBA STATUS answers one descriptor, "mapped", from the starting LBA to the end (or
//     2^32 - 1 blocks): true for a thick volume and a safe answer for a thin one: no initiator
//     skips reading a block it is told is mapped.
//   - A CDB shorter than its opcode's length is refused here (INVALID FIELD IN CDB, field
//     pointer at byte 0), not left to the iSCSI layer, so decode() is total on any span.
//   - Not in the table, so INVALID COMMAND OPERATION CODE: REPORT SUPPORTED OPERATION CODES
//     (its one-command form needs a CDB usage map per command, and an inexact one is worse than
//     none; Linux's sd then reads the VPD pages instead), WRITE AND VERIFY, ORWRITE, PRE-FETCH,
//     START STOP UNIT, PREVENT ALLOW MEDIUM REMOVAL, the reservations (the next issue).
#include "scsi/commands.h"

#include <algorithm>
#include <array>
#include <utility>

#include "scsi/data.h"

namespace shareblk::scsi {
namespace {

using detail::Bytes;
using detail::get_be;

// The highest set bit of a refused field, for the field pointer's BIT POINTER.
uint8_t top_bit(uint8_t v) {
  uint8_t bit = 7;
  while (bit > 0 && (v & (1U << bit)) == 0) --bit;
  return bit;
}

Immediate answer(Bytes data, uint64_t allocation_length) {
  if (data.size() > allocation_length) data.resize(allocation_length);
  return Immediate{std::move(data)};
}

bool in_range(uint64_t lba, uint64_t blocks, const LunInfo& lun) {
  return lba <= lun.block_count && blocks <= lun.block_count - lba;
}

// Where a READ/WRITE/VERIFY-style CDB keeps its LBA and length.
struct Layout {
  std::size_t lba_at;
  std::size_t lba_size;
  std::size_t length_at;
  std::size_t length_size;
};
constexpr Layout k10{2, 4, 7, 2};
constexpr Layout k12{2, 4, 6, 4};
constexpr Layout k16{2, 8, 10, 4};

// READ/WRITE 10/12/16 (SBC-4): RDPROTECT/WRPROTECT in byte 1 bits 7-5
// must be zero without protection information (SBC-4), FUA is bit 3.
template <bool kWrite>
Command read_write(std::span<const uint8_t> c, const LunInfo& lun, const Layout& at) {
  if ((c[1] & 0xe0) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xe0));
  const uint64_t lba = get_be(c, at.lba_at, at.lba_size);
  const auto blocks = static_cast<uint32_t>(get_be(c, at.length_at, at.length_size));
  const bool fua = (c[1] & 0x08) != 0;
  if (lun.limits.max_transfer_blocks != 0 && blocks > lun.limits.max_transfer_blocks) {
    return invalid_field_in_cdb(static_cast<uint16_t>(at.length_at));
  }
  if (!in_range(lba, blocks, lun)) return kLbaOutOfRange;
  if constexpr (kWrite) {
    return Write{lba, blocks, fua};
  } else {
    return Read{lba, blocks, fua};
  }
}

// READ(6)/WRITE(6) (SBC-4): a 21-bit LBA, and 0 blocks means 256.
template <bool kWrite>
Command read_write_6(std::span<const uint8_t> c, const LunInfo& lun) {
  if ((c[1] & 0xe0) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xe0));
  const uint64_t lba = get_be(c, 1, 3) & 0x1fffff;
  const uint32_t blocks = c[4] == 0 ? 256 : c[4];
  if (lun.limits.max_transfer_blocks != 0 && blocks > lun.limits.max_transfer_blocks) {
    return invalid_field_in_cdb(4);
  }
  if (!in_range(lba, blocks, lun)) return kLbaOutOfRange;
  if constexpr (kWrite) {
    return Write{lba, blocks, false};
  } else {
    return Read{lba, blocks, false};
  }
}

Command test_unit_ready(std::span<const uint8_t> /*c*/, const LunInfo& /*lun*/) {
  return Immediate{};
}

// REQUEST SENSE (SPC-5): DESC is byte 1 bit 0, the rest of byte 1 reserved.
Command request_sense(std::span<const uint8_t> c, const LunInfo& /*lun*/) {
  if ((c[1] & 0xfe) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xfe));
  return RequestSense{(c[1] & 0x01) != 0, c[4]};
}

// INQUIRY (SPC-5): EVPD is byte 1 bit 0; bit 1 (the obsolete CMDDT) and the reserved bits
// must be zero; without EVPD the PAGE CODE must be zero.
Command inquiry(std::span<const uint8_t> c, const LunInfo& lun) {
  if ((c[1] & 0xfe) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xfe));
  const uint64_t allocation_length = get_be(c, 3, 2);
  if ((c[1] & 0x01) == 0) {
    if (c[2] != 0) return invalid_field_in_cdb(2);
    return answer(detail::standard_inquiry(lun), allocation_length);
  }
  auto page = detail::vpd_page(c[2], lun);
  if (!page) return invalid_field_in_cdb(2);
  return answer(std::move(*page), allocation_length);
}

// MODE SENSE(6)/(10) (SPC-5).
Command mode_sense(std::span<const uint8_t> c, const LunInfo& lun, bool ten) {
  const uint8_t reserved = ten ? 0xe7 : 0xf7;  // DBD bit 3; (10) also LLBAA bit 4
  if ((c[1] & reserved) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & reserved));
  const bool dbd = (c[1] & 0x08) != 0;
  const bool long_lba = ten && (c[1] & 0x10) != 0;
  const uint8_t page_control = c[2] >> 6;
  const uint8_t page = c[2] & 0x3f;
  const uint8_t subpage = c[3];
  const uint64_t allocation_length = ten ? get_be(c, 7, 2) : c[4];
  if (page_control == 3) return kSavingParametersNotSupported;  // saved values
  std::vector<uint8_t> pages_wanted;
  if (page == 0x3f) {
    if (subpage != 0x00 && subpage != 0xff) return invalid_field_in_cdb(3);
    pages_wanted = {0x08, 0x0a, 0x1c};
  } else {
    if (!detail::mode_page(page, lun, false)) return invalid_field_in_cdb(2, 5);
    if (subpage != 0) return invalid_field_in_cdb(3);
    pages_wanted = {page};
  }
  const std::size_t header = ten ? 8 : 4;
  const std::size_t descriptor = dbd ? 0 : (long_lba ? 16 : 8);
  Bytes b(header + descriptor, 0);
  // The device-specific parameter (SBC-4, direct access): WP, DPOFUA.
  const uint8_t device_specific = static_cast<uint8_t>((lun.read_only ? 0x80 : 0) | 0x10);
  if (ten) {
    b[3] = device_specific;
    if (long_lba) b[4] = 0x01;  // LONGLBA
    detail::put_be(b, 6, descriptor, 2);
  } else {
    b[2] = device_specific;
    b[3] = static_cast<uint8_t>(descriptor);
  }
  if (descriptor == 8) {  // short LBA block descriptor (SBC-4)
    detail::put_be(b, header, std::min<uint64_t>(lun.block_count, 0xffffffffU), 4);
    detail::put_be(b, header + 5, lun.block_size, 3);
  } else if (descriptor == 16) {  // long LBA block descriptor (SBC-4)
    detail::put_be(b, header, lun.block_count, 8);
    detail::put_be(b, header + 12, lun.block_size, 4);
  }
  for (const uint8_t p : pages_wanted) {
    const auto bytes = detail::mode_page(p, lun, page_control == 1);
    b.insert(b.end(), bytes->begin(), bytes->end());
  }
  // MODE DATA LENGTH: the bytes after itself.
  if (ten) {
    detail::put_be(b, 0, b.size() - 2, 2);
  } else {
    b[0] = static_cast<uint8_t>(b.size() - 1);
  }
  return answer(std::move(b), allocation_length);
}

// MODE SELECT(6)/(10) (SPC-5): PF bit 4, SP bit 0 of byte 1. We save nothing, so
// SP is refused; the rest of byte 1 is reserved.
Command mode_select(std::span<const uint8_t> c, const LunInfo& /*lun*/, bool ten) {
  if ((c[1] & 0xee) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xee));
  if ((c[1] & 0x01) != 0) return invalid_field_in_cdb(1, 0);
  const auto length = static_cast<uint32_t>(ten ? get_be(c, 7, 2) : c[4]);
  return ModeSelect{length, ten};
}

// READ CAPACITY(10) (SBC-4): the LBA field must be zero unless PMI (obsolete in SBC-4,
// byte 8 bit 0), and we answer the same either way.
Command read_capacity_10(std::span<const uint8_t> c, const LunInfo& lun) {
  if ((c[8] & 0x01) == 0 && get_be(c, 2, 4) != 0) return invalid_field_in_cdb(2);
  return Immediate{detail::read_capacity_10(lun)};
}

// SERVICE ACTION IN(16), 9Eh: READ CAPACITY(16) and GET LBA STATUS (SBC-4).
Command service_action_in(std::span<const uint8_t> c, const LunInfo& lun) {
  if ((c[1] & 0xe0) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xe0));
  const uint64_t allocation_length = get_be(c, 10, 4);
  switch (c[1] & 0x1f) {
    case 0x10:  // READ CAPACITY(16)
      if ((c[14] & 0x01) == 0 && get_be(c, 2, 8) != 0) return invalid_field_in_cdb(2);
      return answer(detail::read_capacity_16(lun), allocation_length);
    case 0x12: {  // GET LBA STATUS
      const uint64_t lba = get_be(c, 2, 8);
      const uint8_t report_type = c[14];
      if (lba >= lun.block_count) return kLbaOutOfRange;
      // REPORT TYPE (SBC-4): 3 (deallocated) and 4 (anchored) ask only for blocks we
      // never report, so they get no descriptor; every other type, including ones newer than
      // this code, gets the one "mapped" descriptor, which is true of them all.
      Bytes b(8, 0);
      if (report_type != 3 && report_type != 4) {
        b.resize(24, 0);
        detail::put_be(b, 8, lba, 8);
        detail::put_be(b, 16, std::min<uint64_t>(lun.block_count - lba, 0xffffffffU), 4);
        b[20] = 0x00;  // PROVISIONING STATUS: mapped (or unknown)
      }
      detail::put_be(b, 0, b.size() - 4, 4);  // PARAMETER DATA LENGTH
      return answer(std::move(b), allocation_length);
    }
    default:
      return invalid_field_in_cdb(1, 4);
  }
}

// SYNCHRONIZE CACHE(10)/(16) (SBC-4): IMMED is byte 1 bit 1, bit 2 the obsolete
// SYNC_NV; 0 blocks is "through the last LBA".
Command synchronize_cache(std::span<const uint8_t> c, const LunInfo& lun, const Layout& at) {
  if ((c[1] & 0xf9) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xf9));
  const uint64_t lba = get_be(c, at.lba_at, at.lba_size);
  uint64_t blocks = get_be(c, at.length_at, at.length_size);
  if (lba > lun.block_count) return kLbaOutOfRange;
  if (blocks == 0) blocks = lun.block_count - lba;
  if (!in_range(lba, blocks, lun)) return kLbaOutOfRange;
  return SynchronizeCache{lba, blocks, (c[1] & 0x02) != 0};
}

// WRITE SAME(10)/(16) (SBC-4): byte 1 is WRPROTECT (7-5), ANCHOR (4), UNMAP (3),
// two obsolete bits (2-1) and, in (16) only, NDOB (0).
Command write_same(std::span<const uint8_t> c, const LunInfo& lun, const Layout& at, bool ndob_ok) {
  if ((c[1] & 0xe0) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xe0));
  if ((c[1] & 0x10) != 0) return invalid_field_in_cdb(1, 4);  // ANCHOR: ANC_SUP is 0
  const uint8_t other = ndob_ok ? 0x06 : 0x07;
  if ((c[1] & other) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & other));
  const bool unmap = (c[1] & 0x08) != 0;
  if (unmap && !lun.thin) return invalid_field_in_cdb(1, 3);
  const uint64_t lba = get_be(c, at.lba_at, at.lba_size);
  const uint64_t blocks = get_be(c, at.length_at, at.length_size);
  const auto length_field = static_cast<uint16_t>(at.length_at);
  // 0 blocks is refused for WSNZ (VPD page B0h), but an LBA past the capacity first: it is the
  // worse error, and what libiscsi's WRITE SAME tests expect.
  if (blocks == 0) {
    return lba > lun.block_count ? kLbaOutOfRange : invalid_field_in_cdb(length_field);
  }
  if (lun.limits.max_write_same_blocks != 0 && blocks > lun.limits.max_write_same_blocks) {
    return invalid_field_in_cdb(length_field);
  }
  if (!in_range(lba, blocks, lun)) return kLbaOutOfRange;
  return WriteSame{lba, blocks, unmap, ndob_ok && (c[1] & 0x01) != 0};
}

// UNMAP (SBC-4): ANCHOR byte 1 bit 0 (ANC_SUP is 0). Not supported at all on a fully
// provisioned unit (LBPU 0).
Command unmap(std::span<const uint8_t> c, const LunInfo& lun) {
  if (!lun.thin) return kInvalidCommandOperationCode;
  if ((c[1] & 0xff) != 0) return invalid_field_in_cdb(1, top_bit(c[1]));
  const auto length = static_cast<uint32_t>(get_be(c, 7, 2));
  // SBC-4: a PARAMETER LIST LENGTH of 1 to 7 is refused before the transfer.
  if (length > 0 && length < 8) return kParameterListLengthError;
  return Unmap{length};
}

// COMPARE AND WRITE (SBC-4): WRPROTECT (byte 1, 7-5), FUA (bit 3), an 8-byte LBA and a
// one-byte NUMBER OF LOGICAL BLOCKS (byte 13).
Command compare_and_write(std::span<const uint8_t> c, const LunInfo& lun) {
  if ((c[1] & 0xe0) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xe0));
  const uint64_t lba = get_be(c, 2, 8);
  const uint8_t blocks = c[13];
  if (blocks > lun.limits.max_compare_and_write_blocks) return invalid_field_in_cdb(13);
  if (!in_range(lba, blocks, lun)) return kLbaOutOfRange;
  return CompareAndWrite{lba, blocks, (c[1] & 0x08) != 0};
}

// VERIFY(10)/(16) (SBC-4): VRPROTECT (byte 1, 7-5), BYTCHK (bits 2-1; 10b is
// reserved).
Command verify(std::span<const uint8_t> c, const LunInfo& lun, const Layout& at) {
  if ((c[1] & 0xe0) != 0) return invalid_field_in_cdb(1, top_bit(c[1] & 0xe0));
  const auto bytchk = static_cast<uint8_t>((c[1] >> 1) & 0x03);
  if (bytchk == 2) return invalid_field_in_cdb(1, 2);
  const uint64_t lba = get_be(c, at.lba_at, at.lba_size);
  const auto blocks = static_cast<uint32_t>(get_be(c, at.length_at, at.length_size));
  if (bytchk == 1 && lun.limits.max_transfer_blocks != 0 &&
      blocks > lun.limits.max_transfer_blocks) {
    return invalid_field_in_cdb(static_cast<uint16_t>(at.length_at));
  }
  if (!in_range(lba, blocks, lun)) return kLbaOutOfRange;
  return Verify{lba, blocks, bytchk};
}

// REPORT LUNS (SPC-5): SELECT REPORT (byte 2) 00h all, 01h well-known only (we have
// none), 02h all. A short ALLOCATION LENGTH (bytes 6-9) truncates, as for every other
// command: SPC-3 refused one under 16, later revisions do not ask it.
Command report_luns(std::span<const uint8_t> c, const std::vector<uint16_t>& luns) {
  const uint64_t allocation_length = get_be(c, 6, 4);
  switch (c[2]) {
    case 0x00:
    case 0x02:
      return answer(detail::report_luns(luns), allocation_length);
    case 0x01:
      return answer(detail::report_luns({}), allocation_length);
    default:
      return invalid_field_in_cdb(2);
  }
}

using Cdb = std::span<const uint8_t>;
using Decoder = Command (*)(Cdb, const LunInfo&);

struct Entry {
  uint8_t opcode;
  uint8_t length;  // SPC-5, by group code: 0 six bytes, 1-2 ten, 4 sixteen, 5 twelve
  Decoder decode;
};

constexpr std::array kCommands{
    Entry{0x00, 6, test_unit_ready},
    Entry{0x03, 6, request_sense},
    Entry{0x08, 6, read_write_6<false>},
    Entry{0x0a, 6, read_write_6<true>},
    Entry{0x12, 6, inquiry},
    Entry{0x15, 6, [](Cdb c, const LunInfo& l) { return mode_select(c, l, false); }},
    Entry{0x1a, 6, [](Cdb c, const LunInfo& l) { return mode_sense(c, l, false); }},
    Entry{0x25, 10, read_capacity_10},
    Entry{0x28, 10, [](Cdb c, const LunInfo& l) { return read_write<false>(c, l, k10); }},
    Entry{0x2a, 10, [](Cdb c, const LunInfo& l) { return read_write<true>(c, l, k10); }},
    Entry{0x2f, 10, [](Cdb c, const LunInfo& l) { return verify(c, l, k10); }},
    Entry{0x35, 10, [](Cdb c, const LunInfo& l) { return synchronize_cache(c, l, k10); }},
    Entry{0x41, 10, [](Cdb c, const LunInfo& l) { return write_same(c, l, k10, false); }},
    Entry{0x42, 10, unmap},
    Entry{0x55, 10, [](Cdb c, const LunInfo& l) { return mode_select(c, l, true); }},
    Entry{0x5a, 10, [](Cdb c, const LunInfo& l) { return mode_sense(c, l, true); }},
    Entry{0x88, 16, [](Cdb c, const LunInfo& l) { return read_write<false>(c, l, k16); }},
    Entry{0x89, 16, compare_and_write},
    Entry{0x8a, 16, [](Cdb c, const LunInfo& l) { return read_write<true>(c, l, k16); }},
    Entry{0x8f, 16, [](Cdb c, const LunInfo& l) { return verify(c, l, k16); }},
    Entry{0x91, 16, [](Cdb c, const LunInfo& l) { return synchronize_cache(c, l, k16); }},
    Entry{0x93, 16, [](Cdb c, const LunInfo& l) { return write_same(c, l, k16, true); }},
    Entry{0x9e, 16, service_action_in},
    Entry{0xa0, 12, [](Cdb c, const LunInfo& l) { return report_luns(c, l.luns); }},
    Entry{0xa8, 12, [](Cdb c, const LunInfo& l) { return read_write<false>(c, l, k12); }},
    Entry{0xaa, 12, [](Cdb c, const LunInfo& l) { return read_write<true>(c, l, k12); }},
};

const Entry* find(uint8_t opcode) {
  const auto* it = std::find_if(kCommands.begin(), kCommands.end(),
                                [opcode](const Entry& e) { return e.opcode == opcode; });
  return it == kCommands.end() ? nullptr : &*it;
}

// The checks every command shares, then its decoder.
Command decode_cdb(std::span<const uint8_t> cdb, const LunInfo& lun) {
  if (cdb.empty()) return invalid_field_in_cdb(0);
  const Entry* entry = find(cdb[0]);
  if (entry == nullptr) return kInvalidCommandOperationCode;
  if (cdb.size() < entry->length) return invalid_field_in_cdb(0);
  const auto c = cdb.first(entry->length);
  // CONTROL byte (SAM-5): NACA (bit 2) set asks for ACA, which we do not support.
  if ((c.back() & 0x04) != 0) return invalid_field_in_cdb(entry->length - 1, 2);
  return entry->decode(c, lun);
}

}  // namespace

bool writes_medium(const Command& command) {
  return std::holds_alternative<Write>(command) || std::holds_alternative<WriteSame>(command) ||
         std::holds_alternative<Unmap>(command) || std::holds_alternative<CompareAndWrite>(command);
}

Command decode(std::span<const uint8_t> cdb, const LunInfo& lun) {
  Command command = decode_cdb(cdb, lun);
  // A read-only LUN (SBC-4, write protection): refused before any data-out.
  if (lun.read_only && writes_medium(command)) return kWriteProtected;
  return command;
}

uint64_t data_out_length(const Command& command, const LunInfo& lun) {
  const uint64_t block = lun.block_size;
  if (const auto* w = std::get_if<Write>(&command)) return w->blocks * block;
  if (const auto* ws = std::get_if<WriteSame>(&command)) return ws->ndob ? 0 : block;
  if (const auto* u = std::get_if<Unmap>(&command)) return u->param_len;
  if (const auto* cw = std::get_if<CompareAndWrite>(&command)) return 2 * cw->blocks * block;
  if (const auto* v = std::get_if<Verify>(&command)) {
    if (v->bytchk == 1) return v->blocks * block;
    if (v->bytchk == 3) return block;
    return 0;
  }
  if (const auto* ms = std::get_if<ModeSelect>(&command)) return ms->param_len;
  return 0;
}

uint64_t data_in_length(const Command& command, const LunInfo& lun) {
  if (const auto* r = std::get_if<Read>(&command)) return uint64_t{r->blocks} * lun.block_size;
  return 0;
}

ParsedUnmap parse_unmap(std::span<const uint8_t> list, const LunInfo& lun) {
  std::vector<UnmapDescriptor> out;
  if (list.empty()) return out;
  // SBC-4, UNMAP parameter list: UNMAP DATA LENGTH (n - 1, from byte 2 on), UNMAP BLOCK
  // DESCRIPTOR DATA LENGTH (n - 7, from byte 8 on); neither may claim more than was sent.
  if (list.size() < 8) return kParameterListLengthError;
  const uint64_t data_length = get_be(list, 0, 2);
  const uint64_t descriptor_length = get_be(list, 2, 2);
  if (data_length + 2 > list.size() || descriptor_length + 8 > list.size()) {
    return kParameterListLengthError;
  }
  // A trailing partial descriptor is ignored (SBC-4: a length not a multiple of 16).
  const uint64_t count = descriptor_length / 16;
  if (count > lun.limits.max_unmap_descriptors) return invalid_field_in_parameter_list(2);
  uint64_t total = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const std::size_t at = 8 + 16 * i;
    const uint64_t lba = get_be(list, at, 8);
    const auto blocks = static_cast<uint32_t>(get_be(list, at + 8, 4));
    if (!in_range(lba, blocks, lun)) return kLbaOutOfRange;
    total += blocks;
    if (total > lun.limits.max_unmap_lba_count) {
      return invalid_field_in_parameter_list(static_cast<uint16_t>(at + 8));
    }
    if (blocks != 0) out.push_back(UnmapDescriptor{lba, blocks});
  }
  return out;
}

std::optional<Sense> parse_mode_select(std::span<const uint8_t> list, const ModeSelect& command,
                                       const LunInfo& lun) {
  if (list.empty()) return std::nullopt;  // SPC-5: a length of 0 transfers nothing
  // The mode parameter header (SPC-5): MODE DATA LENGTH is reserved
  // in MODE SELECT; MEDIUM TYPE must be 0 (SBC-4); the device-specific parameter's WP
  // and DPOFUA are ignored (SBC-4).
  const std::size_t header = command.ten_byte ? 8 : 4;
  if (list.size() < header) return kParameterListLengthError;
  const std::size_t medium_at = command.ten_byte ? 2 : 1;
  if (list[medium_at] != 0) return invalid_field_in_parameter_list(medium_at);
  const bool long_lba = command.ten_byte && (list[4] & 0x01) != 0;
  const std::size_t descriptor_at = command.ten_byte ? 6 : 3;
  const uint64_t descriptor_length = command.ten_byte ? get_be(list, 6, 2) : uint64_t{list[3]};
  std::size_t at = header;
  if (descriptor_length != 0) {
    if (descriptor_length != (long_lba ? 16U : 8U)) {
      return invalid_field_in_parameter_list(static_cast<uint16_t>(descriptor_at));
    }
    if (list.size() < at + descriptor_length) return kParameterListLengthError;
    // NUMBER OF LOGICAL BLOCKS 0 or the current count changes nothing (SBC-4); the
    // LOGICAL BLOCK LENGTH must be ours.
    const uint64_t blocks = long_lba ? get_be(list, at, 8) : get_be(list, at, 4);
    const uint64_t current =
        long_lba ? lun.block_count : std::min<uint64_t>(lun.block_count, 0xffffffffU);
    if (blocks != 0 && blocks != current) {
      return invalid_field_in_parameter_list(static_cast<uint16_t>(at));
    }
    const std::size_t length_at = at + (long_lba ? 12 : 5);
    if (get_be(list, length_at, long_lba ? 4 : 3) != lun.block_size) {
      return invalid_field_in_parameter_list(static_cast<uint16_t>(length_at));
    }
    at += descriptor_length;
  }
  while (at < list.size()) {
    // A page (SPC-5, mode page format): PS (bit 7, reserved here), SPF (bit 6: we have no
    // subpages), PAGE CODE, PAGE LENGTH.
    if ((list[at] & 0x40) != 0)
      return invalid_field_in_parameter_list(static_cast<uint16_t>(at), 6);
    if (at + 2 > list.size()) return kParameterListLengthError;
    const auto current = detail::mode_page(list[at] & 0x3f, lun, false);
    if (!current) return invalid_field_in_parameter_list(static_cast<uint16_t>(at), 5);
    const std::size_t length = list[at + 1];
    if (length != (*current)[1]) {
      return invalid_field_in_parameter_list(static_cast<uint16_t>(at + 1));
    }
    if (at + 2 + length > list.size()) return kParameterListLengthError;
    for (std::size_t i = 2; i < 2 + length; ++i) {
      const auto differs = static_cast<uint8_t>(list[at + i] ^ (*current)[i]);
      if (differs != 0) {
        return invalid_field_in_parameter_list(static_cast<uint16_t>(at + i), top_bit(differs));
      }
    }
    at += 2 + length;
  }
  return std::nullopt;
}

std::vector<uint8_t> request_sense_data(const std::optional<Sense>& pending,
                                        const RequestSense& command) {
  auto data = encode_sense(pending.value_or(kNoSense), command.descriptor_format);
  if (data.size() > command.allocation_length) data.resize(command.allocation_length);
  return data;
}

bool unit_attention_applies(std::span<const uint8_t> cdb) {
  if (cdb.empty()) return true;
  return cdb[0] != 0x12 && cdb[0] != 0xa0 && cdb[0] != 0x03;
}

Command decode_absent_lun(std::span<const uint8_t> cdb, const std::vector<uint16_t>& luns) {
  if (cdb.empty()) return invalid_field_in_cdb(0);
  LunInfo none;
  none.luns = luns;
  switch (cdb[0]) {
    case 0x12: {  // INQUIRY: peripheral qualifier 011b, type 1Fh (SPC-5)
      // No VPD page: there is no unit to describe, and a designator made up for it could look
      // like another unit's to multipath.
      if (cdb.size() > 1 && (cdb[1] & 0x01) != 0) return kLogicalUnitNotSupported;
      Command c = decode_cdb(cdb, none);
      if (auto* data = std::get_if<Immediate>(&c); data != nullptr && !data->data.empty()) {
        data->data[0] = 0x7f;
      }
      return c;
    }
    case 0xa0:  // REPORT LUNS
      return decode_cdb(cdb, none);
    case 0x03: {  // REQUEST SENSE: the reason, as data, with GOOD (SPC-5)
      Command c = decode_cdb(cdb, none);
      if (const auto* rs = std::get_if<RequestSense>(&c)) {
        return Immediate{request_sense_data(kLogicalUnitNotSupported, *rs)};
      }
      return c;
    }
    default:
      return kLogicalUnitNotSupported;
  }
}

}  // namespace shareblk::scsi
