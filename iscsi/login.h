// One of iscsi/'s public headers (iscsi/iscsi.h includes them all): the target's side of the
// login phase (RFC 7143 §6.3, §11.12-§11.13) as a state machine without I/O, one per connection,
// and the SendTargets answer of a discovery session (§13.3, Appendix C).
//
// The caller decodes each Login Request (pdu.h, digests checked) and hands it to Login::step()
// with its data segment; step() answers with the Login Response to send and says what happens
// next: more login, Full Feature Phase (with the negotiated SessionParams and the caller's handle
// for the authorized target), or close the connection after sending the (reject) response.
//
// The stages (§6.3, §11.12.3):
//   start --> SecurityNegotiation (CSG 0) --> LoginOperationalNegotiation (CSG 1) --> FFP
//   start --> LoginOperationalNegotiation, only when the authorization needs no CHAP (§6.3.1)
//   SecurityNegotiation --> FFP directly is allowed (§6.3's table)
// The target moves only when the initiator asks (T=1), and leaves SecurityNegotiation only once
// the initiator is authenticated; its NSG is the initiator's (it never selects a lower one).
//
// The first complete request text (after any C-bit continuation) must name the initiator, and
// for a Normal session the target (§6.3); then `authorize` is called once, and its Decision
// decides everything else: refused is "target not found" whether the target is unknown or the
// initiator may not use it (docs/iscsi.md: a caller learns nothing of which targets exist); with
// CHAP credentials, CHAP (§12.1.3) is required; without, AuthMethod=None is the one accepted.
//
// Every refusal is a Login reject with the status of §11.13.5 and LoginStep::outcome Close; the
// statuses and their reasons are listed at LoginStatus. Bounds: LoginConfig::max_pdus requests
// and max_text_bytes of text per login, after which the login is rejected (0x0200), so a login
// that never finishes ends; its wall-clock deadline is the caller's (docs/iscsi.md).
//
// Only new sessions: a non-zero TSIH (adding a connection, or connection reinstatement, §6.3.1's
// table) is refused with "session does not exist" (0x020a), as this target runs MaxConnections=1.
// Session reinstatement (an existing ISID with TSIH 0, §6.3.5) is the caller's: LoginResult
// carries the ISID and InitiatorName, which name the session to replace.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "iscsi/chap.h"
#include "iscsi/pdu.h"
#include "iscsi/text.h"

namespace shareblk::iscsi {

// Status-Class and Status-Detail of a Login Response (§11.13.5), as one 16-bit value.
enum class LoginStatus : uint16_t {
  Success = 0x0000,
  // Anything else the initiator got wrong: malformed text (§6.1), a key sent twice in one text or
  // redeclared in a later one (§6.3), a key in a stage that does not allow it (§6.3), a CSG that
  // is not the current stage or a stage transition §6.3's table forbids, a version, ISID or CID
  // that changes during the login, CHAP keys out of their step (§12.1.3), more requests or text
  // than the bounds, or an answer longer than the 8192 bytes an initiator takes during login
  // (§6.3: the default MaxRecvDataSegmentLength applies). Also a negotiation failure
  // (login_status_for()).
  InitiatorError = 0x0200,
  // CHAP failed for any reason: wrong name or wrong secret (the same status, so that a guess
  // learns nothing), a missing, malformed or over-long CHAP_N/CHAP_R/CHAP_I/CHAP_C (but a value
  // longer than text.h parses at all is malformed text, 0x0200), no MD5 in CHAP_A, a reflected
  // challenge or one secret both ways, mutual CHAP the target has no credentials for (§12.1.3: "the
  // target MUST answer with a Login reject with Authentication Failure"); no AuthMethod we
  // accept; or leaving security, or skipping it, without authenticating (§6.3.1).
  AuthenticationFailure = 0x0201,
  NotFound = 0x0203,                 // authorize() refused: unknown target or initiator alike
  UnsupportedVersion = 0x0205,       // Version-min above 0, the only version (§11.12.4)
  MissingParameter = 0x0207,         // no InitiatorName, or no TargetName in a Normal session
  SessionTypeNotSupported = 0x0209,  // SessionType neither Normal nor Discovery, or Discovery off
  SessionDoesNotExist = 0x020a,      // a non-zero TSIH (§6.3.1): we make only new sessions
  InvalidDuringLogin = 0x020b,       // a PDU other than a Login Request during login (§11.12)
  TargetError = 0x0300,              // ours: no random numbers or no MD5 for CHAP (chap.h)
};

// The one mapping of a negotiation failure (text.h) to the login's status: all three are the
// initiator's error (§6.1 duplicate keys; §13 keys only a target sends; a name too long or empty).
LoginStatus login_status_for(NegotiationFailure failure);

// What the caller's authorization says about one initiator and target (or a discovery session).
struct LoginDecision {
  bool allowed = false;
  std::optional<ChapCredentials> chap;         // set: the initiator must authenticate with CHAP
  std::optional<ChapCredentials> mutual_chap;  // set: we answer an initiator's mutual CHAP
  std::shared_ptr<void> handle;                // the caller's; handed back in LoginResult
};

// Called once, with the first request's names. `target_name` is empty in a discovery session
// that names none. Names are as the initiator sent them (§4.2.7.2 normalization is the caller's).
// An empty function refuses every login.
using LoginAuthorize = std::function<LoginDecision(
    SessionType session_type, std::string_view initiator_name, std::string_view target_name)>;

struct LoginConfig {
  TargetPolicy policy;         // policy.auth_method is replaced by the decision's
  uint32_t first_stat_sn = 0;  // StatSN of the first Login Response (§11.13.4)
  uint16_t tsih = 1;  // the new session's TSIH, non-zero, sent in the final response (§11.13.3)
  uint32_t command_window = 32;        // MaxCmdSN = ExpCmdSN + command_window - 1 (at least 1)
  bool allow_discovery = true;         // SessionType=Discovery accepted
  std::size_t max_pdus = 16;           // Login Requests per login, continuations included
  std::size_t max_text_bytes = 32768;  // their data segments, together
};

// The login's end, when it reaches Full Feature Phase.
struct LoginResult {
  SessionParams params;  // negotiated; digests apply from the next PDU on
  std::array<uint8_t, 6> isid{};
  uint16_t tsih = 0;  // the one assigned (LoginConfig::tsih)
  uint16_t cid = 0;
  uint32_t exp_cmd_sn = 0;     // the CmdSN of the first non-immediate command (§11.12.8)
  uint32_t next_stat_sn = 0;   // StatSN of this connection's next response
  bool authenticated = false;  // CHAP verified (false: AuthMethod=None was allowed)
  std::shared_ptr<void> handle;
};

enum class LoginOutcome : uint8_t {
  Continue,     // send the response, wait for the next Login Request
  FullFeature,  // send the response (the final one, with the TSIH); result() is set
  Close,        // send the response if `send`, then close the connection
};

struct LoginStep {
  LoginOutcome outcome = LoginOutcome::Close;
  bool send = true;  // false only when there is nothing to answer (the first PDU is not a
                     // Login Request, §11.12: close at once; or step() after the end)
  Bhs response;      // a LoginResponse
  std::string data;  // its data segment: key=value text, unpadded
  LoginStatus status = LoginStatus::Success;
  std::string_view why;  // for the log: a static string; empty on success
};

class Login {
 public:
  Login(LoginConfig config, LoginAuthorize authorize);

  // One request: `request` as decode_bhs() gave it, `data` its data segment (without padding).
  LoginStep step(const Bhs& request, std::span<const uint8_t> data);

  bool finished() const { return finished_; }
  // Set once step() returned FullFeature.
  const LoginResult* result() const { return result_ ? &*result_ : nullptr; }

 private:
  enum class ChapState : uint8_t { NotStarted, WaitAlgorithm, WaitResponse, Done };

  LoginStep reject(const Bhs& request, LoginStatus status, std::string_view why);
  LoginStep respond(const Bhs& request, const LoginRequest& fields, bool transit, LoginStage next,
                    std::string text);
  std::optional<LoginStep> check_header(const Bhs& request, const LoginRequest& fields);
  std::optional<LoginStep> authorize_first(const Bhs& request, std::span<const KeyValue> pairs);
  LoginStep process(const Bhs& request, const LoginRequest& fields,
                    std::span<const KeyValue> pairs);
  // The security stage's CHAP keys; nullopt when they are fine, with what to answer in `out`.
  std::optional<LoginStep> security(const Bhs& request, std::span<const KeyValue> chap_keys,
                                    bool agreed_now, std::vector<KeyValue>& out);

  LoginConfig config_;
  LoginAuthorize authorize_;
  LoginDecision decision_;
  SessionParams params_;
  LoginStage stage_ = LoginStage::Security;
  ChapState chap_state_ = ChapState::NotStarted;
  ChapChallenge challenge_;
  bool authenticated_ = false;
  bool authorized_ = false;  // authorize() said yes (the first complete text was processed)
  bool started_ = false;     // a Login Request was seen
  bool finished_ = false;
  bool declared_portal_group_ = false;
  std::size_t pdus_ = 0;
  std::size_t text_bytes_ = 0;
  uint32_t next_stat_sn_ = 0;
  LoginRequest first_;  // the first request's fields, which the others must repeat
  TextAccumulator text_;
  std::map<std::string, std::string, std::less<>> declared_;  // every key offered so far
  uint32_t cmd_sn_ = 0;                                       // the latest request's CmdSN
  std::optional<LoginResult> result_;
};

// A target and the portals it is reached at, for SendTargets.
struct TargetPortals {
  std::string target_name;
  std::vector<std::string> addresses;  // TargetAddress values: "ADDR:PORT,TPGT" (§13.8)
};

enum class SendTargetsError : uint8_t {
  BadText,        // the request is not valid text (§6.1)
  NoSendTargets,  // it has no SendTargets key
  AllNotAllowed,  // SendTargets=All outside a discovery session (§13.3)
};

// The data of the Text Response to a Text Request holding SendTargets (§13.3, Appendix C):
// TargetName=<name> then a TargetAddress=<address> for each of its portals, for each target in
// `targets`. The caller passes only the targets this initiator may log in to (docs/iscsi.md);
// this function filters by the request: "All" (discovery sessions only) is every one, a name is
// that target if it is among them, and an empty value is every one in a Normal session (where the
// caller passes the session's own target: §13.3's "the current session's target") and none in a
// discovery session, which has no target of its own. The caller splits a long answer over Text
// Responses with the C bit (§11.11.2) within the initiator's MaxRecvDataSegmentLength.
std::variant<std::string, SendTargetsError> send_targets(std::span<const uint8_t> request_text,
                                                         SessionType session_type,
                                                         std::span<const TargetPortals> targets);

}  // namespace shareblk::iscsi
