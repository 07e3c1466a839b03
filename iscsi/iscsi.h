// iscsi: the protocol layer of a future iSCSI frontend (RFC 7143), with no I/O and no state
// beyond a call except one login's (login.h) and one session's (session.h): the Basic Header
// Segment codec (pdu.h), the login and text key=value format with the target's
// operational-parameter negotiation (text.h), CRC32C digests through ISA-L (digest.h), the target's
// side of CHAP (chap.h), and the login phase as a state machine with the SendTargets answer
// (login.h); and a session's Full Feature Phase bookkeeping (session.h): the command window,
// StatSN, write and read transfers, residuals, and the task table for task management.
//
// Its promise: every function takes bytes or text an initiator sent and either returns a value
// or says why it refuses, as a value (a §11.17.1 Reject reason, a TextError, a
// NegotiationFailure, a ChapError, a Login reject); nothing throws, and no input makes one read
// past what it was given or hold more than the bounds in these headers. It depends on nothing of
// ours (std, GnuTLS, ISA-L), and nothing wires it into the daemon yet: a frontend that does follows
// CONTRIBUTING.md's "Adding a frontend".
//
// The part's public header, in six: pdu.h, text.h, digest.h, chap.h, login.h and session.h. Other
// parts include this one; iscsi/'s own files include the one they use.
#pragma once

#include "iscsi/chap.h"     // IWYU pragma: export
#include "iscsi/digest.h"   // IWYU pragma: export
#include "iscsi/login.h"    // IWYU pragma: export
#include "iscsi/pdu.h"      // IWYU pragma: export
#include "iscsi/session.h"  // IWYU pragma: export
#include "iscsi/text.h"     // IWYU pragma: export
