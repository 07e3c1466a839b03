// Internal to control/: revocations that must survive a restart even when the database cannot
// record them (its file system is full), and changes of writer likewise (docs/fencing.md). A
// fixed file of slots, allocated in full when the daemon starts; recording overwrites a slot in
// place, so it needs no new block from the file system. At the next start, every attachment
// found there is detached, and every writer found there made its volume's writer, before
// anything is served; then its slot is cleared (docs/state.md, "Revocation").
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace shareblk::control {

class RevocationJournal {
 public:
  // Opens `path`, creating and allocating it when missing. A journal that cannot be made
  // (logged) records nothing: revocation then depends on the database, as before.
  explicit RevocationJournal(std::string path);
  ~RevocationJournal();
  RevocationJournal(const RevocationJournal&) = delete;
  RevocationJournal& operator=(const RevocationJournal&) = delete;

  // Records `attachment_id` durably (written and synced); false when it could not.
  bool record(const std::string& attachment_id);
  // Frees its slot once the database says it is detached.
  void clear(const std::string& attachment_id);
  // The ids recorded and not cleared: revocations a previous run could not finish.
  std::vector<std::string> pending();

  // A takeover the database could not record: `attachment_id` became its volume's writer, with
  // that fencing generation, at `since_us` (microseconds since the epoch).
  struct Writer {
    std::string attachment_id;
    uint64_t generation = 0;
    int64_t since_us = 0;
  };
  // Records it durably in a slot of its own; false when it could not (no journal, no free slot).
  bool record_writer(const Writer& w);
  // Frees the slot of that attachment's record at that generation.
  void clear_writer(const std::string& attachment_id, uint64_t generation);
  // The writers recorded and not cleared, in the order of their slots.
  std::vector<Writer> writers();

  static constexpr size_t kSlots = 1024;
  static constexpr size_t kSlotSize = 64;  // an id (a UUID is 36 bytes), zero-padded

 private:
  // Writes `text` into a free slot (true also when a slot holds it already), or clears the
  // slots that hold it. The caller holds mutex_.
  bool put(const std::string& text);
  void erase(const std::string& text);
  std::string path_;
  int fd_ = -1;
  std::mutex mutex_;
};

}  // namespace shareblk::control
