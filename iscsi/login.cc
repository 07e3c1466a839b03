// The login state machine. Each request goes through the same checks in the same order: the PDU
// bound, the header (version, TSIH, ISID/CID, CSG), the text bound and C-bit continuation, the
// text's keys (once each, in their stage), authorization on the first complete text, the
// negotiation (text.h) and CHAP (chap.h) of its stage, and last the stage transition. The first
// check that fails ends the login with a reject; nothing after it runs.
#include "iscsi/login.h"

#include <algorithm>
#include <set>
#include <utility>

namespace shareblk::iscsi {
namespace {

// §6.3 (and §13.12): during login each side receives at most the default
// MaxRecvDataSegmentLength, 8192 bytes, in one PDU.
constexpr std::size_t kLoginSegmentLength = 8192;

// The keys of the CHAP exchange (§12.1.3): chap.h checks them, negotiate() never sees them.
bool is_chap_key(std::string_view key) {
  return key == "CHAP_A" || key == "CHAP_I" || key == "CHAP_C" || key == "CHAP_N" ||
         key == "CHAP_R";
}

// §6.3 forbids declaring a key twice in one login. libiscsi sends its names again with its
// operational keys (lib/login.c: "only send InitiatorName during opneg or the first leg of
// secneg"), so these may come again, unchanged; a changed one would name another initiator or
// target than the one authorized, and is refused like any redeclaration.
bool may_repeat_unchanged(std::string_view key) {
  return key == "InitiatorName" || key == "InitiatorAlias" || key == "TargetName" ||
         key == "SessionType";
}

const std::string* value_of(std::span<const KeyValue> pairs, std::string_view key) {
  for (const KeyValue& pair : pairs) {
    if (pair.key == key) return &pair.value;
  }
  return nullptr;
}

LoginStatus status_for(ChapError error) {
  // Our own failures are the target's error (§11.13.5, 0x0300); everything the initiator sent is
  // an authentication failure (§12.1.3), whichever check it failed.
  if (error == ChapError::RandomFailed || error == ChapError::HashFailed) {
    return LoginStatus::TargetError;
  }
  return LoginStatus::AuthenticationFailure;
}

uint32_t max_cmd_sn(uint32_t exp_cmd_sn, uint32_t window) {
  return exp_cmd_sn + std::max<uint32_t>(window, 1) - 1;  // wraps: RFC 1982 serial numbers
}

}  // namespace

LoginStatus login_status_for(NegotiationFailure failure) {
  switch (failure) {
    case NegotiationFailure::DuplicateKey:   // §6.1, §6.3
    case NegotiationFailure::TargetOnlyKey:  // §13.6, §13.9: only a target declares them
    case NegotiationFailure::InvalidName:    // §4.2.7.1: 1 to 223 bytes
      return LoginStatus::InitiatorError;
  }
  return LoginStatus::InitiatorError;
}

Login::Login(LoginConfig config, LoginAuthorize authorize)
    : config_(std::move(config)),
      authorize_(std::move(authorize)),
      next_stat_sn_(config_.first_stat_sn),
      text_(config_.max_text_bytes) {}

LoginStep Login::step(const Bhs& request, std::span<const uint8_t> data) {
  if (finished_) {
    LoginStep ended;
    ended.send = false;
    ended.status = LoginStatus::InvalidDuringLogin;
    ended.why = "the login has already ended";
    return ended;
  }
  const auto* fields = std::get_if<LoginRequest>(&request.fields);
  if (fields == nullptr) {
    if (!started_) {
      // §11.12: any other PDU before the login starts closes the connection, unanswered.
      finished_ = true;
      LoginStep closed;
      closed.send = false;
      closed.status = LoginStatus::InvalidDuringLogin;
      closed.why = "the first PDU is not a Login Request";
      return closed;
    }
    // §11.12: once it has started, a Login reject "invalid during login", then close.
    return reject(request, LoginStatus::InvalidDuringLogin, "a PDU other than a Login Request");
  }
  if (!started_) {
    started_ = true;
    first_ = *fields;
    if (fields->current_stage != LoginStage::FullFeature) stage_ = fields->current_stage;
  }
  cmd_sn_ = fields->cmd_sn;
  if (++pdus_ > config_.max_pdus) {
    return reject(request, LoginStatus::InitiatorError, "too many Login Requests");
  }
  if (auto refused = check_header(request, *fields)) return std::move(*refused);
  text_bytes_ += data.size();
  if (text_bytes_ > config_.max_text_bytes || !text_.append(data)) {
    return reject(request, LoginStatus::InitiatorError, "login text past its bound");
  }
  if (fields->more_follows) {
    // §11.12.2: the text continues in the next request; each part gets an empty answer (T=0).
    return respond(request, *fields, false, stage_, {});
  }
  const ParsedText parsed = parse_text(text_.text());
  text_.clear();
  const auto* pairs = std::get_if<std::vector<KeyValue>>(&parsed);
  if (pairs == nullptr) {
    return reject(request, LoginStatus::InitiatorError, "login text is not key=value text");
  }
  return process(request, *fields, *pairs);
}

std::optional<LoginStep> Login::check_header(const Bhs& request, const LoginRequest& fields) {
  // §11.12.4: 0 is the only version; Version-min above it is one we cannot speak.
  if (fields.version_min > 0) {
    return reject(request, LoginStatus::UnsupportedVersion, "Version-min above 0");
  }
  // §11.12.4: every request of a login carries the same versions.
  if (fields.version_max != first_.version_max || fields.version_min != first_.version_min) {
    return reject(request, LoginStatus::InitiatorError, "version changed during the login");
  }
  // §6.3.1's table: a non-zero TSIH names an existing session; we make only new ones.
  if (fields.tsih != 0) {
    return reject(request, LoginStatus::SessionDoesNotExist, "non-zero TSIH");
  }
  if (fields.isid != first_.isid || fields.cid != first_.cid) {
    return reject(request, LoginStatus::InitiatorError, "ISID or CID changed during the login");
  }
  // §11.12.3: CSG is the stage both sides are in; 3 is never one a request is in.
  if (fields.current_stage != stage_ || fields.current_stage == LoginStage::FullFeature) {
    return reject(request, LoginStatus::InitiatorError, "CSG is not the current stage");
  }
  return std::nullopt;
}

std::optional<LoginStep> Login::authorize_first(const Bhs& request,
                                                std::span<const KeyValue> pairs) {
  // §13.21: SessionType defaults to Normal.
  SessionType type = SessionType::Normal;
  if (const std::string* session = value_of(pairs, "SessionType")) {
    if (*session == "Discovery") {
      type = SessionType::Discovery;
    } else if (*session != "Normal") {
      return reject(request, LoginStatus::SessionTypeNotSupported, "unknown SessionType");
    }
  }
  if (type == SessionType::Discovery && !config_.allow_discovery) {
    return reject(request, LoginStatus::SessionTypeNotSupported, "discovery sessions are off");
  }
  // §6.3: the first request names the initiator and, unless the session is Discovery, the target.
  const std::string* initiator = value_of(pairs, "InitiatorName");
  const std::string* target = value_of(pairs, "TargetName");
  if (initiator == nullptr || initiator->empty()) {
    return reject(request, LoginStatus::MissingParameter, "no InitiatorName");
  }
  if (type == SessionType::Normal && (target == nullptr || target->empty())) {
    return reject(request, LoginStatus::MissingParameter, "no TargetName");
  }
  if (initiator->size() > kMaxNameLength ||
      (target != nullptr && target->size() > kMaxNameLength)) {
    return reject(request, login_status_for(NegotiationFailure::InvalidName), "name too long");
  }
  decision_ =
      authorize_ ? authorize_(type, *initiator, target != nullptr ? *target : "") : LoginDecision{};
  if (!decision_.allowed) {
    // docs/iscsi.md: the same answer for an unknown target and an initiator that may not use it.
    return reject(request, LoginStatus::NotFound, "not authorized");
  }
  authorized_ = true;
  authenticated_ = !decision_.chap.has_value();
  config_.policy.auth_method = decision_.chap ? AuthMethod::Chap : AuthMethod::None;
  // §6.3.1: a target that requires security answers a login that skips it with "authentication
  // failure".
  if (!authenticated_ && stage_ != LoginStage::Security) {
    return reject(request, LoginStatus::AuthenticationFailure, "security stage skipped");
  }
  return std::nullopt;
}

LoginStep Login::process(const Bhs& request, const LoginRequest& fields,
                         std::span<const KeyValue> pairs) {
  std::vector<KeyValue> offered;  // what negotiate() answers
  std::vector<KeyValue> chap;     // what the CHAP exchange reads
  std::set<std::string_view> in_this_text;
  for (const KeyValue& pair : pairs) {
    // §6.1: a key at most once in a text.
    if (!in_this_text.insert(pair.key).second) {
      return reject(request, login_status_for(NegotiationFailure::DuplicateKey), "key sent twice");
    }
    const bool security_key =
        is_chap_key(pair.key) || login_stage_of(pair.key) == KeyStage::Security;
    const bool operational_key = login_stage_of(pair.key) == KeyStage::Operational;
    // §6.3: a key sent in a stage that does not allow it is a protocol error.
    if ((security_key && stage_ != LoginStage::Security) ||
        (operational_key && stage_ != LoginStage::Operational)) {
      return reject(request, LoginStatus::InitiatorError, "key not allowed in this stage");
    }
    if (is_chap_key(pair.key)) {
      chap.push_back(pair);  // each has one step of the exchange: security() checks it
      continue;
    }
    // §6.3: nor more than once in a login.
    if (const auto earlier = declared_.find(pair.key); earlier != declared_.end()) {
      if (may_repeat_unchanged(pair.key) && earlier->second == pair.value) continue;
      return reject(request, LoginStatus::InitiatorError, "key declared again");
    }
    declared_.emplace(pair.key, pair.value);
    offered.push_back(pair);
  }
  if (!authorized_) {
    if (auto refused = authorize_first(request, pairs)) return std::move(*refused);
  }

  NegotiationResult negotiated = negotiate(offered, config_.policy, params_);
  if (negotiated.failure) {
    return reject(request, login_status_for(*negotiated.failure), "negotiation failed");
  }
  std::vector<KeyValue> answer;
  bool agreed_now = false;
  for (KeyValue& reply : negotiated.response) {
    // §6.3: the portal group tag (and our alias) go with the first response only.
    if (reply.key == "TargetPortalGroupTag" || reply.key == "TargetAlias") {
      if (declared_portal_group_) continue;
    }
    if (reply.key == "AuthMethod") {
      // §6.3.2: nothing we accept was offered; the login cannot authenticate.
      if (reply.value == "Reject") {
        return reject(request, LoginStatus::AuthenticationFailure, "no AuthMethod we accept");
      }
      agreed_now = true;
    }
    answer.push_back(std::move(reply));
  }
  declared_portal_group_ =
      declared_portal_group_ || std::any_of(answer.begin(), answer.end(), [](const KeyValue& pair) {
        return pair.key == "TargetPortalGroupTag";
      });

  if (stage_ == LoginStage::Security) {
    if (agreed_now && params_.auth_method == AuthMethod::Chap) {
      chap_state_ = ChapState::WaitAlgorithm;
    }
    if (auto refused = security(request, chap, agreed_now, answer)) return std::move(*refused);
  }

  // The transition (§6.3, §11.12.3): only when the initiator asks (T=1), to the NSG it asked
  // for, along §6.3's table.
  bool transit = false;
  LoginStage next = stage_;
  if (request.final) {
    const LoginStage wanted = fields.next_stage;
    if (wanted == LoginStage::Security ||
        (stage_ == LoginStage::Operational && wanted != LoginStage::FullFeature)) {
      return reject(request, LoginStatus::InitiatorError, "a stage transition §6.3 forbids");
    }
    if (authenticated_) {
      transit = true;
      next = wanted;
    } else if (chap_state_ == ChapState::NotStarted) {
      return reject(request, LoginStatus::AuthenticationFailure,
                    "leaving security unauthenticated");
    }
    // Otherwise CHAP is under way: answer T=0, and the initiator asks again (§6.3).
  }

  std::string text = encode_text(answer);
  if (text.size() > kLoginSegmentLength) {
    return reject(request, LoginStatus::InitiatorError, "answer longer than a login PDU takes");
  }
  return respond(request, fields, transit, next, std::move(text));
}

std::optional<LoginStep> Login::security(const Bhs& request, std::span<const KeyValue> chap_keys,
                                         bool agreed_now, std::vector<KeyValue>& out) {
  // §12.1.3's steps: CHAP_A, then CHAP_N and CHAP_R (with CHAP_I and CHAP_C for mutual CHAP).
  // A key at another step is a protocol error (0x0200); a failed answer at its step is an
  // authentication failure (0x0201).
  switch (chap_state_) {
    case ChapState::NotStarted:
    case ChapState::Done:
      if (!chap_keys.empty()) {
        return reject(request, LoginStatus::InitiatorError, "CHAP key outside its step");
      }
      return std::nullopt;
    case ChapState::WaitAlgorithm: {
      if (chap_keys.empty()) {
        if (agreed_now) return std::nullopt;
        return reject(request, LoginStatus::AuthenticationFailure, "no CHAP_A");
      }
      // CHAP_A alone; it may come with the AuthMethod it follows, in the same text.
      if (chap_keys.size() != 1 || chap_keys[0].key != "CHAP_A") {
        return reject(request, LoginStatus::InitiatorError, "CHAP key outside its step");
      }
      auto started = chap_begin(chap_keys[0].value);
      if (const auto* error = std::get_if<ChapError>(&started)) {
        return reject(request, status_for(*error), "CHAP_A refused");
      }
      auto& start = std::get<ChapStart>(started);
      challenge_ = std::move(start.challenge);
      out.insert(out.end(), start.response.begin(), start.response.end());
      chap_state_ = ChapState::WaitResponse;
      return std::nullopt;
    }
    case ChapState::WaitResponse: {
      if (value_of(chap_keys, "CHAP_A") != nullptr) {
        return reject(request, LoginStatus::InitiatorError, "CHAP_A sent again");
      }
      // Wrong name and wrong response are one status and one reason, so a guess learns nothing.
      if (const auto error = chap_verify(challenge_, chap_keys, *decision_.chap)) {
        return reject(request, status_for(*error), "CHAP authentication failed");
      }
      if (chap_wants_mutual(chap_keys)) {
        if (!decision_.mutual_chap) {
          return reject(request, LoginStatus::AuthenticationFailure, "no mutual CHAP for this");
        }
        auto mutual =
            chap_mutual_response(challenge_, chap_keys, *decision_.chap, *decision_.mutual_chap);
        if (const auto* error = std::get_if<ChapError>(&mutual)) {
          return reject(request, status_for(*error), "mutual CHAP refused");
        }
        const auto& keys = std::get<std::vector<KeyValue>>(mutual);
        out.insert(out.end(), keys.begin(), keys.end());
      }
      chap_state_ = ChapState::Done;
      authenticated_ = true;
      return std::nullopt;
    }
  }
  return std::nullopt;
}

LoginStep Login::respond(const Bhs& request, const LoginRequest& fields, bool transit,
                         LoginStage next, std::string text) {
  const bool final_response = transit && next == LoginStage::FullFeature;
  LoginResponse fields_out;
  fields_out.current_stage = stage_;
  fields_out.next_stage = transit ? next : LoginStage::Security;
  // §11.13.1-2: version 0 is the highest we support and the one in use.
  fields_out.isid = fields.isid;
  // §11.13.3: the initiator's TSIH (0), except the final response of a new session, which
  // carries the one the target assigns.
  fields_out.tsih = final_response ? config_.tsih : fields.tsih;
  // §11.13.4: StatSN starts at the first response and counts every response, login ones too.
  fields_out.stat_sn = next_stat_sn_++;
  // §11.12.8: login requests are immediate and do not advance CmdSN; the session's first
  // command carries the login's CmdSN.
  fields_out.exp_cmd_sn = fields.cmd_sn;
  fields_out.max_cmd_sn = max_cmd_sn(fields.cmd_sn, config_.command_window);

  LoginStep step;
  step.outcome = final_response ? LoginOutcome::FullFeature : LoginOutcome::Continue;
  step.response.immediate = false;
  step.response.final = transit;  // T (§11.13.6): never 1 unless the request's was
  step.response.data_segment_length = static_cast<uint32_t>(text.size());
  step.response.initiator_task_tag = request.initiator_task_tag;
  step.response.fields = fields_out;
  step.data = std::move(text);
  if (transit) stage_ = next;
  if (final_response) {
    finished_ = true;
    LoginResult result;
    result.params = params_;
    result.isid = first_.isid;
    result.tsih = config_.tsih;
    result.cid = first_.cid;
    result.exp_cmd_sn = fields.cmd_sn;
    result.next_stat_sn = next_stat_sn_;
    result.authenticated = decision_.chap.has_value();
    result.handle = decision_.handle;
    result_ = std::move(result);
  }
  return step;
}

LoginStep Login::reject(const Bhs& request, LoginStatus status, std::string_view why) {
  finished_ = true;
  const auto* fields = std::get_if<LoginRequest>(&request.fields);
  LoginResponse fields_out;
  // §6.3.1: T, CSG and NSG are reserved in a Login reject, so zero; Version-active is the lowest
  // version we support (§11.13.2), 0.
  fields_out.isid = fields != nullptr ? fields->isid : first_.isid;
  fields_out.tsih = fields != nullptr ? fields->tsih : first_.tsih;
  fields_out.stat_sn = next_stat_sn_++;
  fields_out.exp_cmd_sn = cmd_sn_;
  fields_out.max_cmd_sn = max_cmd_sn(cmd_sn_, config_.command_window);
  fields_out.status_class = static_cast<uint8_t>(static_cast<uint16_t>(status) >> 8);
  fields_out.status_detail = static_cast<uint8_t>(static_cast<uint16_t>(status) & 0xff);

  LoginStep step;
  step.outcome = LoginOutcome::Close;
  step.response.immediate = false;
  step.response.final = false;
  step.response.data_segment_length = 0;
  step.response.initiator_task_tag = request.initiator_task_tag;
  step.response.fields = fields_out;
  step.status = status;
  step.why = why;
  return step;
}

std::variant<std::string, SendTargetsError> send_targets(std::span<const uint8_t> request_text,
                                                         SessionType session_type,
                                                         std::span<const TargetPortals> targets) {
  const ParsedText parsed = parse_text(request_text);
  const auto* pairs = std::get_if<std::vector<KeyValue>>(&parsed);
  if (pairs == nullptr) return SendTargetsError::BadText;
  const std::string* value = value_of(*pairs, "SendTargets");
  if (value == nullptr) return SendTargetsError::NoSendTargets;
  // §13.3: "All" only in a discovery session.
  const bool all = *value == "All";
  if (all && session_type != SessionType::Discovery) return SendTargetsError::AllNotAllowed;
  const bool own = value->empty() && session_type == SessionType::Normal;
  std::vector<KeyValue> answer;
  for (const TargetPortals& target : targets) {
    if (!all && !own && *value != target.target_name) continue;
    // Appendix C: each TargetName is followed by the TargetAddress values that reach it.
    answer.push_back({"TargetName", target.target_name});
    for (const std::string& address : target.addresses) {
      answer.push_back({"TargetAddress", address});
    }
  }
  return encode_text(answer);
}

}  // namespace shareblk::iscsi
