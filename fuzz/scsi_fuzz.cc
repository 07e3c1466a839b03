// Fuzzes the SCSI command layer (scsi/scsi.h) on what an initiator sends: a CDB and a parameter
// list, against a logical unit the input describes.
//
// The input is: one byte of LUN flags (bit 0 read-only, 1 thin, 2 write cache, 3 small block
// limits, 4 unmapped blocks read zero, 5 a capacity of any 64-bit size instead of one below
// 2^24 blocks), eight bytes of capacity, one byte of CDB length (0-32), the CDB, and the rest
// as the data-out parameter list. decode() runs on the CDB, and decode_absent_lun() too;
// parse_unmap() and parse_mode_select() on the list. A broken promise aborts:
//   - decode() gives the same answer twice;
//   - a media operation's range is inside the capacity (lba + blocks, without wrapping), READ
//     and WRITE within the maximum transfer length, and a read-only LUN gets none that writes;
//   - data answered at once never passes the CDB's ALLOCATION LENGTH;
//   - a sense encodes to fixed and descriptor format and decodes back to itself;
//   - UNMAP's descriptors are each in range, within the descriptor count and the LBA count;
//   - an absent LUN never gets a media operation.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <variant>
#include <vector>

#include "scsi/scsi.h"

namespace shareblk::fuzz {
namespace {

using namespace scsi;  // NOLINT(google-build-using-namespace): the command set's vocabulary

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "scsi_fuzz: %s\n", what);
    std::abort();
  }
}

uint64_t be(std::span<const uint8_t> b, std::size_t at, std::size_t n) {
  uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v = (v << 8) | b[at + i];
  return v;
}

bool in_range(uint64_t lba, uint64_t blocks, const LunInfo& lun) {
  return lba <= lun.block_count && blocks <= lun.block_count - lba;
}

// The ALLOCATION LENGTH of the commands answered with data, where the CDB has one.
std::optional<uint64_t> allocation_length(std::span<const uint8_t> c) {
  switch (c[0]) {
    case 0x12:
      return be(c, 3, 2);
    case 0x03:
    case 0x1a:
      return c[4];
    case 0x5a:
      return be(c, 7, 2);
    case 0x9e:
      return be(c, 10, 4);
    case 0xa0:
      return be(c, 6, 4);
    default:
      return std::nullopt;
  }
}

void check_sense(const Sense& s) {
  const auto fixed = encode_fixed(s);
  const auto back = decode_sense(fixed);
  check(back.has_value(), "fixed sense does not decode");
  if (!s.information || *s.information <= 0xffffffffU) {
    check(*back == s, "fixed sense decodes to another sense");
  }
  const auto descriptor = encode_descriptor(s);
  check(decode_sense(descriptor) == s, "descriptor sense decodes to another sense");
}

void check_command(const Command& command, std::span<const uint8_t> cdb, const LunInfo& lun) {
  if (lun.read_only) check(!writes_medium(command), "a read-only LUN got a write");
  if (const auto* s = std::get_if<Sense>(&command)) check_sense(*s);
  if (const auto* i = std::get_if<Immediate>(&command)) {
    if (const auto limit = allocation_length(cdb)) {
      check(i->data.size() <= *limit, "data-in past the allocation length");
    }
  }
  if (const auto* r = std::get_if<Read>(&command)) {
    check(in_range(r->lba, r->blocks, lun), "READ out of range");
    check(r->blocks <= lun.limits.max_transfer_blocks, "READ past the transfer limit");
  }
  if (const auto* w = std::get_if<Write>(&command)) {
    check(in_range(w->lba, w->blocks, lun), "WRITE out of range");
    check(w->blocks <= lun.limits.max_transfer_blocks, "WRITE past the transfer limit");
  }
  if (const auto* ws = std::get_if<WriteSame>(&command)) {
    check(in_range(ws->lba, ws->blocks, lun) && ws->blocks > 0, "WRITE SAME range");
    check(ws->blocks <= lun.limits.max_write_same_blocks, "WRITE SAME past its limit");
  }
  if (const auto* cw = std::get_if<CompareAndWrite>(&command)) {
    check(in_range(cw->lba, cw->blocks, lun), "COMPARE AND WRITE out of range");
    check(cw->blocks <= lun.limits.max_compare_and_write_blocks, "COMPARE AND WRITE too long");
  }
  if (const auto* v = std::get_if<Verify>(&command)) {
    check(in_range(v->lba, v->blocks, lun) && v->bytchk != 2, "VERIFY");
  }
  if (const auto* sc = std::get_if<SynchronizeCache>(&command)) {
    check(in_range(sc->lba, sc->blocks, lun), "SYNCHRONIZE CACHE out of range");
  }
  if (const auto* rs = std::get_if<RequestSense>(&command)) {
    const auto data = request_sense_data(kCapacityDataHasChanged, *rs);
    check(data.size() <= rs->allocation_length, "sense data past the allocation length");
  }
}

void check_unmap(std::span<const uint8_t> list, const LunInfo& lun) {
  const ParsedUnmap parsed = parse_unmap(list, lun);
  if (const auto* s = std::get_if<Sense>(&parsed)) {
    check_sense(*s);
    return;
  }
  const auto& descriptors = std::get<std::vector<UnmapDescriptor>>(parsed);
  check(descriptors.size() <= lun.limits.max_unmap_descriptors, "too many unmap descriptors");
  uint64_t total = 0;
  for (const UnmapDescriptor& d : descriptors) {
    check(d.blocks > 0 && in_range(d.lba, d.blocks, lun), "unmap descriptor out of range");
    total += d.blocks;
  }
  check(total <= lun.limits.max_unmap_lba_count, "unmap past its LBA count");
}

}  // namespace
}  // namespace shareblk::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shareblk::scsi;  // NOLINT(google-build-using-namespace)
  namespace fz = shareblk::fuzz;
  if (size < 10) return 0;
  const std::span<const uint8_t> input(data, size);
  const uint8_t flags = input[0];
  LunInfo lun;
  lun.volume_id = "6f1c2b9e-3d4a-4c5b-8e7f-0123456789ab";
  lun.read_only = (flags & 0x01) != 0;
  lun.thin = (flags & 0x02) != 0;
  lun.write_cache = (flags & 0x04) != 0;
  if ((flags & 0x08) != 0) {
    lun.limits.max_transfer_blocks = 8;
    lun.limits.max_unmap_descriptors = 2;
    lun.limits.max_unmap_lba_count = 64;
    lun.limits.max_write_same_blocks = 16;
  }
  lun.unmapped_reads_zero = (flags & 0x10) != 0;
  const uint64_t capacity = fz::be(input, 1, 8);
  lun.block_count = (flags & 0x20) != 0 ? capacity : capacity % (1U << 24);
  lun.target_port_name = "iqn.2026-11.org.shareblk:fuzz,t,0x0001";
  lun.luns = {0, 7, 300};
  const std::size_t cdb_length = std::min<std::size_t>(input[9] % 33, size - 10);
  const auto cdb = input.subspan(10, cdb_length);
  const auto list = input.subspan(10 + cdb_length);

  const Command command = decode(cdb, lun);
  fz::check(decode(cdb, lun) == command, "decode is not a function of its input");
  if (!cdb.empty()) fz::check_command(command, cdb, lun);
  if (const auto* ms = std::get_if<ModeSelect>(&command)) {
    if (const auto refused = parse_mode_select(list, *ms, lun)) fz::check_sense(*refused);
  }
  fz::check_unmap(list, lun);
  for (const bool ten : {false, true}) {
    if (const auto refused = parse_mode_select(list, ModeSelect{0, ten}, lun)) {
      fz::check_sense(*refused);
    }
  }
  const Command absent = decode_absent_lun(cdb, lun.luns);
  fz::check(std::holds_alternative<Immediate>(absent) || std::holds_alternative<Sense>(absent),
            "an absent LUN got a media operation");
  return 0;
}
