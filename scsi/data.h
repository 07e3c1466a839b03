// Internal to scsi/: the data-in that commands.cc answers from a LunInfo alone (INQUIRY and its
// VPD pages, READ CAPACITY, MODE SENSE's pages, REPORT LUNS), and the byte helpers both files
// use. Every builder returns the whole data; the caller truncates it to the allocation length.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "scsi/commands.h"

namespace shareblk::scsi::detail {

using Bytes = std::vector<uint8_t>;

// Big-endian fields; the callers have checked that [at, at + n) is inside `b`.
inline uint64_t get_be(std::span<const uint8_t> b, std::size_t at, std::size_t n) {
  uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v = (v << 8) | b[at + i];
  return v;
}
inline void put_be(Bytes& b, std::size_t at, uint64_t v, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * (n - 1 - i)));
}

// The standard INQUIRY data (SPC-5).
Bytes standard_inquiry(const LunInfo& lun);
// A VPD page (SPC-5 and SBC-4 VPD parameters), or nullopt for a page we do not have.
std::optional<Bytes> vpd_page(uint8_t page, const LunInfo& lun);
// The NAA 6 designator of VPD page 0x83: 16 bytes, a function of the volume id and the
// company id only.
std::array<uint8_t, 16> naa_designator(const LunInfo& lun);

Bytes read_capacity_10(const LunInfo& lun);
Bytes read_capacity_16(const LunInfo& lun);

// Mode pages (SBC-4 and SPC-5 mode parameters): the current values of one page (0x08, 0x0a, 0x1c),
// or nullopt. `changeable` gives the changeable-values mask instead: all zero here.
std::optional<Bytes> mode_page(uint8_t page, const LunInfo& lun, bool changeable);

// REPORT LUNS parameter data (SPC-5) for `luns`, single-level LUN structure (SAM-5
// LUN addressing): peripheral device addressing below 256, flat space addressing below 16384.
Bytes report_luns(const std::vector<uint16_t>& luns);

}  // namespace shareblk::scsi::detail
