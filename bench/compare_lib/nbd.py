"""A tiny NBD client: fixed newstyle handshake, NBD_OPT_GO, NBD_CMD_DISC.

Contract: `nbd_open` connects to a Unix or TCP endpoint, negotiates the export (NBD_OPT_GO,
or NBD_OPT_EXPORT_NAME from a server that lacks it) and returns the socket in transmission
phase with the export size; any protocol problem raises `NbdError`. It is used to tell that
a server is ready and to hold idle connections, never to move data (fio does that).
"""

from __future__ import annotations

import socket
import struct

NBD_MAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OPT_REPLY_MAGIC = 0x0003E889045565A9
OPT_EXPORT_NAME, OPT_GO = 1, 7
REP_ACK, REP_INFO, REP_ERR_UNSUP = 1, 3, (1 << 31) | 1
REQUEST_MAGIC, CMD_DISC = 0x25609513, 2


class NbdError(Exception):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise NbdError("connection closed by the server")
        buf += chunk
    return bytes(buf)


def nbd_open(endpoint: tuple, export: str, timeout: float = 10) -> tuple[socket.socket, int]:
    """Connects and completes the handshake; returns the socket in transmission phase and
    the export size."""
    kind, addr = endpoint
    sock = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(addr)
        magic, optmagic, hflags = struct.unpack(">QQH", _recv_exact(sock, 18))
        if magic != NBD_MAGIC or optmagic != IHAVEOPT:
            raise NbdError("not a newstyle NBD server")
        if not hflags & 1:
            raise NbdError("server is not fixed newstyle")
        no_zeroes = bool(hflags & 2)
        sock.sendall(struct.pack(">I", 1 | (2 if no_zeroes else 0)))
        name = export.encode()
        payload = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
        sock.sendall(struct.pack(">QII", IHAVEOPT, OPT_GO, len(payload)) + payload)
        size = None
        while True:
            magic, _opt, rtype, length = struct.unpack(">QIII", _recv_exact(sock, 20))
            if magic != OPT_REPLY_MAGIC:
                raise NbdError(f"bad option reply magic {magic:#x}")
            data = _recv_exact(sock, length) if length else b""
            if rtype == REP_ACK:
                break
            if rtype == REP_INFO and len(data) >= 12 and struct.unpack(">H", data[:2])[0] == 0:
                size = struct.unpack(">Q", data[2:10])[0]
            elif rtype == REP_ERR_UNSUP:  # an old server: fall back to NBD_OPT_EXPORT_NAME
                sock.sendall(struct.pack(">QII", IHAVEOPT, OPT_EXPORT_NAME, len(name)) + name)
                size = struct.unpack(">QH", _recv_exact(sock, 10))[0]
                if not no_zeroes:
                    _recv_exact(sock, 124)
                break
            elif rtype & (1 << 31):
                msg = data.decode(errors="replace")
                raise NbdError(f"NBD_OPT_GO refused ({rtype & 0x7FFFFFFF}): {msg}")
        if size is None:
            raise NbdError("no NBD_INFO_EXPORT in the reply to NBD_OPT_GO")
        return sock, size
    except BaseException:
        sock.close()
        raise


def nbd_close(sock: socket.socket) -> None:
    try:
        sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_DISC, 0, 0, 0))
    except OSError:
        pass
    sock.close()
