"""A client of shareblkd's control socket (docs/api.md): one JSON-RPC 2.0 request per line,
one reply line per request.

The only one in the tree: the Cinder driver, its tests and the benchmarks in bench/ (which
import this package through the symlink bench/shareblk) all call shareblkd through it.
``ControlClient`` opens a connection per call; ``Connection`` keeps one open for many calls.
Standard library only, for any python3 >= 3.9."""

import itertools
import json
import socket


class ControlError(Exception):
    """A JSON-RPC error from shareblkd: ``reason`` is docs/api.md's (``not_found``, ...);
    ``error`` is the reply's error object as it came."""

    def __init__(self, method, code, message, reason, error=None):
        super().__init__(f"shareblkd {method}: {message} ({reason})")
        self.method = method
        self.code = code
        self.reason = reason
        self.error = error


class ConnectionClosed(OSError):
    """shareblkd closed the connection before the end of a reply line."""


def result(method, line):
    """The result in reply LINE to a call of METHOD. An error reply raises ControlError; a line
    that is not JSON, ValueError."""
    response = json.loads(line)
    error = response.get("error")
    if error is not None:
        raise ControlError(method, error.get("code"), error.get("message", ""),
                           (error.get("data") or {}).get("reason", ""), error)
    return response["result"]


class Connection:
    """One connection to the control socket at ``path``, for any number of calls, one at a time.
    ``timeout`` (seconds; None waits for ever) bounds the connect and each send and reply."""

    def __init__(self, path, timeout=None):
        self._ids = itertools.count(1)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            self._file = self._sock.makefile("rwb")
        except BaseException:
            self._sock.close()
            raise

    def send(self, method, params=None, request_id=None):
        """Sends a call and returns its reply line, unparsed (``result`` parses it); OSError
        (ConnectionClosed if shareblkd hung up) when there is none."""
        if request_id is None:
            request_id = next(self._ids)
        line = json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method,
                           "params": params or {}}) + "\n"
        self._file.write(line.encode())
        self._file.flush()
        reply = self._file.readline()
        if not reply.endswith(b"\n"):
            raise ConnectionClosed(f"shareblkd closed the control socket during {method}")
        return reply

    def call(self, method, params=None):
        """The method's result; ControlError if shareblkd answers with an error."""
        return result(method, self.send(method, params))

    def close(self):
        self._file.close()
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ControlClient:
    """Calls methods on the control socket at ``path``. A connection per call: the driver's
    calls are few, and a daemon restart between two of them costs nothing."""

    def __init__(self, path, timeout=60.0):
        self.path = path
        self.timeout = timeout
        self._ids = itertools.count(1)

    def call(self, method, params=None):
        request_id = next(self._ids)
        with Connection(self.path, self.timeout) as connection:
            reply = connection.send(method, params, request_id)
        return result(method, reply)
