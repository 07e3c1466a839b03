"""A client of shareblkd's control socket (docs/api.md): one JSON-RPC 2.0 request per line,
one reply line per request."""

import itertools
import json
import socket


class ControlError(Exception):
    """A JSON-RPC error from shareblkd: ``reason`` is docs/api.md's (``not_found``, ...)."""

    def __init__(self, method, code, message, reason):
        super().__init__(f"shareblkd {method}: {message} ({reason})")
        self.method = method
        self.code = code
        self.reason = reason


class ControlClient:
    """Calls methods on the control socket at ``path``. A connection per call: the driver's
    calls are few, and a daemon restart between two of them costs nothing."""

    def __init__(self, path, timeout=60.0):
        self.path = path
        self.timeout = timeout
        self._ids = itertools.count(1)

    def call(self, method, params=None):
        request_id = next(self._ids)
        line = json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method,
                           "params": params or {}}) + "\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout)
            s.connect(self.path)
            s.sendall(line.encode())
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise OSError(f"shareblkd closed the control socket during {method}")
                reply += chunk
        response = json.loads(reply)
        if "error" in response:
            error = response["error"]
            raise ControlError(method, error.get("code"), error.get("message", ""),
                               (error.get("data") or {}).get("reason", ""))
        return response["result"]
