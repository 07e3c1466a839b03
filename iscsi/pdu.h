// One of iscsi/'s public headers (iscsi/iscsi.h includes them all): the 48-byte Basic Header
// Segment (RFC 7143 §11.2) as a plain struct, decoded and encoded back.
//
// decode_bhs() fails closed: what the target must refuse comes back as the Reject reason of
// §11.17.1 instead of a struct, so the caller can answer with a Reject PDU (or drop the
// connection, where §7 says so) without inspecting bytes again. encode_bhs() writes every
// reserved field as zero (§11.2: a compliant sender zeroes reserved fields).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <variant>

namespace shareblk::iscsi {

inline constexpr std::size_t kBhsLength = 48;
inline constexpr std::size_t kDigestLength = 4;
// DataSegmentLength is a 24-bit field (§11.2.1.6).
inline constexpr uint32_t kMaxDataSegmentLength = (1U << 24) - 1;
// The Initiator Task Tag that means "no task" (§11.2.1.8; Reject and unsolicited NOP-In).
inline constexpr uint32_t kReservedTag = 0xffffffff;

// §11.2.1.2. Initiator opcodes are 0x00-0x1f, target opcodes 0x20-0x3f.
enum class Opcode : uint8_t {
  NopOut = 0x00,
  ScsiCommand = 0x01,
  TaskMgmtRequest = 0x02,
  LoginRequest = 0x03,
  TextRequest = 0x04,
  DataOut = 0x05,
  LogoutRequest = 0x06,
  SnackRequest = 0x10,
  NopIn = 0x20,
  ScsiResponse = 0x21,
  TaskMgmtResponse = 0x22,
  LoginResponse = 0x23,
  TextResponse = 0x24,
  DataIn = 0x25,
  LogoutResponse = 0x26,
  R2t = 0x31,
  AsyncMessage = 0x32,
  Reject = 0x3f,
};

// The Reject PDU's reason codes (§11.17.1); 0x01 and 0x0b are reserved/deprecated.
enum class RejectReason : uint8_t {
  DataDigestError = 0x02,
  SnackReject = 0x03,
  ProtocolError = 0x04,
  CommandNotSupported = 0x05,
  ImmediateCommandReject = 0x06,
  TaskInProgress = 0x07,
  InvalidDataAck = 0x08,
  InvalidPduField = 0x09,
  LongOpReject = 0x0a,
  WaitingForLogout = 0x0c,
};

// Login stages, the CSG and NSG fields (§11.12.3); 2 is reserved.
enum class LoginStage : uint8_t {
  Security = 0,
  Operational = 1,
  FullFeature = 3,
};

// Opcode-specific fields, one struct per PDU (§11.3-§11.19). Sequence numbers and tags are
// host order; a field the PDU does not have is not here. The common fields are in Bhs.

struct NopOut {  // §11.18
  uint32_t target_transfer_tag = kReservedTag;
  uint32_t cmd_sn = 0;
  uint32_t exp_stat_sn = 0;
};

struct NopIn {  // §11.19
  uint32_t target_transfer_tag = kReservedTag;
  uint32_t stat_sn = 0;
  uint32_t exp_cmd_sn = 0;
  uint32_t max_cmd_sn = 0;
};

struct ScsiCommand {       // §11.3
  bool read = false;       // R
  bool write = false;      // W
  uint8_t attributes = 0;  // ATTR, 3 bits (§11.3.1.3)
  uint32_t expected_data_transfer_length = 0;
  uint32_t cmd_sn = 0;
  uint32_t exp_stat_sn = 0;
  std::array<uint8_t, 16> cdb{};
};

struct ScsiResponse {                // §11.4
  bool bidi_read_overflow = false;   // o
  bool bidi_read_underflow = false;  // u
  bool residual_overflow = false;    // O
  bool residual_underflow = false;   // U
  uint8_t response = 0;              // §11.4.3
  uint8_t status = 0;                // SCSI status (§11.4.2)
  uint32_t snack_tag = 0;
  uint32_t stat_sn = 0;
  uint32_t exp_cmd_sn = 0;
  uint32_t max_cmd_sn = 0;
  uint32_t exp_data_sn = 0;
  uint32_t bidi_read_residual_count = 0;
  uint32_t residual_count = 0;
};

struct TaskMgmtRequest {  // §11.5
  uint8_t function = 0;   // 7 bits (§11.5.1); an unknown one is answered by the TMF response
  uint32_t referenced_task_tag = kReservedTag;
  uint32_t cmd_sn = 0;
  uint32_t exp_stat_sn = 0;
  uint32_t ref_cmd_sn = 0;
  uint32_t exp_data_sn = 0;
};

struct TaskMgmtResponse {  // §11.6
  uint8_t response = 0;
  uint32_t stat_sn = 0;
  uint32_t exp_cmd_sn = 0;
  uint32_t max_cmd_sn = 0;
};

struct DataOut {  // §11.7
  uint32_t target_transfer_tag = kReservedTag;
  uint32_t exp_stat_sn = 0;
  uint32_t data_sn = 0;
  uint32_t buffer_offset = 0;
};

struct DataIn {                     // §11.7
  bool acknowledge = false;         // A
  bool residual_overflow = false;   // O
  bool residual_underflow = false;  // U
  bool status_present = false;      // S: status and StatSN are valid (with F)
  uint8_t status = 0;
  uint32_t target_transfer_tag = kReservedTag;
  uint32_t stat_sn = 0;
  uint32_t exp_cmd_sn = 0;
  uint32_t max_cmd_sn = 0;
  uint32_t data_sn = 0;
  uint32_t buffer_offset = 0;
  uint32_t residual_count = 0;
};

struct R2t {  // §11.8
  uint32_t target_transfer_tag = 0;
  uint32_t stat_sn = 0;
  uint32_t exp_cmd_sn = 0;
  uint32_t max_cmd_sn = 0;
  uint32_t r2t_sn = 0;
  uint32_t buffer_offset = 0;
  uint32_t desired_data_transfer_length = 0;
};

struct TextRequest {          // §11.10
  bool more_follows = false;  // C: the text continues in the next PDU
  uint32_t target_transfer_tag = kReservedTag;
  uint32_t cmd_sn = 0;
  uint32_t exp_stat_sn = 0;
};

struct TextResponse {         // §11.11
  bool more_follows = false;  // C
  uint32_t target_transfer_tag = kReservedTag;
  uint32_t stat_sn = 0;
  uint32_t exp_cmd_sn = 0;
  uint32_t max_cmd_sn = 0;
};

// Login PDUs: Bhs::final is the T (Transit) bit here, which sits where F does (§11.12.2).
struct LoginRequest {         // §11.12
  bool more_follows = false;  // C
  LoginStage current_stage = LoginStage::Security;
  LoginStage next_stage = LoginStage::Security;
  uint8_t version_max = 0;
  uint8_t version_min = 0;
  std::array<uint8_t, 6> isid{};
  uint16_t tsih = 0;
  uint16_t cid = 0;
  uint32_t cmd_sn = 0;
  uint32_t exp_stat_sn = 0;
};

struct LoginResponse {        // §11.13
  bool more_follows = false;  // C
  LoginStage current_stage = LoginStage::Security;
  LoginStage next_stage = LoginStage::Security;
  uint8_t version_max = 0;
  uint8_t version_active = 0;
  std::array<uint8_t, 6> isid{};
  uint16_t tsih = 0;
  uint32_t stat_sn = 0;
  uint32_t exp_cmd_sn = 0;
  uint32_t max_cmd_sn = 0;
  uint8_t status_class = 0;  // §11.13.5
  uint8_t status_detail = 0;
};

struct LogoutRequest {      // §11.14
  uint8_t reason_code = 0;  // 7 bits: 0 session, 1 connection, 2 recovery (§11.14.1)
  uint16_t cid = 0;
  uint32_t cmd_sn = 0;
  uint32_t exp_stat_sn = 0;
};

struct LogoutResponse {  // §11.15
  uint8_t response = 0;
  uint32_t stat_sn = 0;
  uint32_t exp_cmd_sn = 0;
  uint32_t max_cmd_sn = 0;
  uint16_t time2wait = 0;
  uint16_t time2retain = 0;
};

struct Reject {  // §11.17; the data segment carries the rejected PDU's header
  RejectReason reason = RejectReason::ProtocolError;
  uint32_t stat_sn = 0;
  uint32_t exp_cmd_sn = 0;
  uint32_t max_cmd_sn = 0;
  uint32_t data_sn = 0;  // DataSN/R2TSN, or 0
};

// Which PDU a Bhs is follows from which of these it holds: the opcode cannot disagree.
using PduFields = std::variant<NopOut, NopIn, ScsiCommand, ScsiResponse, TaskMgmtRequest,
                               TaskMgmtResponse, DataOut, DataIn, R2t, TextRequest, TextResponse,
                               LoginRequest, LoginResponse, LogoutRequest, LogoutResponse, Reject>;

struct Bhs {
  bool immediate = false;            // I (§11.2.1.1); always set on a Login Request
  bool final = true;                 // F (§11.2.1.3); T on Login PDUs
  uint8_t total_ahs_words = 0;       // TotalAHSLength, in 4-byte words (§11.2.1.5)
  uint32_t data_segment_length = 0;  // bytes, without padding (§11.2.1.6)
  uint64_t lun = 0;  // bytes 8-15 as a big-endian number, for the PDUs that carry a LUN; else 0
  uint32_t initiator_task_tag = 0;
  PduFields fields;
};

Opcode opcode_of(const Bhs& bhs);

// What decode_bhs() accepts. The limits are the receiver's: data_segment_length is the
// MaxRecvDataSegmentLength this side declared (8192 until negotiated, §13.12).
struct DecodeLimits {
  uint32_t max_data_segment_length = 8192;
  uint8_t max_ahs_words = 0;  // no AHS unless the caller handles them (§11.2.2)
  // A target decodes initiator PDUs only; tests and an initiator decode the others.
  bool initiator_opcodes_only = true;
};

struct DecodeRefusal {
  RejectReason reason;
  std::string_view why;  // for the log: a static string
};

using DecodeResult = std::variant<Bhs, DecodeRefusal>;

// Decodes the first 48 bytes of `bytes`; fewer is a ProtocolError. Refuses: an undefined or
// unsupported initiator opcode (CommandNotSupported; SNACK too, as this target runs at
// ErrorRecoveryLevel 0), a target opcode from an initiator (ProtocolError), reserved code values
// in defined fields and combinations §11 forbids (ProtocolError), and lengths past `limits`
// (ProtocolError).
DecodeResult decode_bhs(std::span<const uint8_t> bytes, const DecodeLimits& limits);

// The 48 bytes of `bhs`, reserved fields zero. Values wider than their field are truncated to
// it (the ATTR, function and reason bits; the 24-bit length): callers keep them in range.
std::array<uint8_t, kBhsLength> encode_bhs(const Bhs& bhs);

// A data segment is padded to a multiple of 4 bytes (§11.1).
constexpr uint32_t padded_length(uint32_t data_segment_length) {
  return (data_segment_length + 3U) & ~3U;
}

// The whole PDU on the wire (§11.1): header, AHS, header digest, padded data and, when there is
// data, its digest.
constexpr std::size_t pdu_length(const Bhs& bhs, bool header_digest, bool data_digest) {
  std::size_t length = kBhsLength + std::size_t{bhs.total_ahs_words} * 4;
  if (header_digest) length += kDigestLength;
  if (bhs.data_segment_length > 0) {
    length += padded_length(bhs.data_segment_length);
    if (data_digest) length += kDigestLength;
  }
  return length;
}

}  // namespace shareblk::iscsi
