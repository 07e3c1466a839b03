// Fuzzes the iSCSI protocol layer (iscsi/iscsi.h) on what an initiator sends: the input is a
// 48-byte Basic Header Segment and the data segment after it, as a Login or Text PDU carries.
//
// The header is decoded twice, as a target does (initiator opcodes only) and with every opcode
// allowed. Whatever decodes must encode to 48 bytes that decode to the same header again, and a
// target opcode must never get past the target's decoder. The rest is parsed as text: the pairs
// must encode back to exactly the input, they are negotiated under a CHAP and a no-auth policy
// (every answer must itself be valid text, one per offer at most plus our declarations), each
// value goes through the binary and numerical parsers, and the pairs are checked as a CHAP
// answer, one-way and mutual.
//
// The same input also drives one connection's login (iscsi/login.h): it is read as PDUs on the
// wire, each a 48-byte header and the data segment its DataSegmentLength gives (cut short at the
// input's end, padded to 4 bytes), decoded as the target does; the login stops where a header
// is refused, as the connection would. Every answer must encode to a Login Response for the
// request's task tag, with valid text of at most 8192 bytes (what an initiator takes during
// login) and a StatSN one more than the last; the login must end (Close or Full Feature) within
// its PDU bound and answer nothing after; Full Feature never comes for a login whose
// authorization required CHAP (the fuzzer cannot answer a random challenge) or was refused. The
// last data segment is also given to send_targets().
//
// The same bytes also drive a session's Full Feature Phase bookkeeping (iscsi/session.h): read
// as a stream of small records, they are CmdSNs offered to a CommandWindow (which must keep
// ExpCmdSN and MaxCmdSN from going back, hold no more than its depth and deliver each CmdSN once,
// in order), Data-Out headers offered to a WriteTransfer (whose accepted segments must be
// contiguous, within the Expected Data Transfer Length, each no longer than
// MaxRecvDataSegmentLength, and whose R2Ts ask for at most MaxBurstLength), and the lengths of a
// ReadTransfer (whose Data-In PDUs must tile exactly the bytes it sends). A broken check aborts.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
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

constexpr std::size_t kMaxPdus = 16;  // LoginConfig's default, which the harness keeps

// Who may log in: any target under our prefix (and discovery); CHAP required when the
// initiator name's length is odd, mutual CHAP offered when its last byte is even.
LoginDecision decide(SessionType type, std::string_view initiator, std::string_view target) {
  LoginDecision decision;
  decision.allowed =
      type == SessionType::Discovery || target.starts_with("iqn.2026-11.org.shareblk:");
  if (initiator.size() % 2 == 1) decision.chap = ChapCredentials{"user1", "initiator-secret"};
  if (!initiator.empty() && static_cast<uint8_t>(initiator.back()) % 2 == 0) {
    decision.mutual_chap = ChapCredentials{"target1", "target-secret16"};
  }
  decision.handle = std::make_shared<int>(1);
  return decision;
}

void check_login(std::span<const uint8_t> input) {
  std::optional<LoginDecision> decision;
  LoginConfig config;
  config.first_stat_sn = 0xfffffffe;  // wraps during the login
  config.max_pdus = kMaxPdus;
  Login login(config,
              [&decision](SessionType type, std::string_view initiator, std::string_view target) {
                check(!decision.has_value(), "authorize called twice");
                decision = decide(type, initiator, target);
                return *decision;
              });
  const DecodeLimits target_side{};
  const DecodeLimits any{kMaxDataSegmentLength, 255, false};
  uint32_t stat_sn = config.first_stat_sn;
  std::size_t steps = 0;
  std::span<const uint8_t> last_data;
  while (input.size() >= kBhsLength) {
    const DecodeResult decoded = decode_bhs(input, target_side);
    const auto* request = std::get_if<Bhs>(&decoded);
    if (request == nullptr) break;      // the connection ends (Reject, or closed)
    input = input.subspan(kBhsLength);  // no AHS: the target's limits refuse them
    const std::size_t length = std::min<std::size_t>(request->data_segment_length, input.size());
    const std::span<const uint8_t> data = input.first(length);
    input = input.subspan(
        std::min<std::size_t>(padded_length(static_cast<uint32_t>(length)), input.size()));
    last_data = data;
    const bool was_finished = login.finished();
    const LoginStep step = login.step(*request, data);
    ++steps;
    if (was_finished) {
      check(!step.send && step.outcome == LoginOutcome::Close, "an answer after the end");
      continue;
    }
    if (step.send) {
      const auto header = encode_bhs(step.response);
      const DecodeResult back = decode_bhs(header, any);
      const auto* response = std::get_if<Bhs>(&back);
      check(response != nullptr, "a Login Response that does not decode");
      const auto* fields = std::get_if<LoginResponse>(&response->fields);
      check(fields != nullptr, "an answer that is not a Login Response");
      check(response->initiator_task_tag == request->initiator_task_tag, "ITT not echoed");
      check(fields->stat_sn == stat_sn++, "StatSN not one more than the last");
      check(step.data.size() <= 8192 && response->data_segment_length == step.data.size(),
            "answer length");
      const ParsedText text =
          parse_text({reinterpret_cast<const uint8_t*>(step.data.data()), step.data.size()});
      check(std::holds_alternative<std::vector<KeyValue>>(text), "answer is not valid text");
      const bool success = fields->status_class == 0 && fields->status_detail == 0;
      check(success == (step.outcome != LoginOutcome::Close), "status and outcome disagree");
      check(step.outcome != LoginOutcome::Close || step.data.empty(), "a reject with data");
    }
    if (step.outcome == LoginOutcome::Continue) {
      check(!login.finished() && steps <= kMaxPdus, "a login past its PDU bound");
    } else {
      check(login.finished(), "an ended login not finished");
    }
    if (step.outcome == LoginOutcome::FullFeature) {
      check(login.result() != nullptr && decision && decision->allowed && !decision->chap,
            "Full Feature without authorization");
      check(!login.result()->params.initiator_name.empty(), "Full Feature without a name");
    }
  }
  check(login.finished() || steps <= kMaxPdus, "a login past its PDU bound");
  const std::vector<TargetPortals> targets{{"iqn.2026-11.org.shareblk:vol1", {"192.0.2.1:3260,1"}},
                                           {"iqn.2026-11.org.shareblk:vol2", {}}};
  for (SessionType type : {SessionType::Normal, SessionType::Discovery}) {
    const auto answer = send_targets(last_data, type, targets);
    if (const auto* text = std::get_if<std::string>(&answer)) {
      const ParsedText parsed =
          parse_text({reinterpret_cast<const uint8_t*>(text->data()), text->size()});
      check(std::holds_alternative<std::vector<KeyValue>>(parsed), "SendTargets answer text");
    }
  }
}

// Reads the input a few bytes at a time; past its end, zeros.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> input) : input_(input) {}
  bool empty() const { return input_.empty(); }
  uint8_t u8() {
    if (input_.empty()) return 0;
    const uint8_t v = input_.front();
    input_ = input_.subspan(1);
    return v;
  }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | u8();
    return v;
  }

 private:
  std::span<const uint8_t> input_;
};

void check_window(Reader& in) {
  const uint32_t first = in.u32();
  CommandWindow window(CommandWindowConfig{first, 1U + in.u8() % 16, in.u8() % 4U});
  std::vector<uint32_t> delivered;  // non-immediate CmdSNs, in delivery order
  for (int step = 0; step < 64 && !in.empty(); ++step) {
    const uint32_t exp = window.exp_cmd_sn();
    const uint32_t max = window.max_cmd_sn();
    const uint8_t op = in.u8();
    const uint32_t cmd_sn = exp + static_cast<uint32_t>(static_cast<int8_t>(in.u8()));
    if (op % 4 == 0) {
      (void)window.completed((op & 0x10) != 0);
    } else if (op % 4 == 1) {
      (void)window.consume(cmd_sn);
    } else {
      const CmdSnVerdict verdict = window.accept(cmd_sn, op % 4 == 3);
      if (verdict == CmdSnVerdict::Deliver) delivered.push_back(cmd_sn);
      while (const auto ready = window.take_ready()) delivered.push_back(*ready);
    }
    check(serial_less_equal(exp, window.exp_cmd_sn()), "ExpCmdSN went back");
    check(serial_less_equal(max, window.max_cmd_sn()), "MaxCmdSN went back");
    check(window.outstanding() <= 16 && window.held() <= 16, "more than the window's depth");
    check(window.max_cmd_sn() + 1 - window.exp_cmd_sn() <= 16, "a window wider than its depth");
  }
  // Delivered CmdSNs are consecutive apart from consumed ones: each is after the one before.
  for (std::size_t i = 1; i < delivered.size(); ++i) {
    check(serial_less(delivered[i - 1], delivered[i]), "a CmdSN delivered out of order or twice");
  }
}

void check_write(Reader& in) {
  SessionParams params;
  params.immediate_data = (in.u8() & 1) != 0;
  params.initial_r2t = (in.u8() & 1) != 0;
  params.target_max_recv_data_segment_length = 512U + in.u8() * 64U;
  params.max_burst_length = 512U + in.u8() * 256U;
  params.first_burst_length = std::min(params.max_burst_length, 512U + in.u8() * 128U);
  Bhs command;
  ScsiCommand fields;
  fields.expected_data_transfer_length = in.u32() % (1U << 20);
  command.final = (in.u8() & 1) != 0;
  command.data_segment_length = in.u32() % (1U << 16);
  command.fields = fields;
  auto started = WriteTransfer::start(params, command, 0x55);
  auto* transfer = std::get_if<WriteTransfer>(&started);
  if (transfer == nullptr) return;
  check(transfer->received() == command.data_segment_length, "immediate data not counted");
  std::optional<R2t> open;
  for (int step = 0; step < 64 && !in.empty(); ++step) {
    if ((in.u8() & 3) == 0) {
      if (auto r2t = transfer->next_r2t()) {
        check(!open.has_value() ||
                  transfer->received() == open->buffer_offset + open->desired_data_transfer_length,
              "a second R2T before the first one's data");
        check(r2t->desired_data_transfer_length > 0 &&
                  r2t->desired_data_transfer_length <= params.max_burst_length,
              "R2T length out of range");
        check(r2t->buffer_offset == transfer->received(), "R2T not where the data continues");
        open = r2t;
      }
      continue;
    }
    Bhs pdu;
    DataOut out;
    const uint8_t how = in.u8();
    out.target_transfer_tag = (how & 1) != 0 ? kReservedTag : 0x55;
    out.data_sn = in.u8() % 4;
    // Mostly where the data continues, so that the fuzzer reaches the later checks.
    out.buffer_offset = (how & 2) != 0 ? in.u32() : transfer->received();
    pdu.data_segment_length = (how & 4) != 0 ? in.u32() % (1U << 17) : 1U + in.u8() * 32U;
    pdu.final = (how & 8) != 0;
    pdu.fields = out;
    const uint32_t before = transfer->received();
    const auto result = transfer->data_out(pdu);
    if (const auto* ok = std::get_if<DataOutAccepted>(&result)) {
      check(ok->buffer_offset == before && ok->length == pdu.data_segment_length,
            "an accepted segment not where the data continues");
      check(ok->length <= params.target_max_recv_data_segment_length, "an oversized segment");
      check(transfer->received() == before + ok->length, "received not counted");
      check(ok->transfer_done == transfer->done(), "done disagrees");
    } else {
      check(transfer->received() == before, "a refused segment counted");
      return;  // the connection ends
    }
    check(transfer->received() <= transfer->length(), "more than the expected length");
  }
}

void check_read(Reader& in) {
  SessionParams params;
  params.initiator_max_recv_data_segment_length = 1U + in.u32() % (1U << 18);
  params.max_burst_length = 1U + in.u32() % (1U << 20);
  const uint32_t expected = in.u32() % (1U << 22);
  const uint64_t data_length = in.u32() % (1U << 22);
  ReadTransfer read(params, expected, data_length, 7, 0, (in.u8() & 1) != 0);
  uint32_t offset = 0;
  uint32_t data_sn = 0;
  while (auto pdu = read.next()) {
    const auto& fields = std::get<DataIn>(pdu->header.fields);
    check(fields.buffer_offset == offset && fields.data_sn == data_sn++, "Data-In not in order");
    check(pdu->length > 0 && pdu->length <= params.initiator_max_recv_data_segment_length,
          "Data-In segment length");
    offset += pdu->length;
    const bool last = offset == read.send_length();
    check(!last || pdu->header.final, "last Data-In without F");
    check(fields.status_present == (last && read.status_in_data()), "S bit misplaced");
  }
  check(offset == std::min<uint64_t>(expected, data_length), "Data-In does not tile the data");
}

void check_session(std::span<const uint8_t> input) {
  Reader in(input);
  check_window(in);
  check_write(in);
  check_read(in);
}

}  // namespace
}  // namespace shareblk::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> input(data, size);
  shareblk::fuzz::check_header(input);
  if (size >= shareblk::iscsi::kBhsLength) {
    shareblk::fuzz::check_text(input.subspan(shareblk::iscsi::kBhsLength));
  }
  shareblk::fuzz::check_login(input);
  shareblk::fuzz::check_session(input);
  return 0;
}
