// A session's Full Feature Phase bookkeeping (iscsi/session.h): the command window at its edges
// and across the 32-bit wrap, StatSN acknowledgment, write transfers under each ImmediateData x
// InitialR2T combination with every refusal of a Data-Out, read splitting with phase-collapsed
// status, residuals, and the task table's answers to task management requests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

#include "iscsi/iscsi.h"

namespace shareblk::iscsi {
namespace {

// ---- serial numbers ---------------------------------------------------------------------------

TEST(SerialNumber, ComparesAcrossTheWrap) {
  EXPECT_TRUE(serial_less(1, 2));
  EXPECT_FALSE(serial_less(2, 1));
  EXPECT_FALSE(serial_less(7, 7));
  EXPECT_TRUE(serial_less(0xffffffff, 0));
  EXPECT_TRUE(serial_less(0xfffffff0, 5));
  EXPECT_FALSE(serial_less(5, 0xfffffff0));
  // Exactly 2^31 apart: undefined in RFC 1982, so unordered both ways.
  EXPECT_FALSE(serial_less(0, 0x80000000));
  EXPECT_FALSE(serial_less(0x80000000, 0));
  EXPECT_TRUE(serial_less(0, 0x7fffffff));
  EXPECT_TRUE(serial_less_equal(3, 3));
}

// ---- CommandWindow ----------------------------------------------------------------------------

CommandWindow window(uint32_t exp, uint32_t depth, uint32_t immediate_depth = 8) {
  return CommandWindow(CommandWindowConfig{exp, depth, immediate_depth});
}

TEST(CommandWindow, InOrderDeliveryAndMaxCmdSnMovesOnCompletion) {
  CommandWindow w = window(10, 4);
  EXPECT_EQ(w.exp_cmd_sn(), 10U);
  EXPECT_EQ(w.max_cmd_sn(), 13U);
  EXPECT_EQ(w.accept(10, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(w.exp_cmd_sn(), 11U);
  EXPECT_EQ(w.max_cmd_sn(), 13U);  // delivering keeps MaxCmdSN
  EXPECT_EQ(w.accept(11, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(w.accept(12, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(w.accept(13, false), CmdSnVerdict::Deliver);
  // Four outstanding: the window is closed, MaxCmdSN = ExpCmdSN - 1.
  EXPECT_EQ(w.outstanding(), 4U);
  EXPECT_EQ(w.max_cmd_sn(), 13U);
  EXPECT_EQ(w.exp_cmd_sn(), 14U);
  EXPECT_EQ(w.accept(14, false), CmdSnVerdict::OutsideWindow);
  ASSERT_TRUE(w.completed(false));
  EXPECT_EQ(w.max_cmd_sn(), 14U);
  EXPECT_EQ(w.accept(14, false), CmdSnVerdict::Deliver);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(w.completed(false));
  EXPECT_FALSE(w.completed(false));  // nothing outstanding
  EXPECT_EQ(w.max_cmd_sn(), 18U);
}

TEST(CommandWindow, OutOfOrderIsHeldUntilTheGapFills) {
  CommandWindow w = window(100, 8);
  EXPECT_EQ(w.accept(102, false), CmdSnVerdict::Hold);
  EXPECT_EQ(w.accept(101, false), CmdSnVerdict::Hold);
  EXPECT_EQ(w.accept(104, false), CmdSnVerdict::Hold);
  EXPECT_EQ(w.held(), 3U);
  EXPECT_EQ(w.take_ready(), std::nullopt);  // 100 is missing
  EXPECT_EQ(w.exp_cmd_sn(), 100U);
  EXPECT_EQ(w.accept(100, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(w.take_ready(), 101U);
  EXPECT_EQ(w.take_ready(), 102U);
  EXPECT_EQ(w.take_ready(), std::nullopt);  // 103 is missing
  EXPECT_EQ(w.exp_cmd_sn(), 103U);
  EXPECT_EQ(w.accept(103, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(w.take_ready(), 104U);
  EXPECT_EQ(w.held(), 0U);
  EXPECT_EQ(w.outstanding(), 5U);
  EXPECT_EQ(w.max_cmd_sn(), 100U + 8 - 1);  // nothing completed: MaxCmdSN never moved
}

TEST(CommandWindow, DuplicatesAndOutOfWindowAreIgnored) {
  CommandWindow w = window(50, 4);
  EXPECT_EQ(w.accept(50, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(w.accept(50, false), CmdSnVerdict::Duplicate);  // already delivered
  EXPECT_EQ(w.accept(49, false), CmdSnVerdict::Duplicate);  // before ExpCmdSN
  EXPECT_EQ(w.accept(52, false), CmdSnVerdict::Hold);
  EXPECT_EQ(w.accept(52, false), CmdSnVerdict::Duplicate);  // already held
  EXPECT_EQ(w.held(), 1U);
  // MaxCmdSN is 53: 54 is outside, and so is anything far ahead or unordered.
  EXPECT_EQ(w.max_cmd_sn(), 53U);
  EXPECT_EQ(w.accept(53, false), CmdSnVerdict::Hold);
  EXPECT_EQ(w.accept(54, false), CmdSnVerdict::OutsideWindow);
  EXPECT_EQ(w.accept(50 + 0x80000000U, false), CmdSnVerdict::OutsideWindow);
  EXPECT_EQ(w.accept(1000, false), CmdSnVerdict::OutsideWindow);
  EXPECT_EQ(w.exp_cmd_sn(), 51U);  // ignored commands changed nothing
  EXPECT_EQ(w.held(), 2U);
}

TEST(CommandWindow, WrapsAt32Bits) {
  CommandWindow w = window(0xfffffffe, 4);
  EXPECT_EQ(w.max_cmd_sn(), 1U);
  EXPECT_EQ(w.accept(0, false), CmdSnVerdict::Hold);
  EXPECT_EQ(w.accept(1, false), CmdSnVerdict::Hold);
  EXPECT_EQ(w.accept(2, false), CmdSnVerdict::OutsideWindow);
  EXPECT_EQ(w.accept(0xfffffffd, false), CmdSnVerdict::Duplicate);
  EXPECT_EQ(w.accept(0xfffffffe, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(w.take_ready(), std::nullopt);
  EXPECT_EQ(w.accept(0xffffffff, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(w.take_ready(), 0U);
  EXPECT_EQ(w.take_ready(), 1U);
  EXPECT_EQ(w.exp_cmd_sn(), 2U);
  EXPECT_EQ(w.accept(0xffffffff, false), CmdSnVerdict::Duplicate);
  EXPECT_EQ(w.accept(0, false), CmdSnVerdict::Duplicate);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(w.completed(false));
  EXPECT_EQ(w.max_cmd_sn(), 5U);
}

TEST(CommandWindow, ImmediateCommandsBypassOrderAndHaveTheirOwnBound) {
  CommandWindow w = window(7, 2, 2);
  EXPECT_EQ(w.accept(7, true), CmdSnVerdict::Immediate);
  EXPECT_EQ(w.exp_cmd_sn(), 7U);  // not advanced
  EXPECT_EQ(w.max_cmd_sn(), 8U);  // and no window slot taken
  EXPECT_EQ(w.accept(7, true), CmdSnVerdict::Immediate);
  EXPECT_EQ(w.accept(7, true), CmdSnVerdict::ImmediateRejected);
  EXPECT_EQ(w.outstanding_immediate(), 2U);
  // An immediate command is not ordered even with a CmdSN outside the window.
  ASSERT_TRUE(w.completed(true));
  EXPECT_EQ(w.accept(5000, true), CmdSnVerdict::Immediate);
  // The non-immediate command with the same CmdSN is still expected.
  EXPECT_EQ(w.accept(7, false), CmdSnVerdict::Deliver);
  ASSERT_TRUE(w.completed(true));
  ASSERT_TRUE(w.completed(true));
  EXPECT_FALSE(w.completed(true));
  EXPECT_EQ(w.outstanding(), 1U);
}

TEST(CommandWindow, DepthIsClamped) {
  CommandWindow zero = window(0, 0);
  EXPECT_EQ(zero.max_cmd_sn(), 0U);  // at least one command
  EXPECT_EQ(zero.accept(0, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(zero.accept(1, false), CmdSnVerdict::OutsideWindow);
  CommandWindow huge = window(0, 0xffffffff);
  EXPECT_EQ(huge.max_cmd_sn(), kMaxCommandDepth - 1);
  EXPECT_EQ(huge.accept(kMaxCommandDepth, false), CmdSnVerdict::OutsideWindow);
}

TEST(CommandWindow, ConsumedCmdSnIsPassedAndIgnoredWhenItComes) {
  CommandWindow w = window(20, 8);
  EXPECT_EQ(w.accept(22, false), CmdSnVerdict::Hold);
  EXPECT_EQ(w.accept(24, false), CmdSnVerdict::Hold);
  ASSERT_TRUE(w.consume(21));
  EXPECT_FALSE(w.consume(21));  // once
  EXPECT_FALSE(w.consume(40));  // outside
  ASSERT_TRUE(w.consume(24));   // held: never delivered
  EXPECT_EQ(w.held(), 1U);
  EXPECT_EQ(w.accept(21, false), CmdSnVerdict::Duplicate);
  EXPECT_EQ(w.accept(24, false), CmdSnVerdict::Duplicate);
  EXPECT_EQ(w.accept(20, false), CmdSnVerdict::Deliver);
  EXPECT_EQ(w.exp_cmd_sn(), 22U);  // 21 passed
  EXPECT_EQ(w.take_ready(), 22U);
  EXPECT_EQ(w.take_ready(), std::nullopt);
  ASSERT_TRUE(w.consume(23));  // ExpCmdSN itself: passed at once, and 24 after it
  EXPECT_EQ(w.exp_cmd_sn(), 25U);
  EXPECT_EQ(w.held(), 0U);
  EXPECT_EQ(w.outstanding(), 2U);
  EXPECT_EQ(w.max_cmd_sn(), 25U + 8 - 2 - 1);
}

// ---- StatSequence -----------------------------------------------------------------------------

TEST(StatSequence, TakesPeeksAndChecksAcknowledgments) {
  StatSequence s(0xfffffffe);
  EXPECT_EQ(s.peek(), 0xfffffffeU);
  EXPECT_EQ(s.take(), 0xfffffffeU);
  EXPECT_EQ(s.take(), 0xffffffffU);
  EXPECT_EQ(s.take(), 0U);
  EXPECT_EQ(s.peek(), 1U);
  EXPECT_EQ(s.unacknowledged(), 3U);
  EXPECT_EQ(s.acknowledge(0xffffffff), AckVerdict::Ok);
  EXPECT_EQ(s.unacknowledged(), 2U);
  EXPECT_EQ(s.acknowledge(0xfffffffe), AckVerdict::Stale);  // overtaken, older
  EXPECT_EQ(s.acknowledge(2), AckVerdict::Invalid);         // never sent
  EXPECT_EQ(s.acknowledge(1), AckVerdict::Ok);              // everything
  EXPECT_EQ(s.unacknowledged(), 0U);
  EXPECT_EQ(s.acknowledge(1), AckVerdict::Ok);  // repeated
  EXPECT_EQ(s.acknowledge(1 + 0x80000000U), AckVerdict::Invalid);
}

// ---- Residuals --------------------------------------------------------------------------------

TEST(Residual, UnderflowOverflowAndExact) {
  EXPECT_EQ(residual_for(4096, 4096), (Residual{false, false, 0}));
  EXPECT_EQ(residual_for(4096, 1024), (Residual{false, true, 3072}));
  EXPECT_EQ(residual_for(1024, 4096), (Residual{true, false, 3072}));
  EXPECT_EQ(residual_for(0, 512), (Residual{true, false, 512}));
  EXPECT_EQ(residual_for(512, 0), (Residual{false, true, 512}));
  EXPECT_EQ(residual_for(0, uint64_t{1} << 40), (Residual{true, false, 0xffffffff}));
}

// ---- WriteTransfer ----------------------------------------------------------------------------

constexpr uint32_t kTtt = 0x1234;

SessionParams params(bool immediate_data, bool initial_r2t) {
  SessionParams p;
  p.immediate_data = immediate_data;
  p.initial_r2t = initial_r2t;
  p.target_max_recv_data_segment_length = 8192;
  p.initiator_max_recv_data_segment_length = 4096;
  p.first_burst_length = 16384;
  p.max_burst_length = 32768;
  return p;
}

Bhs command(uint32_t edtl, uint32_t immediate, bool final) {
  Bhs bhs;
  bhs.final = final;
  bhs.data_segment_length = immediate;
  ScsiCommand fields;
  fields.write = true;
  fields.expected_data_transfer_length = edtl;
  bhs.fields = fields;
  return bhs;
}

Bhs data_out(uint32_t ttt, uint32_t data_sn, uint32_t offset, uint32_t length, bool final) {
  Bhs bhs;
  bhs.final = final;
  bhs.data_segment_length = length;
  DataOut fields;
  fields.target_transfer_tag = ttt;
  fields.data_sn = data_sn;
  fields.buffer_offset = offset;
  bhs.fields = fields;
  return bhs;
}

WriteTransfer started(const SessionParams& p, const Bhs& cmd) {
  auto result = WriteTransfer::start(p, cmd, kTtt);
  EXPECT_TRUE(std::holds_alternative<WriteTransfer>(result));
  return std::get<WriteTransfer>(result);
}

DataOutAccepted accepted(WriteTransfer& t, const Bhs& pdu) {
  auto result = t.data_out(pdu);
  EXPECT_TRUE(std::holds_alternative<DataOutAccepted>(result))
      << "refused: " << static_cast<int>(std::get<WriteError>(result));
  return std::holds_alternative<DataOutAccepted>(result) ? std::get<DataOutAccepted>(result)
                                                         : DataOutAccepted{};
}

std::optional<WriteError> refusal(WriteTransfer& t, const Bhs& pdu) {
  auto result = t.data_out(pdu);
  if (const auto* error = std::get_if<WriteError>(&result)) return *error;
  return std::nullopt;
}

// Sends a solicited burst for `r2t` in segments of `segment` bytes, each expected to be taken.
void send_burst(WriteTransfer& t, const R2t& r2t, uint32_t segment) {
  uint32_t offset = r2t.buffer_offset;
  const uint32_t end = r2t.buffer_offset + r2t.desired_data_transfer_length;
  for (uint32_t sn = 0; offset < end; ++sn) {
    const uint32_t length = std::min(segment, end - offset);
    const DataOutAccepted a =
        accepted(t, data_out(r2t.target_transfer_tag, sn, offset, length, offset + length == end));
    EXPECT_EQ(a.buffer_offset, offset);
    EXPECT_EQ(a.sequence_done, offset + length == end);
    offset += length;
  }
}

// ImmediateData=No, InitialR2T=Yes: everything solicited, in MaxBurstLength R2Ts.
TEST(WriteTransfer, NoImmediateInitialR2tSeveralBursts) {
  const SessionParams p = params(false, true);
  WriteTransfer t = started(p, command(80000, 0, true));
  std::vector<R2t> r2ts;
  while (auto r2t = t.next_r2t()) {
    EXPECT_EQ(t.next_r2t(), std::nullopt);  // MaxOutstandingR2T=1
    r2ts.push_back(*r2t);
    send_burst(t, *r2t, 8192);
  }
  ASSERT_EQ(r2ts.size(), 3U);
  EXPECT_EQ(r2ts[0].r2t_sn, 0U);
  EXPECT_EQ(r2ts[0].buffer_offset, 0U);
  EXPECT_EQ(r2ts[0].desired_data_transfer_length, 32768U);
  EXPECT_EQ(r2ts[1].r2t_sn, 1U);
  EXPECT_EQ(r2ts[1].buffer_offset, 32768U);
  EXPECT_EQ(r2ts[2].r2t_sn, 2U);
  EXPECT_EQ(r2ts[2].buffer_offset, 65536U);
  EXPECT_EQ(r2ts[2].desired_data_transfer_length, 80000U - 65536U);
  EXPECT_EQ(r2ts[2].target_transfer_tag, kTtt);
  EXPECT_TRUE(t.done());
}

TEST(WriteTransfer, NoImmediateRefusesImmediateData) {
  const auto result = WriteTransfer::start(params(false, true), command(4096, 512, true), kTtt);
  EXPECT_EQ(std::get<WriteError>(result), WriteError::ImmediateDataNotAllowed);
}

// ImmediateData=Yes, InitialR2T=Yes: immediate data, then R2Ts from where it ends.
TEST(WriteTransfer, ImmediateThenSolicited) {
  const SessionParams p = params(true, true);
  WriteTransfer t = started(p, command(40000, 8192, true));
  EXPECT_EQ(t.immediate_length(), 8192U);
  EXPECT_EQ(t.received(), 8192U);
  auto r2t = t.next_r2t();
  ASSERT_TRUE(r2t);
  EXPECT_EQ(r2t->buffer_offset, 8192U);
  EXPECT_EQ(r2t->desired_data_transfer_length, 40000U - 8192U);
  EXPECT_EQ(t.next_r2t(), std::nullopt);
  send_burst(t, *r2t, 8192);
  EXPECT_TRUE(t.done());
  EXPECT_EQ(t.next_r2t(), std::nullopt);
  // Any Data-Out now is one too many.
  EXPECT_EQ(refusal(t, data_out(kTtt, 4, 40000, 1, true)), WriteError::NoOpenBurst);
}

TEST(WriteTransfer, ImmediateDataCoveringEverything) {
  WriteTransfer t = started(params(true, true), command(4096, 4096, true));
  EXPECT_TRUE(t.done());
  EXPECT_EQ(t.next_r2t(), std::nullopt);
}

TEST(WriteTransfer, InitialR2tRefusesUnsolicitedDataOut) {
  const SessionParams p = params(true, true);
  // The command's F=0 announces unsolicited Data-Out, which InitialR2T=Yes forbids.
  EXPECT_EQ(std::get<WriteError>(WriteTransfer::start(p, command(40000, 0, false), kTtt)),
            WriteError::UnsolicitedNotAllowed);
  WriteTransfer t = started(p, command(40000, 0, true));
  EXPECT_EQ(refusal(t, data_out(kReservedTag, 0, 0, 4096, false)),
            WriteError::UnsolicitedNotAllowed);
}

// ImmediateData=No, InitialR2T=No: an unsolicited sequence up to FirstBurstLength, then R2Ts.
TEST(WriteTransfer, UnsolicitedThenSolicited) {
  const SessionParams p = params(false, false);
  WriteTransfer t = started(p, command(50000, 0, false));
  EXPECT_EQ(t.next_r2t(), std::nullopt);  // not before the unsolicited sequence ends
  EXPECT_FALSE(accepted(t, data_out(kReservedTag, 0, 0, 8192, false)).sequence_done);
  const DataOutAccepted last = accepted(t, data_out(kReservedTag, 1, 8192, 8192, true));
  EXPECT_TRUE(last.sequence_done);
  EXPECT_FALSE(last.transfer_done);
  auto r2t = t.next_r2t();
  ASSERT_TRUE(r2t);
  EXPECT_EQ(r2t->r2t_sn, 0U);
  EXPECT_EQ(r2t->buffer_offset, 16384U);
  EXPECT_EQ(r2t->desired_data_transfer_length, 32768U);  // MaxBurstLength
  send_burst(t, *r2t, 8192);
  r2t = t.next_r2t();
  ASSERT_TRUE(r2t);
  EXPECT_EQ(r2t->r2t_sn, 1U);
  EXPECT_EQ(r2t->buffer_offset, 16384U + 32768U);
  EXPECT_EQ(r2t->desired_data_transfer_length, 50000U - 16384U - 32768U);
  send_burst(t, *r2t, 8192);
  EXPECT_TRUE(t.done());
}

// ImmediateData=Yes, InitialR2T=No: immediate data counts in the first burst.
TEST(WriteTransfer, ImmediateUnsolicitedThenSolicited) {
  const SessionParams p = params(true, false);
  WriteTransfer t = started(p, command(100000, 4096, false));
  EXPECT_EQ(refusal(t, data_out(kReservedTag, 0, 4096, 8192, true)), WriteError::EarlyFinal);
  WriteTransfer u = started(p, command(100000, 4096, false));
  accepted(u, data_out(kReservedTag, 0, 4096, 8192, false));
  EXPECT_EQ(refusal(u, data_out(kReservedTag, 1, 12288, 8192, true)), WriteError::BurstOverrun);
  WriteTransfer v = started(p, command(100000, 4096, false));
  accepted(v, data_out(kReservedTag, 0, 4096, 8192, false));
  EXPECT_TRUE(accepted(v, data_out(kReservedTag, 1, 12288, 4096, true)).sequence_done);
  uint32_t bursts = 0;
  while (auto r2t = v.next_r2t()) {
    EXPECT_EQ(r2t->r2t_sn, bursts++);
    send_burst(v, *r2t, 8192);
  }
  EXPECT_EQ(bursts, 3U);  // 83616 bytes left: 32768 + 32768 + 18080
  EXPECT_TRUE(v.done());
}

TEST(WriteTransfer, UnsolicitedSequenceSmallerThanFirstBurst) {
  // EDTL below FirstBurstLength: the unsolicited sequence is the whole transfer.
  WriteTransfer t = started(params(true, false), command(6000, 2000, false));
  const DataOutAccepted a = accepted(t, data_out(kReservedTag, 0, 2000, 4000, true));
  EXPECT_TRUE(a.transfer_done);
  EXPECT_EQ(t.next_r2t(), std::nullopt);
}

TEST(WriteTransfer, CommandFinalWithImmediateOnlyThenR2t) {
  // InitialR2T=No but F=1: the initiator sends no unsolicited Data-Out; R2Ts do the rest.
  WriteTransfer t = started(params(true, false), command(20000, 1000, true));
  EXPECT_EQ(refusal(t, data_out(kReservedTag, 0, 1000, 1000, false)),
            WriteError::UnsolicitedNotAllowed);
  auto r2t = t.next_r2t();
  ASSERT_TRUE(r2t);
  EXPECT_EQ(r2t->buffer_offset, 1000U);
  EXPECT_EQ(r2t->desired_data_transfer_length, 19000U);
}

TEST(WriteTransfer, CommandRefusals) {
  const SessionParams p = params(true, false);
  EXPECT_EQ(std::get<WriteError>(WriteTransfer::start(p, command(4096, 8193, true), kTtt)),
            WriteError::SegmentTooLong);
  EXPECT_EQ(std::get<WriteError>(WriteTransfer::start(p, command(1000, 2000, true), kTtt)),
            WriteError::BeyondExpectedLength);
  SessionParams small = p;
  small.first_burst_length = 4096;
  EXPECT_EQ(std::get<WriteError>(WriteTransfer::start(small, command(9000, 8000, true), kTtt)),
            WriteError::FirstBurstExceeded);
  // F=0 with the first burst already full of immediate data.
  EXPECT_EQ(std::get<WriteError>(WriteTransfer::start(small, command(9000, 4096, false), kTtt)),
            WriteError::UnsolicitedNotAllowed);
}

// An initiator that follows the rules, for each ImmediateData x InitialR2T combination and
// lengths around the segment, first-burst and burst boundaries: every transfer completes, with
// the R2Ts an initiator expects and nothing refused.
TEST(WriteTransfer, EveryCombinationCompletesAtBoundaryLengths) {
  for (bool immediate_data : {false, true}) {
    for (bool initial_r2t : {false, true}) {
      const SessionParams p = params(immediate_data, initial_r2t);
      for (uint32_t edtl : {1U, 511U, 8192U, 8193U, 16383U, 16384U, 16385U, 32768U, 49152U, 49153U,
                            100000U, 1048576U}) {
        SCOPED_TRACE(testing::Message() << "ImmediateData=" << immediate_data
                                        << " InitialR2T=" << initial_r2t << " EDTL=" << edtl);
        const uint32_t first_burst = std::min(p.first_burst_length, edtl);
        const uint32_t immediate =
            immediate_data ? std::min(first_burst, p.target_max_recv_data_segment_length) : 0;
        const bool unsolicited = !initial_r2t && immediate < first_burst;
        WriteTransfer t = started(p, command(edtl, immediate, !unsolicited));
        uint32_t offset = immediate;
        for (uint32_t sn = 0; unsolicited && offset < first_burst; ++sn) {
          const uint32_t length =
              std::min(p.target_max_recv_data_segment_length, first_burst - offset);
          accepted(t, data_out(kReservedTag, sn, offset, length, offset + length == first_burst));
          offset += length;
        }
        uint32_t r2t_sn = 0;
        while (auto r2t = t.next_r2t()) {
          EXPECT_EQ(r2t->r2t_sn, r2t_sn++);
          EXPECT_EQ(r2t->buffer_offset, offset);
          EXPECT_LE(r2t->desired_data_transfer_length, p.max_burst_length);
          send_burst(t, *r2t, p.target_max_recv_data_segment_length);
          offset += r2t->desired_data_transfer_length;
        }
        EXPECT_TRUE(t.done());
        EXPECT_EQ(offset, edtl);
      }
    }
  }
}

class DataOutRefusals : public ::testing::Test {
 protected:
  void SetUp() override {
    transfer_.emplace(started(params(false, true), command(65536, 0, true)));
    r2t_ = *transfer_->next_r2t();
  }
  WriteTransfer& t() { return *transfer_; }
  std::optional<WriteTransfer> transfer_;
  R2t r2t_;
};

TEST_F(DataOutRefusals, BadTargetTransferTag) {
  EXPECT_EQ(refusal(t(), data_out(kTtt + 1, 0, 0, 4096, false)), WriteError::BadTargetTransferTag);
  EXPECT_EQ(reject_reason_for(WriteError::BadTargetTransferTag), RejectReason::InvalidPduField);
  EXPECT_EQ(reject_reason_for(WriteError::DataSnOutOfOrder), RejectReason::ProtocolError);
}

TEST_F(DataOutRefusals, SkippedDataSn) {
  accepted(t(), data_out(kTtt, 0, 0, 4096, false));
  EXPECT_EQ(refusal(t(), data_out(kTtt, 2, 4096, 4096, false)), WriteError::DataSnOutOfOrder);
  EXPECT_EQ(refusal(t(), data_out(kTtt, 0, 4096, 4096, false)), WriteError::DataSnOutOfOrder);
}

TEST_F(DataOutRefusals, OverlappingAndGappedOffsets) {
  accepted(t(), data_out(kTtt, 0, 0, 4096, false));
  EXPECT_EQ(refusal(t(), data_out(kTtt, 1, 2048, 4096, false)), WriteError::BadBufferOffset);
  EXPECT_EQ(refusal(t(), data_out(kTtt, 1, 8192, 4096, false)), WriteError::BadBufferOffset);
  EXPECT_EQ(t().received(), 4096U);  // refusals changed nothing
  accepted(t(), data_out(kTtt, 1, 4096, 4096, false));
}

TEST_F(DataOutRefusals, OversizedSegment) {
  EXPECT_EQ(refusal(t(), data_out(kTtt, 0, 0, 8193, false)), WriteError::SegmentTooLong);
}

TEST_F(DataOutRefusals, PastTheBurstAndPastTheExpectedLength) {
  for (uint32_t sn = 0; sn < 3; ++sn) accepted(t(), data_out(kTtt, sn, sn * 8192, 8192, false));
  // 24576 of the 32768 burst are in: 8192 more ends it, more is an overrun.
  EXPECT_EQ(refusal(t(), data_out(kTtt, 3, 24576, 8192 + 1, true)), WriteError::SegmentTooLong);
  EXPECT_EQ(refusal(t(), data_out(kTtt, 3, 24576, 4096, true)), WriteError::EarlyFinal);
  EXPECT_EQ(refusal(t(), data_out(kTtt, 3, 24576, 8192, false)), WriteError::MissingFinal);
  EXPECT_TRUE(accepted(t(), data_out(kTtt, 3, 24576, 8192, true)).sequence_done);
  // The second burst: its R2T asks for the last 32768 bytes; more goes past EDTL.
  const R2t second = *t().next_r2t();
  EXPECT_EQ(second.r2t_sn, 1U);
  for (uint32_t sn = 0; sn < 3; ++sn) {
    accepted(t(), data_out(kTtt, sn, 32768 + sn * 8192, 8192, false));
  }
  EXPECT_EQ(refusal(t(), data_out(kTtt, 3, 57344, 8192 + 100, true)), WriteError::SegmentTooLong);
  SessionParams wide = params(false, true);
  wide.target_max_recv_data_segment_length = 65536;
  WriteTransfer w = started(wide, command(10000, 0, true));
  const R2t only = *w.next_r2t();
  EXPECT_EQ(only.desired_data_transfer_length, 10000U);
  EXPECT_EQ(refusal(w, data_out(kTtt, 0, 0, 10001, true)), WriteError::BeyondExpectedLength);
  EXPECT_EQ(refusal(w, data_out(kTtt, 0, 0, 0xffffffff, true)), WriteError::SegmentTooLong);
}

TEST_F(DataOutRefusals, BurstOverrunWithinTheExpectedLength) {
  SessionParams wide = params(false, true);
  wide.target_max_recv_data_segment_length = 65536;
  WriteTransfer w = started(wide, command(65536, 0, true));
  const R2t first = *w.next_r2t();
  EXPECT_EQ(first.desired_data_transfer_length, 32768U);
  EXPECT_EQ(refusal(w, data_out(kTtt, 0, 0, 40000, true)), WriteError::BurstOverrun);
}

TEST_F(DataOutRefusals, UnsolicitedDataOutWhileSolicitedAndNotADataOut) {
  EXPECT_EQ(refusal(t(), data_out(kReservedTag, 0, 0, 4096, false)),
            WriteError::UnsolicitedNotAllowed);
  EXPECT_EQ(refusal(t(), command(1, 0, true)), WriteError::NotDataOut);
}

TEST(WriteTransfer, SolicitedTagDuringTheUnsolicitedSequence) {
  WriteTransfer t = started(params(false, false), command(50000, 0, false));
  EXPECT_EQ(refusal(t, data_out(kTtt, 0, 0, 4096, false)), WriteError::BadTargetTransferTag);
}

// ---- ReadTransfer -----------------------------------------------------------------------------

std::vector<DataInPdu> all(ReadTransfer& r) {
  std::vector<DataInPdu> out;
  while (auto pdu = r.next()) out.push_back(*pdu);
  return out;
}

const DataIn& in(const DataInPdu& pdu) {
  return std::get<DataIn>(pdu.header.fields);
}

TEST(ReadTransfer, SplitsAtTheInitiatorsSegmentLength) {
  SessionParams p = params(true, true);  // the initiator takes 4096 a PDU
  ReadTransfer r(p, 10000, 10000, 0x77, 0, false);
  const auto pdus = all(r);
  ASSERT_EQ(pdus.size(), 3U);
  uint32_t offset = 0;
  for (uint32_t i = 0; i < pdus.size(); ++i) {
    EXPECT_EQ(in(pdus[i]).data_sn, i);
    EXPECT_EQ(in(pdus[i]).buffer_offset, offset);
    EXPECT_EQ(pdus[i].header.initiator_task_tag, 0x77U);
    EXPECT_EQ(pdus[i].header.data_segment_length, pdus[i].length);
    EXPECT_FALSE(in(pdus[i]).status_present);
    EXPECT_EQ(pdus[i].header.final, i == 2);
    offset += pdus[i].length;
  }
  EXPECT_EQ(pdus[2].length, 10000U - 8192U);
  EXPECT_FALSE(r.status_in_data());
  EXPECT_EQ(r.next(), std::nullopt);
}

TEST(ReadTransfer, ExactMultipleOfTheSegmentLength) {
  ReadTransfer r(params(true, true), 8192, 8192, 1, 0, false);
  const auto pdus = all(r);
  ASSERT_EQ(pdus.size(), 2U);
  EXPECT_EQ(pdus[1].length, 4096U);
  EXPECT_TRUE(pdus[1].header.final);
}

TEST(ReadTransfer, FinalEndsEachMaxBurstSequence) {
  SessionParams p = params(true, true);
  p.max_burst_length = 6000;  // not a multiple of the segment length
  ReadTransfer r(p, 14000, 14000, 1, 0, false);
  const auto pdus = all(r);
  std::vector<uint32_t> lengths;
  std::vector<bool> finals;
  for (const auto& pdu : pdus) {
    lengths.push_back(pdu.length);
    finals.push_back(pdu.header.final);
  }
  EXPECT_EQ(lengths, (std::vector<uint32_t>{4096, 1904, 4096, 1904, 2000}));
  EXPECT_EQ(finals, (std::vector<bool>{false, true, false, true, true}));
  EXPECT_EQ(in(pdus.back()).data_sn, 4U);  // DataSN runs across sequences
}

TEST(ReadTransfer, PhaseCollapsedStatusWithUnderflow) {
  ReadTransfer r(params(true, true), 8192, 5000, 9, 0x0001000000000000, true);
  const auto pdus = all(r);
  ASSERT_EQ(pdus.size(), 2U);
  EXPECT_FALSE(in(pdus[0]).status_present);
  const DataIn& last = in(pdus[1]);
  EXPECT_TRUE(pdus[1].header.final);
  EXPECT_TRUE(last.status_present);
  EXPECT_EQ(last.status, 0);
  EXPECT_TRUE(last.residual_underflow);
  EXPECT_FALSE(last.residual_overflow);
  EXPECT_EQ(last.residual_count, 3192U);
  EXPECT_EQ(pdus[1].header.lun, 0x0001000000000000U);
  EXPECT_TRUE(r.status_in_data());
  // It encodes and decodes as a Data-In with S and F.
  const auto bytes = encode_bhs(pdus[1].header);
  const DecodeResult back = decode_bhs(bytes, DecodeLimits{kMaxDataSegmentLength, 0, false});
  ASSERT_TRUE(std::holds_alternative<Bhs>(back));
  EXPECT_TRUE(std::get<DataIn>(std::get<Bhs>(back).fields).status_present);
}

TEST(ReadTransfer, OverflowSendsOnlyTheExpectedLength) {
  ReadTransfer r(params(true, true), 4096, 16384, 9, 0, true);
  const auto pdus = all(r);
  ASSERT_EQ(pdus.size(), 1U);
  EXPECT_EQ(pdus[0].length, 4096U);
  EXPECT_TRUE(in(pdus[0]).residual_overflow);
  EXPECT_EQ(in(pdus[0]).residual_count, 12288U);
  EXPECT_EQ(r.residual(), (Residual{true, false, 12288}));
}

TEST(ReadTransfer, NothingToSendLeavesTheStatusToTheResponse) {
  ReadTransfer r(params(true, true), 4096, 0, 9, 0, true);
  EXPECT_EQ(r.next(), std::nullopt);
  EXPECT_FALSE(r.status_in_data());
  EXPECT_EQ(r.residual(), (Residual{false, true, 4096}));
}

// ---- TaskTable --------------------------------------------------------------------------------

TaskMgmtRequest tmf(TmfFunction function, uint32_t ref_tag = kReservedTag, uint32_t cmd_sn = 0,
                    uint32_t ref_cmd_sn = 0) {
  TaskMgmtRequest r;
  r.function = static_cast<uint8_t>(function);
  r.referenced_task_tag = ref_tag;
  r.cmd_sn = cmd_sn;
  r.ref_cmd_sn = ref_cmd_sn;
  return r;
}

TEST(TaskTable, AddFindRemove) {
  TaskTable tasks;
  EXPECT_TRUE(tasks.add({1, 0, 10}));
  EXPECT_FALSE(tasks.add({1, 0, 11}));  // tag in use
  EXPECT_FALSE(tasks.add({kReservedTag, 0, 12}));
  ASSERT_NE(tasks.find(1), nullptr);
  EXPECT_EQ(tasks.find(1)->cmd_sn, 10U);
  EXPECT_TRUE(tasks.remove(1));
  EXPECT_FALSE(tasks.remove(1));
  EXPECT_EQ(tasks.size(), 0U);
}

TEST(TaskTable, AbortTask) {
  TaskTable tasks;
  ASSERT_TRUE(tasks.add({5, 0, 30}));
  ASSERT_TRUE(tasks.add({6, 1, 31}));
  CommandWindow w = window(32, 8);
  TmfDecision d = tasks.manage(tmf(TmfFunction::AbortTask, 5, 32, 30), 0, w, true);
  EXPECT_EQ(d.response, TmfResponse::FunctionComplete);
  EXPECT_EQ(d.abort, std::vector<uint32_t>{5});
  EXPECT_EQ(d.consume_cmd_sn, std::nullopt);
  // Task 6 is on LUN 1, not 0; and its CmdSN is before the window: does not exist.
  d = tasks.manage(tmf(TmfFunction::AbortTask, 6, 32, 31), 0, w, true);
  EXPECT_EQ(d.response, TmfResponse::TaskDoesNotExist);
  EXPECT_TRUE(d.abort.empty());
  // Not arrived yet: RefCmdSN within the window and before the TMF's CmdSN.
  d = tasks.manage(tmf(TmfFunction::AbortTask, 7, 35, 33), 0, w, true);
  EXPECT_EQ(d.response, TmfResponse::FunctionComplete);
  EXPECT_EQ(d.consume_cmd_sn, 33U);
  ASSERT_TRUE(w.consume(*d.consume_cmd_sn));
  EXPECT_EQ(w.accept(33, false), CmdSnVerdict::Duplicate);
  // RefCmdSN not before the TMF's own CmdSN, or outside the window: does not exist.
  d = tasks.manage(tmf(TmfFunction::AbortTask, 7, 33, 34), 0, w, true);
  EXPECT_EQ(d.response, TmfResponse::TaskDoesNotExist);
  d = tasks.manage(tmf(TmfFunction::AbortTask, 7, 100, 90), 0, w, true);
  EXPECT_EQ(d.response, TmfResponse::TaskDoesNotExist);
  d = tasks.manage(tmf(TmfFunction::AbortTask, 5, 32, 30), 3, w, false);
  EXPECT_EQ(d.response, TmfResponse::LunDoesNotExist);
}

TEST(TaskTable, TaskSetFunctionsAndUnsupportedOnes) {
  TaskTable tasks;
  ASSERT_TRUE(tasks.add({1, 0, 1}));
  ASSERT_TRUE(tasks.add({2, 1, 2}));
  ASSERT_TRUE(tasks.add({3, 0, 3}));
  const CommandWindow w = window(4, 8);
  for (TmfFunction f :
       {TmfFunction::AbortTaskSet, TmfFunction::ClearTaskSet, TmfFunction::LogicalUnitReset}) {
    const TmfDecision d = tasks.manage(tmf(f), 0, w, true);
    EXPECT_EQ(d.response, TmfResponse::FunctionComplete);
    EXPECT_EQ(d.abort, (std::vector<uint32_t>{1, 3}));
    EXPECT_EQ(tasks.manage(tmf(f), 9, w, false).response, TmfResponse::LunDoesNotExist);
  }
  for (TmfFunction f : {TmfFunction::ClearAca, TmfFunction::TargetWarmReset,
                        TmfFunction::TargetColdReset, TmfFunction::TaskReassign}) {
    EXPECT_EQ(tasks.manage(tmf(f), 0, w, true).response, TmfResponse::FunctionNotSupported);
  }
  for (uint8_t f : {0, 9, 15, 127}) {
    TaskMgmtRequest r = tmf(TmfFunction::AbortTask);
    r.function = f;
    const TmfDecision d = tasks.manage(r, 0, w, true);
    EXPECT_EQ(d.response, TmfResponse::FunctionRejected);
    EXPECT_TRUE(d.abort.empty());
  }
}

}  // namespace
}  // namespace shareblk::iscsi
