// The socket side of the server (sockets.cc), for server.cc: listeners, the options of
// accepted sockets, and who is at the other end. Public ones (listen_unix, accept_or_stop,
// describe) are in server.h.
#pragma once

#include <chrono>
#include <string>
#include <system_error>

#include "target/server.h"

namespace shareblk::target {

// The send buffer of an accepted socket. Unix: 4 MiB, room for several maximum-size replies
// (with the default, about 208 KiB, a 1 MiB read reply needs several round trips through the
// send queue). TCP: `tcp_bytes` (ServerOptions::tcp_send_buffer says why not more), or the
// kernel's autotuning when 0.
void size_send_buffer(int fd, bool tcp, unsigned tcp_bytes);

// True for a TCP socket (AF_INET or AF_INET6).
bool is_tcp(int fd);

// SO_RCVLOWAT: a TCP socket wakes its reader once `bytes` are queued (the kernel may lower
// it to half its largest receive buffer), not at every segment. `bytes` must be at most what
// the client is bound to send next, or the reader may wait for bytes that never come.
void wake_reader_at(int fd, int bytes);

// Bytes queued in a socket that nobody has read yet (FIONREAD); 0 when the kernel cannot say.
int unread_bytes(int fd);

// A TCP client whose host dies sends no FIN or RST: without these its connection would stay
// established for ever when idle (keepalive off), or for ~15 min of retransmissions when a
// reply is unacknowledged (tcp_retries2). Both are bounded by `timeout` (tcp(7):
// TCP_USER_TIMEOUT also decides when failed keepalive probes end the connection). A live
// peer answers the probes, and zero-window probes, however long it does not read.
void drop_silent_peers_after(int fd, std::chrono::milliseconds timeout);

// "HOST:PORT" ("[HOST]:PORT" for IPv6) of a bound TCP socket.
std::string tcp_endpoint_of(int fd);

// A passed-in socket (socket activation) as a listener: whether it is TCP, and its endpoint or
// path. EINVAL for anything but a listening stream socket of AF_UNIX, AF_INET or AF_INET6.
std::error_code inspect_listener(int fd, bool& tcp, std::string& where);

// Listens on "HOST:PORT" ("[V6]:PORT"; port 0 picks one): the socket in `out`, the endpoint
// it is bound to in `bound`.
std::error_code listen_tcp(const std::string& endpoint, int& out, std::string& bound);

// The client of an accepted socket: its address and port over TCP, its pid and uid (from
// SO_PEERCRED) over a Unix socket; fields left empty when the kernel cannot say.
Peer peer_of(int fd, bool tcp);

// What the per-peer handshake limit counts by: the client's address over TCP, its uid over a
// Unix socket ("" when unknown: all such clients count as one).
std::string peer_key(int fd, bool tcp);

}  // namespace shareblk::target
