#include "control/revocation_journal.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <memory>

namespace shareblk::control {

namespace {

using Slot = std::array<char, RevocationJournal::kSlotSize>;
using Slots = std::array<Slot, RevocationJournal::kSlots>;

bool read_all(int fd, Slots& slots) {
  return ::pread(fd, slots.data(), sizeof slots, 0) == static_cast<ssize_t>(sizeof slots);
}

bool write_slot(int fd, size_t i, const Slot& slot) {
  return ::pwrite(fd, slot.data(), slot.size(), static_cast<off_t>(i * slot.size())) ==
             static_cast<ssize_t>(slot.size()) &&
         ::fdatasync(fd) == 0;
}

std::string id_of(const Slot& slot) {
  return std::string(slot.data(), strnlen(slot.data(), slot.size()));
}

}  // namespace

RevocationJournal::RevocationJournal(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  const auto size = static_cast<off_t>(kSlots * kSlotSize);
  int err = fd_ < 0 ? errno : ::posix_fallocate(fd_, 0, size);
  if (err == 0 && ::fsync(fd_) != 0) err = errno;
  if (err != 0) {
    spdlog::error(
        "control: cannot allocate the revocation journal {}: {}; a detach that the "
        "database cannot record will not survive a restart",
        path_, std::strerror(err));
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
}

RevocationJournal::~RevocationJournal() {
  if (fd_ >= 0) ::close(fd_);
}

bool RevocationJournal::record(const std::string& attachment_id) {
  std::lock_guard lock(mutex_);
  if (fd_ < 0 || attachment_id.empty() || attachment_id.size() >= kSlotSize) return false;
  auto slots = std::make_unique<Slots>();
  if (!read_all(fd_, *slots)) return false;
  size_t free_slot = kSlots;
  for (size_t i = 0; i < kSlots; ++i) {
    if (id_of((*slots)[i]) == attachment_id) return true;  // already there
    if ((*slots)[i][0] == '\0' && free_slot == kSlots) free_slot = i;
  }
  if (free_slot == kSlots) return false;  // full: as many unfinished revocations as slots
  Slot slot{};
  std::memcpy(slot.data(), attachment_id.data(), attachment_id.size());
  return write_slot(fd_, free_slot, slot);
}

void RevocationJournal::clear(const std::string& attachment_id) {
  std::lock_guard lock(mutex_);
  if (fd_ < 0) return;
  auto slots = std::make_unique<Slots>();
  if (!read_all(fd_, *slots)) return;
  for (size_t i = 0; i < kSlots; ++i) {
    if (id_of((*slots)[i]) == attachment_id) write_slot(fd_, i, Slot{});
  }
}

std::vector<std::string> RevocationJournal::pending() {
  std::lock_guard lock(mutex_);
  std::vector<std::string> ids;
  if (fd_ < 0) return ids;
  auto slots = std::make_unique<Slots>();
  if (!read_all(fd_, *slots)) return ids;
  for (const Slot& slot : *slots) {
    if (slot[0] != '\0') ids.push_back(id_of(slot));
  }
  return ids;
}

}  // namespace shareblk::control
