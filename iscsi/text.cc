// The text format and the target's answers. One table, kKeys, says what each key is; the
// negotiation loop reads it and never names a key, except SessionType, which decides whether the
// others are relevant (§13.21) and so is read first.
#include "iscsi/text.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <set>
#include <utility>

#include "text/hex.h"

namespace shareblk::iscsi {
namespace {

bool is_key_character(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '-' || c == '+' || c == '@' || c == '_';
}

std::optional<TextError> check_pair(std::string_view pair, KeyValue& out) {
  const std::size_t equals = pair.find('=');
  if (pair.empty()) return TextError::EmptyKey;
  if (equals == std::string_view::npos) return TextError::MissingEquals;
  const std::string_view key = pair.substr(0, equals);
  const std::string_view value = pair.substr(equals + 1);
  if (key.empty()) return TextError::EmptyKey;
  if (key.size() > kMaxKeyLength) return TextError::KeyTooLong;
  if (!std::all_of(key.begin(), key.end(), is_key_character)) return TextError::BadKeyCharacter;
  if (value.size() > kMaxEncodedValueLength) return TextError::ValueTooLong;
  out.key = key;
  out.value = value;
  return std::nullopt;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

int base64_digit(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

std::optional<std::vector<uint8_t>> decode_hex(std::string_view digits) {
  std::vector<uint8_t> out;
  out.reserve((digits.size() + 1) / 2);
  // An odd count has an implied leading zero digit (§6.1, hex-constant).
  std::size_t i = 0;
  if (digits.size() % 2 == 1) {
    const int low = hex_digit(digits[0]);
    if (low < 0) return std::nullopt;
    out.push_back(static_cast<uint8_t>(low));
    i = 1;
  }
  for (; i < digits.size(); i += 2) {
    const int high = hex_digit(digits[i]);
    const int low = hex_digit(digits[i + 1]);
    if (high < 0 || low < 0) return std::nullopt;
    out.push_back(static_cast<uint8_t>((high << 4) | low));
  }
  return out;
}

std::optional<std::vector<uint8_t>> decode_base64(std::string_view digits) {
  if (digits.size() % 4 != 0) return std::nullopt;
  const std::size_t padding =
      digits.ends_with("==") ? 2 : static_cast<std::size_t>(digits.ends_with("="));
  std::vector<uint8_t> out;
  out.reserve(digits.size() / 4 * 3);
  for (std::size_t i = 0; i < digits.size(); i += 4) {
    const bool last = i + 4 == digits.size();
    uint32_t group = 0;
    for (std::size_t j = 0; j < 4; ++j) {
      const char c = digits[i + j];
      int v = base64_digit(c);
      if (c == '=' && last && j >= 4 - padding) v = 0;
      if (v < 0) return std::nullopt;
      group = (group << 6) | static_cast<uint32_t>(v);
    }
    const std::size_t bytes = last ? 3 - padding : 3;
    // RFC 4648 §3.5: the bits a pad leaves over are zero in canonical text.
    if (last && padding > 0 && (group & ((1U << (8 * padding)) - 1)) != 0) return std::nullopt;
    for (std::size_t k = 0; k < bytes; ++k)
      out.push_back(static_cast<uint8_t>(group >> (16 - 8 * k)));
  }
  return out;
}

// --- Negotiation ---

// How a key's answer is reached (§6.2.2 for the result functions, §13 for which key is which).
enum class Kind : uint8_t {
  BoolAnd,      // Yes only if both say Yes
  BoolOr,       // Yes if either says Yes
  NumberMin,    // the smaller of the two
  NumberMax,    // the larger of the two
  Declarative,  // a number each side declares for itself (MaxRecvDataSegmentLength)
  Name,         // text the initiator declares (InitiatorName, ...); no answer
  Digests,      // list: the first of the initiator's that we support
  Auth,         // list: the first of the initiator's that policy allows
  Session,      // SessionType: Normal or Discovery
  TargetOnly,   // only a target sends it
};

struct KeySpec {
  std::string_view name;
  Kind kind;
  uint32_t min = 0;
  uint32_t max = 0;
  bool normal_only = false;  // Irrelevant in a Discovery session
  uint32_t SessionParams::*number = nullptr;
  uint32_t TargetPolicy::*our_number = nullptr;
  bool SessionParams::*flag = nullptr;
  bool TargetPolicy::*our_flag = nullptr;
  std::string SessionParams::*text = nullptr;
  Digest SessionParams::*digest = nullptr;
};

constexpr uint32_t kMaxLength24 = (1U << 24) - 1;

using P = SessionParams;
using T = TargetPolicy;

// name, kind, range, Irrelevant in Discovery, where the result goes, where ours comes from.
const std::array kKeys{
    KeySpec{"HeaderDigest", Kind::Digests, 0, 0, false, nullptr, nullptr, nullptr, nullptr, nullptr,
            &P::header_digest},
    KeySpec{"DataDigest", Kind::Digests, 0, 0, false, nullptr, nullptr, nullptr, nullptr, nullptr,
            &P::data_digest},
    KeySpec{"MaxConnections", Kind::NumberMin, 1, 65535, true, &P::max_connections,
            &T::max_connections},
    KeySpec{"InitialR2T", Kind::BoolOr, 0, 0, true, nullptr, nullptr, &P::initial_r2t,
            &T::initial_r2t},
    KeySpec{"ImmediateData", Kind::BoolAnd, 0, 0, true, nullptr, nullptr, &P::immediate_data,
            &T::immediate_data},
    KeySpec{"MaxRecvDataSegmentLength", Kind::Declarative, 512, kMaxLength24, false,
            &P::initiator_max_recv_data_segment_length, &T::max_recv_data_segment_length},
    KeySpec{"MaxBurstLength", Kind::NumberMin, 512, kMaxLength24, true, &P::max_burst_length,
            &T::max_burst_length},
    KeySpec{"FirstBurstLength", Kind::NumberMin, 512, kMaxLength24, true, &P::first_burst_length,
            &T::first_burst_length},
    KeySpec{"DefaultTime2Wait", Kind::NumberMax, 0, 3600, false, &P::default_time2wait,
            &T::default_time2wait},
    KeySpec{"DefaultTime2Retain", Kind::NumberMin, 0, 3600, false, &P::default_time2retain,
            &T::default_time2retain},
    KeySpec{"MaxOutstandingR2T", Kind::NumberMin, 1, 65535, true, &P::max_outstanding_r2t,
            &T::max_outstanding_r2t},
    KeySpec{"DataPDUInOrder", Kind::BoolOr, 0, 0, true, nullptr, nullptr, &P::data_pdu_in_order,
            &T::data_pdu_in_order},
    KeySpec{"DataSequenceInOrder", Kind::BoolOr, 0, 0, true, nullptr, nullptr,
            &P::data_sequence_in_order, &T::data_sequence_in_order},
    KeySpec{"ErrorRecoveryLevel", Kind::NumberMin, 0, 2, false, &P::error_recovery_level,
            &T::error_recovery_level},
    KeySpec{"SessionType", Kind::Session},
    KeySpec{"AuthMethod", Kind::Auth},
    KeySpec{"InitiatorName", Kind::Name, 1, kMaxNameLength, false, nullptr, nullptr, nullptr,
            nullptr, &P::initiator_name},
    KeySpec{"InitiatorAlias", Kind::Name, 0, kMaxTextValueLength, false, nullptr, nullptr, nullptr,
            nullptr, &P::initiator_alias},
    KeySpec{"TargetName", Kind::Name, 1, kMaxNameLength, false, nullptr, nullptr, nullptr, nullptr,
            &P::target_name},
    KeySpec{"TargetAlias", Kind::TargetOnly},
    KeySpec{"TargetPortalGroupTag", Kind::TargetOnly},
};

const KeySpec* find_key(std::string_view name) {
  for (const KeySpec& spec : kKeys) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

constexpr std::string_view kReject = "Reject";
constexpr std::string_view kIrrelevant = "Irrelevant";
constexpr std::string_view kNotUnderstood = "NotUnderstood";

std::optional<bool> parse_bool(std::string_view value) {
  if (value == "Yes") return true;
  if (value == "No") return false;
  return std::nullopt;
}
std::string_view yes_no(bool value) {
  return value ? "Yes" : "No";
}

// The items of a list value (§6.1, comma-separated), each non-empty; nullopt otherwise.
std::optional<std::vector<std::string_view>> split_list(std::string_view value) {
  std::vector<std::string_view> items;
  while (true) {
    const std::size_t comma = value.find(',');
    const std::string_view item = value.substr(0, comma);
    if (item.empty() || item.size() > kMaxTextValueLength) return std::nullopt;
    items.push_back(item);
    if (comma == std::string_view::npos) return items;
    value.remove_prefix(comma + 1);
  }
}

std::optional<Digest> digest_named(std::string_view name, const TargetPolicy& policy) {
  if (name == "None") return Digest::None;
  if (name == "CRC32C" && policy.crc32c_digests) return Digest::Crc32c;
  return std::nullopt;
}
std::string_view name_of(Digest digest) {
  return digest == Digest::Crc32c ? "CRC32C" : "None";
}

std::optional<AuthMethod> auth_named(std::string_view name, const TargetPolicy& policy) {
  // Only the method policy asks for; "None" where CHAP is required would skip authentication.
  if (name == "CHAP" && policy.auth_method == AuthMethod::Chap) return AuthMethod::Chap;
  if (name == "None" && policy.auth_method == AuthMethod::None) return AuthMethod::None;
  return std::nullopt;
}
std::string_view name_of(AuthMethod method) {
  return method == AuthMethod::Chap ? "CHAP" : "None";
}

// The first item of `value` that `pick` accepts (§6.2.1: the responder picks the first of the
// offer's values it supports).
template <typename Pick>
auto first_supported(std::string_view value, Pick pick) -> decltype(pick(value)) {
  const auto items = split_list(value);
  if (!items) return std::nullopt;
  for (std::string_view item : *items) {
    if (auto chosen = pick(item)) return chosen;
  }
  return std::nullopt;
}

// One key's answer: the value to send back, or nullopt for none. Sets `failure` for the
// errors that end the negotiation.
std::optional<std::string> answer(const KeySpec& spec, std::string_view value,
                                  const TargetPolicy& policy, SessionParams& params,
                                  std::optional<NegotiationFailure>& failure) {
  if (spec.normal_only && params.session_type == SessionType::Discovery) {
    return std::string(kIrrelevant);
  }
  switch (spec.kind) {
    case Kind::BoolAnd:
    case Kind::BoolOr: {
      const auto offered = parse_bool(value);
      if (!offered) return std::string(kReject);
      const bool ours = policy.*spec.our_flag;
      const bool result = spec.kind == Kind::BoolAnd ? (*offered && ours) : (*offered || ours);
      params.*spec.flag = result;
      return std::string(yes_no(result));
    }
    case Kind::NumberMin:
    case Kind::NumberMax:
    case Kind::Declarative: {
      const auto offered = parse_number(value);
      if (!offered || *offered < spec.min || *offered > spec.max) return std::string(kReject);
      const auto number = static_cast<uint32_t>(*offered);
      const uint32_t ours = policy.*spec.our_number;
      uint32_t result = ours;  // Declarative: the initiator's is recorded, ours declared back
      if (spec.kind == Kind::NumberMin) result = std::min(number, ours);
      if (spec.kind == Kind::NumberMax) result = std::max(number, ours);
      if (spec.kind == Kind::Declarative) {
        params.*spec.number = number;
        params.target_max_recv_data_segment_length = ours;
      } else {
        params.*spec.number = result;
      }
      return std::to_string(result);
    }
    case Kind::Name:
      if (value.size() < spec.min || value.size() > spec.max) {
        failure = NegotiationFailure::InvalidName;
        return std::nullopt;
      }
      params.*spec.text = value;
      return std::nullopt;
    case Kind::Digests: {
      const auto chosen =
          first_supported(value, [&](std::string_view item) { return digest_named(item, policy); });
      if (!chosen) return std::string(kReject);
      params.*spec.digest = *chosen;
      return std::string(name_of(*chosen));
    }
    case Kind::Auth: {
      const auto chosen =
          first_supported(value, [&](std::string_view item) { return auth_named(item, policy); });
      if (!chosen) return std::string(kReject);
      params.auth_method = *chosen;
      return std::string(name_of(*chosen));
    }
    case Kind::Session:
      return std::nullopt;  // read before the loop
    case Kind::TargetOnly:
      failure = NegotiationFailure::TargetOnlyKey;
      return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

ParsedText parse_text(std::span<const uint8_t> data) {
  const std::string_view text(reinterpret_cast<const char*>(data.data()), data.size());
  std::vector<KeyValue> pairs;
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t end = text.find('\0', start);
    if (end == std::string_view::npos) return TextError::Unterminated;
    KeyValue pair;
    if (auto error = check_pair(text.substr(start, end - start), pair)) return *error;
    pairs.push_back(std::move(pair));
    start = end + 1;
  }
  return pairs;
}

std::string encode_text(std::span<const KeyValue> pairs) {
  std::string text;
  for (const KeyValue& pair : pairs) {
    text.append(pair.key).append(1, '=').append(pair.value).append(1, '\0');
  }
  return text;
}

bool TextAccumulator::append(std::span<const uint8_t> segment) {
  if (segment.size() > max_length_ - text_.size()) return false;
  text_.append(reinterpret_cast<const char*>(segment.data()), segment.size());
  return true;
}

std::span<const uint8_t> TextAccumulator::text() const {
  return {reinterpret_cast<const uint8_t*>(text_.data()), text_.size()};
}

std::optional<std::vector<uint8_t>> decode_binary(std::string_view value) {
  if (value.size() < 3 || value[0] != '0') return std::nullopt;
  const std::string_view digits = value.substr(2);
  if (value[1] == 'x' || value[1] == 'X') return decode_hex(digits);
  if (value[1] == 'b' || value[1] == 'B') return decode_base64(digits);
  return std::nullopt;
}

std::string encode_hex(std::span<const uint8_t> bytes) {
  return "0x" + to_hex(bytes);
}

std::optional<uint64_t> parse_number(std::string_view value) {
  if (value.size() > 1 && value[0] == '0' && !(value[1] >= '0' && value[1] <= '9')) {
    const auto bytes = decode_binary(value);
    if (!bytes || bytes->size() > 8) return std::nullopt;
    uint64_t number = 0;
    for (uint8_t b : *bytes) number = (number << 8) | b;
    return number;
  }
  if (value.empty() ||
      !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  uint64_t number = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), number);
  if (error != std::errc{} || end != value.data() + value.size()) return std::nullopt;
  return number;
}

KeyStage login_stage_of(std::string_view key) {
  const KeySpec* spec = find_key(key);
  if (spec == nullptr) return KeyStage::Any;
  switch (spec->kind) {
    case Kind::Auth:
      return KeyStage::Security;
    case Kind::Name:
    case Kind::Session:
    case Kind::TargetOnly:
      return KeyStage::Any;
    default:
      return KeyStage::Operational;
  }
}

NegotiationResult negotiate(std::span<const KeyValue> offered, const TargetPolicy& policy,
                            SessionParams& params) {
  NegotiationResult result;
  std::set<std::string_view> seen;
  for (const KeyValue& pair : offered) {
    if (!seen.insert(pair.key).second) {
      result.failure = NegotiationFailure::DuplicateKey;
      result.failed_key = pair.key;
      return result;
    }
  }
  // SessionType first: it decides which of the others are Irrelevant (§13.21).
  for (const KeyValue& pair : offered) {
    if (pair.key != "SessionType") continue;
    if (pair.value == "Discovery") params.session_type = SessionType::Discovery;
    if (pair.value == "Normal") params.session_type = SessionType::Normal;
  }
  bool declare_portal_group = false;
  for (const KeyValue& pair : offered) {
    const std::string_view value = pair.value;
    if (value == kNotUnderstood || value == kIrrelevant || value == kReject) continue;
    const KeySpec* spec = find_key(pair.key);
    if (spec == nullptr) {
      // Unknown, and private or public extension keys (X-..., X#..., §13.22) we do not use.
      result.response.push_back({pair.key, std::string(kNotUnderstood)});
      continue;
    }
    if (spec->kind == Kind::Session) {
      if (value != "Discovery" && value != "Normal") {
        result.response.push_back({pair.key, std::string(kReject)});
      }
      continue;
    }
    auto reply = answer(*spec, value, policy, params, result.failure);
    if (result.failure) {
      result.failed_key = pair.key;
      return result;
    }
    if (reply) result.response.push_back({pair.key, std::move(*reply)});
    // A Normal session's leading login names the target; the target answers with its portal
    // group tag (§13.9) and may add its alias (§13.6).
    if (pair.key == "TargetName") declare_portal_group = true;
  }
  // §13.14: FirstBurstLength never exceeds MaxBurstLength.
  if (params.first_burst_length > params.max_burst_length) {
    params.first_burst_length = params.max_burst_length;
    for (KeyValue& reply : result.response) {
      if (reply.key == "FirstBurstLength") reply.value = std::to_string(params.first_burst_length);
    }
  }
  if (declare_portal_group) {
    result.response.push_back(
        {"TargetPortalGroupTag", std::to_string(policy.target_portal_group_tag)});
    if (!policy.target_alias.empty())
      result.response.push_back({"TargetAlias", policy.target_alias});
  }
  return result;
}

}  // namespace shareblk::iscsi
