// Full Feature Phase bookkeeping. Each object keeps only numbers (no PDUs, no data): the
// connection owns the buffers, so nothing here can grow with what an initiator sends beyond the
// command window's depth (held and consumed CmdSNs are within the window by construction).
#include "iscsi/session.h"

#include <algorithm>
#include <limits>

namespace shareblk::iscsi {

// ---- CommandWindow ----------------------------------------------------------------------------

CommandWindow::CommandWindow(const CommandWindowConfig& config)
    : depth_(std::clamp<uint32_t>(config.depth, 1, kMaxCommandDepth)),
      immediate_depth_(config.immediate_depth),
      exp_cmd_sn_(config.exp_cmd_sn) {}

void CommandWindow::advance() {
  ++exp_cmd_sn_;
  // A consumed number is received already (an aborted command still on its way): pass it.
  while (consumed_.erase(exp_cmd_sn_) > 0) ++exp_cmd_sn_;
}

CmdSnVerdict CommandWindow::accept(uint32_t cmd_sn, bool immediate) {
  if (immediate) {
    // §4.2.2.1: an immediate command is delivered at once and does not move ExpCmdSN. Its CmdSN
    // is the next one's, by the initiator's rule, but nothing here depends on it, so it is not
    // checked (a wrong one would only confuse the initiator's own accounting).
    if (outstanding_immediate_ >= immediate_depth_) return CmdSnVerdict::ImmediateRejected;
    ++outstanding_immediate_;
    return CmdSnVerdict::Immediate;
  }
  if (!in_window(cmd_sn)) {
    // Before ExpCmdSN (serially) it was received once already; anything else is past MaxCmdSN
    // (or so far back or ahead that serial order is undefined): both ignored silently.
    return serial_less(cmd_sn, exp_cmd_sn_) ? CmdSnVerdict::Duplicate : CmdSnVerdict::OutsideWindow;
  }
  if (held_.contains(cmd_sn) || consumed_.contains(cmd_sn)) return CmdSnVerdict::Duplicate;
  if (cmd_sn != exp_cmd_sn_) {
    held_.insert(cmd_sn);
    return CmdSnVerdict::Hold;
  }
  ++outstanding_;
  advance();
  return CmdSnVerdict::Deliver;
}

std::optional<uint32_t> CommandWindow::take_ready() {
  const auto it = held_.find(exp_cmd_sn_);
  if (it == held_.end()) return std::nullopt;
  const uint32_t cmd_sn = *it;
  held_.erase(it);
  ++outstanding_;
  advance();
  return cmd_sn;
}

bool CommandWindow::completed(bool immediate) {
  uint32_t& count = immediate ? outstanding_immediate_ : outstanding_;
  if (count == 0) return false;
  --count;
  return true;
}

bool CommandWindow::consume(uint32_t cmd_sn) {
  if (!in_window(cmd_sn) || consumed_.contains(cmd_sn)) return false;
  held_.erase(cmd_sn);  // received, never to be delivered: the caller drops its PDU
  if (cmd_sn == exp_cmd_sn_) {
    advance();
  } else {
    consumed_.insert(cmd_sn);
  }
  return true;
}

// ---- StatSequence -----------------------------------------------------------------------------

AckVerdict StatSequence::acknowledge(uint32_t exp_stat_sn) {
  // Distances from the oldest unacknowledged status: 0..unacknowledged() is valid.
  const uint32_t ahead = exp_stat_sn - acked_;
  if (ahead <= next_ - acked_) {
    acked_ = exp_stat_sn;
    return AckVerdict::Ok;
  }
  return serial_less(exp_stat_sn, acked_) ? AckVerdict::Stale : AckVerdict::Invalid;
}

// ---- Residuals --------------------------------------------------------------------------------

Residual residual_for(uint32_t expected, uint64_t actual) {
  Residual r;
  if (actual < expected) {
    r.underflow = true;
    r.count = static_cast<uint32_t>(expected - actual);
  } else if (actual > expected) {
    r.overflow = true;
    r.count = static_cast<uint32_t>(
        std::min<uint64_t>(actual - expected, std::numeric_limits<uint32_t>::max()));
  }
  return r;
}

// ---- WriteTransfer ----------------------------------------------------------------------------

RejectReason reject_reason_for(WriteError error) {
  return error == WriteError::BadTargetTransferTag ? RejectReason::InvalidPduField
                                                   : RejectReason::ProtocolError;
}

WriteTransfer::WriteTransfer(const SessionParams& params, uint32_t length, uint32_t immediate,
                             bool unsolicited_follows, uint32_t target_transfer_tag)
    : max_segment_(params.target_max_recv_data_segment_length),
      max_burst_(std::max<uint32_t>(params.max_burst_length, 1)),
      length_(length),
      immediate_(immediate),
      ttt_(target_transfer_tag),
      phase_(unsolicited_follows ? Phase::Unsolicited : Phase::Idle),
      received_(immediate),
      // The unsolicited sequence ends at min(FirstBurstLength, length) (§13.14), neither sooner
      // nor later, with F there and nowhere else: Linux's LIO target holds initiators to the
      // same, so no initiator that works with it sends a shorter one.
      sequence_end_(unsolicited_follows ? std::min(params.first_burst_length, length) : immediate) {
}

WriteTransfer::Started WriteTransfer::start(const SessionParams& params, const Bhs& command,
                                            uint32_t target_transfer_tag) {
  const auto* fields = std::get_if<ScsiCommand>(&command.fields);
  const uint32_t length = fields != nullptr ? fields->expected_data_transfer_length : 0;
  const uint32_t immediate = command.data_segment_length;
  if (immediate > 0 && !params.immediate_data) return WriteError::ImmediateDataNotAllowed;
  if (immediate > params.target_max_recv_data_segment_length) return WriteError::SegmentTooLong;
  if (immediate > length) return WriteError::BeyondExpectedLength;
  if (immediate > params.first_burst_length) return WriteError::FirstBurstExceeded;
  // F=0 on the command announces unsolicited Data-Out (§11.3.1): InitialR2T=No only (§13.10),
  // and only when the first burst has room left after the immediate data.
  const bool unsolicited_follows = !command.final;
  if (unsolicited_follows &&
      (params.initial_r2t || immediate >= std::min(params.first_burst_length, length))) {
    return WriteError::UnsolicitedNotAllowed;
  }
  return WriteTransfer(params, length, immediate, unsolicited_follows, target_transfer_tag);
}

std::optional<R2t> WriteTransfer::next_r2t() {
  if (phase_ != Phase::Idle || received_ >= length_) return std::nullopt;
  R2t r2t;
  r2t.target_transfer_tag = ttt_;
  r2t.r2t_sn = next_r2t_sn_++;
  r2t.buffer_offset = received_;
  r2t.desired_data_transfer_length = std::min(max_burst_, length_ - received_);
  sequence_end_ = received_ + r2t.desired_data_transfer_length;
  next_data_sn_ = 0;  // DataSN starts at 0 in each solicited sequence (§11.7.5)
  phase_ = Phase::Solicited;
  return r2t;
}

std::variant<DataOutAccepted, WriteError> WriteTransfer::data_out(const Bhs& pdu) {
  const auto* fields = std::get_if<DataOut>(&pdu.fields);
  if (fields == nullptr) return WriteError::NotDataOut;
  const uint32_t length = pdu.data_segment_length;
  // Which sequence it claims to belong to, by its tag (§11.7.4).
  if (fields->target_transfer_tag == kReservedTag) {
    if (phase_ != Phase::Unsolicited) return WriteError::UnsolicitedNotAllowed;
  } else if (phase_ != Phase::Solicited) {
    return phase_ == Phase::Unsolicited ? WriteError::BadTargetTransferTag
                                        : WriteError::NoOpenBurst;
  } else if (fields->target_transfer_tag != ttt_) {
    return WriteError::BadTargetTransferTag;
  }
  if (length > max_segment_) return WriteError::SegmentTooLong;
  if (fields->data_sn != next_data_sn_) return WriteError::DataSnOutOfOrder;
  if (fields->buffer_offset != received_) return WriteError::BadBufferOffset;
  // 64 bits: an offset near 2^32 plus a length must not wrap.
  const uint64_t end = uint64_t{received_} + length;
  if (end > length_) return WriteError::BeyondExpectedLength;
  if (end > sequence_end_) return WriteError::BurstOverrun;
  const bool sequence_done = end == sequence_end_;
  if (sequence_done && !pdu.final) return WriteError::MissingFinal;
  if (!sequence_done && pdu.final) return WriteError::EarlyFinal;

  DataOutAccepted accepted{received_, length, sequence_done, false};
  received_ = static_cast<uint32_t>(end);
  ++next_data_sn_;
  if (sequence_done) {
    phase_ = Phase::Idle;
    next_data_sn_ = 0;
  }
  accepted.transfer_done = received_ == length_;
  return accepted;
}

// ---- ReadTransfer -----------------------------------------------------------------------------

ReadTransfer::ReadTransfer(const SessionParams& params, uint32_t expected, uint64_t data_length,
                           uint32_t initiator_task_tag, uint64_t lun, bool collapse_status)
    : max_segment_(std::max<uint32_t>(params.initiator_max_recv_data_segment_length, 1)),
      max_burst_(std::max<uint32_t>(params.max_burst_length, 1)),
      send_length_(static_cast<uint32_t>(std::min<uint64_t>(expected, data_length))),
      residual_(residual_for(expected, data_length)),
      itt_(initiator_task_tag),
      lun_(lun),
      collapse_(collapse_status),
      burst_left_(max_burst_) {}

std::optional<DataInPdu> ReadTransfer::next() {
  if (offset_ >= send_length_) return std::nullopt;
  const uint32_t length = std::min({max_segment_, burst_left_, send_length_ - offset_});
  burst_left_ -= length;
  const bool last = offset_ + length == send_length_;
  // F ends a sequence: a MaxBurstLength's worth, or the whole transfer (§11.7.1, §13.13).
  const bool final = last || burst_left_ == 0;

  DataInPdu pdu;
  pdu.length = length;
  pdu.header.final = final;
  pdu.header.data_segment_length = length;
  pdu.header.lun = lun_;
  pdu.header.initiator_task_tag = itt_;
  DataIn fields;
  fields.data_sn = data_sn_++;
  fields.buffer_offset = offset_;
  if (last && collapse_) {
    // §11.7.3: S with F; status GOOD, the residual as a SCSI Response would carry it.
    fields.status_present = true;
    fields.status = 0;  // GOOD
    fields.residual_overflow = residual_.overflow;
    fields.residual_underflow = residual_.underflow;
    fields.residual_count = residual_.count;
  }
  pdu.header.fields = fields;

  offset_ += length;
  if (burst_left_ == 0) burst_left_ = max_burst_;
  return pdu;
}

// ---- TaskTable --------------------------------------------------------------------------------

bool TaskTable::add(const TaskEntry& task) {
  if (task.initiator_task_tag == kReservedTag || find(task.initiator_task_tag) != nullptr) {
    return false;
  }
  tasks_.push_back(task);
  return true;
}

bool TaskTable::remove(uint32_t initiator_task_tag) {
  const auto it = std::find_if(tasks_.begin(), tasks_.end(), [&](const TaskEntry& t) {
    return t.initiator_task_tag == initiator_task_tag;
  });
  if (it == tasks_.end()) return false;
  tasks_.erase(it);
  return true;
}

const TaskEntry* TaskTable::find(uint32_t initiator_task_tag) const {
  for (const TaskEntry& task : tasks_) {
    if (task.initiator_task_tag == initiator_task_tag) return &task;
  }
  return nullptr;
}

TmfDecision TaskTable::manage(const TaskMgmtRequest& request, uint64_t lun,
                              const CommandWindow& window, bool lun_exists) const {
  TmfDecision decision;
  switch (static_cast<TmfFunction>(request.function)) {
    case TmfFunction::AbortTask: {
      if (!lun_exists) {
        decision.response = TmfResponse::LunDoesNotExist;
        break;
      }
      const TaskEntry* task = find(request.referenced_task_tag);
      if (task != nullptr && task->lun == lun) {
        decision.response = TmfResponse::FunctionComplete;
        decision.abort.push_back(task->initiator_task_tag);
        break;
      }
      // §11.6.1 b: not here, but its CmdSN is within the window and before the TMF's own, so
      // it is on its way: consider it received, and aborted.
      const uint32_t ref = request.ref_cmd_sn;
      if (task == nullptr && window.in_window(ref) && serial_less(ref, request.cmd_sn)) {
        decision.response = TmfResponse::FunctionComplete;
        decision.consume_cmd_sn = ref;
      } else {
        decision.response = TmfResponse::TaskDoesNotExist;
      }
      break;
    }
    case TmfFunction::AbortTaskSet:
    case TmfFunction::ClearTaskSet:
    case TmfFunction::LogicalUnitReset:
      if (!lun_exists) {
        decision.response = TmfResponse::LunDoesNotExist;
        break;
      }
      decision.response = TmfResponse::FunctionComplete;
      for (const TaskEntry& task : tasks_) {
        if (task.lun == lun) decision.abort.push_back(task.initiator_task_tag);
      }
      break;
    case TmfFunction::ClearAca:
    case TmfFunction::TargetWarmReset:
    case TmfFunction::TargetColdReset:
    case TmfFunction::TaskReassign:
      decision.response = TmfResponse::FunctionNotSupported;
      break;
    default:
      decision.response = TmfResponse::FunctionRejected;
      break;
  }
  return decision;
}

}  // namespace shareblk::iscsi
