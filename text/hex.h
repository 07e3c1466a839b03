// text: bytes as lower-case hex, two digits a byte: how keys, random names and binary values
// are written (TLS-PSK keys, export names, iSCSI's "0x" values, printable()'s \xNN escapes).
// Header-only, like the rest of text/, so that every part can use it without linking another.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace shareblk {

inline void append_hex(std::string& out, unsigned char byte) {
  static constexpr char kDigits[] = "0123456789abcdef";
  out += kDigits[byte >> 4];
  out += kDigits[byte & 15];
}

inline std::string to_hex(std::span<const uint8_t> bytes) {
  std::string out;
  out.reserve(2 * bytes.size());
  for (const uint8_t byte : bytes) append_hex(out, byte);
  return out;
}

inline std::string to_hex(std::string_view bytes) {
  return to_hex(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
}

}  // namespace shareblk
