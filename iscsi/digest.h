// One of iscsi/'s public headers (iscsi/iscsi.h includes them all): CRC32C, the header and data
// digests of RFC 7143 §12.1 (the "CRC32C" value of HeaderDigest/DataDigest, §13.1), computed by
// Intel ISA-L.
//
// The value is the CRC of RFC 3720 Appendix B.4 (reflected Castagnoli polynomial 0x1EDC6F41,
// register preset to all ones, result complemented); on the wire its four bytes go least
// significant first (to_wire_bytes()), which is how B.4's test vectors are written.
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace shareblk::iscsi {

// A digest computed over several pieces, e.g. a BHS and its AHS, or a data segment and its pad
// bytes (§12.1: the data digest covers the padding).
class Crc32c {
 public:
  void update(std::span<const uint8_t> bytes);
  uint32_t value() const { return ~state_; }

 private:
  uint32_t state_ = 0xffffffff;
};

uint32_t crc32c(std::span<const uint8_t> bytes);

// The digest as sent: least significant byte first.
std::array<uint8_t, 4> to_wire_bytes(uint32_t digest);
// The digest as received; `wire` must hold 4 bytes.
uint32_t from_wire_bytes(std::span<const uint8_t, 4> wire);

}  // namespace shareblk::iscsi
