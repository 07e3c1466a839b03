// ISA-L's crc32_iscsi() is the bare CRC register: it neither presets nor complements. It is
// given the running register (all ones to start, §12.1 / RFC 3720 B.4) and the caller
// complements the end result; chaining calls over pieces then equals one call over the whole.
// tests/iscsi_codec_test.cc holds this to the B.4 vectors.
#include "iscsi/digest.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <climits>

namespace shareblk::iscsi {

void Crc32c::update(std::span<const uint8_t> bytes) {
  // crc32_iscsi() takes an int length: feed it at most INT_MAX bytes at a time.
  while (!bytes.empty()) {
    const std::size_t piece = std::min<std::size_t>(bytes.size(), INT_MAX);
    // ISA-L's prototype is not const-correct; it only reads the buffer.
    auto* data = const_cast<unsigned char*>(bytes.data());  // NOLINT(*-const-cast)
    state_ = crc32_iscsi(data, static_cast<int>(piece), state_);
    bytes = bytes.subspan(piece);
  }
}

uint32_t crc32c(std::span<const uint8_t> bytes) {
  Crc32c crc;
  crc.update(bytes);
  return crc.value();
}

std::array<uint8_t, 4> to_wire_bytes(uint32_t digest) {
  return {static_cast<uint8_t>(digest), static_cast<uint8_t>(digest >> 8),
          static_cast<uint8_t>(digest >> 16), static_cast<uint8_t>(digest >> 24)};
}

uint32_t from_wire_bytes(std::span<const uint8_t, 4> wire) {
  return uint32_t{wire[0]} | (uint32_t{wire[1]} << 8) | (uint32_t{wire[2]} << 16) |
         (uint32_t{wire[3]} << 24);
}

}  // namespace shareblk::iscsi
