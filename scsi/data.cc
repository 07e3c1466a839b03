// The data-in built from a LunInfo. Layouts are SPC-5's and SBC-4's tables, cited at each
// builder; every reserved byte is zero.
#include "scsi/data.h"

#include <algorithm>
#include <string>
#include <string_view>

namespace shareblk::scsi::detail {
namespace {

constexpr uint8_t kPeripheralDirectAccess = 0x00;  // qualifier 000b, type 00h (SBC device)
constexpr char kVendor[] = "SHAREBLK";             // T10 vendor identification, 8 bytes

// Left-aligned ASCII, padded with spaces (SPC-5, ASCII data fields).
void put_ascii(Bytes& b, std::size_t at, std::string_view text, std::size_t width) {
  for (std::size_t i = 0; i < width; ++i) {
    const char c = i < text.size() ? text[i] : ' ';
    b[at + i] = (c >= 0x20 && c < 0x7f) ? static_cast<uint8_t>(c) : static_cast<uint8_t>(' ');
  }
}

// A VPD page: the 4-byte header (SPC-5), PAGE LENGTH the body's.
Bytes vpd(uint8_t page, const Bytes& body) {
  Bytes b(4 + body.size(), 0);
  b[0] = kPeripheralDirectAccess;
  b[1] = page;
  put_be(b, 2, body.size(), 2);
  std::copy(body.begin(), body.end(), b.begin() + 4);
  return b;
}

// One designation descriptor (SPC-5, Device Identification VPD page).
enum : uint8_t { kCodeBinary = 1, kCodeAscii = 2, kCodeUtf8 = 3 };
enum : uint8_t { kAssocLu = 0, kAssocPort = 1, kAssocDevice = 2 };
enum : uint8_t { kTypeT10 = 1, kTypeNaa = 3, kTypeRelPort = 4, kTypeTpg = 5, kTypeName = 8 };
constexpr uint8_t kProtocolIscsi = 5;  // SPC-5 PROTOCOL IDENTIFIER values

void add_designator(Bytes& out, uint8_t code_set, uint8_t association, uint8_t type,
                    std::span<const uint8_t> value) {
  // PIV (and so the protocol identifier) means something only for a port or device
  // association (SPC-5).
  const bool piv = association != kAssocLu;
  out.push_back(static_cast<uint8_t>((piv ? kProtocolIscsi << 4 : 0) | code_set));
  out.push_back(static_cast<uint8_t>((piv ? 0x80 : 0) | (association << 4) | type));
  out.push_back(0);
  out.push_back(static_cast<uint8_t>(value.size()));
  out.insert(out.end(), value.begin(), value.end());
}

// A SCSI name string (SPC-5): UTF-8, NUL-terminated, padded with NULs to a multiple of 4.
// Nothing when it would not fit the one-byte DESIGNATOR LENGTH.
void add_name(Bytes& out, uint8_t association, std::string_view name) {
  if (name.empty() || name.size() > 251) return;
  Bytes value(name.begin(), name.end());
  value.resize((name.size() + 4) & ~std::size_t{3}, 0);
  add_designator(out, kCodeUtf8, association, kTypeName, value);
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// 32 hex digits: the UUID's own when the volume id is one (dashes skipped), else two FNV-1a
// 64-bit hashes of its text with different offset bases. Either way a function of the id
// alone, so every gateway derives the same digits.
std::array<uint8_t, 32> id_digits(std::string_view id) {
  std::array<uint8_t, 32> digits{};
  std::size_t n = 0;
  bool uuid = true;
  for (const char c : id) {
    if (c == '-') continue;
    const int v = hex_value(c);
    if (v < 0 || n == digits.size()) {
      uuid = false;
      break;
    }
    digits[n++] = static_cast<uint8_t>(v);
  }
  if (uuid && n == digits.size()) return digits;
  uint64_t h[2] = {0xcbf29ce484222325ULL, 0x84222325cbf29ce4ULL};
  for (uint64_t& x : h) {
    for (const char c : id) {
      x ^= static_cast<uint8_t>(c);
      x *= 0x100000001b3ULL;
    }
  }
  for (std::size_t i = 0; i < 32; ++i) {
    digits[i] = static_cast<uint8_t>((h[i / 16] >> (4 * (15 - i % 16))) & 0xf);
  }
  return digits;
}

}  // namespace

// SPC-5, standard INQUIRY data. 36 bytes: no version descriptors.
Bytes standard_inquiry(const LunInfo& lun) {
  Bytes b(36, 0);
  b[0] = kPeripheralDirectAccess;
  b[2] = 0x07;                                // VERSION: SPC-5
  b[3] = 0x10 | 0x02;                         // HISUP, RESPONSE DATA FORMAT 2
  b[4] = static_cast<uint8_t>(b.size() - 5);  // ADDITIONAL LENGTH (n - 4)
  b[7] = 0x02;                                // CMDQUE
  put_ascii(b, 8, kVendor, 8);
  put_ascii(b, 16, lun.product, 16);
  put_ascii(b, 32, lun.revision, 4);
  return b;
}

// NAA 6, IEEE Registered Extended (SPC-5): NAA (4 bits), IEEE COMPANY_ID
// (24), VENDOR SPECIFIC IDENTIFIER (36) and its EXTENSION (64). The 100 vendor bits are 25 of the
// UUID's hex digits, skipping digit 12 (the version) and digit 16 (the variant), the two that
// are the same in every random UUID: two volumes share a designator only if their UUIDs share
// those 100 random bits.
std::array<uint8_t, 16> naa_designator(const LunInfo& lun) {
  const auto digits = id_digits(lun.volume_id);
  std::array<uint8_t, 32> nibbles{};
  nibbles[0] = 0x6;
  for (std::size_t i = 0; i < 6; ++i) {
    nibbles[1 + i] = static_cast<uint8_t>((lun.ieee_company_id >> (4 * (5 - i))) & 0xf);
  }
  std::size_t at = 7;
  for (std::size_t i = 0; i < digits.size() && at < nibbles.size(); ++i) {
    if (i == 12 || i == 16) continue;
    nibbles[at++] = digits[i];
  }
  std::array<uint8_t, 16> out{};
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<uint8_t>((nibbles[2 * i] << 4) | nibbles[2 * i + 1]);
  }
  return out;
}

std::optional<Bytes> vpd_page(uint8_t page, const LunInfo& lun) {
  switch (page) {
    case 0x00: {  // Supported VPD pages (SPC-5), ascending
      return vpd(page, {0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2});
    }
    case 0x80: {  // Unit serial number (SPC-5): the volume id
      Bytes body(lun.volume_id.size());
      put_ascii(body, 0, lun.volume_id, body.size());
      return vpd(page, body);
    }
    case 0x83: {  // Device identification (SPC-5)
      Bytes body;
      const auto naa = naa_designator(lun);
      add_designator(body, kCodeBinary, kAssocLu, kTypeNaa, naa);
      // T10 vendor ID based (SPC-5): the vendor, then the volume id.
      Bytes t10(8 + std::min<std::size_t>(lun.volume_id.size(), 200), 0);
      put_ascii(t10, 0, kVendor, 8);
      put_ascii(t10, 8, lun.volume_id, t10.size() - 8);
      add_designator(body, kCodeAscii, kAssocLu, kTypeT10, t10);
      if (lun.relative_target_port != 0) {  // relative target port
        const uint8_t v[4] = {0, 0, static_cast<uint8_t>(lun.relative_target_port >> 8),
                              static_cast<uint8_t>(lun.relative_target_port)};
        add_designator(body, kCodeBinary, kAssocPort, kTypeRelPort, v);
      }
      if (lun.target_port_group != 0) {  // target port group
        const uint8_t v[4] = {0, 0, static_cast<uint8_t>(lun.target_port_group >> 8),
                              static_cast<uint8_t>(lun.target_port_group)};
        add_designator(body, kCodeBinary, kAssocPort, kTypeTpg, v);
      }
      add_name(body, kAssocPort, lun.target_port_name);
      add_name(body, kAssocDevice, lun.target_name);
      return vpd(page, body);
    }
    case 0xb0: {  // Block Limits (SBC-4): page length 003Ch
      const BlockLimits& l = lun.limits;
      Bytes body(0x3c, 0);
      body[0] = 0x01;  // WSNZ: WRITE SAME with 0 blocks is refused (byte 4 of the page)
      body[1] = l.max_compare_and_write_blocks;
      put_be(body, 2, l.optimal_transfer_granularity, 2);
      put_be(body, 4, l.max_transfer_blocks, 4);
      put_be(body, 8, l.optimal_transfer_blocks, 4);
      if (lun.thin) {
        put_be(body, 16, l.max_unmap_lba_count, 4);
        put_be(body, 20, l.max_unmap_descriptors, 4);
        put_be(body, 24, l.unmap_granularity, 4);
        body[28] = 0x80;  // UGAVALID, UNMAP GRANULARITY ALIGNMENT 0
      }
      put_be(body, 32, l.max_write_same_blocks, 8);
      return vpd(page, body);
    }
    case 0xb1: {  // Block Device Characteristics (SBC-4): non-rotating medium
      Bytes body(0x3c, 0);
      body[1] = 0x01;  // MEDIUM ROTATION RATE 0001h
      return vpd(page, body);
    }
    case 0xb2: {  // Logical Block Provisioning (SBC-4)
      Bytes body(4, 0);
      if (lun.thin) {
        body[1] = 0x80 | 0x40 | 0x20;                  // LBPU, LBPWS, LBPWS10
        if (lun.unmapped_reads_zero) body[1] |= 0x04;  // LBPRZ 001b (bits 4-2)
        body[2] = 0x02;                                // PROVISIONING TYPE: thin
      }
      return vpd(page, body);
    }
    default:
      return std::nullopt;
  }
}

// READ CAPACITY (10) parameter data (SBC-4): the last LBA, or FFFFFFFFh when it does not fit.
Bytes read_capacity_10(const LunInfo& lun) {
  Bytes b(8, 0);
  const uint64_t last = lun.block_count == 0 ? 0 : lun.block_count - 1;
  put_be(b, 0, std::min<uint64_t>(last, 0xffffffffU), 4);
  put_be(b, 4, lun.block_size, 4);
  return b;
}

// READ CAPACITY (16) parameter data (SBC-4).
Bytes read_capacity_16(const LunInfo& lun) {
  Bytes b(32, 0);
  put_be(b, 0, lun.block_count == 0 ? 0 : lun.block_count - 1, 8);
  put_be(b, 8, lun.block_size, 4);
  b[13] = static_cast<uint8_t>(lun.physical_block_exponent & 0x0f);
  if (lun.thin) {
    b[14] = 0x80;                                // LBPME
    if (lun.unmapped_reads_zero) b[14] |= 0x40;  // LBPRZ
  }
  return b;
}

std::optional<Bytes> mode_page(uint8_t page, const LunInfo& lun, bool changeable) {
  Bytes b;
  switch (page) {
    case 0x08:  // Caching (SBC-4): WCE in byte 2, bit 2
      b.assign(20, 0);
      b[0] = page;
      b[1] = 0x12;
      if (!changeable && lun.write_cache) b[2] = 0x04;
      return b;
    case 0x0a:  // Control (SPC-5)
      b.assign(12, 0);
      b[0] = page;
      b[1] = 0x0a;
      // QUEUE ALGORITHM MODIFIER 1: commands may be reordered (we do not order them).
      if (!changeable) {
        b[3] = 0x10;
        // BUSY TIMEOUT PERIOD FFFFh: unlimited.
        b[8] = 0xff;
        b[9] = 0xff;
      }
      return b;
    case 0x1c:  // Informational Exceptions Control (SPC-5): nothing reported
      b.assign(12, 0);
      b[0] = page;
      b[1] = 0x0a;
      return b;
    default:
      return std::nullopt;
  }
}

Bytes report_luns(const std::vector<uint16_t>& luns) {
  std::vector<uint16_t> sorted;
  for (const uint16_t lun : luns) {
    if (lun < 0x4000) sorted.push_back(lun);
  }
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  Bytes b(8 + 8 * sorted.size(), 0);
  put_be(b, 0, 8 * sorted.size(), 4);  // LUN LIST LENGTH
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    const uint16_t lun = sorted[i];
    // SAM-5 peripheral device addressing (method 00b) below 256, flat space addressing (01b)
    // above.
    b[8 + 8 * i] = lun < 256 ? 0 : static_cast<uint8_t>(0x40 | (lun >> 8));
    b[8 + 8 * i + 1] = static_cast<uint8_t>(lun);
  }
  return b;
}

}  // namespace shareblk::scsi::detail
