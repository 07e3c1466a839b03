// One of iscsi/'s public headers (iscsi/iscsi.h includes them all): the bookkeeping of one
// session in Full Feature Phase, as objects without I/O that the connection drives:
//
//   - CommandWindow: CmdSN ordering and the command window (RFC 7143 §4.2.2.1);
//   - StatSequence: a connection's StatSN and the initiator's ExpStatSN (§4.2.2.2);
//   - WriteTransfer: one WRITE's data-out, immediate, unsolicited and solicited by R2T (the Data
//     Transfer Overview of §4.2, §11.7, §11.8, the keys of §13.10-§13.19);
//   - ReadTransfer: one READ's data-in split into Data-In PDUs, optionally with the status in the
//     last one (§11.7);
//   - residual_for(): the residual overflow/underflow of a SCSI Response or Data-In (§11.4.5);
//   - TaskTable: the tasks of a session by Initiator Task Tag, for ABORT TASK and LUN RESET
//     (§11.5, §11.6).
//
// Each takes header fields the connection decoded (pdu.h) and the negotiated SessionParams
// (text.h), and answers with values: what to do with a command, the header fields of the R2T or
// Data-In to send, or why a PDU is refused. Nothing throws and nothing here sends: the connection
// builds and sends the PDUs (encode_bhs()), and on a refusal rejects the PDU and, as this target
// runs at ErrorRecoveryLevel 0, ends the connection (§7: at ERL 0 the only recovery is the
// session's). Sequence numbers compare with 32-bit serial number arithmetic (RFC 1982) everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <variant>
#include <vector>

#include "iscsi/pdu.h"
#include "iscsi/text.h"

namespace shareblk::iscsi {

// RFC 1982 with SERIAL_BITS 32 (§4.2.2.1 says CmdSN, StatSN and the rest compare this way): `a`
// is less than `b` when b is 1 to 2^31 - 1 ahead of it. Two numbers exactly 2^31 apart are
// unordered, so neither is less than the other.
constexpr bool serial_less(uint32_t a, uint32_t b) {
  const uint32_t ahead = b - a;
  return ahead != 0 && ahead < 0x80000000U;
}
constexpr bool serial_less_equal(uint32_t a, uint32_t b) {
  return a == b || serial_less(a, b);
}

// ---------------------------------------------------------------------------------------------
// CommandWindow (§4.2.2.1): the session's ExpCmdSN and MaxCmdSN, and the order in which
// non-immediate commands are delivered to SCSI.
//
// The window is [ExpCmdSN, MaxCmdSN]. The target promises room for `depth` commands: those
// delivered and not yet completed() count against it, so MaxCmdSN = ExpCmdSN + depth -
// outstanding - 1. Delivering a command moves ExpCmdSN and keeps MaxCmdSN; completing one moves
// MaxCmdSN; so MaxCmdSN never goes back, and it is ExpCmdSN - 1 (the window closed, which
// §4.2.2.1 allows) while `depth` commands run.
//
// accept() decides for each CmdSN-carrying PDU (SCSI Command, Task Management, Text, Logout, a
// NOP-Out with the I bit clear):
//   - Deliver: CmdSN == ExpCmdSN. ExpCmdSN moves on. Afterwards, take_ready() hands out the held
//     commands that are now in order, one at a time.
//   - Hold: within the window but after a gap. The caller keeps the PDU (the window keeps only
//     the number) until take_ready() returns its CmdSN.
//   - Duplicate, OutsideWindow: §4.2.2.1: the target MUST silently ignore a non-immediate command
//     outside [ExpCmdSN, MaxCmdSN], or one it has already received (before ExpCmdSN, or held).
//   - Immediate (I bit): delivered at once, out of order, and ExpCmdSN does not move (§4.2.2.1);
//     its CmdSN is not checked. Immediate commands have a bound of their own
//     (`immediate_depth`); past it, ImmediateRejected: answer with a Reject "Immediate command
//     reject" (§11.17.1, reason 0x06).
// Each Deliver, take_ready() and Immediate takes a slot that completed() gives back, with the
// same `immediate`.
// ---------------------------------------------------------------------------------------------

enum class CmdSnVerdict : uint8_t {
  Deliver,
  Hold,
  Duplicate,      // ignore silently
  OutsideWindow,  // ignore silently
  Immediate,
  ImmediateRejected,
};

struct CommandWindowConfig {
  uint32_t exp_cmd_sn = 0;       // LoginResult::exp_cmd_sn: the CmdSN of the first command
  uint32_t depth = 32;           // non-immediate commands at once; clamped to [1, kMaxCommandDepth]
  uint32_t immediate_depth = 8;  // immediate commands at once
};

inline constexpr uint32_t kMaxCommandDepth = 65536;

class CommandWindow {
 public:
  explicit CommandWindow(const CommandWindowConfig& config);

  CmdSnVerdict accept(uint32_t cmd_sn, bool immediate);
  // A held CmdSN that is now ExpCmdSN, which is then delivered (as Deliver is); nullopt when none.
  std::optional<uint32_t> take_ready();
  // A delivered command ended (its response is sent, or it was aborted). False, and nothing
  // changes, when no command of that kind is outstanding: the caller's bookkeeping is wrong.
  [[nodiscard]] bool completed(bool immediate);
  // Counts `cmd_sn`, within the window and not yet delivered, as received and never delivers it
  // (an ABORT TASK for a command still on its way, §11.6.1 b): ExpCmdSN passes it, it is a
  // Duplicate if it comes, and if it was held the caller drops the PDU it kept. False when it is
  // outside the window or consumed already.
  [[nodiscard]] bool consume(uint32_t cmd_sn);

  // Whether `cmd_sn` is within [ExpCmdSN, MaxCmdSN] (empty while the window is closed).
  bool in_window(uint32_t cmd_sn) const { return cmd_sn - exp_cmd_sn_ < depth_ - outstanding_; }
  uint32_t exp_cmd_sn() const { return exp_cmd_sn_; }
  uint32_t max_cmd_sn() const { return exp_cmd_sn_ + (depth_ - outstanding_) - 1; }
  uint32_t outstanding() const { return outstanding_; }
  uint32_t outstanding_immediate() const { return outstanding_immediate_; }
  std::size_t held() const { return held_.size(); }

 private:
  uint32_t depth_;
  uint32_t immediate_depth_;
  uint32_t exp_cmd_sn_;
  uint32_t outstanding_ = 0;
  uint32_t outstanding_immediate_ = 0;
  std::set<uint32_t> held_;      // CmdSNs received out of order, not yet delivered
  std::set<uint32_t> consumed_;  // CmdSNs counted as received by consume()

  void advance();  // ExpCmdSN past itself and any consumed numbers after it
};

// ---------------------------------------------------------------------------------------------
// StatSequence (§4.2.2.2): one connection's StatSN. Each SCSI Response, Task Management
// Response, Logout Response, Text Response, Reject, NOP-In answering a NOP-Out and Data-In with
// status takes the next one (take()); R2T, a Data-In without status and an unsolicited NOP-In
// carry it without taking it (peek(); §11.8, §11.19).
//
// acknowledge() checks each ExpStatSN the initiator sends: it must be within [the last
// acknowledged, the next to be sent]. An older one is Stale (a PDU overtaken, not an error); one
// past what was sent is Invalid: the initiator acknowledges a status it never got, which at
// ERL 0 ends the connection.
// ---------------------------------------------------------------------------------------------

enum class AckVerdict : uint8_t { Ok, Stale, Invalid };

class StatSequence {
 public:
  explicit StatSequence(uint32_t next_stat_sn) : next_(next_stat_sn), acked_(next_stat_sn) {}

  uint32_t take() { return next_++; }
  uint32_t peek() const { return next_; }
  AckVerdict acknowledge(uint32_t exp_stat_sn);
  // Statuses sent and not yet acknowledged: a caller may bound this (a stalled initiator).
  uint32_t unacknowledged() const { return next_ - acked_; }

 private:
  uint32_t next_;
  uint32_t acked_;
};

// ---------------------------------------------------------------------------------------------
// Residuals (§11.4.5): `expected` is the Expected Data Transfer Length of the command, `actual`
// the bytes the SCSI command itself transfers (its CDB's length). Underflow: actual < expected,
// residual expected - actual. Overflow: actual > expected, residual actual - expected (saturated
// at 2^32 - 1). The one home of that rule: SCSI Response and Data-In with status both use it.
// ---------------------------------------------------------------------------------------------

struct Residual {
  bool overflow = false;   // O
  bool underflow = false;  // U
  uint32_t count = 0;
  bool operator==(const Residual&) const = default;
};

Residual residual_for(uint32_t expected, uint64_t actual);

// ---------------------------------------------------------------------------------------------
// WriteTransfer: the data-out of one SCSI command with the W bit, as the session's keys allow it
// (§13.10 InitialR2T, §13.11 ImmediateData, §13.12 MaxRecvDataSegmentLength, §13.13
// MaxBurstLength, §13.14 FirstBurstLength); this target negotiates MaxOutstandingR2T=1,
// DataPDUInOrder=Yes and DataSequenceInOrder=Yes (§13.17-§13.19), and the checks assume them.
//
// The `length` bytes (the command's Expected Data Transfer Length) arrive in this order:
//   1. immediate data, in the command PDU itself (ImmediateData=Yes), at offset 0;
//   2. if the command's F bit is 0 (only with InitialR2T=No): one unsolicited Data-Out sequence,
//      TTT 0xffffffff, DataSN from 0, that ends with F=1 exactly when the unsolicited data
//      (immediate data included) reaches min(FirstBurstLength, length) (§13.14);
//   3. the rest, in bursts this target solicits one at a time: next_r2t() gives an R2T (R2TSN
//      from 0, the caller's TTT, the next offset, at most MaxBurstLength), and its Data-Out
//      sequence has that TTT, DataSN from 0, contiguous offsets, and F=1 exactly on its last PDU.
// R2Ts come only after the unsolicited sequence has ended (a choice: DataSequenceInOrder=Yes
// then needs no reordering).
//
// data_out() checks each Data-Out against that (the first failed check is the answer); every
// segment is at most MaxRecvDataSegmentLength (§13.12). A WriteError is a protocol error: the
// caller rejects the PDU and ends the connection (ERL 0), and does not use this object again.
//
// `length` is the Expected Data Transfer Length, what the initiator sends; whether the CDB asks
// for more or less is residual_for()'s question, and the command's to fail.
// ---------------------------------------------------------------------------------------------

enum class WriteError : uint8_t {
  ImmediateDataNotAllowed,  // a data segment in the command with ImmediateData=No (§13.11)
  UnsolicitedNotAllowed,    // command F=0 with InitialR2T=Yes, nothing left to send unsolicited,
                            // or a Data-Out with TTT 0xffffffff when no unsolicited sequence is
                            // open (§13.10)
  FirstBurstExceeded,       // immediate data longer than FirstBurstLength (§13.14)
  BeyondExpectedLength,     // data past the Expected Data Transfer Length
  SegmentTooLong,           // a data segment over MaxRecvDataSegmentLength (§13.12)
  NotDataOut,               // data_out() given a PDU that is not a Data-Out
  BadTargetTransferTag,     // a TTT no open R2T has (§11.7.4)
  NoOpenBurst,              // a Data-Out when no R2T is open and no unsolicited data is due
  DataSnOutOfOrder,         // not the next DataSN of its sequence (§11.7.5)
  BadBufferOffset,          // a gap or an overlap: DataPDUInOrder=Yes (§13.18, §11.7.6)
  BurstOverrun,             // past the end of its R2T's desired length or of the first burst
  MissingFinal,             // the PDU that ends a sequence has F=0 (§11.7.1)
  EarlyFinal,               // F=1 before the sequence's end
};

// The one mapping of a WriteError to the Reject reason (§11.17.1) sent before the connection
// ends: a wrong TTT is an invalid field, anything else a protocol error.
RejectReason reject_reason_for(WriteError error);

struct DataOutAccepted {
  uint32_t buffer_offset = 0;  // where the segment's bytes go
  uint32_t length = 0;
  bool sequence_done = false;  // the burst ended: next_r2t() may have the next R2T
  bool transfer_done = false;  // all `length` bytes are in: run the command
};

class WriteTransfer {
 public:
  using Started = std::variant<WriteTransfer, WriteError>;

  // The command PDU (a Bhs without ScsiCommand fields reads as length 0): its F bit and data
  // segment length (the immediate data), the Expected Data Transfer Length, and the Target Transfer
  // Tag this task's R2Ts carry (never 0xffffffff; the caller keeps it unique among the connection's
  // open tasks, §11.8).
  static Started start(const SessionParams& params, const Bhs& command,
                       uint32_t target_transfer_tag);

  // The R2T to send now, with every field but StatSN, ExpCmdSN and MaxCmdSN (the caller's): when
  // no sequence is open and bytes are still due. Then nullopt until that R2T's sequence ends.
  std::optional<R2t> next_r2t();

  std::variant<DataOutAccepted, WriteError> data_out(const Bhs& pdu);

  uint32_t length() const { return length_; }
  uint32_t received() const { return received_; }
  uint32_t immediate_length() const { return immediate_; }
  bool done() const { return received_ == length_; }

 private:
  WriteTransfer(const SessionParams& params, uint32_t length, uint32_t immediate,
                bool unsolicited_follows, uint32_t target_transfer_tag);

  enum class Phase : uint8_t { Unsolicited, Idle, Solicited };

  uint32_t max_segment_;
  uint32_t max_burst_;
  uint32_t length_;
  uint32_t immediate_;
  uint32_t ttt_;
  Phase phase_;
  uint32_t received_;      // bytes in, all contiguous from 0
  uint32_t sequence_end_;  // where the open sequence (unsolicited or R2T) ends
  uint32_t next_data_sn_ = 0;
  uint32_t next_r2t_sn_ = 0;
};

// ---------------------------------------------------------------------------------------------
// ReadTransfer: `data_length` bytes of data-in for a command of Expected Data Transfer Length
// `expected`, as Data-In PDUs (§11.7). At most min(data_length, expected) bytes are sent (the
// rest is the residual overflow; fewer is underflow: residual_for()). Each PDU carries at most
// the initiator's MaxRecvDataSegmentLength (§13.12); a sequence (burst) is at most
// MaxBurstLength (§13.13) and its last PDU has F=1 (§11.7.1); DataSN counts 0, 1, ... across the
// command (§11.7.5), BufferOffset the bytes before (§11.7.6).
//
// With `collapse_status` (only for status GOOD with no sense data, §11.7.3), the last PDU also
// has S=1, status GOOD and the residual, and takes a StatSN: no SCSI Response follows. Without
// it, or when no byte is sent (nothing to send: the SCSI Response carries everything), the caller
// sends a SCSI Response after the last Data-In.
// ---------------------------------------------------------------------------------------------

struct DataInPdu {
  Bhs header;           // DataIn fields; StatSN (with S), ExpCmdSN, MaxCmdSN are the caller's
  uint32_t length = 0;  // its data segment: the bytes at header's BufferOffset
};

class ReadTransfer {
 public:
  ReadTransfer(const SessionParams& params, uint32_t expected, uint64_t data_length,
               uint32_t initiator_task_tag, uint64_t lun, bool collapse_status);

  // The next Data-In, or nullopt when all are given.
  std::optional<DataInPdu> next();

  // Whether the last Data-In carried the status (so no SCSI Response is sent).
  bool status_in_data() const { return collapse_ && send_length_ > 0; }
  uint32_t send_length() const { return send_length_; }
  Residual residual() const { return residual_; }

 private:
  uint32_t max_segment_;
  uint32_t max_burst_;
  uint32_t send_length_;
  Residual residual_;
  uint32_t itt_;
  uint64_t lun_;
  bool collapse_;
  uint32_t offset_ = 0;
  uint32_t burst_left_;
  uint32_t data_sn_ = 0;
};

// ---------------------------------------------------------------------------------------------
// TaskTable: the session's tasks by Initiator Task Tag, and whom a Task Management Function
// request (§11.5) affects, with its response code (§11.6.1).
//
// The connection add()s each SCSI command it delivers (a second task with a tag in use is
// refused: tags are unique among a session's tasks, §11.2.1.8) and remove()s it when its
// response is sent or it is aborted. manage() answers a TMF with the response code and the tags
// of the tasks to abort (the caller aborts them, sends no SCSI Response for them, §11.6, and
// remove()s them):
//   - ABORT TASK (1): the task with the Referenced Task Tag, on the request's LUN: Function
//     complete. No such task: if RefCmdSN is within [ExpCmdSN, MaxCmdSN] and before the TMF's
//     own CmdSN, the command is still on its way: Function complete, and the window must count
//     that CmdSN as received (TmfDecision::consume_cmd_sn, CommandWindow::consume()), so that
//     it is ignored when it comes; otherwise Task does not exist (§11.6.1 a-c).
//   - ABORT TASK SET (2), CLEAR TASK SET (4), LOGICAL UNIT RESET (5): every task of that LUN
//     (one task set per LUN, shared by the session's one connection).
//   - a LUN the session does not have: LUN does not exist, for the functions that name one.
//   - CLEAR ACA (3, no NACA support), TARGET WARM/COLD RESET (6, 7: a target of many sessions
//     does not let one reset the others), TASK REASSIGN (8, ERL 2 only): Function not supported.
//   - an undefined function: Function rejected (255).
// ---------------------------------------------------------------------------------------------

// §11.5.1
enum class TmfFunction : uint8_t {
  AbortTask = 1,
  AbortTaskSet = 2,
  ClearAca = 3,
  ClearTaskSet = 4,
  LogicalUnitReset = 5,
  TargetWarmReset = 6,
  TargetColdReset = 7,
  TaskReassign = 8,
};

// §11.6.1
enum class TmfResponse : uint8_t {
  FunctionComplete = 0,
  TaskDoesNotExist = 1,
  LunDoesNotExist = 2,
  TaskStillAllegiant = 3,
  TaskReassignNotSupported = 4,
  FunctionNotSupported = 5,
  AuthorizationFailed = 6,
  FunctionRejected = 255,
};

struct TaskEntry {
  uint32_t initiator_task_tag = 0;
  uint64_t lun = 0;
  uint32_t cmd_sn = 0;
};

struct TmfDecision {
  TmfResponse response = TmfResponse::FunctionRejected;
  std::vector<uint32_t> abort;             // the tags of the tasks to abort
  std::optional<uint32_t> consume_cmd_sn;  // for CommandWindow::consume()
};

class TaskTable {
 public:
  // False, and nothing added, when the tag is kReservedTag or already in use.
  [[nodiscard]] bool add(const TaskEntry& task);
  // False when there is no such task.
  bool remove(uint32_t initiator_task_tag);
  const TaskEntry* find(uint32_t initiator_task_tag) const;
  std::size_t size() const { return tasks_.size(); }

  // `request` as decoded, `lun` its LUN field, `window` the session's (read only);
  // `lun_exists` says whether the session has that LUN.
  TmfDecision manage(const TaskMgmtRequest& request, uint64_t lun, const CommandWindow& window,
                     bool lun_exists) const;

 private:
  std::vector<TaskEntry> tasks_;  // few (the command window bounds them): a vector is enough
};

}  // namespace shareblk::iscsi
