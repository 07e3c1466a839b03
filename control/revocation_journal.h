// Internal to control/: revocations that must survive a restart even when the database cannot
// record them (its file system is full). A fixed file of slots, allocated in full when the
// daemon starts; recording an attachment id overwrites a slot in place, so it needs no new
// block from the file system. At the next start, every id found there is detached before
// anything is served, then its slot is cleared (docs/state.md, "Revocation").
#pragma once

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

  static constexpr size_t kSlots = 1024;
  static constexpr size_t kSlotSize = 64;  // an id (a UUID is 36 bytes), zero-padded

 private:
  std::string path_;
  int fd_ = -1;
  std::mutex mutex_;
};

}  // namespace shareblk::control
