// The login state machine (iscsi/login.h) as initiators drive it: whole logins laid out byte for
// byte as open-iscsi and libiscsi send them (CHAP, mutual CHAP, no authentication, discovery),
// then every refusal the header promises, each with its §11.13.5 status, and the SendTargets
// answer. Requests are built as wire bytes and decoded with decode_bhs(), as the target will.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "iscsi/iscsi.h"

namespace shareblk::iscsi {
namespace {

using Bytes = std::vector<uint8_t>;

constexpr std::string_view kInitiator = "iqn.2004-10.com.ubuntu:01:5e2c3f1a9b";
constexpr std::string_view kLibiscsiInitiator =
    "iqn.2007-10.com.github:sahlberg:libiscsi:iscsi-test";
constexpr std::string_view kTarget = "iqn.2026-11.org.shareblk:vol1";
constexpr std::string_view kOtherTarget = "iqn.2026-11.org.shareblk:vol2";
// open-iscsi's ISID: type 00 (OUI format), its OUI 0x023d, then a qualifier (§11.12.5).
constexpr std::array<uint8_t, 6> kIsid{0x00, 0x02, 0x3d, 0x00, 0x00, 0x01};
constexpr uint32_t kFirstStatSn = 0x1000;
constexpr uint16_t kTsih = 0x0102;

// Byte 1 of a Login Request: T (0x80), C (0x40), CSG << 2, NSG (§11.12).
constexpr uint8_t kT = 0x80;
constexpr uint8_t kC = 0x40;
constexpr uint8_t stages(uint8_t csg, uint8_t nsg) {
  return static_cast<uint8_t>((csg << 2) | nsg);
}

struct Request {
  uint8_t flags = 0;
  uint32_t itt = 0;
  uint32_t cmd_sn = 1;
  uint32_t exp_stat_sn = 0;
  uint16_t tsih = 0;
  uint8_t version_max = 0;
  uint8_t version_min = 0;
  uint8_t byte0 = 0x43;  // Login Request (0x03) with the I bit
  std::array<uint8_t, 6> isid = kIsid;
};

void put32(Bytes& b, std::size_t at, uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(v >> (24 - 8 * i));
}

Bytes header(const Request& r, std::size_t data_length) {
  Bytes b(kBhsLength, 0);
  b[0] = r.byte0;
  b[1] = r.flags;
  b[2] = r.version_max;
  b[3] = r.version_min;
  b[5] = static_cast<uint8_t>(data_length >> 16);
  b[6] = static_cast<uint8_t>(data_length >> 8);
  b[7] = static_cast<uint8_t>(data_length);
  std::copy(r.isid.begin(), r.isid.end(), b.begin() + 8);
  b[14] = static_cast<uint8_t>(r.tsih >> 8);
  b[15] = static_cast<uint8_t>(r.tsih);
  put32(b, 16, r.itt);
  put32(b, 24, r.cmd_sn);
  put32(b, 28, r.exp_stat_sn);
  return b;
}

// key=value\0 for each.
std::string text(std::initializer_list<std::string_view> pairs) {
  std::string out;
  for (std::string_view pair : pairs) out.append(pair).append(1, '\0');
  return out;
}

std::vector<KeyValue> pairs_of(const std::string& data) {
  const ParsedText parsed =
      parse_text({reinterpret_cast<const uint8_t*>(data.data()), data.size()});
  const auto* pairs = std::get_if<std::vector<KeyValue>>(&parsed);
  EXPECT_NE(pairs, nullptr) << "the answer is not valid text";
  return pairs != nullptr ? *pairs : std::vector<KeyValue>{};
}

std::string value(const std::vector<KeyValue>& pairs, std::string_view key) {
  for (const KeyValue& pair : pairs) {
    if (pair.key == key) return pair.value;
  }
  return "<absent>";
}

LoginResponse response_fields(const LoginStep& step) {
  const auto* fields = std::get_if<LoginResponse>(&step.response.fields);
  EXPECT_NE(fields, nullptr);
  return fields != nullptr ? *fields : LoginResponse{};
}

uint16_t status_of(const LoginStep& step) {
  const LoginResponse r = response_fields(step);
  return static_cast<uint16_t>((r.status_class << 8) | r.status_detail);
}

// The whole response PDU on the wire: header then data, padded (§11.1).
Bytes wire(const LoginStep& step) {
  const auto h = encode_bhs(step.response);
  Bytes out(kBhsLength + padded_length(static_cast<uint32_t>(step.data.size())), 0);
  std::copy(h.begin(), h.end(), out.begin());
  std::copy(step.data.begin(), step.data.end(), out.begin() + kBhsLength);
  return out;
}

// The CHAP_R an initiator with `secret` answers to `challenge_keys` (CHAP_I, CHAP_C).
std::string chap_answer(const std::vector<KeyValue>& challenge_keys, std::string_view secret) {
  const auto id = parse_number(value(challenge_keys, "CHAP_I"));
  const auto challenge = decode_binary(value(challenge_keys, "CHAP_C"));
  EXPECT_TRUE(id && challenge);
  if (!id || !challenge) return {};
  const auto digest = chap_md5(static_cast<uint8_t>(*id), secret, *challenge);
  return encode_hex(std::get<std::array<uint8_t, kMd5Length>>(digest));
}

struct Policy {
  bool allow = true;
  bool chap = true;
  bool mutual = false;
  std::vector<std::string> targets{std::string(kTarget)};
};

// One connection's login, with an authorizer that allows `kTarget` to the known initiators.
class LoginTest : public ::testing::Test {
 protected:
  void start(Policy policy = {}) {
    policy_ = std::move(policy);
    LoginConfig config;
    config.first_stat_sn = kFirstStatSn;
    config.tsih = kTsih;
    login_ = std::make_unique<Login>(
        config, [this](SessionType type, std::string_view initiator, std::string_view target) {
          ++authorize_calls_;
          last_type_ = type;
          LoginDecision decision;
          const bool known_initiator = initiator == kInitiator || initiator == kLibiscsiInitiator;
          const bool known_target = type == SessionType::Discovery ||
                                    std::find(policy_.targets.begin(), policy_.targets.end(),
                                              target) != policy_.targets.end();
          decision.allowed = policy_.allow && known_initiator && known_target;
          if (policy_.chap) decision.chap = ChapCredentials{"user1", "initiator-secret"};
          if (policy_.mutual) decision.mutual_chap = ChapCredentials{"target1", "target-secret16"};
          decision.handle = handle_;
          return decision;
        });
  }

  LoginStep send(const Request& r, const std::string& data) {
    const Bytes h = header(r, data.size());
    const DecodeResult decoded = decode_bhs(h, DecodeLimits{});
    const auto* bhs = std::get_if<Bhs>(&decoded);
    EXPECT_NE(bhs, nullptr) << "the test's request does not decode";
    if (bhs == nullptr) return {};
    return login_->step(*bhs, {reinterpret_cast<const uint8_t*>(data.data()), data.size()});
  }

  // Checks the response's sequence numbers and tag against the request (§11.13.4, §11.12.8).
  void expect_bookkeeping(const LoginStep& step, const Request& r, uint32_t stat_sn) {
    const LoginResponse f = response_fields(step);
    EXPECT_EQ(step.response.initiator_task_tag, r.itt);
    EXPECT_EQ(f.stat_sn, stat_sn);
    EXPECT_EQ(f.exp_cmd_sn, r.cmd_sn);
    EXPECT_EQ(f.max_cmd_sn, r.cmd_sn + 31);
    EXPECT_EQ(f.isid, r.isid);
    EXPECT_EQ(f.version_max, 0);
    EXPECT_EQ(f.version_active, 0);
  }

  // Runs open-iscsi's first two security requests and returns the challenge's keys.
  std::vector<KeyValue> open_iscsi_to_challenge() {
    const Request first{.flags = kT | stages(0, 1), .itt = 0x10};
    LoginStep step =
        send(first, text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                          "InitiatorAlias=node1", "TargetName=iqn.2026-11.org.shareblk:vol1",
                          "SessionType=Normal", "AuthMethod=CHAP,None"}));
    EXPECT_EQ(step.outcome, LoginOutcome::Continue);
    EXPECT_EQ(wire(step)[1], 0x00) << "T=0, CSG=0: CHAP is not done";
    const auto answers = pairs_of(step.data);
    EXPECT_EQ(value(answers, "AuthMethod"), "CHAP");
    EXPECT_EQ(value(answers, "TargetPortalGroupTag"), "1");
    expect_bookkeeping(step, first, kFirstStatSn);
    // open-iscsi offers SHA3-256, SHA-256, SHA-1 and MD5; NSG bits set while T=0.
    const Request second{.flags = stages(0, 1), .itt = 0x10, .exp_stat_sn = kFirstStatSn + 1};
    step = send(second, text({"CHAP_A=7,6,5"}));
    EXPECT_EQ(step.outcome, LoginOutcome::Continue);
    expect_bookkeeping(step, second, kFirstStatSn + 1);
    auto challenge = pairs_of(step.data);
    EXPECT_EQ(value(challenge, "CHAP_A"), "5");
    EXPECT_EQ(value(challenge, "CHAP_C").size(), 2 + 2 * kChapChallengeLength);
    return challenge;
  }

  Policy policy_;
  std::shared_ptr<void> handle_ = std::make_shared<int>(42);
  std::unique_ptr<Login> login_;
  int authorize_calls_ = 0;
  SessionType last_type_ = SessionType::Normal;
};

TEST_F(LoginTest, OpenIscsiChapThenOperationalThenFullFeature) {
  start();
  const auto challenge = open_iscsi_to_challenge();
  const Request third{.flags = kT | stages(0, 1), .itt = 0x10, .exp_stat_sn = kFirstStatSn + 2};
  const std::string response = "CHAP_R=" + chap_answer(challenge, "initiator-secret");
  LoginStep step = send(third, text({"CHAP_N=user1", response}));
  ASSERT_EQ(step.outcome, LoginOutcome::Continue) << step.why;
  EXPECT_EQ(wire(step)[1], kT | stages(0, 1)) << "T=1, CSG=0, NSG=1";
  EXPECT_TRUE(step.data.empty());
  expect_bookkeeping(step, third, kFirstStatSn + 2);

  const Request fourth{.flags = kT | stages(1, 3), .itt = 0x10, .exp_stat_sn = kFirstStatSn + 3};
  step = send(fourth, text({"HeaderDigest=None", "DataDigest=None", "DefaultTime2Wait=2",
                            "DefaultTime2Retain=0", "IFMarker=No", "OFMarker=No",
                            "ErrorRecoveryLevel=0", "InitialR2T=No", "ImmediateData=Yes",
                            "MaxBurstLength=16776192", "FirstBurstLength=262144",
                            "MaxOutstandingR2T=1", "MaxConnections=1", "DataPDUInOrder=Yes",
                            "DataSequenceInOrder=Yes", "MaxRecvDataSegmentLength=262144"}));
  ASSERT_EQ(step.outcome, LoginOutcome::FullFeature) << step.why;
  const Bytes bytes = wire(step);
  EXPECT_EQ(bytes[0], 0x23) << "Login Response, no I bit";
  EXPECT_EQ(bytes[1], kT | stages(1, 3));
  EXPECT_EQ(bytes[14], kTsih >> 8);
  EXPECT_EQ(bytes[15], kTsih & 0xff);
  EXPECT_EQ(bytes[36], 0);
  EXPECT_EQ(bytes[37], 0);
  expect_bookkeeping(step, fourth, kFirstStatSn + 3);
  const auto answers = pairs_of(step.data);
  EXPECT_EQ(value(answers, "InitialR2T"), "Yes");  // OR: ours is Yes
  EXPECT_EQ(value(answers, "ImmediateData"), "Yes");
  EXPECT_EQ(value(answers, "MaxBurstLength"), "262144");
  EXPECT_EQ(value(answers, "FirstBurstLength"), "65536");
  EXPECT_EQ(value(answers, "IFMarker"), "NotUnderstood");
  EXPECT_EQ(value(answers, "TargetPortalGroupTag"), "<absent>") << "declared once only";

  ASSERT_NE(login_->result(), nullptr);
  const LoginResult& result = *login_->result();
  EXPECT_EQ(result.params.initiator_name, kInitiator);
  EXPECT_EQ(result.params.target_name, kTarget);
  EXPECT_EQ(result.params.session_type, SessionType::Normal);
  EXPECT_EQ(result.params.initiator_max_recv_data_segment_length, 262144U);
  EXPECT_EQ(result.params.auth_method, AuthMethod::Chap);
  EXPECT_TRUE(result.authenticated);
  EXPECT_EQ(result.tsih, kTsih);
  EXPECT_EQ(result.isid, kIsid);
  EXPECT_EQ(result.exp_cmd_sn, 1U);
  EXPECT_EQ(result.next_stat_sn, kFirstStatSn + 4);
  EXPECT_EQ(result.handle, handle_);
  EXPECT_EQ(authorize_calls_, 1);
  EXPECT_TRUE(login_->finished());
  // Nothing more is answered once the login has ended.
  EXPECT_FALSE(send(fourth, "").send);
}

// libiscsi (lib/login.c): AuthMethod=CHAP,None with T=1; CHAP_A=5 with T=0; CHAP_N, CHAP_R and,
// with a target user, CHAP_I and CHAP_C, with T=1; then every operational key in one request
// that names the initiator, target and session type again.
TEST_F(LoginTest, LibiscsiMutualChap) {
  start({.mutual = true});
  const Request first{.flags = kT | stages(0, 1), .itt = 0x5eed, .cmd_sn = 0x7a3c9e11};
  LoginStep step =
      send(first, text({"InitiatorName=iqn.2007-10.com.github:sahlberg:libiscsi:iscsi-test",
                        "TargetName=iqn.2026-11.org.shareblk:vol1", "SessionType=Normal",
                        "AuthMethod=CHAP,None"}));
  ASSERT_EQ(step.outcome, LoginOutcome::Continue) << step.why;
  EXPECT_EQ(value(pairs_of(step.data), "AuthMethod"), "CHAP");
  const Request second{.flags = stages(0, 1), .itt = 0x5eed, .cmd_sn = 0x7a3c9e11};
  step = send(second, text({"CHAP_A=5"}));
  ASSERT_EQ(step.outcome, LoginOutcome::Continue) << step.why;
  const auto challenge = pairs_of(step.data);

  std::array<uint8_t, 32> ours{};
  for (std::size_t i = 0; i < ours.size(); ++i) ours[i] = static_cast<uint8_t>(i * 7 + 3);
  const std::string response = "CHAP_R=" + chap_answer(challenge, "initiator-secret");
  const std::string our_challenge = "CHAP_C=" + encode_hex(ours);
  const Request third{.flags = kT | stages(0, 1), .itt = 0x5eed, .cmd_sn = 0x7a3c9e11};
  step = send(third, text({"CHAP_N=user1", response, "CHAP_I=1", our_challenge}));
  ASSERT_EQ(step.outcome, LoginOutcome::Continue) << step.why;
  EXPECT_EQ(wire(step)[1], kT | stages(0, 1));
  const auto mutual = pairs_of(step.data);
  EXPECT_EQ(value(mutual, "CHAP_N"), "target1");
  const auto expected = chap_md5(1, "target-secret16", ours);
  EXPECT_EQ(value(mutual, "CHAP_R"),
            encode_hex(std::get<std::array<uint8_t, kMd5Length>>(expected)));

  const Request fourth{.flags = kT | stages(1, 3), .itt = 0x5eed, .cmd_sn = 0x7a3c9e11};
  step = send(fourth, text({"InitiatorName=iqn.2007-10.com.github:sahlberg:libiscsi:iscsi-test",
                            "TargetName=iqn.2026-11.org.shareblk:vol1", "SessionType=Normal",
                            "HeaderDigest=None,CRC32C", "DataDigest=None", "InitialR2T=No",
                            "ImmediateData=Yes", "MaxBurstLength=262144", "FirstBurstLength=262144",
                            "DefaultTime2Wait=2", "DefaultTime2Retain=0", "MaxOutstandingR2T=1",
                            "ErrorRecoveryLevel=0", "IFMarker=No", "OFMarker=No",
                            "MaxConnections=1", "MaxRecvDataSegmentLength=262144",
                            "DataPDUInOrder=Yes", "DataSequenceInOrder=Yes"}));
  ASSERT_EQ(step.outcome, LoginOutcome::FullFeature) << step.why;
  const auto answers = pairs_of(step.data);
  EXPECT_EQ(value(answers, "HeaderDigest"), "None");
  EXPECT_EQ(value(answers, "FirstBurstLength"), "65536");
  EXPECT_EQ(value(answers, "TargetPortalGroupTag"), "<absent>");
  expect_bookkeeping(step, fourth, kFirstStatSn + 3);
  ASSERT_NE(login_->result(), nullptr);
  EXPECT_EQ(login_->result()->exp_cmd_sn, 0x7a3c9e11U);
  EXPECT_EQ(login_->result()->params.initiator_name, kLibiscsiInitiator);
}

// libiscsi without a user starts in LoginOperationalNegotiation (CSG=1, NSG=3, T=1): one request,
// one answer, Full Feature Phase, when the authorization needs no CHAP.
TEST_F(LoginTest, LibiscsiWithoutAuthGoesStraightToOperational) {
  start({.chap = false});
  const Request only{.flags = kT | stages(1, 3), .itt = 1, .cmd_sn = 5};
  const LoginStep step =
      send(only, text({"InitiatorName=iqn.2007-10.com.github:sahlberg:libiscsi:iscsi-test",
                       "TargetName=iqn.2026-11.org.shareblk:vol1", "SessionType=Normal",
                       "HeaderDigest=CRC32C,None", "DataDigest=CRC32C,None", "InitialR2T=No",
                       "ImmediateData=Yes", "MaxBurstLength=262144", "FirstBurstLength=262144",
                       "MaxRecvDataSegmentLength=65536"}));
  ASSERT_EQ(step.outcome, LoginOutcome::FullFeature) << step.why;
  EXPECT_EQ(wire(step)[1], kT | stages(1, 3));
  EXPECT_EQ(response_fields(step).tsih, kTsih);
  expect_bookkeeping(step, only, kFirstStatSn);
  const auto answers = pairs_of(step.data);
  EXPECT_EQ(value(answers, "HeaderDigest"), "CRC32C");
  EXPECT_EQ(value(answers, "TargetPortalGroupTag"), "1");
  ASSERT_NE(login_->result(), nullptr);
  EXPECT_EQ(login_->result()->params.header_digest, Digest::Crc32c);
  EXPECT_FALSE(login_->result()->authenticated);
}

// The same, but CHAP is required: skipping security is an authentication failure (§6.3.1).
TEST_F(LoginTest, SkippingSecurityWhenChapIsRequiredFails) {
  start();
  const LoginStep step =
      send({.flags = kT | stages(1, 3)}, text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                                               "TargetName=iqn.2026-11.org.shareblk:vol1"}));
  EXPECT_EQ(step.outcome, LoginOutcome::Close);
  EXPECT_EQ(status_of(step), 0x0201);
  EXPECT_EQ(wire(step)[1], 0) << "T, CSG and NSG are reserved in a reject";
  EXPECT_TRUE(step.data.empty());
}

// An initiator that only asks to leave security, with CHAP required and no AuthMethod offered.
TEST_F(LoginTest, LeavingSecurityWithoutAuthenticatingFails) {
  start();
  const LoginStep step =
      send({.flags = kT | stages(0, 1)}, text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                                               "TargetName=iqn.2026-11.org.shareblk:vol1"}));
  EXPECT_EQ(status_of(step), 0x0201);
}

// AuthMethod=None only, where CHAP is required: nothing we accept (§6.3.2).
TEST_F(LoginTest, AuthMethodNoneWhereChapIsRequiredFails) {
  start();
  const LoginStep step =
      send({.flags = kT | stages(0, 1)},
           text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                 "TargetName=iqn.2026-11.org.shareblk:vol1", "AuthMethod=None"}));
  EXPECT_EQ(status_of(step), 0x0201);
}

// Wrong secret and wrong user name: one status, byte-identical rejects.
TEST_F(LoginTest, WrongChapSecretAndWrongUserGiveTheSameReject) {
  std::vector<Bytes> rejects;
  for (const auto& [user, secret] :
       {std::pair{"user1", "wrong-secret"}, std::pair{"someone", "initiator-secret"}}) {
    start();
    const auto challenge = open_iscsi_to_challenge();
    const std::string name = std::string("CHAP_N=") + user;
    const std::string response = "CHAP_R=" + chap_answer(challenge, secret);
    const LoginStep step = send({.flags = kT | stages(0, 1), .itt = 0x10}, text({name, response}));
    EXPECT_EQ(step.outcome, LoginOutcome::Close);
    EXPECT_EQ(status_of(step), 0x0201);
    EXPECT_EQ(login_->result(), nullptr);
    rejects.push_back(wire(step));
  }
  EXPECT_EQ(rejects[0], rejects[1]);
}

// Malformed and over-long CHAP answers are authentication failures too (§12.1.3).
TEST_F(LoginTest, MalformedChapAnswersAreAuthenticationFailures) {
  // 1101 bytes in base64: within what the text parser takes, past CHAP's 1024.
  for (const std::string& bad :
       {std::string("CHAP_R=0xzz"), std::string("CHAP_R=0b") + std::string(1468, 'A'),
        std::string("CHAP_R=0x00"), std::string("CHAP_X=1")}) {
    start();
    (void)open_iscsi_to_challenge();
    const LoginStep step =
        send({.flags = kT | stages(0, 1), .itt = 0x10}, text({"CHAP_N=user1", bad}));
    EXPECT_EQ(status_of(step), 0x0201) << bad;
  }
  // A value longer than any text we parse is malformed text (§6.1), before CHAP sees it.
  start();
  (void)open_iscsi_to_challenge();
  EXPECT_EQ(status_of(send({.flags = kT | stages(0, 1), .itt = 0x10},
                           text({"CHAP_N=user1", "CHAP_R=0x" + std::string(4000, 'a')}))),
            0x0200);
  // CHAP_A at the response's step is out of order: a protocol error (0x0200).
  start();
  (void)open_iscsi_to_challenge();
  EXPECT_EQ(status_of(send({.flags = stages(0, 1)}, text({"CHAP_A=5"}))), 0x0200);
  // No MD5 among the algorithms (§12.1.3: initiators must offer it).
  start();
  (void)send({.flags = stages(0, 1)},
             text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                   "TargetName=iqn.2026-11.org.shareblk:vol1", "AuthMethod=CHAP"}));
  EXPECT_EQ(status_of(send({.flags = stages(0, 1)}, text({"CHAP_A=7,6"}))), 0x0201);
}

// Some initiators send CHAP_A with AuthMethod in their first request: it is the next step of an
// AuthMethod agreed in the same text, so the challenge comes at once (§12.1.3).
TEST_F(LoginTest, ChapAlgorithmWithAuthMethodInOneRequest) {
  start();
  LoginStep step = send({.flags = kT | stages(0, 1)},
                        text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                              "TargetName=iqn.2026-11.org.shareblk:vol1", "SessionType=Normal",
                              "AuthMethod=CHAP,None", "CHAP_A=5"}));
  ASSERT_EQ(step.outcome, LoginOutcome::Continue) << step.why;
  EXPECT_EQ(wire(step)[1], 0x00);
  const auto challenge = pairs_of(step.data);
  EXPECT_EQ(value(challenge, "AuthMethod"), "CHAP");
  const std::string response = "CHAP_R=" + chap_answer(challenge, "initiator-secret");
  step = send({.flags = kT | stages(0, 3)}, text({"CHAP_N=user1", response}));
  EXPECT_EQ(step.outcome, LoginOutcome::FullFeature) << step.why;
}

// Mutual CHAP asked of a target that has no credentials for it.
TEST_F(LoginTest, MutualChapWithoutTargetCredentialsFails) {
  start();
  const auto challenge = open_iscsi_to_challenge();
  const std::string response = "CHAP_R=" + chap_answer(challenge, "initiator-secret");
  const LoginStep step = send(
      {.flags = kT | stages(0, 1), .itt = 0x10},
      text({"CHAP_N=user1", response, "CHAP_I=9", "CHAP_C=0x00112233445566778899aabbccddeeff"}));
  EXPECT_EQ(status_of(step), 0x0201);
}

// docs/iscsi.md: an unknown target and an initiator that may not use a target get the same
// bytes back, "target not found".
TEST_F(LoginTest, UnauthorizedInitiatorAndUnknownTargetAreIndistinguishable) {
  start();
  const LoginStep unknown_target =
      send({.flags = kT | stages(0, 1), .itt = 7},
           text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                 "TargetName=iqn.2026-11.org.shareblk:vol2", "AuthMethod=CHAP"}));
  start();
  const LoginStep stranger =
      send({.flags = kT | stages(0, 1), .itt = 7},
           text({"InitiatorName=iqn.1991-05.com.microsoft:evil",
                 "TargetName=iqn.2026-11.org.shareblk:vol1", "AuthMethod=CHAP"}));
  EXPECT_EQ(status_of(unknown_target), 0x0203);
  EXPECT_EQ(unknown_target.outcome, LoginOutcome::Close);
  EXPECT_EQ(wire(unknown_target), wire(stranger));
  EXPECT_EQ(unknown_target.why, stranger.why);
}

TEST_F(LoginTest, MissingNamesAreMissingParameters) {
  start();
  EXPECT_EQ(status_of(send({.flags = kT | stages(0, 1)},
                           text({"TargetName=iqn.2026-11.org.shareblk:vol1", "AuthMethod=CHAP"}))),
            0x0207);
  start();
  EXPECT_EQ(status_of(send({.flags = kT | stages(0, 1)},
                           text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                                 "SessionType=Normal", "AuthMethod=CHAP"}))),
            0x0207);
  EXPECT_EQ(authorize_calls_, 0);
  start();
  EXPECT_EQ(status_of(send({.flags = kT | stages(0, 1)},
                           text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                                 "SessionType=Weird", "AuthMethod=CHAP"}))),
            0x0209);
}

// §11.12.3: the CSG of each request is the stage the login is in.
TEST_F(LoginTest, CsgMismatchIsAnInitiatorError) {
  start();
  LoginStep step = send({.flags = kT | stages(0, 1)},
                        text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                              "TargetName=iqn.2026-11.org.shareblk:vol1", "AuthMethod=CHAP"}));
  ASSERT_EQ(step.outcome, LoginOutcome::Continue);
  // The target answered T=0: still security. An operational request now is out of stage.
  step = send({.flags = kT | stages(1, 3)}, text({"HeaderDigest=None"}));
  EXPECT_EQ(step.outcome, LoginOutcome::Close);
  EXPECT_EQ(status_of(step), 0x0200);
  EXPECT_EQ(step.response.initiator_task_tag, 0U);
  EXPECT_EQ(response_fields(step).stat_sn, kFirstStatSn + 1);
}

// §6.3: a key in a stage that does not allow it, and a key declared twice in one login.
TEST_F(LoginTest, KeysOutOfStageOrDeclaredAgainAreInitiatorErrors) {
  start({.chap = false});
  EXPECT_EQ(
      status_of(send({.flags = kT | stages(0, 1)},
                     text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                           "TargetName=iqn.2026-11.org.shareblk:vol1", "HeaderDigest=None"}))),
      0x0200);
  const auto security_then = [this](const std::string& operational) {
    start({.chap = false});
    const LoginStep step =
        send({.flags = kT | stages(0, 1)},
             text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                   "TargetName=iqn.2026-11.org.shareblk:vol1", "AuthMethod=None"}));
    EXPECT_EQ(step.outcome, LoginOutcome::Continue) << step.why;
    EXPECT_EQ(wire(step)[1], kT | stages(0, 1));
    return status_of(send({.flags = kT | stages(1, 3)}, operational));
  };
  EXPECT_EQ(security_then(text({"AuthMethod=None"})), 0x0200);
  EXPECT_EQ(security_then(text({"TargetName=iqn.2026-11.org.shareblk:vol2"})), 0x0200);
  EXPECT_EQ(security_then(text({"TargetName=iqn.2026-11.org.shareblk:vol1"})), 0x0000);
  EXPECT_EQ(security_then(text({"HeaderDigest=None", "HeaderDigest=CRC32C"})), 0x0200);
  EXPECT_EQ(security_then(text({"TargetAlias=me"})), 0x0200);
  // §6.3's table: Operational to Operational is no transition.
  start({.chap = false});
  EXPECT_EQ(status_of(send({.flags = kT | stages(1, 1)},
                           text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                                 "TargetName=iqn.2026-11.org.shareblk:vol1"}))),
            0x0200);
}

// §6.3's table allows Security straight to Full Feature (every operational key at its default).
TEST_F(LoginTest, SecurityStraightToFullFeature) {
  start({.chap = false});
  const LoginStep step =
      send({.flags = kT | stages(0, 3), .itt = 3},
           text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                 "TargetName=iqn.2026-11.org.shareblk:vol1", "AuthMethod=None"}));
  ASSERT_EQ(step.outcome, LoginOutcome::FullFeature) << step.why;
  EXPECT_EQ(wire(step)[1], kT | stages(0, 3));
  EXPECT_EQ(response_fields(step).tsih, kTsih);
  ASSERT_NE(login_->result(), nullptr);
  EXPECT_EQ(login_->result()->params.max_burst_length, 262144U);  // §13.13's default
}

// An answer longer than the 8192 bytes an initiator takes during login (§6.3): a thousand
// unknown keys, each answered NotUnderstood.
TEST_F(LoginTest, AnswerPastTheLoginSegmentLengthIsRefused) {
  start({.chap = false});
  std::string data = text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                           "TargetName=iqn.2026-11.org.shareblk:vol1"});
  for (int i = 0; i < 1000; ++i) data += "K" + std::to_string(1000 + i) + "=1" + '\0';
  ASSERT_LE(data.size(), 8192U);
  const LoginStep step = send({.flags = stages(0, 1)}, data);
  EXPECT_EQ(status_of(step), 0x0200);
  EXPECT_TRUE(step.data.empty());
}

// A login that never ends: 16 requests at most (LoginConfig::max_pdus), then a reject.
TEST_F(LoginTest, TooManyRequestsEndTheLogin) {
  start();
  LoginStep step =
      send({.flags = stages(0, 1)}, text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                                          "TargetName=iqn.2026-11.org.shareblk:vol1"}));
  int answered = 1;
  while (step.outcome == LoginOutcome::Continue) {
    step = send({.flags = stages(0, 1)}, "");
    if (step.outcome == LoginOutcome::Continue) ++answered;
    ASSERT_LE(answered, 16);
  }
  EXPECT_EQ(answered, 16);
  EXPECT_EQ(status_of(step), 0x0200);
  EXPECT_EQ(step.why, "too many Login Requests");
}

TEST_F(LoginTest, TooMuchTextEndsTheLogin) {
  start();
  const std::string part(8000, 'a');
  LoginStep step = send({.flags = kC | stages(0, 0)}, "InitiatorName=" + part);
  int answered = 0;
  while (step.outcome == LoginOutcome::Continue) {
    ++answered;
    EXPECT_TRUE(step.data.empty());
    EXPECT_EQ(wire(step)[1], 0) << "an empty T=0 answer to each C=1 part";
    step = send({.flags = kC | stages(0, 0)}, part);
  }
  EXPECT_EQ(answered, 4);  // 32768 bytes of text, then the bound
  EXPECT_EQ(status_of(step), 0x0200);
}

// §11.12.2: a text split over requests with the C bit is negotiated once whole.
TEST_F(LoginTest, ContinuedTextIsJoined) {
  start({.chap = false});
  const std::string whole = text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                                  "TargetName=iqn.2026-11.org.shareblk:vol1", "AuthMethod=None"});
  const std::size_t cut = 20;  // inside the first key's value
  LoginStep step = send({.flags = kC | stages(0, 0)}, whole.substr(0, cut));
  ASSERT_EQ(step.outcome, LoginOutcome::Continue);
  EXPECT_EQ(authorize_calls_, 0);
  step = send({.flags = kT | stages(0, 1)}, whole.substr(cut));
  ASSERT_EQ(step.outcome, LoginOutcome::Continue) << step.why;
  EXPECT_EQ(authorize_calls_, 1);
  EXPECT_EQ(value(pairs_of(step.data), "AuthMethod"), "None");
  EXPECT_EQ(response_fields(step).stat_sn, kFirstStatSn + 1);
}

// §6.3.1: we make only new sessions; a TSIH names an existing one.
TEST_F(LoginTest, NonZeroTsihIsSessionDoesNotExist) {
  start();
  const LoginStep step = send({.flags = kT | stages(0, 1), .tsih = 7},
                              text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                                    "TargetName=iqn.2026-11.org.shareblk:vol1"}));
  EXPECT_EQ(status_of(step), 0x020a);
  EXPECT_EQ(response_fields(step).tsih, 7) << "the initiator's TSIH, echoed (§11.13.3)";
  EXPECT_EQ(authorize_calls_, 0);
}

// §11.12.4: version 0 only.
TEST_F(LoginTest, UnsupportedVersion) {
  start();
  const LoginStep step = send({.flags = kT | stages(0, 1), .version_max = 2, .version_min = 1},
                              text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b"}));
  EXPECT_EQ(status_of(step), 0x0205);
  EXPECT_EQ(response_fields(step).version_active, 0);
  // A version that changes during the login.
  start({.chap = false});
  ASSERT_EQ(send({.flags = stages(0, 1), .version_max = 1},
                 text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                       "TargetName=iqn.2026-11.org.shareblk:vol1"}))
                .outcome,
            LoginOutcome::Continue);
  EXPECT_EQ(status_of(send({.flags = stages(0, 1)}, "")), 0x0200);
}

// §11.12: a PDU other than a Login Request closes the connection: unanswered before the login,
// with "invalid during login" after it started.
TEST_F(LoginTest, OtherPdusDuringLogin) {
  start();
  EXPECT_FALSE(send({.flags = 0x80, .byte0 = 0x00}, "").send) << "a NOP-Out first";
  EXPECT_TRUE(login_->finished());
  start();
  ASSERT_EQ(
      send({.flags = stages(0, 1)}, text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                                          "TargetName=iqn.2026-11.org.shareblk:vol1"}))
          .outcome,
      LoginOutcome::Continue);
  const LoginStep step = send({.flags = 0x80, .byte0 = 0x00}, "");
  EXPECT_TRUE(step.send);
  EXPECT_EQ(step.outcome, LoginOutcome::Close);
  EXPECT_EQ(status_of(step), 0x020b);
}

// open-iscsi's discovery (iscsiadm -m discovery -t st): no authentication, SessionType=Discovery,
// then SendTargets=All over the Text Request.
TEST_F(LoginTest, DiscoverySessionAndSendTargets) {
  start({.chap = false});
  LoginStep step = send({.flags = kT | stages(0, 1)},
                        text({"InitiatorName=iqn.2004-10.com.ubuntu:01:5e2c3f1a9b",
                              "InitiatorAlias=node1", "SessionType=Discovery", "AuthMethod=None"}));
  ASSERT_EQ(step.outcome, LoginOutcome::Continue) << step.why;
  EXPECT_EQ(last_type_, SessionType::Discovery);
  EXPECT_EQ(value(pairs_of(step.data), "TargetPortalGroupTag"), "<absent>") << "no TargetName";
  step = send({.flags = kT | stages(1, 3)},
              text({"HeaderDigest=None", "DataDigest=None", "DefaultTime2Wait=2",
                    "DefaultTime2Retain=0", "IFMarker=No", "OFMarker=No", "ErrorRecoveryLevel=0",
                    "MaxRecvDataSegmentLength=32768", "InitialR2T=No"}));
  ASSERT_EQ(step.outcome, LoginOutcome::FullFeature) << step.why;
  EXPECT_EQ(value(pairs_of(step.data), "InitialR2T"), "Irrelevant");
  ASSERT_NE(login_->result(), nullptr);
  EXPECT_EQ(login_->result()->params.session_type, SessionType::Discovery);

  const std::vector<TargetPortals> targets{
      {std::string(kTarget), {"192.0.2.10:3260,1", "[2001:db8::10]:3260,1"}},
      {std::string(kOtherTarget), {"192.0.2.10:3260,1"}}};
  const std::string request = text({"SendTargets=All"});
  const auto all = send_targets({reinterpret_cast<const uint8_t*>(request.data()), request.size()},
                                SessionType::Discovery, targets);
  ASSERT_TRUE(std::holds_alternative<std::string>(all));
  EXPECT_EQ(std::get<std::string>(all),
            text({"TargetName=iqn.2026-11.org.shareblk:vol1", "TargetAddress=192.0.2.10:3260,1",
                  "TargetAddress=[2001:db8::10]:3260,1", "TargetName=iqn.2026-11.org.shareblk:vol2",
                  "TargetAddress=192.0.2.10:3260,1"}));
  const auto run = [&](const std::string& req, SessionType type) {
    return send_targets({reinterpret_cast<const uint8_t*>(req.data()), req.size()}, type, targets);
  };
  EXPECT_EQ(std::get<std::string>(
                run(text({"SendTargets=iqn.2026-11.org.shareblk:vol2"}), SessionType::Discovery)),
            text({"TargetName=iqn.2026-11.org.shareblk:vol2", "TargetAddress=192.0.2.10:3260,1"}));
  EXPECT_EQ(std::get<std::string>(
                run(text({"SendTargets=iqn.2026-11.org.shareblk:vol9"}), SessionType::Discovery)),
            "");
  EXPECT_EQ(std::get<std::string>(run(text({"SendTargets="}), SessionType::Discovery)), "");
  EXPECT_EQ(std::get<SendTargetsError>(run(text({"SendTargets=All"}), SessionType::Normal)),
            SendTargetsError::AllNotAllowed);
  EXPECT_EQ(std::get<SendTargetsError>(run(text({"Other=1"}), SessionType::Discovery)),
            SendTargetsError::NoSendTargets);
  EXPECT_EQ(std::get<SendTargetsError>(run("SendTargets=All", SessionType::Discovery)),
            SendTargetsError::BadText);
}

TEST(LoginStatusTest, NegotiationFailuresAreInitiatorErrors) {
  for (NegotiationFailure failure :
       {NegotiationFailure::DuplicateKey, NegotiationFailure::TargetOnlyKey,
        NegotiationFailure::InvalidName}) {
    EXPECT_EQ(login_status_for(failure), LoginStatus::InitiatorError);
  }
}

TEST(LoginStageTest, KeysBelongToTheirStages) {
  EXPECT_EQ(login_stage_of("AuthMethod"), KeyStage::Security);
  EXPECT_EQ(login_stage_of("HeaderDigest"), KeyStage::Operational);
  EXPECT_EQ(login_stage_of("MaxRecvDataSegmentLength"), KeyStage::Operational);
  EXPECT_EQ(login_stage_of("InitiatorName"), KeyStage::Any);
  EXPECT_EQ(login_stage_of("SessionType"), KeyStage::Any);
  EXPECT_EQ(login_stage_of("X-com.example.Key"), KeyStage::Any);
}

}  // namespace
}  // namespace shareblk::iscsi
