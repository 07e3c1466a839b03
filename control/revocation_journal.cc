#include "control/revocation_journal.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string_view>

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

// A writer's slot: "w ID GENERATION SINCE_US". An attachment id (a UUID) has no space, so a
// revocation's slot never reads as one.
constexpr std::string_view kWriterTag = "w ";

bool is_writer(const std::string& text) {
  return text.starts_with(kWriterTag);
}

std::string writer_text(const RevocationJournal::Writer& w) {
  if (w.attachment_id.empty() || w.attachment_id.find(' ') != std::string::npos) return {};
  const std::string text = std::string(kWriterTag) + w.attachment_id + " " +
                           std::to_string(w.generation) + " " + std::to_string(w.since_us);
  return text.size() <= RevocationJournal::kSlotSize ? text : std::string();  // put() refuses ""
}

std::optional<RevocationJournal::Writer> writer_of(const std::string& text) {
  if (!is_writer(text)) return std::nullopt;
  std::istringstream in(text.substr(kWriterTag.size()));
  RevocationJournal::Writer w;
  if (!(in >> w.attachment_id >> w.generation >> w.since_us) || !in.eof()) return std::nullopt;
  return w;
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
        "database cannot record will not survive a restart, and such a takeover is refused",
        path_, std::strerror(err));
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
}

RevocationJournal::~RevocationJournal() {
  if (fd_ >= 0) ::close(fd_);
}

bool RevocationJournal::put(const std::string& text) {
  if (fd_ < 0 || text.empty() || text.size() > kSlotSize) return false;
  auto slots = std::make_unique<Slots>();
  if (!read_all(fd_, *slots)) return false;
  size_t free_slot = kSlots;
  for (size_t i = 0; i < kSlots; ++i) {
    if (id_of((*slots)[i]) == text) return true;  // already there
    if ((*slots)[i][0] == '\0' && free_slot == kSlots) free_slot = i;
  }
  if (free_slot == kSlots) return false;  // full: as many unfinished records as slots
  Slot slot{};
  std::memcpy(slot.data(), text.data(), text.size());
  return write_slot(fd_, free_slot, slot);
}

void RevocationJournal::erase(const std::string& text) {
  if (fd_ < 0) return;
  auto slots = std::make_unique<Slots>();
  if (!read_all(fd_, *slots)) return;
  for (size_t i = 0; i < kSlots; ++i) {
    if (id_of((*slots)[i]) == text) write_slot(fd_, i, Slot{});
  }
}

bool RevocationJournal::record(const std::string& attachment_id) {
  std::lock_guard lock(mutex_);
  return attachment_id.size() < kSlotSize && put(attachment_id);
}

void RevocationJournal::clear(const std::string& attachment_id) {
  std::lock_guard lock(mutex_);
  erase(attachment_id);
}

bool RevocationJournal::record_writer(const Writer& w) {
  std::lock_guard lock(mutex_);
  return put(writer_text(w));
}

void RevocationJournal::clear_writer(const std::string& attachment_id, uint64_t generation) {
  std::lock_guard lock(mutex_);
  if (fd_ < 0) return;
  auto slots = std::make_unique<Slots>();
  if (!read_all(fd_, *slots)) return;
  for (size_t i = 0; i < kSlots; ++i) {
    const std::optional<Writer> w = writer_of(id_of((*slots)[i]));
    if (w && w->attachment_id == attachment_id && w->generation == generation) {
      write_slot(fd_, i, Slot{});
    }
  }
}

std::vector<RevocationJournal::Writer> RevocationJournal::writers() {
  std::lock_guard lock(mutex_);
  std::vector<Writer> found;
  if (fd_ < 0) return found;
  auto slots = std::make_unique<Slots>();
  if (!read_all(fd_, *slots)) return found;
  for (const Slot& slot : *slots) {
    if (std::optional<Writer> w = writer_of(id_of(slot))) found.push_back(std::move(*w));
  }
  return found;
}

std::vector<std::string> RevocationJournal::pending() {
  std::lock_guard lock(mutex_);
  std::vector<std::string> ids;
  if (fd_ < 0) return ids;
  auto slots = std::make_unique<Slots>();
  if (!read_all(fd_, *slots)) return ids;
  for (const Slot& slot : *slots) {
    if (slot[0] != '\0' && !is_writer(id_of(slot))) ids.push_back(id_of(slot));
  }
  return ids;
}

}  // namespace shareblk::control
