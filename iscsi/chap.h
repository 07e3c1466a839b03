// One of iscsi/'s public headers (iscsi/iscsi.h includes them all): the target's side of CHAP
// (RFC 7143 §12.1.3 over RFC 1994), with MD5 (CHAP_A=5) only.
//
// The exchange, in the Security stage after AuthMethod=CHAP was agreed (iscsi/text.h):
//   initiator CHAP_A=<list>               -> chap_begin(): CHAP_A=5, CHAP_I, CHAP_C
//   initiator CHAP_N, CHAP_R [, CHAP_I, CHAP_C]
//                                         -> chap_verify(); for mutual CHAP, then
//                                            chap_mutual_response(): CHAP_N, CHAP_R
// Every value is checked before use and every failure is a ChapError; a caller that gets one
// ends the login with "authentication failure" (§11.13.5, 0x0201). Binary values are read with
// iscsi/text.h's decode_binary(), the one parser of §6.1's "0x"/"0b" encodings.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "iscsi/text.h"

namespace shareblk::iscsi {

inline constexpr std::string_view kChapMd5 = "5";  // CHAP_A value for MD5 (RFC 1994 §2)
// Our challenges' length: at least 16 bytes, as §12.1.3 asks of an MD5 challenge.
inline constexpr std::size_t kChapChallengeLength = 16;
// The longest binary value we take in CHAP_C or CHAP_R (§12.1.3's bound on CHAP_C).
inline constexpr std::size_t kMaxChapBinaryLength = 1024;
inline constexpr std::size_t kMd5Length = 16;

struct ChapCredentials {
  std::string name;    // CHAP_N
  std::string secret;  // the shared secret, raw bytes
};

// What we sent: the identifier and the challenge the initiator's CHAP_R must answer.
struct ChapChallenge {
  uint8_t identifier = 0;
  std::vector<uint8_t> challenge;
};

enum class ChapError : uint8_t {
  NoSupportedAlgorithm,  // CHAP_A lists no 5
  RandomFailed,          // gnutls_rnd() failed
  HashFailed,            // MD5 unavailable (e.g. a FIPS-mode GnuTLS)
  MissingKey,            // CHAP_N or CHAP_R (or one of CHAP_I/CHAP_C without the other)
  Malformed,             // a value not in its encoding, or CHAP_I not 0..255
  TooLong,               // a value past its bound
  WrongName,             // CHAP_N is not the configured name
  WrongResponse,         // CHAP_R does not answer our challenge with the secret
  ReflectedChallenge,    // the initiator's CHAP_C is ours (§12.1.3: never answered)
  SameSecret,            // mutual CHAP with one secret both ways (§12.1.3)
};

struct ChapStart {
  ChapChallenge challenge;
  std::vector<KeyValue> response;  // CHAP_A, CHAP_I, CHAP_C
};

// Picks MD5 from the initiator's CHAP_A list and makes a random identifier and challenge of
// `challenge_length` (at least kChapChallengeLength) bytes from gnutls_rnd().
std::variant<ChapStart, ChapError> chap_begin(std::string_view chap_a,
                                              std::size_t challenge_length = kChapChallengeLength);

// RFC 1994 §4.1: MD5(identifier || secret || challenge).
std::variant<std::array<uint8_t, kMd5Length>, ChapError> chap_md5(
    uint8_t identifier, std::string_view secret, std::span<const uint8_t> challenge);

// Checks the initiator's CHAP_N and CHAP_R (among `keys`, the text of its PDU) against `sent`
// and `initiator`. The response is compared in constant time. Nullopt: authenticated.
std::optional<ChapError> chap_verify(const ChapChallenge& sent, std::span<const KeyValue> keys,
                                     const ChapCredentials& initiator);

// Whether the initiator asks to authenticate us too: it sent CHAP_I or CHAP_C.
bool chap_wants_mutual(std::span<const KeyValue> keys);

// Mutual CHAP: our CHAP_N and CHAP_R for the initiator's CHAP_I and CHAP_C, computed with
// `target`'s secret, which must differ from the initiator's.
std::variant<std::vector<KeyValue>, ChapError> chap_mutual_response(
    const ChapChallenge& sent, std::span<const KeyValue> keys, const ChapCredentials& initiator,
    const ChapCredentials& target);

}  // namespace shareblk::iscsi
