// One of iscsi/'s public headers (iscsi/iscsi.h includes them all): the text of Login and Text
// PDUs (RFC 7143 §6.1), its binary and numerical value encodings, and the target's side of
// operational-parameter negotiation (§6.2, §13).
//
// Everything here fails closed and returns errors as values. Parsing refuses what §6.1
// forbids (a pair without its NUL, a key of more than 63 bytes or with other characters, an
// empty key) and a value longer than any key we understand can carry. negotiate() answers
// each offered key from one table (text.cc, kKeys) of the key's kind and range; it does not
// decide the login's outcome, which is the caller's from NegotiationResult and SessionParams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace shareblk::iscsi {

inline constexpr std::size_t kMaxKeyLength = 63;         // §6.1
inline constexpr std::size_t kMaxTextValueLength = 255;  // §6.1, unless a key says otherwise
inline constexpr std::size_t kMaxNameLength = 223;       // iSCSI names (§4.2.7.1)
// The longest value parse_text() takes: a 1024-byte binary value (CHAP_C, CHAP_R; §12.1.3)
// written in hex, "0x" and two digits a byte. Nothing longer means anything to us.
inline constexpr std::size_t kMaxEncodedValueLength = 2 + 2 * 1024;
// What TextAccumulator holds by default: the text of one login stage or one Text exchange.
inline constexpr std::size_t kDefaultMaxTextLength = 65536;

struct KeyValue {
  std::string key;
  std::string value;
  bool operator==(const KeyValue&) const = default;
};

enum class TextError : uint8_t {
  Unterminated,     // the last pair has no NUL (§6.1: every pair ends with one)
  MissingEquals,    // a pair without '='
  EmptyKey,         // also an empty pair, i.e. two NULs in a row
  KeyTooLong,       // > kMaxKeyLength
  BadKeyCharacter,  // §6.1: letters, digits, '.', '-', '+', '@', '_'
  ValueTooLong,     // > kMaxEncodedValueLength
  TooLong,          // TextAccumulator: past its bound
};

using ParsedText = std::variant<std::vector<KeyValue>, TextError>;

// `data` is a whole text (a data segment, or several joined), without the pad bytes. Keys keep
// their order and duplicates: negotiate() refuses those.
ParsedText parse_text(std::span<const uint8_t> data);
// key=value\0 for each pair.
std::string encode_text(std::span<const KeyValue> pairs);

// Joins the data segments of a text that spans PDUs (C bit, §11.10.2, §11.12.2), up to a bound.
class TextAccumulator {
 public:
  explicit TextAccumulator(std::size_t max_length = kDefaultMaxTextLength)
      : max_length_(max_length) {}
  // False, and nothing kept, when the text would pass the bound: the caller ends the exchange.
  [[nodiscard]] bool append(std::span<const uint8_t> segment);
  std::span<const uint8_t> text() const;
  void clear() { text_.clear(); }

 private:
  std::size_t max_length_;
  std::string text_;
};

// §6.1 binary values: "0x"/"0X" and hex digits (an odd count has an implied leading zero), or
// "0b"/"0B" and base64 (RFC 4648, padded to a multiple of 4). Anything else, an empty value, a
// stray character or wrong padding is nullopt.
std::optional<std::vector<uint8_t>> decode_binary(std::string_view value);
// "0x" and lower-case hex digits, two a byte.
std::string encode_hex(std::span<const uint8_t> bytes);
// §6.1 numerical values: decimal (no sign, no leading '+'), or a binary value of at most 8
// bytes read big-endian. Nullopt on overflow or anything else.
std::optional<uint64_t> parse_number(std::string_view value);

enum class Digest : uint8_t { None, Crc32c };
enum class SessionType : uint8_t { Normal, Discovery };
enum class AuthMethod : uint8_t { None, Chap };

// The target's side of each key: its own limits and choices. The defaults are what this
// target asks for; RFC defaults are SessionParams'.
struct TargetPolicy {
  AuthMethod auth_method = AuthMethod::None;  // the one method accepted
  bool crc32c_digests = true;                 // offer CRC32C besides None
  std::string target_alias;                   // declared when non-empty
  uint16_t target_portal_group_tag = 1;
  uint32_t max_connections = 1;
  bool initial_r2t = true;
  bool immediate_data = true;
  uint32_t max_recv_data_segment_length = 262144;
  uint32_t max_burst_length = 262144;
  uint32_t first_burst_length = 65536;
  uint32_t default_time2wait = 2;
  uint32_t default_time2retain = 20;
  uint32_t max_outstanding_r2t = 1;
  bool data_pdu_in_order = true;
  bool data_sequence_in_order = true;
  uint32_t error_recovery_level = 0;
};

// The session as negotiated so far. Starts at the RFC's defaults (§13); negotiate() updates it
// key by key, so one value is carried across a login's PDUs and stages.
struct SessionParams {
  SessionType session_type = SessionType::Normal;
  std::string initiator_name;
  std::string initiator_alias;
  std::string target_name;
  std::optional<AuthMethod> auth_method;  // set once AuthMethod was agreed
  Digest header_digest = Digest::None;
  Digest data_digest = Digest::None;
  uint32_t max_connections = 1;
  bool initial_r2t = true;
  bool immediate_data = true;
  // §13.12 is declarative in each direction: what the initiator receives (our largest data
  // segment to it) and what we receive (its largest to us).
  uint32_t initiator_max_recv_data_segment_length = 8192;
  uint32_t target_max_recv_data_segment_length = 8192;
  uint32_t max_burst_length = 262144;
  uint32_t first_burst_length = 65536;
  uint32_t default_time2wait = 2;
  uint32_t default_time2retain = 20;
  uint32_t max_outstanding_r2t = 1;
  bool data_pdu_in_order = true;
  bool data_sequence_in_order = true;
  uint32_t error_recovery_level = 0;
};

// Why a whole negotiation fails (the caller ends the login, Status-Class 2 "initiator error",
// §11.13.5), as opposed to one key answered "Reject".
enum class NegotiationFailure : uint8_t {
  DuplicateKey,   // §6.1: a key is not offered more than once in a negotiation
  TargetOnlyKey,  // a key only a target sends (§13: TargetAlias, TargetPortalGroupTag)
  InvalidName,    // InitiatorName, InitiatorAlias or TargetName empty or too long
};

struct NegotiationResult {
  std::vector<KeyValue> response;  // in the order of the offers, then our declarations
  std::optional<NegotiationFailure> failure;
  std::string failed_key;
};

// Which login stage a key may be sent in (§6.3: sending a key in a stage that does not allow it
// is a protocol error). AuthMethod is a security key (§12); the names, SessionType and the
// target's declarations are allowed in any stage (§13); every other key of §13 that negotiate()
// knows is operational. Keys negotiate() does not know (and CHAP_*, which chap.h handles) are
// Any: they are answered, or refused, by their own rules.
enum class KeyStage : uint8_t { Any, Security, Operational };
KeyStage login_stage_of(std::string_view key);

// Answers `offered` under `policy` and updates `params`. Unknown keys and private ones (X-,
// X#) are answered NotUnderstood (§6.2, §13.22); a value not valid for its key, or out of its
// range, is answered Reject and changes nothing; keys that mean nothing in a Discovery session
// are answered Irrelevant. Offered "NotUnderstood", "Irrelevant" and "Reject" answer offers of
// ours, which this target never makes: they change nothing and get no answer.
NegotiationResult negotiate(std::span<const KeyValue> offered, const TargetPolicy& policy,
                            SessionParams& params);

}  // namespace shareblk::iscsi
