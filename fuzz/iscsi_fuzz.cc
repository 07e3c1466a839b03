// Fuzzes the iSCSI protocol layer (iscsi/iscsi.h) on what an initiator sends: the input is a
// 48-byte Basic Header Segment and the data segment after it, as a Login or Text PDU carries.
//
// The header is decoded twice, as a target does (initiator opcodes only) and with every opcode
// allowed. Whatever decodes must encode to 48 bytes that decode to the same header again, and a
// target opcode must never get past the target's decoder. The rest is parsed as text: the pairs
// must encode back to exactly the input, they are negotiated under a CHAP and a no-auth policy
// (every answer must itself be valid text, one per offer at most plus our declarations), each
// value goes through the binary and numerical parsers, and the pairs are checked as a CHAP
// answer, one-way and mutual. A broken check aborts.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "iscsi/iscsi.h"

namespace shareblk::fuzz {
namespace {

using namespace iscsi;  // NOLINT(google-build-using-namespace): the protocol's vocabulary

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "iscsi_fuzz: %s\n", what);
    std::abort();
  }
}

void check_header(std::span<const uint8_t> input) {
  const DecodeLimits target_side{};
  const DecodeLimits any{kMaxDataSegmentLength, 255, false};
  const DecodeResult strict = decode_bhs(input, target_side);
  const DecodeResult loose = decode_bhs(input, any);
  if (const auto* bhs = std::get_if<Bhs>(&strict)) {
    check(static_cast<uint8_t>(opcode_of(*bhs)) < 0x20, "target opcode decoded on target side");
    check(std::holds_alternative<Bhs>(loose), "target-side decode wider than the loose one");
  }
  const auto* bhs = std::get_if<Bhs>(&loose);
  if (bhs == nullptr) return;
  const auto once = encode_bhs(*bhs);
  const DecodeResult again = decode_bhs(once, any);
  const auto* back = std::get_if<Bhs>(&again);
  check(back != nullptr, "an encoded header does not decode");
  check(encode_bhs(*back) == once, "encode(decode(encode(x))) differs from encode(x)");
  check(pdu_length(*back, true, true) >= kBhsLength, "PDU shorter than its header");
}

void check_text(std::span<const uint8_t> text) {
  const ParsedText parsed = parse_text(text);
  const auto* pairs = std::get_if<std::vector<KeyValue>>(&parsed);
  if (pairs == nullptr) return;
  const std::string encoded = encode_text(*pairs);
  check(encoded.size() == text.size() &&
            std::equal(encoded.begin(), encoded.end(), text.begin(),
                       [](char a, uint8_t b) { return static_cast<uint8_t>(a) == b; }),
        "text does not encode back to itself");
  for (const KeyValue& pair : *pairs) {
    (void)decode_binary(pair.value);
    (void)parse_number(pair.value);
  }
  for (AuthMethod method : {AuthMethod::None, AuthMethod::Chap}) {
    TargetPolicy policy;
    policy.auth_method = method;
    policy.target_alias = "fuzz";
    SessionParams params;
    const NegotiationResult result = negotiate(*pairs, policy, params);
    check(result.response.size() <= pairs->size() + 2, "more answers than offers");
    const std::string answer = encode_text(result.response);
    const ParsedText reparsed =
        parse_text({reinterpret_cast<const uint8_t*>(answer.data()), answer.size()});
    check(std::holds_alternative<std::vector<KeyValue>>(reparsed), "an answer is not valid text");
    check(params.first_burst_length <= params.max_burst_length, "FirstBurstLength > MaxBurst");
    check(params.error_recovery_level == 0 && params.max_connections == 1,
          "negotiated past the target's limits");
  }
  ChapChallenge sent;
  sent.identifier = 1;
  sent.challenge.assign(16, 0x5a);
  const ChapCredentials initiator{"iqn.fuzz:i", "initiatorsecret"};
  const ChapCredentials target{"iqn.fuzz:t", "targetsecret"};
  check(chap_verify(sent, *pairs, initiator).has_value(), "a fuzzed CHAP answer was accepted");
  (void)chap_mutual_response(sent, *pairs, initiator, target);
}

}  // namespace
}  // namespace shareblk::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> input(data, size);
  shareblk::fuzz::check_header(input);
  if (size >= shareblk::iscsi::kBhsLength) {
    shareblk::fuzz::check_text(input.subspan(shareblk::iscsi::kBhsLength));
  }
  return 0;
}
