// The fixed newstyle handshake (proto.md "Option haggling"), written against a byte stream so
// that the same code runs on a socket and under the fuzzer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "target/server.h"

namespace shareblk::target {

// A blocking byte stream. Both calls return false when the stream is gone or timed out.
class ByteStream {
 public:
  virtual bool read_exact(void* buf, size_t length) = 0;
  virtual bool write_all(const void* buf, size_t length) = 0;

 protected:
  ~ByteStream() = default;
};

// What the handshake agreed on, handed to the transmission phase.
struct Session {
  std::string export_name;
  Export exp;
  bool structured_replies = false;
  bool base_allocation = false;  // metadata context kBaseAllocationId selected
  uint16_t transmission_flags = 0;
  // Set by the server when it adopts the connection: the how-manieth of its group it is.
  uint64_t serial = 0;
};

inline constexpr uint32_t kBaseAllocationId = 1;

// What NBD_OPT_STARTTLS upgrades the connection with (proto.md "TLS support").
class TlsUpgrade {
 public:
  // FORCEDTLS: before STARTTLS every option but ABORT gets NBD_REP_ERR_TLS_REQD. Otherwise
  // SELECTIVETLS: the catalog says which exports need TLS.
  virtual bool required() const = 0;
  // Called once NBD_REP_ACK has gone out: the TLS handshake. On success, the stream the rest
  // of the haggling uses and what the session proved of the client; nullptr ends the
  // connection (proto.md: a failed TLS handshake MUST terminate the session).
  virtual ByteStream* start(TlsPeer& proved) = 0;

 protected:
  ~TlsUpgrade() = default;
};

// Told each time the client has sent a whole message: its flags, then each option with its
// payload (whether in the clear or over TLS). The server's handshake table uses it to tell a
// client that negotiates from one that holds a place and says nothing (docs/nbd.md,
// "Handshake limits").
class HandshakeProgress {
 public:
  virtual void progressed() = 0;

 protected:
  ~HandshakeProgress() = default;
};

// The transmission flags an export gets: only what is true of it (proto.md
// "Transmission flags"). DF needs structured replies.
uint16_t transmission_flags(const Export& exp, bool structured_replies);

// Runs the server side of the handshake. Returns the session on NBD_OPT_GO or
// NBD_OPT_EXPORT_NAME, nothing when the client aborted, disconnected, or broke the protocol.
// Without `tls` the server is NOTLS: NBD_OPT_STARTTLS gets NBD_REP_ERR_UNSUP. `progress`, when
// given, is told of each whole message the client sends.
std::optional<Session> negotiate(ByteStream& stream, ExportCatalog& catalog, const Peer& peer,
                                 TlsUpgrade* tls = nullptr, HandshakeProgress* progress = nullptr);

}  // namespace shareblk::target
