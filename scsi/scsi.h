// scsi: the SCSI command layer of the iSCSI frontend (SPC-5, SBC-4), with no I/O and no state
// beyond a call: decode() turns a CDB and a logical unit's description (LunInfo) into an answer
// built at once, a media operation for the frontend to run on the volume, or CHECK CONDITION
// with sense data (commands.h); sense.h holds the refusals as values, their two byte formats,
// and the one errno -> sense mapping for what the backend fails.
//
// Its promise: every function takes bytes an initiator sent (a CDB, a parameter list) and
// either returns a value or a Sense saying why it refuses; nothing throws, no input makes one
// read past what it was given, data-in never exceeds the ALLOCATION LENGTH, a media operation's
// range is inside the capacity and the block limits, and a read-only LUN gets no media
// operation that writes (writes_medium()). It depends on nothing of ours (std only); the
// frontend that uses it keeps the per-nexus state (unit attentions, the pending sense) and runs
// the media operations through a backend::Handle (CONTRIBUTING.md, "Adding a frontend").
//
// The part's public header, in two: sense.h and commands.h. Other parts include this one;
// scsi/'s own files include the one they use (data.h is internal).
#pragma once

#include "scsi/commands.h"  // IWYU pragma: export
#include "scsi/sense.h"     // IWYU pragma: export
