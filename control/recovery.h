// Internal to control/: the start's recovery, run once before anything is served. No
// connection survives a restart, so a detach that was under way is finished, whether the
// database or only the revocation journal knew of it; a takeover only the journal recorded goes
// into the database; an interrupted create is rolled back and an interrupted delete finished
// (docs/state.md, "Creates and deletes"); the store and the database are compared; and the
// live attachments' write gates are set from the database, a shared store's writer locks taken
// back (docs/fencing.md, docs/scale-out.md).
#pragma once

#include "control/db.h"

namespace shareblk::control {

class BackingJobs;
class ExportRegistry;
class RevocationJournal;
class SharedStore;
class VolumeRegistry;

class Recovery {
 public:
  struct Parts {
    Database& db;
    RevocationJournal& journal;
    ExportRegistry& exports;
    VolumeRegistry& volumes;
    SharedStore& shared;
    BackingJobs& backing;
  };
  explicit Recovery(Parts parts) : p_(parts) {}

  // Throws DbError when the database cannot be read; what cannot be settled now is logged and
  // left for the next start.
  void run();

 private:
  // The takeovers that only the revocation journal recorded go into the database, or, while it
  // still cannot record them, stand as the database's pending writers.
  void settle_journaled_writers();
  void finish_intents();
  // The gates of the live attachments, from the database, and no writer that is not a live
  // attachment.
  void load_write_access(Database::Transaction& tx);

  Parts p_;
};

}  // namespace shareblk::control
