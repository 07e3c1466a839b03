// The BHS codec. Offsets are those of the figures in RFC 7143 §11.2-§11.19; every multi-byte
// field is big-endian (§11.1, "network byte order").
#include "iscsi/pdu.h"

#include <optional>
#include <type_traits>

namespace shareblk::iscsi {
namespace {

constexpr uint8_t kImmediateBit = 0x40;  // byte 0 (§11.2.1.1)
constexpr uint8_t kOpcodeMask = 0x3f;
constexpr uint8_t kFinalBit = 0x80;     // byte 1: F, or T on Login PDUs
constexpr uint8_t kContinueBit = 0x40;  // byte 1: C on Text and Login PDUs

using Header = std::array<uint8_t, kBhsLength>;

uint16_t get16(std::span<const uint8_t> b, std::size_t at) {
  return static_cast<uint16_t>((b[at] << 8) | b[at + 1]);
}
uint32_t get24(std::span<const uint8_t> b, std::size_t at) {
  return (uint32_t{b[at]} << 16) | (uint32_t{b[at + 1]} << 8) | b[at + 2];
}
uint32_t get32(std::span<const uint8_t> b, std::size_t at) {
  return (uint32_t{get16(b, at)} << 16) | get16(b, at + 2);
}
uint64_t get64(std::span<const uint8_t> b, std::size_t at) {
  return (uint64_t{get32(b, at)} << 32) | get32(b, at + 4);
}
void put16(Header& h, std::size_t at, uint16_t v) {
  h[at] = static_cast<uint8_t>(v >> 8);
  h[at + 1] = static_cast<uint8_t>(v);
}
void put24(Header& h, std::size_t at, uint32_t v) {
  h[at] = static_cast<uint8_t>(v >> 16);
  put16(h, at + 1, static_cast<uint16_t>(v));
}
void put32(Header& h, std::size_t at, uint32_t v) {
  put16(h, at, static_cast<uint16_t>(v >> 16));
  put16(h, at + 2, static_cast<uint16_t>(v));
}
void put64(Header& h, std::size_t at, uint64_t v) {
  put32(h, at, static_cast<uint32_t>(v >> 32));
  put32(h, at + 4, static_cast<uint32_t>(v));
}
bool bit(uint8_t byte, uint8_t mask) {
  return (byte & mask) != 0;
}
uint8_t flag(bool on, uint8_t mask) {
  return on ? mask : 0;
}

std::array<uint8_t, 6> get_isid(std::span<const uint8_t> b) {
  std::array<uint8_t, 6> isid{};
  for (std::size_t i = 0; i < isid.size(); ++i) isid[i] = b[8 + i];
  return isid;
}

// CSG and NSG (§11.12.3): 2 is a reserved code value, a protocol error on receipt (§11.2).
std::optional<LoginStage> stage_of(uint8_t two_bits) {
  if (two_bits == 2) return std::nullopt;
  return static_cast<LoginStage>(two_bits);
}

using Decoded = std::variant<PduFields, DecodeRefusal>;

DecodeRefusal protocol_error(std::string_view why) {
  return {RejectReason::ProtocolError, why};
}

// One decoder per opcode: the fields at the offsets of the PDU's figure. `b` is the whole BHS.
Decoded decode_fields(Opcode op, std::span<const uint8_t> b, bool immediate, uint32_t itt) {
  const uint8_t flags = b[1];
  switch (op) {
    case Opcode::NopOut:
      // §11.18.5: a NOP-Out that wants no answer (ITT 0xffffffff) is sent as immediate.
      if (itt == kReservedTag && !immediate) {
        return protocol_error("NOP-Out without a reply tag must be immediate");
      }
      return NopOut{
          .target_transfer_tag = get32(b, 20), .cmd_sn = get32(b, 24), .exp_stat_sn = get32(b, 28)};
    case Opcode::NopIn:
      return NopIn{.target_transfer_tag = get32(b, 20),
                   .stat_sn = get32(b, 24),
                   .exp_cmd_sn = get32(b, 28),
                   .max_cmd_sn = get32(b, 32)};
    case Opcode::ScsiCommand: {
      ScsiCommand cmd{.read = bit(flags, 0x40),
                      .write = bit(flags, 0x20),
                      .attributes = static_cast<uint8_t>(flags & 0x07),
                      .expected_data_transfer_length = get32(b, 20),
                      .cmd_sn = get32(b, 24),
                      .exp_stat_sn = get32(b, 28)};
      // ATTR 5-7 are reserved (§11.3.1.3).
      if (cmd.attributes > 4) return protocol_error("reserved task attribute");
      for (std::size_t i = 0; i < cmd.cdb.size(); ++i) cmd.cdb[i] = b[32 + i];
      return cmd;
    }
    case Opcode::ScsiResponse:
      return ScsiResponse{.bidi_read_overflow = bit(flags, 0x10),
                          .bidi_read_underflow = bit(flags, 0x08),
                          .residual_overflow = bit(flags, 0x04),
                          .residual_underflow = bit(flags, 0x02),
                          .response = b[2],
                          .status = b[3],
                          .snack_tag = get32(b, 20),
                          .stat_sn = get32(b, 24),
                          .exp_cmd_sn = get32(b, 28),
                          .max_cmd_sn = get32(b, 32),
                          .exp_data_sn = get32(b, 36),
                          .bidi_read_residual_count = get32(b, 40),
                          .residual_count = get32(b, 44)};
    case Opcode::TaskMgmtRequest:
      return TaskMgmtRequest{.function = static_cast<uint8_t>(flags & 0x7f),
                             .referenced_task_tag = get32(b, 20),
                             .cmd_sn = get32(b, 24),
                             .exp_stat_sn = get32(b, 28),
                             .ref_cmd_sn = get32(b, 32),
                             .exp_data_sn = get32(b, 36)};
    case Opcode::TaskMgmtResponse:
      return TaskMgmtResponse{.response = b[2],
                              .stat_sn = get32(b, 24),
                              .exp_cmd_sn = get32(b, 28),
                              .max_cmd_sn = get32(b, 32)};
    case Opcode::DataOut:
      return DataOut{.target_transfer_tag = get32(b, 20),
                     .exp_stat_sn = get32(b, 28),
                     .data_sn = get32(b, 36),
                     .buffer_offset = get32(b, 40)};
    case Opcode::DataIn:
      return DataIn{.acknowledge = bit(flags, 0x40),
                    .residual_overflow = bit(flags, 0x04),
                    .residual_underflow = bit(flags, 0x02),
                    .status_present = bit(flags, 0x01),
                    .status = b[3],
                    .target_transfer_tag = get32(b, 20),
                    .stat_sn = get32(b, 24),
                    .exp_cmd_sn = get32(b, 28),
                    .max_cmd_sn = get32(b, 32),
                    .data_sn = get32(b, 36),
                    .buffer_offset = get32(b, 40),
                    .residual_count = get32(b, 44)};
    case Opcode::R2t:
      return R2t{.target_transfer_tag = get32(b, 20),
                 .stat_sn = get32(b, 24),
                 .exp_cmd_sn = get32(b, 28),
                 .max_cmd_sn = get32(b, 32),
                 .r2t_sn = get32(b, 36),
                 .buffer_offset = get32(b, 40),
                 .desired_data_transfer_length = get32(b, 44)};
    case Opcode::TextRequest:
      // §11.10.2: F and C must not both be set.
      if (bit(flags, kFinalBit) && bit(flags, kContinueBit)) {
        return protocol_error("Text Request with both F and C");
      }
      return TextRequest{.more_follows = bit(flags, kContinueBit),
                         .target_transfer_tag = get32(b, 20),
                         .cmd_sn = get32(b, 24),
                         .exp_stat_sn = get32(b, 28)};
    case Opcode::TextResponse:
      return TextResponse{.more_follows = bit(flags, kContinueBit),
                          .target_transfer_tag = get32(b, 20),
                          .stat_sn = get32(b, 24),
                          .exp_cmd_sn = get32(b, 28),
                          .max_cmd_sn = get32(b, 32)};
    case Opcode::LoginRequest:
    case Opcode::LoginResponse: {
      const bool transit = bit(flags, kFinalBit);
      const bool more = bit(flags, kContinueBit);
      // §11.12.2: T and C are never both set. The I bit of a Login Request is always 1 (§11.12).
      if (transit && more) return protocol_error("Login PDU with both T and C");
      if (op == Opcode::LoginRequest && !immediate) {
        return protocol_error("Login Request without the I bit");
      }
      const auto current = stage_of((flags >> 2) & 0x03);
      // NSG is reserved unless T is set (§11.12.3): ignored then, as reserved fields are.
      const auto next = transit ? stage_of(flags & 0x03) : LoginStage::Security;
      if (!current || !next) return protocol_error("reserved login stage");
      if (op == Opcode::LoginRequest) {
        return LoginRequest{.more_follows = more,
                            .current_stage = *current,
                            .next_stage = *next,
                            .version_max = b[2],
                            .version_min = b[3],
                            .isid = get_isid(b),
                            .tsih = get16(b, 14),
                            .cid = get16(b, 20),
                            .cmd_sn = get32(b, 24),
                            .exp_stat_sn = get32(b, 28)};
      }
      return LoginResponse{.more_follows = more,
                           .current_stage = *current,
                           .next_stage = *next,
                           .version_max = b[2],
                           .version_active = b[3],
                           .isid = get_isid(b),
                           .tsih = get16(b, 14),
                           .stat_sn = get32(b, 24),
                           .exp_cmd_sn = get32(b, 28),
                           .max_cmd_sn = get32(b, 32),
                           .status_class = b[36],
                           .status_detail = b[37]};
    }
    case Opcode::LogoutRequest: {
      const auto reason = static_cast<uint8_t>(flags & 0x7f);
      if (reason > 2) return protocol_error("reserved logout reason");  // §11.14.1
      return LogoutRequest{.reason_code = reason,
                           .cid = get16(b, 20),
                           .cmd_sn = get32(b, 24),
                           .exp_stat_sn = get32(b, 28)};
    }
    case Opcode::LogoutResponse:
      return LogoutResponse{.response = b[2],
                            .stat_sn = get32(b, 24),
                            .exp_cmd_sn = get32(b, 28),
                            .max_cmd_sn = get32(b, 32),
                            .time2wait = get16(b, 40),
                            .time2retain = get16(b, 42)};
    case Opcode::Reject:
      return Reject{.reason = static_cast<RejectReason>(b[2]),
                    .stat_sn = get32(b, 24),
                    .exp_cmd_sn = get32(b, 28),
                    .max_cmd_sn = get32(b, 32),
                    .data_sn = get32(b, 36)};
    case Opcode::SnackRequest:
      // Only ErrorRecoveryLevel > 0 uses SNACK (§11.16); this target negotiates 0.
      return DecodeRefusal{RejectReason::CommandNotSupported, "SNACK at ErrorRecoveryLevel 0"};
    case Opcode::AsyncMessage:
      break;
  }
  return DecodeRefusal{RejectReason::CommandNotSupported, "opcode not supported"};
}

// Whether byte 0's six bits name an opcode this codec knows.
bool is_defined(uint8_t code) {
  switch (static_cast<Opcode>(code)) {
    case Opcode::NopOut:
    case Opcode::ScsiCommand:
    case Opcode::TaskMgmtRequest:
    case Opcode::LoginRequest:
    case Opcode::TextRequest:
    case Opcode::DataOut:
    case Opcode::LogoutRequest:
    case Opcode::SnackRequest:
    case Opcode::NopIn:
    case Opcode::ScsiResponse:
    case Opcode::TaskMgmtResponse:
    case Opcode::LoginResponse:
    case Opcode::TextResponse:
    case Opcode::DataIn:
    case Opcode::LogoutResponse:
    case Opcode::R2t:
    case Opcode::AsyncMessage:
    case Opcode::Reject:
      return true;
  }
  return false;
}

// Which PDUs carry a LUN in bytes 8-15 (§11.2.1.7 and each PDU's figure).
bool carries_lun(Opcode op) {
  switch (op) {
    case Opcode::NopOut:
    case Opcode::NopIn:
    case Opcode::ScsiCommand:
    case Opcode::TaskMgmtRequest:
    case Opcode::DataOut:
    case Opcode::DataIn:
    case Opcode::R2t:
    case Opcode::TextRequest:
    case Opcode::TextResponse:
      return true;
    default:
      return false;
  }
}

// Writes one PDU's own fields; the common ones are already in place.
struct FieldWriter {
  Header& h;

  void operator()(const NopOut& f) const {
    put32(h, 20, f.target_transfer_tag);
    put32(h, 24, f.cmd_sn);
    put32(h, 28, f.exp_stat_sn);
  }
  void operator()(const NopIn& f) const {
    put32(h, 20, f.target_transfer_tag);
    put32(h, 24, f.stat_sn);
    put32(h, 28, f.exp_cmd_sn);
    put32(h, 32, f.max_cmd_sn);
  }
  void operator()(const ScsiCommand& f) const {
    h[1] |= flag(f.read, 0x40) | flag(f.write, 0x20) | (f.attributes & 0x07);
    put32(h, 20, f.expected_data_transfer_length);
    put32(h, 24, f.cmd_sn);
    put32(h, 28, f.exp_stat_sn);
    for (std::size_t i = 0; i < f.cdb.size(); ++i) h[32 + i] = f.cdb[i];
  }
  void operator()(const ScsiResponse& f) const {
    h[1] |= flag(f.bidi_read_overflow, 0x10) | flag(f.bidi_read_underflow, 0x08) |
            flag(f.residual_overflow, 0x04) | flag(f.residual_underflow, 0x02);
    h[2] = f.response;
    h[3] = f.status;
    put32(h, 20, f.snack_tag);
    put32(h, 24, f.stat_sn);
    put32(h, 28, f.exp_cmd_sn);
    put32(h, 32, f.max_cmd_sn);
    put32(h, 36, f.exp_data_sn);
    put32(h, 40, f.bidi_read_residual_count);
    put32(h, 44, f.residual_count);
  }
  void operator()(const TaskMgmtRequest& f) const {
    h[1] |= f.function & 0x7f;
    put32(h, 20, f.referenced_task_tag);
    put32(h, 24, f.cmd_sn);
    put32(h, 28, f.exp_stat_sn);
    put32(h, 32, f.ref_cmd_sn);
    put32(h, 36, f.exp_data_sn);
  }
  void operator()(const TaskMgmtResponse& f) const {
    h[2] = f.response;
    put32(h, 24, f.stat_sn);
    put32(h, 28, f.exp_cmd_sn);
    put32(h, 32, f.max_cmd_sn);
  }
  void operator()(const DataOut& f) const {
    put32(h, 20, f.target_transfer_tag);
    put32(h, 28, f.exp_stat_sn);
    put32(h, 36, f.data_sn);
    put32(h, 40, f.buffer_offset);
  }
  void operator()(const DataIn& f) const {
    h[1] |= flag(f.acknowledge, 0x40) | flag(f.residual_overflow, 0x04) |
            flag(f.residual_underflow, 0x02) | flag(f.status_present, 0x01);
    h[3] = f.status;
    put32(h, 20, f.target_transfer_tag);
    put32(h, 24, f.stat_sn);
    put32(h, 28, f.exp_cmd_sn);
    put32(h, 32, f.max_cmd_sn);
    put32(h, 36, f.data_sn);
    put32(h, 40, f.buffer_offset);
    put32(h, 44, f.residual_count);
  }
  void operator()(const R2t& f) const {
    put32(h, 20, f.target_transfer_tag);
    put32(h, 24, f.stat_sn);
    put32(h, 28, f.exp_cmd_sn);
    put32(h, 32, f.max_cmd_sn);
    put32(h, 36, f.r2t_sn);
    put32(h, 40, f.buffer_offset);
    put32(h, 44, f.desired_data_transfer_length);
  }
  void operator()(const TextRequest& f) const {
    h[1] |= flag(f.more_follows, kContinueBit);
    put32(h, 20, f.target_transfer_tag);
    put32(h, 24, f.cmd_sn);
    put32(h, 28, f.exp_stat_sn);
  }
  void operator()(const TextResponse& f) const {
    h[1] |= flag(f.more_follows, kContinueBit);
    put32(h, 20, f.target_transfer_tag);
    put32(h, 24, f.stat_sn);
    put32(h, 28, f.exp_cmd_sn);
    put32(h, 32, f.max_cmd_sn);
  }
  void login_common(bool more, LoginStage current, LoginStage next, uint8_t v_max, uint8_t v2,
                    const std::array<uint8_t, 6>& isid, uint16_t tsih) const {
    const bool transit = bit(h[1], kFinalBit);
    h[1] |=
        flag(more, kContinueBit) | static_cast<uint8_t>((static_cast<uint8_t>(current) & 3) << 2);
    if (transit) h[1] |= static_cast<uint8_t>(next) & 3;
    h[2] = v_max;
    h[3] = v2;
    for (std::size_t i = 0; i < isid.size(); ++i) h[8 + i] = isid[i];
    put16(h, 14, tsih);
  }
  void operator()(const LoginRequest& f) const {
    login_common(f.more_follows, f.current_stage, f.next_stage, f.version_max, f.version_min,
                 f.isid, f.tsih);
    put16(h, 20, f.cid);
    put32(h, 24, f.cmd_sn);
    put32(h, 28, f.exp_stat_sn);
  }
  void operator()(const LoginResponse& f) const {
    login_common(f.more_follows, f.current_stage, f.next_stage, f.version_max, f.version_active,
                 f.isid, f.tsih);
    put32(h, 24, f.stat_sn);
    put32(h, 28, f.exp_cmd_sn);
    put32(h, 32, f.max_cmd_sn);
    h[36] = f.status_class;
    h[37] = f.status_detail;
  }
  void operator()(const LogoutRequest& f) const {
    h[1] |= f.reason_code & 0x7f;
    put16(h, 20, f.cid);
    put32(h, 24, f.cmd_sn);
    put32(h, 28, f.exp_stat_sn);
  }
  void operator()(const LogoutResponse& f) const {
    h[2] = f.response;
    put32(h, 24, f.stat_sn);
    put32(h, 28, f.exp_cmd_sn);
    put32(h, 32, f.max_cmd_sn);
    put16(h, 40, f.time2wait);
    put16(h, 42, f.time2retain);
  }
  void operator()(const Reject& f) const {
    h[2] = static_cast<uint8_t>(f.reason);
    put32(h, 24, f.stat_sn);
    put32(h, 28, f.exp_cmd_sn);
    put32(h, 32, f.max_cmd_sn);
    put32(h, 36, f.data_sn);
  }
};

// The opcode of each alternative of PduFields, in its order.
template <typename T>
constexpr Opcode opcode_for() {
  if constexpr (std::is_same_v<T, NopOut>) return Opcode::NopOut;
  if constexpr (std::is_same_v<T, NopIn>) return Opcode::NopIn;
  if constexpr (std::is_same_v<T, ScsiCommand>) return Opcode::ScsiCommand;
  if constexpr (std::is_same_v<T, ScsiResponse>) return Opcode::ScsiResponse;
  if constexpr (std::is_same_v<T, TaskMgmtRequest>) return Opcode::TaskMgmtRequest;
  if constexpr (std::is_same_v<T, TaskMgmtResponse>) return Opcode::TaskMgmtResponse;
  if constexpr (std::is_same_v<T, DataOut>) return Opcode::DataOut;
  if constexpr (std::is_same_v<T, DataIn>) return Opcode::DataIn;
  if constexpr (std::is_same_v<T, R2t>) return Opcode::R2t;
  if constexpr (std::is_same_v<T, TextRequest>) return Opcode::TextRequest;
  if constexpr (std::is_same_v<T, TextResponse>) return Opcode::TextResponse;
  if constexpr (std::is_same_v<T, LoginRequest>) return Opcode::LoginRequest;
  if constexpr (std::is_same_v<T, LoginResponse>) return Opcode::LoginResponse;
  if constexpr (std::is_same_v<T, LogoutRequest>) return Opcode::LogoutRequest;
  if constexpr (std::is_same_v<T, LogoutResponse>) return Opcode::LogoutResponse;
  if constexpr (std::is_same_v<T, Reject>) return Opcode::Reject;
}

}  // namespace

Opcode opcode_of(const Bhs& bhs) {
  return std::visit([](const auto& f) { return opcode_for<std::decay_t<decltype(f)>>(); },
                    bhs.fields);
}

DecodeResult decode_bhs(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  if (bytes.size() < kBhsLength) return protocol_error("header shorter than 48 bytes");
  const std::span<const uint8_t> b = bytes.first(kBhsLength);
  const uint8_t code = b[0] & kOpcodeMask;
  const bool from_target = code >= 0x20;
  if (limits.initiator_opcodes_only && from_target) {
    return protocol_error("target opcode from an initiator");  // §11.2.1.2
  }
  if (!is_defined(code)) {
    return DecodeRefusal{RejectReason::CommandNotSupported, "undefined opcode"};
  }
  Bhs bhs;
  bhs.immediate = bit(b[0], kImmediateBit);
  bhs.final = bit(b[1], kFinalBit);
  bhs.total_ahs_words = b[4];
  bhs.data_segment_length = get24(b, 5);
  bhs.initiator_task_tag = get32(b, 16);
  if (bhs.total_ahs_words > limits.max_ahs_words) return protocol_error("AHS longer than allowed");
  if (bhs.data_segment_length > limits.max_data_segment_length) {
    // Past the MaxRecvDataSegmentLength we declared (§13.12).
    return protocol_error("data segment longer than MaxRecvDataSegmentLength");
  }
  const auto op = static_cast<Opcode>(code);
  if (carries_lun(op)) bhs.lun = get64(b, 8);
  Decoded fields = decode_fields(op, b, bhs.immediate, bhs.initiator_task_tag);
  if (auto* refusal = std::get_if<DecodeRefusal>(&fields)) return *refusal;
  bhs.fields = std::get<PduFields>(fields);
  return bhs;
}

std::array<uint8_t, kBhsLength> encode_bhs(const Bhs& bhs) {
  Header h{};
  const Opcode op = opcode_of(bhs);
  h[0] = static_cast<uint8_t>(static_cast<uint8_t>(op) | flag(bhs.immediate, kImmediateBit));
  h[1] = flag(bhs.final, kFinalBit);
  h[4] = bhs.total_ahs_words;
  put24(h, 5, bhs.data_segment_length & kMaxDataSegmentLength);
  if (carries_lun(op)) put64(h, 8, bhs.lun);
  put32(h, 16, bhs.initiator_task_tag);
  std::visit(FieldWriter{h}, bhs.fields);
  return h;
}

}  // namespace shareblk::iscsi
