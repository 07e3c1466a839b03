// The iSCSI protocol layer (iscsi/iscsi.h) as an initiator meets it: login and command headers
// laid out byte for byte from RFC 7143's figures decode and encode back the same; truncated,
// oversized and garbage headers are refused with the §11.17.1 reason; negotiation answers each
// key kind of §13; CRC32C matches RFC 3720 B.4; CHAP accepts the right answer only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "iscsi/iscsi.h"

namespace shareblk::iscsi {
namespace {

using Bytes = std::vector<uint8_t>;

Bytes bytes_of(std::string_view text) {
  return Bytes(text.begin(), text.end());
}

void put32(Bytes& b, std::size_t at, uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(v >> (24 - 8 * i));
}

// What open-iscsi sends first when no authentication is configured: a Login Request, I bit set
// (0x43), T=1, CSG=0 (security), NSG=1 (operational), versions 0, ISID of the OUI format
// (type 00, open-iscsi's 0x023d), TSIH 0, ITT 0, CID 0, CmdSN 1, ExpStatSN 0 (§11.12).
constexpr char kLoginTextBytes[] =
    "InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b\0"
    "InitiatorAlias=node1\0"
    "TargetName=iqn.2026-11.org.shareblk:vol1\0"
    "SessionType=Normal\0"
    "AuthMethod=None\0";
constexpr std::string_view kLoginText(kLoginTextBytes, sizeof(kLoginTextBytes) - 1);

Bytes open_iscsi_login() {
  Bytes b(kBhsLength, 0);
  b[0] = 0x43;
  b[1] = 0x81;
  b[5] = 0;
  b[6] = 0;
  b[7] = static_cast<uint8_t>(kLoginText.size());
  const uint8_t isid[] = {0x00, 0x02, 0x3d, 0x00, 0x00, 0x01};
  std::copy(std::begin(isid), std::end(isid), b.begin() + 8);
  put32(b, 24, 1);
  return b;
}

// RFC 3720 B.4's "iSCSI - SCSI Read (10) Command PDU": a SCSI Command, F and R, ITT
// 0x14000000, 1024 bytes expected, CmdSN 0x14, ExpStatSN 0x18, CDB READ(10) of 2 blocks.
Bytes rfc3720_read_command() {
  return {0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
          0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
          0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
          0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
}

Bhs decoded(const Bytes& b, DecodeLimits limits = {}) {
  DecodeResult result = decode_bhs(b, limits);
  if (const auto* refusal = std::get_if<DecodeRefusal>(&result)) {
    ADD_FAILURE() << "refused: " << refusal->why;
    return {};
  }
  return std::get<Bhs>(result);
}

std::optional<RejectReason> refusal_of(const Bytes& b, DecodeLimits limits = {}) {
  DecodeResult result = decode_bhs(b, limits);
  if (const auto* refusal = std::get_if<DecodeRefusal>(&result)) return refusal->reason;
  return std::nullopt;
}

Bytes encoded(const Bhs& bhs) {
  const auto h = encode_bhs(bhs);
  return Bytes(h.begin(), h.end());
}

// --- The Basic Header Segment ---

TEST(IscsiPdu, OpenIscsiLoginDecodesAndEncodesBack) {
  const Bytes wire = open_iscsi_login();
  const Bhs bhs = decoded(wire);
  ASSERT_EQ(opcode_of(bhs), Opcode::LoginRequest);
  EXPECT_TRUE(bhs.immediate);
  EXPECT_TRUE(bhs.final);  // T
  EXPECT_EQ(bhs.data_segment_length, kLoginText.size());
  const auto& login = std::get<LoginRequest>(bhs.fields);
  EXPECT_FALSE(login.more_follows);
  EXPECT_EQ(login.current_stage, LoginStage::Security);
  EXPECT_EQ(login.next_stage, LoginStage::Operational);
  EXPECT_EQ(login.isid, (std::array<uint8_t, 6>{0x00, 0x02, 0x3d, 0x00, 0x00, 0x01}));
  EXPECT_EQ(login.tsih, 0);
  EXPECT_EQ(login.cmd_sn, 1U);
  EXPECT_EQ(bhs.lun, 0U);  // bytes 8-15 are the ISID and TSIH here, not a LUN
  EXPECT_EQ(encoded(bhs), wire);
}

TEST(IscsiPdu, Rfc3720ReadCommandDecodesWithItsFields) {
  const Bytes wire = rfc3720_read_command();
  const Bhs bhs = decoded(wire);
  ASSERT_EQ(opcode_of(bhs), Opcode::ScsiCommand);
  EXPECT_FALSE(bhs.immediate);
  EXPECT_TRUE(bhs.final);
  EXPECT_EQ(bhs.initiator_task_tag, 0x14000000U);
  const auto& cmd = std::get<ScsiCommand>(bhs.fields);
  EXPECT_TRUE(cmd.read);
  EXPECT_FALSE(cmd.write);
  EXPECT_EQ(cmd.expected_data_transfer_length, 1024U);
  EXPECT_EQ(cmd.cmd_sn, 0x14U);
  EXPECT_EQ(cmd.exp_stat_sn, 0x18U);
  EXPECT_EQ(cmd.cdb[0], 0x28);  // READ(10)
  EXPECT_EQ(cmd.cdb[8], 0x02);
  EXPECT_EQ(encoded(bhs), wire);
}

// Every PDU the codec knows, with every field set, survives encode then decode.
TEST(IscsiPdu, EveryPduRoundTrips) {
  ScsiCommand cmd{true, true, 2, 0x10000, 7, 8, {}};
  cmd.cdb.fill(0xa5);
  LoginRequest login{false,
                     LoginStage::Operational,
                     LoginStage::FullFeature,
                     0,
                     0,
                     {0x80, 1, 2, 3, 4, 5},
                     0x1234,
                     3,
                     99,
                     100};
  const std::vector<Bhs> all = {
      {true, true, 0, 0, 0x0001000000000000, kReservedTag, NopOut{kReservedTag, 5, 6}},
      {false, true, 0, 48, 0x0002000000000000, 9, NopIn{0x77, 1, 2, 3}},
      {false, false, 2, 512, 0x0001000000000000, 10, cmd},
      {false, true, 0, 0, 0, 10, ScsiResponse{true, false, true, false, 0, 2, 1, 2, 3, 4, 5, 6, 7}},
      {true, true, 0, 0, 0x0001000000000000, 11, TaskMgmtRequest{1, 10, 3, 4, 5, 6}},
      {false, true, 0, 0, 0, 11, TaskMgmtResponse{0, 4, 5, 6}},
      {false, true, 0, 8192, 0x0001000000000000, 12, DataOut{0x55, 7, 3, 8192}},
      {false, true, 0, 4096, 0x0001000000000000, 12,
       DataIn{true, false, true, true, 0x02, 0x55, 1, 2, 3, 4, 4096, 512}},
      {false, true, 0, 0, 0x0001000000000000, 12, R2t{0x55, 1, 2, 3, 4, 65536, 262144}},
      {true, false, 0, 100, 0, 13, TextRequest{true, kReservedTag, 4, 5}},
      {false, true, 0, 100, 0, 13, TextResponse{false, 0x66, 4, 5, 6}},
      {true, true, 0, 200, 0, 14, login},
      {false, true, 0, 200, 0, 14,
       LoginResponse{false,
                     LoginStage::Operational,
                     LoginStage::FullFeature,
                     0,
                     0,
                     {0x80, 1, 2, 3, 4, 5},
                     0x1234,
                     1,
                     2,
                     3,
                     0,
                     0}},
      {true, true, 0, 0, 0, 15, LogoutRequest{1, 3, 4, 5}},
      {false, true, 0, 0, 0, 15, LogoutResponse{0, 1, 2, 3, 2, 20}},
      {false, true, 0, 48, 0, kReservedTag, Reject{RejectReason::InvalidPduField, 1, 2, 3, 0}},
  };
  const DecodeLimits any{kMaxDataSegmentLength, 255, false};
  for (const Bhs& original : all) {
    const Bytes wire = encoded(original);
    ASSERT_EQ(wire.size(), kBhsLength);
    const Bhs back = decoded(wire, any);
    EXPECT_EQ(opcode_of(back), opcode_of(original));
    EXPECT_EQ(encoded(back), wire) << "opcode " << int(wire[0] & 0x3f);
    EXPECT_EQ(back.data_segment_length, original.data_segment_length);
    EXPECT_EQ(back.lun, original.lun);
  }
}

TEST(IscsiPdu, TruncatedHeaderIsAProtocolError) {
  Bytes wire = open_iscsi_login();
  wire.resize(47);
  EXPECT_EQ(refusal_of(wire), RejectReason::ProtocolError);
  EXPECT_EQ(refusal_of(Bytes{}), RejectReason::ProtocolError);
}

TEST(IscsiPdu, LengthsPastTheLimitsAreRefused) {
  Bytes wire = open_iscsi_login();
  wire[5] = 0x01;  // 65,536 + 149 bytes of text, over the 8192 of a login (§13.12)
  EXPECT_EQ(refusal_of(wire), RejectReason::ProtocolError);
  EXPECT_FALSE(refusal_of(wire, {1U << 17, 0, true}));
  wire = open_iscsi_login();
  wire[4] = 1;  // an AHS the caller does not take
  EXPECT_EQ(refusal_of(wire), RejectReason::ProtocolError);
  EXPECT_FALSE(refusal_of(wire, {8192, 1, true}));
}

TEST(IscsiPdu, UnknownAndUnsupportedOpcodesAreNotSupported) {
  for (uint8_t code : {0x07, 0x0f, 0x11, 0x1c, 0x1f}) {
    Bytes wire(kBhsLength, 0);
    wire[0] = code;
    EXPECT_EQ(refusal_of(wire), RejectReason::CommandNotSupported) << int(code);
  }
  Bytes snack(kBhsLength, 0);
  snack[0] = 0x10;
  EXPECT_EQ(refusal_of(snack), RejectReason::CommandNotSupported);
}

TEST(IscsiPdu, TargetOpcodesFromAnInitiatorAreAProtocolError) {
  for (uint8_t code : {0x20, 0x21, 0x25, 0x31, 0x3f, 0x2a}) {
    Bytes wire(kBhsLength, 0);
    wire[0] = code;
    wire[1] = 0x80;
    EXPECT_EQ(refusal_of(wire), RejectReason::ProtocolError) << int(code);
  }
}

TEST(IscsiPdu, ReservedValuesAndForbiddenCombinationsAreRefused) {
  Bytes wire = open_iscsi_login();
  wire[1] = 0xc1;  // T and C (§11.12.2)
  EXPECT_EQ(refusal_of(wire), RejectReason::ProtocolError);
  wire = open_iscsi_login();
  wire[1] = 0x82;  // NSG 2, reserved
  EXPECT_EQ(refusal_of(wire), RejectReason::ProtocolError);
  wire = open_iscsi_login();
  wire[0] = 0x03;  // a Login Request without the I bit
  EXPECT_EQ(refusal_of(wire), RejectReason::ProtocolError);

  Bytes text(kBhsLength, 0);
  text[0] = 0x04;
  text[1] = 0xc0;  // F and C (§11.10.2)
  EXPECT_EQ(refusal_of(text), RejectReason::ProtocolError);

  Bytes logout(kBhsLength, 0);
  logout[0] = 0x46;
  logout[1] = 0x83;  // reason 3, reserved
  EXPECT_EQ(refusal_of(logout), RejectReason::ProtocolError);

  Bytes command = rfc3720_read_command();
  command[1] |= 0x05;  // ATTR 5, reserved
  EXPECT_EQ(refusal_of(command), RejectReason::ProtocolError);

  Bytes nop(kBhsLength, 0);
  nop[0] = 0x00;  // not immediate, yet ITT 0xffffffff: no answer wanted
  nop[1] = 0x80;
  put32(nop, 16, kReservedTag);
  EXPECT_EQ(refusal_of(nop), RejectReason::ProtocolError);
  nop[0] = 0x40;
  EXPECT_FALSE(refusal_of(nop));
}

// Reserved fields are ignored on receipt and zero when sent (§11.2).
TEST(IscsiPdu, ReservedBytesAreIgnoredAndSentAsZero) {
  Bytes wire = open_iscsi_login();
  wire[22] = 0xff;  // reserved in a Login Request
  wire[40] = 0xff;
  const Bhs bhs = decoded(wire);
  EXPECT_EQ(encoded(bhs), open_iscsi_login());
}

TEST(IscsiPdu, GarbageNeverDecodesIntoSomethingThatEncodesDifferently) {
  // Every byte value in byte 0 and byte 1: whatever decodes must re-encode to a header that
  // decodes to the same thing (a fixed point after one round).
  for (int b0 = 0; b0 < 256; ++b0) {
    for (int b1 = 0; b1 < 256; b1 += 5) {
      Bytes wire(kBhsLength, 0x5a);
      wire[0] = static_cast<uint8_t>(b0);
      wire[1] = static_cast<uint8_t>(b1);
      wire[4] = 0;
      const DecodeLimits any{kMaxDataSegmentLength, 255, false};
      DecodeResult first = decode_bhs(wire, any);
      if (std::holds_alternative<DecodeRefusal>(first)) continue;
      const Bytes once = encoded(std::get<Bhs>(first));
      EXPECT_EQ(encoded(decoded(once, any)), once) << b0 << " " << b1;
    }
  }
}

TEST(IscsiPdu, LengthHelpersPadAndCountDigests) {
  EXPECT_EQ(padded_length(0), 0U);
  EXPECT_EQ(padded_length(1), 4U);
  EXPECT_EQ(padded_length(149), 152U);
  EXPECT_EQ(padded_length(8192), 8192U);
  Bhs bhs;
  bhs.fields = DataOut{};
  EXPECT_EQ(pdu_length(bhs, true, true), 48U + 4U);  // no data: no data digest
  bhs.data_segment_length = 149;
  bhs.total_ahs_words = 2;
  EXPECT_EQ(pdu_length(bhs, false, false), 48U + 8U + 152U);
  EXPECT_EQ(pdu_length(bhs, true, true), 48U + 8U + 4U + 152U + 4U);
}

// --- Text ---

TEST(IscsiText, LoginTextParsesInOrderAndEncodesBack) {
  const auto parsed = parse_text(bytes_of(kLoginText));
  ASSERT_TRUE(std::holds_alternative<std::vector<KeyValue>>(parsed));
  const auto& pairs = std::get<std::vector<KeyValue>>(parsed);
  ASSERT_EQ(pairs.size(), 5U);
  EXPECT_EQ(pairs[0], (KeyValue{"InitiatorName", "iqn.2004-10.com.ubuntu:01:5e2c3f1a9b"}));
  EXPECT_EQ(pairs[4], (KeyValue{"AuthMethod", "None"}));
  EXPECT_EQ(encode_text(pairs), kLoginText);
}

TEST(IscsiText, MalformedTextIsRefused) {
  using namespace std::string_view_literals;
  const auto error = [](std::string_view text) -> std::optional<TextError> {
    const auto parsed = parse_text(bytes_of(text));
    if (const auto* e = std::get_if<TextError>(&parsed)) return *e;
    return std::nullopt;
  };
  EXPECT_EQ(error("A=1"sv), TextError::Unterminated);
  EXPECT_EQ(error("A1\0"sv), TextError::MissingEquals);
  EXPECT_EQ(error("=1\0"sv), TextError::EmptyKey);
  EXPECT_EQ(error("A=1\0\0"sv), TextError::EmptyKey);
  EXPECT_EQ(error("A B=1\0"sv), TextError::BadKeyCharacter);
  EXPECT_EQ(error(std::string(64, 'K') + "=1" + '\0'), TextError::KeyTooLong);
  EXPECT_FALSE(error(std::string(63, 'K') + "=1" + '\0'));
  EXPECT_EQ(error("K=" + std::string(kMaxEncodedValueLength + 1, 'v') + '\0'),
            TextError::ValueTooLong);
  EXPECT_FALSE(error(""sv));
  EXPECT_FALSE(error("X-com.example.k=a=b\0"sv));  // '=' in a value is the value's
}

TEST(IscsiText, AccumulatorJoinsSegmentsUpToItsBound) {
  TextAccumulator text(8);
  EXPECT_TRUE(text.append(bytes_of("Aut")));
  EXPECT_TRUE(text.append(bytes_of("h=No")));
  EXPECT_FALSE(text.append(bytes_of("ne\0")));  // 10 bytes > 8
  EXPECT_EQ(text.text().size(), 7U);
  text.clear();
  EXPECT_TRUE(text.append(bytes_of("12345678")));
  EXPECT_FALSE(text.append(bytes_of("9")));
}

// A login text split mid-pair over two PDUs (C bit) parses once joined.
TEST(IscsiText, TextSplitAcrossPdusParsesOnceJoined) {
  const Bytes whole = bytes_of(kLoginText);
  TextAccumulator text;
  ASSERT_TRUE(text.append(std::span(whole).first(20)));
  EXPECT_TRUE(std::holds_alternative<TextError>(parse_text(text.text())));  // not yet whole
  ASSERT_TRUE(text.append(std::span(whole).subspan(20)));
  const auto parsed = parse_text(text.text());
  ASSERT_TRUE(std::holds_alternative<std::vector<KeyValue>>(parsed));
  EXPECT_EQ(std::get<std::vector<KeyValue>>(parsed).size(), 5U);
}

TEST(IscsiText, BinaryAndNumericalValues) {
  EXPECT_EQ(decode_binary("0x0aFf"), (Bytes{0x0a, 0xff}));
  EXPECT_EQ(decode_binary("0X123"), (Bytes{0x01, 0x23}));  // odd: an implied leading zero
  EXPECT_EQ(decode_binary("0bAQID"), (Bytes{1, 2, 3}));
  EXPECT_EQ(decode_binary("0BAQI="), (Bytes{1, 2}));
  EXPECT_EQ(decode_binary("0bAQ=="), (Bytes{1}));
  for (std::string_view bad : {"", "0x", "0b", "x12", "0y12", "0x1g", "0bAQI", "0bA=QI",
                               "0bAQJ=", "0bAR==", "0b====", "0b AQID", "0x12 "}) {
    EXPECT_FALSE(decode_binary(bad)) << bad;
  }
  EXPECT_EQ(encode_hex(Bytes{0x00, 0xab}), "0x00ab");
  EXPECT_EQ(parse_number("8192"), 8192U);
  EXPECT_EQ(parse_number("0x2000"), 8192U);
  EXPECT_EQ(parse_number("0bIAA="), 8192U);
  EXPECT_EQ(parse_number("18446744073709551615"), UINT64_MAX);
  for (std::string_view bad :
       {"", "-1", "+1", " 1", "1k", "18446744073709551616", "0x010000000000000000"}) {
    EXPECT_FALSE(parse_number(bad)) << bad;
  }
}

// --- Negotiation ---

std::vector<KeyValue> keys(std::initializer_list<std::pair<const char*, const char*>> list) {
  std::vector<KeyValue> out;
  for (const auto& [k, v] : list) out.push_back({k, v});
  return out;
}

std::string answer_of(const NegotiationResult& result, std::string_view key) {
  for (const KeyValue& kv : result.response) {
    if (kv.key == key) return kv.value;
  }
  return "(none)";
}

TEST(IscsiNegotiation, OpenIscsiOperationalOfferGetsTheRightAnswers) {
  // open-iscsi's operational stage, its defaults (iscsid.conf).
  const auto offer = keys({{"HeaderDigest", "None"},
                           {"DataDigest", "None"},
                           {"MaxConnections", "1"},
                           {"InitialR2T", "No"},
                           {"ImmediateData", "Yes"},
                           {"MaxRecvDataSegmentLength", "262144"},
                           {"MaxBurstLength", "16776192"},
                           {"FirstBurstLength", "262144"},
                           {"DefaultTime2Wait", "0"},
                           {"DefaultTime2Retain", "0"},
                           {"MaxOutstandingR2T", "1"},
                           {"DataPDUInOrder", "Yes"},
                           {"DataSequenceInOrder", "Yes"},
                           {"ErrorRecoveryLevel", "0"}});
  TargetPolicy policy;
  policy.max_recv_data_segment_length = 65536;
  SessionParams params;
  const NegotiationResult result = negotiate(offer, policy, params);
  ASSERT_FALSE(result.failure);
  EXPECT_EQ(answer_of(result, "HeaderDigest"), "None");
  EXPECT_EQ(answer_of(result, "MaxConnections"), "1");
  EXPECT_EQ(answer_of(result, "InitialR2T"), "Yes");  // OR: ours is Yes
  EXPECT_TRUE(params.initial_r2t);
  EXPECT_EQ(answer_of(result, "ImmediateData"), "Yes");  // AND
  // Declarative: the initiator's is what we may send it; we answer with ours.
  EXPECT_EQ(answer_of(result, "MaxRecvDataSegmentLength"), "65536");
  EXPECT_EQ(params.initiator_max_recv_data_segment_length, 262144U);
  EXPECT_EQ(params.target_max_recv_data_segment_length, 65536U);
  EXPECT_EQ(answer_of(result, "MaxBurstLength"), "262144");  // min
  EXPECT_EQ(answer_of(result, "FirstBurstLength"), "65536");
  EXPECT_EQ(answer_of(result, "DefaultTime2Wait"), "2");    // max
  EXPECT_EQ(answer_of(result, "DefaultTime2Retain"), "0");  // min
  EXPECT_EQ(answer_of(result, "DataPDUInOrder"), "Yes");
  EXPECT_EQ(answer_of(result, "ErrorRecoveryLevel"), "0");
  EXPECT_EQ(params.max_burst_length, 262144U);
  EXPECT_EQ(params.default_time2wait, 2U);
  EXPECT_EQ(params.default_time2retain, 0U);
  EXPECT_EQ(result.response.size(), offer.size());
}

TEST(IscsiNegotiation, BooleanAndOrAndNumericalMinMax) {
  TargetPolicy policy;
  policy.initial_r2t = false;
  policy.immediate_data = true;
  policy.max_outstanding_r2t = 4;
  policy.error_recovery_level = 0;
  SessionParams params;
  auto result = negotiate(keys({{"InitialR2T", "No"},
                                {"ImmediateData", "No"},
                                {"MaxOutstandingR2T", "16"},
                                {"ErrorRecoveryLevel", "2"},
                                {"DefaultTime2Wait", "20"}}),
                          policy, params);
  EXPECT_EQ(answer_of(result, "InitialR2T"), "No");     // No OR No
  EXPECT_EQ(answer_of(result, "ImmediateData"), "No");  // No AND Yes
  EXPECT_EQ(answer_of(result, "MaxOutstandingR2T"), "4");
  EXPECT_EQ(answer_of(result, "ErrorRecoveryLevel"), "0");
  EXPECT_EQ(answer_of(result, "DefaultTime2Wait"), "20");
  EXPECT_FALSE(params.initial_r2t);
  EXPECT_FALSE(params.immediate_data);
  EXPECT_EQ(params.max_outstanding_r2t, 4U);
}

TEST(IscsiNegotiation, FirstBurstNeverExceedsMaxBurst) {
  TargetPolicy policy;
  policy.first_burst_length = 262144;
  SessionParams params;
  const auto result = negotiate(keys({{"MaxBurstLength", "16384"}, {"FirstBurstLength", "262144"}}),
                                policy, params);
  EXPECT_EQ(answer_of(result, "FirstBurstLength"), "16384");
  EXPECT_EQ(params.first_burst_length, 16384U);
}

TEST(IscsiNegotiation, DigestsPreferTheInitiatorsOrderAmongOurs) {
  TargetPolicy policy;
  SessionParams params;
  auto result = negotiate(keys({{"HeaderDigest", "CRC32C,None"}, {"DataDigest", "None,CRC32C"}}),
                          policy, params);
  EXPECT_EQ(answer_of(result, "HeaderDigest"), "CRC32C");
  EXPECT_EQ(answer_of(result, "DataDigest"), "None");
  EXPECT_EQ(params.header_digest, Digest::Crc32c);
  EXPECT_EQ(params.data_digest, Digest::None);

  policy.crc32c_digests = false;
  SessionParams plain;
  result = negotiate(keys({{"HeaderDigest", "CRC32C"}, {"DataDigest", "MD5,None"}}), policy, plain);
  EXPECT_EQ(answer_of(result, "HeaderDigest"), "Reject");
  EXPECT_EQ(answer_of(result, "DataDigest"), "None");
  EXPECT_EQ(plain.header_digest, Digest::None);
  result = negotiate(keys({{"HeaderDigest", "None,,CRC32C"}}), policy, plain);
  EXPECT_EQ(answer_of(result, "HeaderDigest"), "Reject");  // an empty item
}

TEST(IscsiNegotiation, AuthMethodFollowsThePolicy) {
  TargetPolicy chap;
  chap.auth_method = AuthMethod::Chap;
  SessionParams params;
  auto result = negotiate(keys({{"AuthMethod", "None,CHAP"}}), chap, params);
  EXPECT_EQ(answer_of(result, "AuthMethod"), "CHAP");
  EXPECT_EQ(params.auth_method, AuthMethod::Chap);

  SessionParams refused;
  result = negotiate(keys({{"AuthMethod", "None"}}), chap, refused);
  EXPECT_EQ(answer_of(result, "AuthMethod"), "Reject");
  EXPECT_FALSE(refused.auth_method);  // the caller fails the login: authentication failure

  SessionParams open;
  result = negotiate(keys({{"AuthMethod", "CHAP,None"}}), TargetPolicy{}, open);
  EXPECT_EQ(answer_of(result, "AuthMethod"), "None");
}

TEST(IscsiNegotiation, NamesAreRecordedAndTheTargetDeclaresItsTag) {
  const auto parsed = parse_text(bytes_of(kLoginText));
  const auto& offer = std::get<std::vector<KeyValue>>(parsed);
  TargetPolicy policy;
  policy.target_portal_group_tag = 7;
  policy.target_alias = "shareblk vol1";
  SessionParams params;
  const auto result = negotiate(offer, policy, params);
  ASSERT_FALSE(result.failure);
  EXPECT_EQ(params.initiator_name, "iqn.2004-10.com.ubuntu:01:5e2c3f1a9b");
  EXPECT_EQ(params.initiator_alias, "node1");
  EXPECT_EQ(params.target_name, "iqn.2026-11.org.shareblk:vol1");
  EXPECT_EQ(params.session_type, SessionType::Normal);
  EXPECT_EQ(params.auth_method, AuthMethod::None);
  EXPECT_EQ(result.response, keys({{"AuthMethod", "None"},
                                   {"TargetPortalGroupTag", "7"},
                                   {"TargetAlias", "shareblk vol1"}}));
}

TEST(IscsiNegotiation, DiscoverySessionsAnswerIrrelevant) {
  SessionParams params;
  const auto result = negotiate(
      keys({{"MaxBurstLength", "4096"}, {"SessionType", "Discovery"}, {"HeaderDigest", "None"}}),
      TargetPolicy{}, params);
  EXPECT_EQ(params.session_type, SessionType::Discovery);
  EXPECT_EQ(answer_of(result, "MaxBurstLength"), "Irrelevant");
  EXPECT_EQ(answer_of(result, "HeaderDigest"), "None");
  EXPECT_EQ(params.max_burst_length, 262144U);
}

TEST(IscsiNegotiation, UnknownAndPrivateKeysAreNotUnderstood) {
  SessionParams params;
  const auto result = negotiate(keys({{"X-com.example.Foo", "1"},
                                      {"X#org.example.Bar", "Yes"},
                                      {"OFMarker", "No"},
                                      {"MaxConnections", "1"}}),
                                TargetPolicy{}, params);
  ASSERT_FALSE(result.failure);
  EXPECT_EQ(answer_of(result, "X-com.example.Foo"), "NotUnderstood");
  EXPECT_EQ(answer_of(result, "X#org.example.Bar"), "NotUnderstood");
  EXPECT_EQ(answer_of(result, "OFMarker"), "NotUnderstood");
  EXPECT_EQ(answer_of(result, "MaxConnections"), "1");
}

TEST(IscsiNegotiation, OutOfRangeAndInvalidValuesAreRejectedAndChangeNothing) {
  SessionParams params;
  const auto result = negotiate(keys({{"MaxRecvDataSegmentLength", "511"},
                                      {"MaxBurstLength", "16777216"},
                                      {"DefaultTime2Wait", "3601"},
                                      {"ErrorRecoveryLevel", "3"},
                                      {"MaxOutstandingR2T", "0"},
                                      {"InitialR2T", "Maybe"},
                                      {"MaxConnections", "one"},
                                      {"SessionType", "Other"}}),
                                TargetPolicy{}, params);
  ASSERT_FALSE(result.failure);
  ASSERT_EQ(result.response.size(), 8U);
  for (const KeyValue& kv : result.response) EXPECT_EQ(kv.value, "Reject") << kv.key;
  EXPECT_EQ(params.initiator_max_recv_data_segment_length, 8192U);
  EXPECT_EQ(params.max_burst_length, 262144U);
  EXPECT_EQ(params.default_time2wait, 2U);
}

TEST(IscsiNegotiation, DuplicatesTargetKeysAndBadNamesFailTheNegotiation) {
  SessionParams params;
  auto result =
      negotiate(keys({{"MaxConnections", "1"}, {"InitialR2T", "Yes"}, {"MaxConnections", "1"}}),
                TargetPolicy{}, params);
  EXPECT_EQ(result.failure, NegotiationFailure::DuplicateKey);
  EXPECT_EQ(result.failed_key, "MaxConnections");

  result = negotiate(keys({{"TargetPortalGroupTag", "1"}}), TargetPolicy{}, params);
  EXPECT_EQ(result.failure, NegotiationFailure::TargetOnlyKey);

  result = negotiate(keys({{"InitiatorName", ""}}), TargetPolicy{}, params);
  EXPECT_EQ(result.failure, NegotiationFailure::InvalidName);
  const std::string too_long(kMaxNameLength + 1, 'i');
  result = negotiate(std::vector<KeyValue>{{"TargetName", too_long}}, TargetPolicy{}, params);
  EXPECT_EQ(result.failure, NegotiationFailure::InvalidName);
  EXPECT_TRUE(params.target_name.empty());
}

// --- CRC32C ---

TEST(IscsiDigest, Rfc3720AppendixB4Vectors) {
  const Bytes zeros(32, 0x00);
  const Bytes ones(32, 0xff);
  Bytes ascending(32);
  Bytes descending(32);
  for (uint8_t i = 0; i < 32; ++i) {
    ascending[i] = i;
    descending[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(crc32c(zeros), 0x8a9136aaU);
  EXPECT_EQ(crc32c(ones), 0x62a8ab43U);
  EXPECT_EQ(crc32c(ascending), 0x46dd794eU);
  EXPECT_EQ(crc32c(descending), 0x113fdb5cU);
  EXPECT_EQ(crc32c(rfc3720_read_command()), 0xd9963a56U);
  // B.4 writes each digest as the bytes on the wire: least significant first.
  EXPECT_EQ(to_wire_bytes(0x8a9136aa), (std::array<uint8_t, 4>{0xaa, 0x36, 0x91, 0x8a}));
  const std::array<uint8_t, 4> wire{0x56, 0x3a, 0x96, 0xd9};
  EXPECT_EQ(from_wire_bytes(wire), 0xd9963a56U);
}

TEST(IscsiDigest, PiecesGiveTheSameDigestAsTheWhole) {
  const Bytes header = rfc3720_read_command();
  Crc32c crc;
  crc.update(std::span(header).first(10));
  crc.update(std::span(header).subspan(10));
  EXPECT_EQ(crc.value(), 0xd9963a56U);
  EXPECT_EQ(crc32c(Bytes{}), 0U);
}

// --- CHAP ---

ChapChallenge fixed_challenge() {
  ChapChallenge c;
  c.identifier = 1;
  for (uint8_t i = 0; i < 16; ++i) c.challenge.push_back(i);
  return c;
}

const ChapCredentials kInitiator{"iqn.2004-10.com.ubuntu:01:5e2c3f1a9b", "secretsecret"};
const ChapCredentials kTarget{"iqn.2026-11.org.shareblk:vol1", "targetsecret1"};
// MD5(0x01 || "secretsecret" || 00..0f), computed independently (Python's hashlib).
constexpr std::string_view kRightAnswer = "0x226dc576c33f04ff9c3a200ffe35f442";

std::optional<ChapError> verify(std::string_view name, std::string_view response) {
  return chap_verify(
      fixed_challenge(),
      std::vector<KeyValue>{{"CHAP_N", std::string(name)}, {"CHAP_R", std::string(response)}},
      kInitiator);
}

TEST(IscsiChap, BeginPicksMd5AndMakesAFreshChallenge) {
  auto first = chap_begin("7,6,5");
  ASSERT_TRUE(std::holds_alternative<ChapStart>(first));
  const auto& start = std::get<ChapStart>(first);
  EXPECT_EQ(start.challenge.challenge.size(), kChapChallengeLength);
  ASSERT_EQ(start.response.size(), 3U);
  EXPECT_EQ(start.response[0], (KeyValue{"CHAP_A", "5"}));
  EXPECT_EQ(start.response[1].key, "CHAP_I");
  EXPECT_EQ(parse_number(start.response[1].value), start.challenge.identifier);
  EXPECT_EQ(decode_binary(start.response[2].value), start.challenge.challenge);
  auto second = chap_begin("5");
  ASSERT_TRUE(std::holds_alternative<ChapStart>(second));
  EXPECT_NE(std::get<ChapStart>(second).challenge.challenge, start.challenge.challenge);
  EXPECT_EQ(std::get<ChapStart>(chap_begin("5", 64)).challenge.challenge.size(), 64U);
  EXPECT_EQ(std::get<ChapError>(chap_begin("7,6")), ChapError::NoSupportedAlgorithm);
  EXPECT_EQ(std::get<ChapError>(chap_begin("55")), ChapError::NoSupportedAlgorithm);
  EXPECT_EQ(std::get<ChapError>(chap_begin("")), ChapError::NoSupportedAlgorithm);
}

TEST(IscsiChap, TheRightAnswerIsAcceptedInEitherEncoding) {
  EXPECT_FALSE(verify(kInitiator.name, kRightAnswer));
  EXPECT_FALSE(verify(kInitiator.name, "0X226DC576C33F04FF9C3A200FFE35F442"));
  EXPECT_FALSE(verify(kInitiator.name, "0bIm3FdsM/BP+cOiAP/jX0Qg=="));
}

TEST(IscsiChap, WrongSecretIdentifierOrNameIsRefused) {
  // The answer to the same challenge with another secret, or with another identifier.
  const auto with = [](uint8_t id, std::string_view secret) {
    const auto digest = chap_md5(id, secret, fixed_challenge().challenge);
    return encode_hex(std::get<std::array<uint8_t, kMd5Length>>(digest));
  };
  EXPECT_EQ(with(1, "secretsecret"), kRightAnswer);
  EXPECT_EQ(verify(kInitiator.name, with(1, "secretsecreT")), ChapError::WrongResponse);
  EXPECT_EQ(verify(kInitiator.name, with(2, "secretsecret")), ChapError::WrongResponse);
  EXPECT_EQ(verify("iqn.other", kRightAnswer), ChapError::WrongName);
  // A truncated or extended response is wrong, not malformed.
  EXPECT_EQ(verify(kInitiator.name, kRightAnswer.substr(0, kRightAnswer.size() - 2)),
            ChapError::WrongResponse);
  EXPECT_EQ(verify(kInitiator.name, std::string(kRightAnswer) + "00"), ChapError::WrongResponse);
}

TEST(IscsiChap, MalformedMissingAndOverlongValuesAreRefused) {
  EXPECT_EQ(verify(kInitiator.name, "226dc576c33f04ff9c3a200ffe35f442"), ChapError::Malformed);
  EXPECT_EQ(verify(kInitiator.name, "0x226dc576c33f04ff9c3a200ffe35f44g"), ChapError::Malformed);
  EXPECT_EQ(verify(kInitiator.name, "0bIm3FdsM/BP+cOiAP/jX0Qg="), ChapError::Malformed);
  EXPECT_EQ(verify(kInitiator.name, "0bIm3FdsM/BP+cOiAP/jX0Qg=!"), ChapError::Malformed);
  EXPECT_EQ(verify(kInitiator.name, "0x" + std::string(2 * kMaxChapBinaryLength + 2, '0')),
            ChapError::TooLong);
  EXPECT_EQ(verify(std::string(kMaxTextValueLength + 1, 'n'), kRightAnswer), ChapError::TooLong);
  EXPECT_EQ(chap_verify(fixed_challenge(), std::vector<KeyValue>{{"CHAP_N", kInitiator.name}},
                        kInitiator),
            ChapError::MissingKey);
  EXPECT_EQ(chap_verify(fixed_challenge(),
                        std::vector<KeyValue>{{"CHAP_N", kInitiator.name},
                                              {"CHAP_R", std::string(kRightAnswer)},
                                              {"CHAP_R", std::string(kRightAnswer)}},
                        kInitiator),
            ChapError::Malformed);
}

TEST(IscsiChap, MutualChapAnswersTheInitiatorsChallenge) {
  std::vector<KeyValue> keys_in{{"CHAP_N", kInitiator.name},
                                {"CHAP_R", std::string(kRightAnswer)},
                                {"CHAP_I", "7"},
                                {"CHAP_C", "0x" + std::string(32, 'a')}};
  EXPECT_TRUE(chap_wants_mutual(keys_in));
  EXPECT_FALSE(chap_wants_mutual(std::span(keys_in).first(2)));
  ASSERT_FALSE(chap_verify(fixed_challenge(), keys_in, kInitiator));
  auto reply = chap_mutual_response(fixed_challenge(), keys_in, kInitiator, kTarget);
  ASSERT_TRUE(std::holds_alternative<std::vector<KeyValue>>(reply));
  // MD5(0x07 || "targetsecret1" || 16 x 0xaa), computed independently.
  EXPECT_EQ(std::get<std::vector<KeyValue>>(reply),
            (std::vector<KeyValue>{{"CHAP_N", kTarget.name},
                                   {"CHAP_R", "0x94848fffe1e37115e0fcec1516f40d83"}}));

  auto refused = [&](std::vector<KeyValue> k, const ChapCredentials& target) {
    auto r = chap_mutual_response(fixed_challenge(), k, kInitiator, target);
    return std::holds_alternative<ChapError>(r) ? std::get<ChapError>(r)
                                                : ChapError::NoSupportedAlgorithm;
  };
  auto with = [&](std::string_view id, std::string_view challenge) {
    auto k = keys_in;
    k[2].value = id;
    k[3].value = challenge;
    return k;
  };
  EXPECT_EQ(refused(with("256", "0xaa"), kTarget), ChapError::Malformed);
  EXPECT_EQ(refused(with("x", "0xaa"), kTarget), ChapError::Malformed);
  EXPECT_EQ(refused(with("7", "aa"), kTarget), ChapError::Malformed);
  EXPECT_EQ(refused(with("7", encode_hex(fixed_challenge().challenge)), kTarget),
            ChapError::ReflectedChallenge);
  EXPECT_EQ(refused(keys_in, ChapCredentials{"t", kInitiator.secret}), ChapError::SameSecret);
  EXPECT_EQ(refused(std::vector<KeyValue>(keys_in.begin(), keys_in.begin() + 3), kTarget),
            ChapError::MissingKey);
}

}  // namespace
}  // namespace shareblk::iscsi
