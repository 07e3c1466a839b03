// CHAP's arithmetic is RFC 1994's; what iSCSI adds (§12.1.3) is the text encoding of its fields
// and three rules kept here: MD5 only, a challenge of at least 16 bytes, and never answering a
// challenge we sent ourselves (a reflection would let an attacker make us compute its answer).
#include "iscsi/chap.h"

#include <gnutls/crypto.h>
#include <gnutls/gnutls.h>

#include <algorithm>
#include <utility>

namespace shareblk::iscsi {
namespace {

// The value of `key` among `keys`, or nullptr. negotiate() already refused duplicates, but
// CHAP keys are not in its table, so a second copy is refused here too.
const std::string* find_value(std::span<const KeyValue> keys, std::string_view key,
                              bool& duplicate) {
  const std::string* found = nullptr;
  for (const KeyValue& pair : keys) {
    if (pair.key != key) continue;
    if (found != nullptr) duplicate = true;
    found = &pair.value;
  }
  return found;
}

// A CHAP_C or CHAP_R value, decoded and within bounds.
std::variant<std::vector<uint8_t>, ChapError> binary_value(const std::string& value) {
  if (value.size() > 2 + 2 * kMaxChapBinaryLength) return ChapError::TooLong;
  auto bytes = decode_binary(value);
  if (!bytes) return ChapError::Malformed;
  if (bytes->size() > kMaxChapBinaryLength) return ChapError::TooLong;
  return std::move(*bytes);
}

}  // namespace

std::variant<ChapStart, ChapError> chap_begin(std::string_view chap_a,
                                              std::size_t challenge_length) {
  bool md5 = false;
  std::size_t start = 0;
  while (start <= chap_a.size()) {
    const std::size_t comma = std::min(chap_a.find(',', start), chap_a.size());
    if (chap_a.substr(start, comma - start) == kChapMd5) md5 = true;
    start = comma + 1;
  }
  if (!md5) return ChapError::NoSupportedAlgorithm;
  ChapStart start_keys;
  start_keys.challenge.challenge.resize(std::max(challenge_length, kChapChallengeLength));
  std::vector<uint8_t>& challenge = start_keys.challenge.challenge;
  if (gnutls_rnd(GNUTLS_RND_NONCE, &start_keys.challenge.identifier, 1) != 0 ||
      gnutls_rnd(GNUTLS_RND_RANDOM, challenge.data(), challenge.size()) != 0) {
    return ChapError::RandomFailed;
  }
  start_keys.response = {{"CHAP_A", std::string(kChapMd5)},
                         {"CHAP_I", std::to_string(start_keys.challenge.identifier)},
                         {"CHAP_C", encode_hex(challenge)}};
  return start_keys;
}

std::variant<std::array<uint8_t, kMd5Length>, ChapError> chap_md5(
    uint8_t identifier, std::string_view secret, std::span<const uint8_t> challenge) {
  std::vector<uint8_t> message;
  message.reserve(1 + secret.size() + challenge.size());
  message.push_back(identifier);
  message.insert(message.end(), secret.begin(), secret.end());
  message.insert(message.end(), challenge.begin(), challenge.end());
  std::array<uint8_t, kMd5Length> digest{};
  if (gnutls_hash_fast(GNUTLS_DIG_MD5, message.data(), message.size(), digest.data()) != 0) {
    return ChapError::HashFailed;
  }
  return digest;
}

std::optional<ChapError> chap_verify(const ChapChallenge& sent, std::span<const KeyValue> keys,
                                     const ChapCredentials& initiator) {
  bool duplicate = false;
  const std::string* name = find_value(keys, "CHAP_N", duplicate);
  const std::string* response = find_value(keys, "CHAP_R", duplicate);
  if (duplicate) return ChapError::Malformed;
  if (name == nullptr || response == nullptr) return ChapError::MissingKey;
  if (name->size() > kMaxTextValueLength) return ChapError::TooLong;
  auto received = binary_value(*response);
  if (auto* error = std::get_if<ChapError>(&received)) return *error;
  const auto& received_bytes = std::get<std::vector<uint8_t>>(received);
  auto expected = chap_md5(sent.identifier, initiator.secret, sent.challenge);
  if (auto* error = std::get_if<ChapError>(&expected)) return *error;
  const auto& expected_bytes = std::get<std::array<uint8_t, kMd5Length>>(expected);
  // The length of an MD5 digest is no secret; its bytes are compared in constant time.
  const bool response_ok =
      received_bytes.size() == kMd5Length &&
      gnutls_memcmp(received_bytes.data(), expected_bytes.data(), kMd5Length) == 0;
  if (*name != initiator.name) return ChapError::WrongName;
  if (!response_ok) return ChapError::WrongResponse;
  return std::nullopt;
}

bool chap_wants_mutual(std::span<const KeyValue> keys) {
  return std::any_of(keys.begin(), keys.end(), [](const KeyValue& pair) {
    return pair.key == "CHAP_I" || pair.key == "CHAP_C";
  });
}

std::variant<std::vector<KeyValue>, ChapError> chap_mutual_response(
    const ChapChallenge& sent, std::span<const KeyValue> keys, const ChapCredentials& initiator,
    const ChapCredentials& target) {
  bool duplicate = false;
  const std::string* id_value = find_value(keys, "CHAP_I", duplicate);
  const std::string* challenge_value = find_value(keys, "CHAP_C", duplicate);
  if (duplicate) return ChapError::Malformed;
  if (id_value == nullptr || challenge_value == nullptr) return ChapError::MissingKey;
  const auto identifier = parse_number(*id_value);
  if (!identifier || *identifier > 255) return ChapError::Malformed;
  auto challenge = binary_value(*challenge_value);
  if (auto* error = std::get_if<ChapError>(&challenge)) return *error;
  const auto& challenge_bytes = std::get<std::vector<uint8_t>>(challenge);
  if (challenge_bytes.empty()) return ChapError::Malformed;
  if (challenge_bytes == sent.challenge) return ChapError::ReflectedChallenge;
  // One secret both ways would let a man in the middle reflect each side's challenge to the
  // other (§12.1.3 asks for different secrets).
  if (target.secret == initiator.secret) return ChapError::SameSecret;
  auto digest = chap_md5(static_cast<uint8_t>(*identifier), target.secret, challenge_bytes);
  if (auto* error = std::get_if<ChapError>(&digest)) return *error;
  return std::vector<KeyValue>{
      {"CHAP_N", target.name},
      {"CHAP_R", encode_hex(std::get<std::array<uint8_t, kMd5Length>>(digest))}};
}

}  // namespace shareblk::iscsi
