// Part of target/'s public header (target.h): the NBD server, who connects to it (Peer), what a
// client may reach (ExportCatalog) and how it listens (ServerOptions).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "target/io_stats.h"
#include "target/qos.h"

namespace shareblk::target {

// What a TLS session proved about its client (docs/nbd.md, "TLS").
struct TlsPeer {
  std::string psk_identity;  // PSK sessions: the identity whose key the client holds
  std::string x509_dn;       // x509 sessions: the verified client certificate's subject DN
};

// Who is connecting, as the listener that accepted it saw it.
struct Peer {
  enum class Transport : uint8_t { Unix, Tcp };
  std::string address;  // TCP: the client's IP address as text; empty for a Unix socket
  uint16_t port = 0;    // TCP: the client's port
  Transport transport = Transport::Unix;
  // Unix: the connecting process's credentials (SO_PEERCRED), when the kernel gave them.
  std::optional<uid_t> uid;
  pid_t pid = 0;
  // Set once NBD_OPT_STARTTLS succeeded: the options after it are haggled over TLS.
  std::optional<TlsPeer> tls;

  static Peer tcp(std::string ip) {
    Peer peer;
    peer.address = std::move(ip);
    peer.transport = Transport::Tcp;
    return peer;
  }
};

// The peer for log lines: "tcp 192.0.2.1" or "unix pid 42 uid 1000".
std::string describe(const Peer& peer);
// One connection's peer, with the TCP port: "tcp 192.0.2.1:40312" or "unix pid 42 uid 1000".
std::string describe_endpoint(const Peer& peer);

// What an export name resolves to.
struct Export {
  std::shared_ptr<backend::Volume> volume;
  backend::AttachMode mode = backend::AttachMode::ReadOnly;
  // Connections are counted and closed per group: the attachment id, or the export name.
  std::string group;
  std::string description;
  // The attachment's write access (backend::WriteAccess); nullptr: always, in `mode`.
  std::shared_ptr<backend::WriteAccess> write_access;
  // One connection at a time (an attachment: one host's). A client that finishes its
  // handshake replaces the group's older connections: they stop reading and are closed once
  // their requests in flight are answered, and only then is the new one served, so that a
  // request left in an old connection never runs after a newer connection's (a client that
  // re-sends a timed-out write on a new connection; docs/nbd.md, "Reconnects"). The export
  // then does not advertise NBD_FLAG_CAN_MULTI_CONN.
  bool exclusive = false;
  // The attachment's QoS limiter (its parent the volume's); nullptr: never limited.
  std::shared_ptr<QosLimiter> qos;
};

class ExportCatalog {
 public:
  virtual ~ExportCatalog() = default;
  // Unknown: NBD_REP_ERR_UNKNOWN, as for a name that does not exist; Policy:
  // NBD_REP_ERR_POLICY; TlsRequired: the export is TLS-only and the client has not started TLS
  // (NBD_REP_ERR_TLS_REQD, proto.md "SELECTIVETLS mode").
  enum class Refusal { Unknown, Policy, TlsRequired };
  struct Lookup {
    std::optional<Export> found;
    Refusal refusal = Refusal::Unknown;  // why, when `found` is empty
  };
  // Called from handshake threads, possibly concurrently.
  virtual Lookup resolve(const std::string& name, const Peer& peer) = 0;
  // The key (raw bytes) a TLS-PSK client authenticating as `identity` must hold; nothing when
  // no such identity may start TLS now. Called from handshake threads.
  virtual std::optional<std::string> psk_key(const std::string& /*identity*/) {
    return std::nullopt;
  }
  // The names NBD_OPT_LIST may reveal (none, for attachments: their names are capabilities).
  virtual std::vector<std::string> listable() = 0;
};

// A fixed table of exports, as `shareblkd --export NAME=PATH[,ro]` gives (like qemu-nbd).
// The empty name reaches the only export when there is exactly one.
class StaticCatalog final : public ExportCatalog {
 public:
  void add(const std::string& name, Export exp);
  Lookup resolve(const std::string& name, const Peer& peer) override;
  std::vector<std::string> listable() override;

 private:
  std::vector<std::pair<std::string, Export>> exports_;
};

// Who may connect to a Unix socket the daemon listens on: the socket file's mode and group
// (its owner is the daemon's user). Connecting needs write permission on it.
struct SocketAccess {
  mode_t mode = 0660;
  std::optional<gid_t> group;  // nullopt: the daemon's own group
};

// Binds and listens on a Unix socket at `path`, replacing a socket file left there (never
// another kind of file), with `access` in force before any client can connect. For the NBD
// listeners and the control socket alike.
std::error_code listen_unix(const std::string& path, const SocketAccess& access, int& fd);

// Accepts one connection on `listen_fd` (the new descriptor SOCK_CLOEXEC), waiting in poll()
// so that a write to the eventfd `stop_fd` ends the wait: then -1 with errno ECANCELED. A
// listener systemd passed in cannot be woken with shutdown(), which would shut it for systemd
// too. For the NBD listeners and the control socket alike.
int accept_or_stop(int listen_fd, int stop_fd);

// TLS on the NBD listeners (proto.md "TLS support"; docs/nbd.md, "TLS").
struct TlsOptions {
  // Off: NOTLS (NBD_OPT_STARTTLS gets NBD_REP_ERR_UNSUP). On: SELECTIVETLS, exports the
  // catalog marks TLS-only get NBD_REP_ERR_TLS_REQD before STARTTLS. Require: FORCEDTLS,
  // every option but STARTTLS and ABORT gets NBD_REP_ERR_TLS_REQD before it.
  enum class Mode : uint8_t { Off, On, Require };
  Mode mode = Mode::Off;
  // QEMU's layout: ca-cert.pem, server-cert.pem, server-key.pem, optional ca-crl.pem. Clients
  // must then present a certificate the CA signed. Empty: no x509, PSK only.
  std::string x509_dir;
  // A GnuTLS keys.psk file (`identity:hexkey` lines): keys besides the catalog's psk_key().
  std::string psk_file;
};

struct ServerOptions {
  std::vector<std::string> listen_unix;  // socket paths
  SocketAccess unix_access;              // for every path of listen_unix
  std::vector<std::string> listen_tcp;   // HOST:PORT; port 0 picks a free one
  // Sockets already listening (systemd socket activation), Unix or TCP by their address
  // family, served besides the ones above. The server takes the descriptors (closes them at
  // stop) but never binds, shuts down or removes the sockets: they stay with whoever passed
  // them, listening, so that systemd can start the daemon again on the next connection.
  std::vector<int> listen_fds;
  unsigned workers = 0;             // io_uring threads; 0 = one per CPU
  unsigned max_connections = 1024;  // beyond this, new connections are closed at once
  // Connections still in their handshake, at most, over TCP and over Unix sockets each (two
  // tables: neither kind of client can take the other's places), and at most per peer (a TCP
  // address, or a Unix uid). Past the per-peer limit a new connection is closed at once; in a
  // full table it takes the place of the stalest handshake, which is closed: one whose client
  // sent no whole message (its flags, an option) before one that did, of the peer holding the
  // most places, then the one that went longest without progress. So clients that connect and
  // say nothing, from however many hosts, cannot keep a negotiating one out.
  unsigned max_handshakes = 128;
  unsigned max_handshakes_per_peer = 16;
  std::chrono::milliseconds handshake_timeout{10000};
  // Request payload bytes all connections may hold at once, shared out among the workers;
  // 0 = a quarter of the machine's memory. Past it, connections wait before reading more.
  uint64_t payload_memory = 0;
  // A closing connection (close_group(), a newer connection of an exclusive export) whose
  // client takes none of its replies, or sends none of a payload it owes, for this long is cut
  // off; one whose requests are in storage is waited for, however long.
  std::chrono::milliseconds close_grace{10000};
  // The same at stop(): shorter, as no fence depends on it and the service manager waits.
  std::chrono::milliseconds stop_grace{5000};
  // A connection whose client takes none of its replies for this long is cut off; 0 = never.
  std::chrono::milliseconds send_timeout{30000};
  // A connection whose client sent a request's header and then none of its payload (a WRITE's
  // data) for this long is cut off; 0 = never. The payload's buffer counts against
  // payload_memory until then. Every byte that arrives starts the time again.
  std::chrono::milliseconds payload_timeout{30000};
  // A TCP connection whose peer stays silent this long (no acknowledgement of a reply, no
  // answer to keepalive probes) is dropped; 0 = the kernel's defaults (hours when idle).
  std::chrono::milliseconds peer_timeout{60000};
  // The send buffer asked for on each TCP connection (SO_SNDBUF, which the kernel doubles for
  // its bookkeeping); 0 leaves it to the kernel's autotuning. It bounds a connection's
  // replies in flight to one buffer per round trip (1 MiB per 100 µs is 10 GB/s), and a
  // larger one costs CPU: a sender that never finds its buffer full does all of TCP's work
  // itself, where one that does lets the acknowledgements send the rest from the client's
  // side (bench/PROFILE.md, "Page-cache 1 MiB reads with the cache warm").
  unsigned tcp_send_buffer = 512 << 10;
  TlsOptions tls;
};

class Server {
 public:
  Server(ServerOptions options, std::shared_ptr<ExportCatalog> catalog);
  ~Server();  // stops if running
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds every listener and starts the workers; nothing is accepted yet. Errors name the
  // failing listener. A daemon binds while it may still bind what needs root, then drops root,
  // then serves: no connection is ever handled with authority the daemon gives up.
  std::error_code bind(std::string& what);
  // Starts accepting on every listener bound. Once, after a successful bind().
  void serve();
  // bind() and serve().
  std::error_code start(std::string& what);
  void stop();

  // Loads the TLS credentials again (the files TlsOptions names), for the handshakes that
  // follow; connections keep the ones they started with. On failure the old ones stay in
  // force and `error` says which file was wrong. Nothing to do when TLS is off.
  std::error_code reload_tls(std::string& error);

  // The TCP endpoints actually bound ("HOST:PORT"), useful with port 0.
  std::vector<std::string> tcp_endpoints() const;
  // The Unix socket paths listened on, listen_unix's and then the passed ones'.
  std::vector<std::string> unix_paths() const;

  // Stops reading from every connection of `group`, lets the requests in flight be answered,
  // closes the connections and returns when none is left. Connections of the group still in
  // their handshake are refused. A group stays closed for the life of the server.
  void close_group(const std::string& group);

  // The same for the connections `group` has now, without closing the group: its clients
  // connect again and negotiate afresh (an attachment whose mode changed). Clients that
  // finish their handshake while this runs are closed too.
  void close_connections(const std::string& group);

  // Live connections of `group` (in transmission phase).
  size_t connections(const std::string& group) const;

  // Every group's I/O figures since start and its live connections; groups with neither are
  // left out. A group closed for good (close_group) starts again from zero. Any thread; the
  // workers are not stopped or waited for.
  std::vector<GroupStats> stats() const;

  struct Impl;

 private:
  void drain_group(const std::string& group);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shareblk::target
