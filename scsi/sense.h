// One of scsi/'s public headers (scsi/scsi.h includes both): a refusal as a value (Sense), the
// refusals the block target gives as named constants, their bytes in fixed format and descriptor
// format (SPC-5, "Sense data"), and the one mapping from a backend errno to a sense.
//
// A Sense is what CHECK CONDITION carries: the sense key and the additional sense code and
// qualifier (SPC-5's assignments), and optionally the INFORMATION field and a sense key specific
// field pointer naming the byte, and maybe the bit, of the CDB or parameter list that was refused.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace shareblk::scsi {

// SAM-5 status codes this target returns.
inline constexpr uint8_t kStatusGood = 0x00;
inline constexpr uint8_t kStatusCheckCondition = 0x02;

// SPC-5's sense keys.
enum class SenseKey : uint8_t {
  NoSense = 0x0,
  RecoveredError = 0x1,
  NotReady = 0x2,
  MediumError = 0x3,
  HardwareError = 0x4,
  IllegalRequest = 0x5,
  UnitAttention = 0x6,
  DataProtect = 0x7,
  BlankCheck = 0x8,
  AbortedCommand = 0xb,
  Miscompare = 0xe,
};

// The sense-key-specific field pointer of ILLEGAL REQUEST (SPC-5, field pointer sense key specific
// data): which byte (and, when `bit` is set, which bit: BPV) of the CDB (`in_cdb`, the C/D bit) or
// of the parameter list was refused.
struct FieldPointer {
  bool in_cdb = true;
  uint16_t byte = 0;
  std::optional<uint8_t> bit;
  bool operator==(const FieldPointer&) const = default;
};

struct Sense {
  SenseKey key = SenseKey::NoSense;
  uint8_t asc = 0;
  uint8_t ascq = 0;
  std::optional<uint64_t> information;  // the INFORMATION field (VALID bit set when present)
  std::optional<FieldPointer> field;    // SKSV set when present
  bool operator==(const Sense&) const = default;
};

// The refusals (ASC/ASCQ as SPC-5 assigns them). Field pointers and INFORMATION are added by
// the functions below.
inline constexpr Sense kNoSense{};
inline constexpr Sense kInvalidCommandOperationCode{SenseKey::IllegalRequest, 0x20, 0x00};
inline constexpr Sense kLbaOutOfRange{SenseKey::IllegalRequest, 0x21, 0x00};
inline constexpr Sense kInvalidFieldInCdb{SenseKey::IllegalRequest, 0x24, 0x00};
inline constexpr Sense kLogicalUnitNotSupported{SenseKey::IllegalRequest, 0x25, 0x00};
inline constexpr Sense kInvalidFieldInParameterList{SenseKey::IllegalRequest, 0x26, 0x00};
inline constexpr Sense kParameterListLengthError{SenseKey::IllegalRequest, 0x1a, 0x00};
inline constexpr Sense kSavingParametersNotSupported{SenseKey::IllegalRequest, 0x39, 0x00};
inline constexpr Sense kWriteProtected{SenseKey::DataProtect, 0x27, 0x00};
inline constexpr Sense kSpaceAllocationFailedWriteProtect{SenseKey::DataProtect, 0x27, 0x07};
inline constexpr Sense kMiscompareDuringVerify{SenseKey::Miscompare, 0x1d, 0x00};
inline constexpr Sense kUnrecoveredReadError{SenseKey::MediumError, 0x11, 0x00};
inline constexpr Sense kWriteError{SenseKey::MediumError, 0x0c, 0x00};
inline constexpr Sense kInternalTargetFailure{SenseKey::HardwareError, 0x44, 0x00};
// Unit attentions (SAM-5, unit attention condition).
inline constexpr Sense kPowerOnReset{SenseKey::UnitAttention, 0x29, 0x00};
inline constexpr Sense kCapacityDataHasChanged{SenseKey::UnitAttention, 0x2a, 0x09};
inline constexpr Sense kReportedLunsDataHasChanged{SenseKey::UnitAttention, 0x3f, 0x0e};

// INVALID FIELD IN CDB pointing at `byte` (and `bit`) of the CDB.
Sense invalid_field_in_cdb(uint16_t byte, std::optional<uint8_t> bit = std::nullopt);
// INVALID FIELD IN PARAMETER LIST pointing at `byte` (and `bit`) of the parameter list.
Sense invalid_field_in_parameter_list(uint16_t byte, std::optional<uint8_t> bit = std::nullopt);
// MISCOMPARE DURING VERIFY OPERATION with the offset of the first differing byte in
// INFORMATION (SBC-4: COMPARE AND WRITE, VERIFY with BYTCHK).
Sense miscompare_at(uint64_t offset);

// What a request that the backend failed with positive errno `err` answers: the one home of
// this mapping. `write` says whether the request changed the medium (a write, write same,
// unmap, or the write half of COMPARE AND WRITE), which picks between the two medium errors.
//   EIO                      MEDIUM ERROR, UNRECOVERED READ ERROR (11/00) or WRITE ERROR (0C/00)
//   ENOSPC, EDQUOT, EFBIG    DATA PROTECT, SPACE ALLOCATION FAILED WRITE PROTECT (27/07)
//   EPERM, EROFS, EACCES     DATA PROTECT, WRITE PROTECTED (27/00): a read-only attachment or a
//                            revoked write access (backend/backend.h, Handle::admit())
//   anything else            HARDWARE ERROR, INTERNAL TARGET FAILURE (44/00)
Sense sense_for_errno(int err, bool write);

inline constexpr std::size_t kFixedSenseLength = 18;
// Fixed format, response code 0x70 (current error; SPC-5 fixed format sense data). INFORMATION
// holds 32 bits: a larger value is left out with VALID clear.
std::array<uint8_t, kFixedSenseLength> encode_fixed(const Sense& sense);
// Descriptor format, response code 0x72: the header, then an Information descriptor and a
// sense key specific descriptor when the sense has them.
std::vector<uint8_t> encode_descriptor(const Sense& sense);
// Either of the two, as the D_SENSE bit of the control mode page or REQUEST SENSE's DESC asks.
std::vector<uint8_t> encode_sense(const Sense& sense, bool descriptor_format);

// Reads a sense back from either format (for tests and the fuzzer); nullopt when the bytes are
// neither.
std::optional<Sense> decode_sense(std::span<const uint8_t> bytes);

}  // namespace shareblk::scsi
