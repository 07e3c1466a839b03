// target: the NBD server. Listens on Unix and TCP sockets, negotiates with each client, and
// serves the transmission phase on io_uring worker threads.
//
// What a client may reach is decided by an ExportCatalog: the standalone `--export` table, or
// the control plane's live attachments. Every connection belongs to one export and takes that
// export's mode; the mode is enforced in the backend's admission check, not here.
//
// The part's public header, in three: server.h (Server, ServerOptions, ExportCatalog, Peer),
// qos.h (QosSpec, QosLimiter) and io_stats.h (IoStats, GroupStats). Other parts include this
// one; target/'s own files include the one they use.
#pragma once

#include "target/io_stats.h"  // IWYU pragma: export
#include "target/qos.h"       // IWYU pragma: export
#include "target/server.h"    // IWYU pragma: export
