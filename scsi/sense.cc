// Sense data bytes, laid out from SPC-5's "Sense data" clause: fixed format, descriptor format
// with the Information descriptor and the sense key specific descriptor; the field pointer's
// three bytes are the same in either.
#include "scsi/sense.h"

#include <algorithm>
#include <cerrno>

namespace shareblk::scsi {
namespace {

// SKSV, C/D, BPV and the bit pointer, then the field pointer.
std::array<uint8_t, 3> field_pointer_bytes(const FieldPointer& f) {
  uint8_t first = 0x80;  // SKSV
  if (f.in_cdb) first |= 0x40;
  if (f.bit) first |= static_cast<uint8_t>(0x08 | (*f.bit & 0x07));
  return {first, static_cast<uint8_t>(f.byte >> 8), static_cast<uint8_t>(f.byte)};
}

FieldPointer field_pointer_from(const uint8_t* b) {
  FieldPointer f;
  f.in_cdb = (b[0] & 0x40) != 0;
  if ((b[0] & 0x08) != 0) f.bit = static_cast<uint8_t>(b[0] & 0x07);
  f.byte = static_cast<uint16_t>((b[1] << 8) | b[2]);
  return f;
}

}  // namespace

Sense invalid_field_in_cdb(uint16_t byte, std::optional<uint8_t> bit) {
  Sense s = kInvalidFieldInCdb;
  s.field = FieldPointer{true, byte, bit};
  return s;
}

Sense invalid_field_in_parameter_list(uint16_t byte, std::optional<uint8_t> bit) {
  Sense s = kInvalidFieldInParameterList;
  s.field = FieldPointer{false, byte, bit};
  return s;
}

Sense miscompare_at(uint64_t offset) {
  Sense s = kMiscompareDuringVerify;
  s.information = offset;
  return s;
}

Sense sense_for_errno(int err, bool write) {
  switch (err) {
    case EIO:
      return write ? kWriteError : kUnrecoveredReadError;
    // decode() has already refused a range past the capacity, so ENOSPC from the backend is
    // the store running out of space (SBC-4, thin provisioning: a logical unit that cannot
    // allocate answers 27/07).
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return kSpaceAllocationFailedWriteProtect;
    case EPERM:
    case EROFS:
    case EACCES:
      return kWriteProtected;
    default:
      return kInternalTargetFailure;
  }
}

std::array<uint8_t, kFixedSenseLength> encode_fixed(const Sense& sense) {
  std::array<uint8_t, kFixedSenseLength> b{};
  b[0] = 0x70;
  b[2] = static_cast<uint8_t>(sense.key);
  if (sense.information && *sense.information <= 0xffffffffU) {
    b[0] |= 0x80;  // VALID
    const uint64_t info = *sense.information;
    for (std::size_t i = 0; i < 4; ++i) b[3 + i] = static_cast<uint8_t>(info >> (24 - 8 * i));
  }
  b[7] = kFixedSenseLength - 8;  // ADDITIONAL SENSE LENGTH
  b[12] = sense.asc;
  b[13] = sense.ascq;
  if (sense.field) {
    const auto f = field_pointer_bytes(*sense.field);
    b[15] = f[0];
    b[16] = f[1];
    b[17] = f[2];
  }
  return b;
}

std::vector<uint8_t> encode_descriptor(const Sense& sense) {
  std::vector<uint8_t> b(8, 0);
  b[0] = 0x72;
  b[1] = static_cast<uint8_t>(sense.key);
  b[2] = sense.asc;
  b[3] = sense.ascq;
  if (sense.information) {
    // Information descriptor: type 00h, additional length 0Ah, VALID, 64-bit INFORMATION.
    const std::size_t at = b.size();
    b.resize(at + 12, 0);
    b[at] = 0x00;
    b[at + 1] = 0x0a;
    b[at + 2] = 0x80;
    for (std::size_t i = 0; i < 8; ++i) {
      b[at + 4 + i] = static_cast<uint8_t>(*sense.information >> (56 - 8 * i));
    }
  }
  if (sense.field) {
    // Sense key specific descriptor: type 02h, additional length 06h, bytes 4-6 the field pointer.
    const std::size_t at = b.size();
    b.resize(at + 8, 0);
    b[at] = 0x02;
    b[at + 1] = 0x06;
    const auto f = field_pointer_bytes(*sense.field);
    b[at + 4] = f[0];
    b[at + 5] = f[1];
    b[at + 6] = f[2];
  }
  b[7] = static_cast<uint8_t>(b.size() - 8);  // ADDITIONAL SENSE LENGTH
  return b;
}

std::vector<uint8_t> encode_sense(const Sense& sense, bool descriptor_format) {
  if (descriptor_format) return encode_descriptor(sense);
  const auto fixed = encode_fixed(sense);
  return {fixed.begin(), fixed.end()};
}

std::optional<Sense> decode_sense(std::span<const uint8_t> b) {
  if (b.empty()) return std::nullopt;
  const uint8_t code = b[0] & 0x7f;
  Sense s;
  if (code == 0x70 || code == 0x71) {
    if (b.size() < kFixedSenseLength) return std::nullopt;
    s.key = static_cast<SenseKey>(b[2] & 0x0f);
    if ((b[0] & 0x80) != 0) {
      s.information =
          (uint64_t{b[3]} << 24) | (uint64_t{b[4]} << 16) | (uint64_t{b[5]} << 8) | uint64_t{b[6]};
    }
    s.asc = b[12];
    s.ascq = b[13];
    if ((b[15] & 0x80) != 0) s.field = field_pointer_from(&b[15]);
    return s;
  }
  if (code != 0x72 && code != 0x73) return std::nullopt;
  if (b.size() < 8) return std::nullopt;
  s.key = static_cast<SenseKey>(b[1] & 0x0f);
  s.asc = b[2];
  s.ascq = b[3];
  const std::size_t end = std::min<std::size_t>(b.size(), 8 + std::size_t{b[7]});
  std::size_t at = 8;
  while (at + 2 <= end) {
    const std::size_t length = 2 + std::size_t{b[at + 1]};
    if (at + length > end) return std::nullopt;
    if (b[at] == 0x00 && length == 12 && (b[at + 2] & 0x80) != 0) {
      uint64_t info = 0;
      for (std::size_t i = 0; i < 8; ++i) info = (info << 8) | b[at + 4 + i];
      s.information = info;
    } else if (b[at] == 0x02 && length == 8 && (b[at + 4] & 0x80) != 0) {
      s.field = field_pointer_from(&b[at + 4]);
    }
    at += length;
  }
  return s;
}

}  // namespace shareblk::scsi
