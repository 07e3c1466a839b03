// The NBD wire format: every constant and message layout shareblk speaks, in one place.
//
// Written from doc/proto.md of the NetworkBlockDevice/nbd repository. All integers on the wire
// are big-endian. Messages are encoded and decoded with the helpers at the bottom rather than
// with packed structs, so that no code depends on struct layout or alignment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace shareblk::nbd {

// --- Handshake (proto.md "Newstyle negotiation") ---
inline constexpr uint64_t kMagic = 0x4e42444d41474943;     // "NBDMAGIC"
inline constexpr uint64_t kOptMagic = 0x49484156454f5054;  // "IHAVEOPT"
inline constexpr uint64_t kOptReplyMagic = 0x0003e889045565a9;

// Handshake flags (server, 16 bits).
inline constexpr uint16_t kFlagFixedNewstyle = 1 << 0;
inline constexpr uint16_t kFlagNoZeroes = 1 << 1;
// Client flags (32 bits). A server MUST close on a flag it does not know.
inline constexpr uint32_t kClientFixedNewstyle = 1 << 0;
inline constexpr uint32_t kClientNoZeroes = 1 << 1;
inline constexpr uint32_t kClientKnownFlags = kClientFixedNewstyle | kClientNoZeroes;

// Option haggling.
enum Opt : uint32_t {
  kOptExportName = 1,
  kOptAbort = 2,
  kOptList = 3,
  kOptPeekExport = 4,
  kOptStartTls = 5,
  kOptInfo = 6,
  kOptGo = 7,
  kOptStructuredReply = 8,
  kOptListMetaContext = 9,
  kOptSetMetaContext = 10,
  kOptExtendedHeaders = 11,
};

inline constexpr uint32_t kRepErrBit = 1u << 31;
enum Rep : uint32_t {
  kRepAck = 1,
  kRepServer = 2,
  kRepInfo = 3,
  kRepMetaContext = 4,
  kRepErrUnsup = kRepErrBit | 1,
  kRepErrPolicy = kRepErrBit | 2,
  kRepErrInvalid = kRepErrBit | 3,
  kRepErrPlatform = kRepErrBit | 4,
  kRepErrTlsReqd = kRepErrBit | 5,
  kRepErrUnknown = kRepErrBit | 6,
  kRepErrShutdown = kRepErrBit | 7,
  kRepErrBlockSizeReqd = kRepErrBit | 8,
  kRepErrTooBig = kRepErrBit | 9,
};

// NBD_OPT_INFO / NBD_OPT_GO information types.
enum Info : uint16_t {
  kInfoExport = 0,  // u64 size, u16 transmission flags
  kInfoName = 1,    // string
  kInfoDescription = 2,
  kInfoBlockSize = 3,  // u32 minimum, u32 preferred, u32 maximum
};

// Transmission flags (16 bits), sent with the export.
inline constexpr uint16_t kFlagHasFlags = 1 << 0;
inline constexpr uint16_t kFlagReadOnly = 1 << 1;
inline constexpr uint16_t kFlagSendFlush = 1 << 2;
inline constexpr uint16_t kFlagSendFua = 1 << 3;
inline constexpr uint16_t kFlagRotational = 1 << 4;
inline constexpr uint16_t kFlagSendTrim = 1 << 5;
inline constexpr uint16_t kFlagSendWriteZeroes = 1 << 6;
inline constexpr uint16_t kFlagSendDf = 1 << 7;
inline constexpr uint16_t kFlagCanMultiConn = 1 << 8;
inline constexpr uint16_t kFlagSendCache = 1 << 10;
inline constexpr uint16_t kFlagSendFastZero = 1 << 11;

// --- Transmission (proto.md "Transmission phase") ---
inline constexpr uint32_t kRequestMagic = 0x25609513;
inline constexpr uint32_t kSimpleReplyMagic = 0x67446698;
inline constexpr uint32_t kStructuredReplyMagic = 0x668e33ef;

enum Cmd : uint16_t {
  kCmdRead = 0,
  kCmdWrite = 1,
  kCmdDisc = 2,
  kCmdFlush = 3,
  kCmdTrim = 4,
  kCmdCache = 5,
  kCmdWriteZeroes = 6,
  kCmdBlockStatus = 7,
};

// Command flags, and which command each applies to (others with it get EINVAL).
inline constexpr uint16_t kCmdFlagFua = 1 << 0;       // any, with SEND_FUA; acts on writes only
inline constexpr uint16_t kCmdFlagNoHole = 1 << 1;    // WRITE_ZEROES
inline constexpr uint16_t kCmdFlagDf = 1 << 2;        // READ, structured replies only
inline constexpr uint16_t kCmdFlagReqOne = 1 << 3;    // BLOCK_STATUS
inline constexpr uint16_t kCmdFlagFastZero = 1 << 4;  // WRITE_ZEROES

inline constexpr uint16_t kReplyFlagDone = 1 << 0;
enum ReplyType : uint16_t {
  kReplyNone = 0,
  kReplyOffsetData = 1,               // u64 offset, data
  kReplyOffsetHole = 2,               // u64 offset, u32 length
  kReplyBlockStatus = 5,              // u32 context id, {u32 length, u32 flags}...
  kReplyError = (1 << 15) | 1,        // u32 error, u16 message length, message
  kReplyErrorOffset = (1 << 15) | 2,  // as ERROR, then u64 offset
};

// base:allocation flags (proto.md "Metadata contexts").
inline constexpr uint32_t kStateHole = 1 << 0;
inline constexpr uint32_t kStateZero = 1 << 1;
inline constexpr char kBaseAllocation[] = "base:allocation";

// Error values (proto.md "Error values"): the only errnos that may cross the wire.
enum Error : uint32_t {
  kEperm = 1,
  kEio = 5,
  kEnomem = 12,
  kEinval = 22,
  kEnospc = 28,
  kEoverflow = 75,
  kEnotsup = 95,
  kEshutdown = 108,
};

// --- Message sizes ---
inline constexpr size_t kOptionHeaderSize = 16;       // magic, option, length
inline constexpr size_t kOptionReplyHeaderSize = 20;  // magic, option, type, length
inline constexpr size_t kRequestSize = 28;            // magic, flags, type, cookie, offset, length
inline constexpr size_t kSimpleReplySize = 16;        // magic, error, cookie
inline constexpr size_t kChunkHeaderSize = 20;        // magic, flags, type, cookie, length
inline constexpr size_t kExportNameZeroes = 124;      // padding after NBD_OPT_EXPORT_NAME's reply

// Sizes we choose. Strings are at most 4096 bytes (proto.md "Conventions"); an option's payload
// carries at most a few of them, so anything larger is a protocol error.
inline constexpr uint32_t kMaxStringLength = 4096;
inline constexpr uint32_t kMaxOptionLength = 64 * 1024;
inline constexpr uint32_t kMaxPayload = 32 * 1024 * 1024;  // advertised maximum block size
inline constexpr uint32_t kPreferredBlock = 4096;

// --- Big-endian codec ---
inline void put16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}
inline void put32(uint8_t* p, uint32_t v) {
  put16(p, static_cast<uint16_t>(v >> 16));
  put16(p + 2, static_cast<uint16_t>(v));
}
inline void put64(uint8_t* p, uint64_t v) {
  put32(p, static_cast<uint32_t>(v >> 32));
  put32(p + 4, static_cast<uint32_t>(v));
}
inline uint16_t get16(const uint8_t* p) {
  return static_cast<uint16_t>((p[0] << 8) | p[1]);
}
inline uint32_t get32(const uint8_t* p) {
  return (static_cast<uint32_t>(get16(p)) << 16) | get16(p + 2);
}
inline uint64_t get64(const uint8_t* p) {
  return (static_cast<uint64_t>(get32(p)) << 32) | get32(p + 4);
}

// C: a transmission-phase request.
struct Request {
  uint32_t magic;
  uint16_t flags;
  uint16_t type;
  uint64_t cookie;
  uint64_t offset;
  uint32_t length;
};
inline Request decode_request(const uint8_t* p) {
  return Request{get32(p), get16(p + 4), get16(p + 6), get64(p + 8), get64(p + 16), get32(p + 24)};
}
inline void encode_request(uint8_t* p, const Request& r) {
  put32(p, r.magic);
  put16(p + 4, r.flags);
  put16(p + 6, r.type);
  put64(p + 8, r.cookie);
  put64(p + 16, r.offset);
  put32(p + 24, r.length);
}

// S: simple reply header.
inline void encode_simple_reply(uint8_t* p, uint32_t error, uint64_t cookie) {
  put32(p, kSimpleReplyMagic);
  put32(p + 4, error);
  put64(p + 8, cookie);
}

// S: structured reply chunk header; `length` counts the bytes that follow it.
inline void encode_chunk_header(uint8_t* p, uint16_t flags, uint16_t type, uint64_t cookie,
                                uint32_t length) {
  put32(p, kStructuredReplyMagic);
  put16(p + 4, flags);
  put16(p + 6, type);
  put64(p + 8, cookie);
  put32(p + 16, length);
}

// S: option reply header.
inline void encode_option_reply(uint8_t* p, uint32_t option, uint32_t type, uint32_t length) {
  put64(p, kOptReplyMagic);
  put32(p + 8, option);
  put32(p + 12, type);
  put32(p + 16, length);
}

static_assert(kRequestSize == 4 + 2 + 2 + 8 + 8 + 4);
static_assert(kSimpleReplySize == 4 + 4 + 8);
static_assert(kChunkHeaderSize == 4 + 2 + 2 + 8 + 4);
static_assert(kOptionReplyHeaderSize == 8 + 4 + 4 + 4);
static_assert(kOptionHeaderSize == 8 + 4 + 4);

}  // namespace shareblk::nbd
