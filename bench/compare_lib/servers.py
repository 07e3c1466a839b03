"""The servers compared, and one running instance of a server.

Contract: `SERVERS` is the catalogue (`--only` names, their caching mode, a description);
the mode decides which ratios a server takes part in (see `report`). A `Server` is one
instance on one transport: `command()` is its exact command line, `start()` runs it and
returns once it answers an NBD handshake with the expected export size (else `StartError`),
`stop()` stops it by its own pid. `fio_target()` is what fio needs to reach it. Frontends
(shareblk's nbdkit plugin and FUSE) are in `frontends`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from .context import Context
from .nbd import NbdError, nbd_close, nbd_open
from .procs import Process, StartError, descendants, proc_stat

EXPORT = "vol"

# name -> (mode, description). Modes: direct (O_DIRECT / no page cache), cache (page cache),
# local (fio io_uring on the file), tmpfs (file in /dev/shm or RAM), frontend (shareblk's
# other frontends on the same volume: compared with shareblkd's listener only, never peers).
SERVERS = {
    "shareblkd": ("direct", "shareblkd (O_DIRECT, default)"),
    "nbdkit-nocache": ("direct", "nbdkit file cache=none"),
    "qemu-nbd": ("direct", "qemu-nbd --aio=io_uring --cache=none"),
    "shareblkd-buffered": ("cache", "shareblkd --buffered"),
    "nbdkit": ("cache", "nbdkit file (default cache)"),
    "nbd-server": ("cache", "nbd-server"),
    "local": ("local", "fio io_uring --direct=1 on the file"),
    "shareblkd-tmpfs": ("tmpfs", "shareblkd on a /dev/shm file (page cache)"),
    "nbdkit-memory": ("tmpfs", "nbdkit memory"),
    "shareblk-nbdkit": ("frontend", "nbdkit with the shareblk plugin, managed shareblkd"),
    "shareblk-fuse": ("frontend", "FUSE local attach of a managed shareblkd, fio io_uring"),
}
FRONTENDS = [s for s, (mode, _) in SERVERS.items() if mode == "frontend"]


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server(Process):
    """One running server instance on one transport."""

    def __init__(self, name: str, transport: str, ctx: "Context"):
        super().__init__(ctx.logs / f"{name}-{transport}.log")
        self.name, self.transport, self.ctx = name, transport, ctx
        if transport == "unix":
            self.sock_path = str(ctx.sockdir / f"{name}.sock")
            self.endpoint: tuple = ("unix", self.sock_path)
        else:
            self.port = free_tcp_port()
            self.endpoint = ("tcp", ("127.0.0.1", self.port))
        self.set_export(EXPORT)
        self.path = str(ctx.tmpfs_file if SERVERS[name][0] == "tmpfs" else ctx.backing)
        self.size = ctx.tmpfs_size if SERVERS[name][0] == "tmpfs" else ctx.size

    def set_export(self, export: str) -> None:
        self.export = export
        if self.transport == "unix":
            self.uri = f"nbd+unix:///{export}?socket={self.sock_path}"
        else:
            self.uri = f"nbd://127.0.0.1:{self.port}/{export}"

    def fio_target(self) -> list[str]:
        """fio's engine options for this server."""
        return ["--ioengine=nbd", f"--uri={self.uri}"]

    def register(self) -> None:
        """From here on, the finally blocks stop this server."""
        if self not in self.ctx.running:
            self.ctx.running.append(self)

    def _listen_args_nbdkit(self) -> list[str]:
        if self.transport == "unix":
            return ["-U", self.sock_path]
        return ["-i", "127.0.0.1", "-p", str(self.port)]

    def command(self) -> list[str]:
        n, a = self.name, self.ctx.args
        if n.startswith("shareblkd"):
            cmd = [a.shareblkd, "--export", f"{EXPORT}={self.path}"]
            if self.transport == "unix":
                cmd += ["--listen-unix", self.sock_path]
            else:
                cmd += ["--listen-tcp", f"127.0.0.1:{self.port}"]
            if n == "shareblkd-buffered":
                cmd.append("--buffered")
            if a.workers is not None:
                cmd += ["--workers", str(a.workers)]
            return cmd
        if n in ("nbdkit", "nbdkit-nocache"):
            cmd = ["nbdkit", "-f", "--exit-with-parent", "-e", EXPORT] + self._listen_args_nbdkit()
            cmd += ["file", f"file={self.path}"]
            if n == "nbdkit-nocache":
                cmd.append("cache=none")
            return cmd
        if n == "nbdkit-memory":
            return (["nbdkit", "-f", "--exit-with-parent", "-e", EXPORT] + self._listen_args_nbdkit()
                    + ["memory", f"size={self.size}"])
        if n == "qemu-nbd":
            cmd = ["qemu-nbd", "--aio=io_uring", "--cache=none", "--shared=8", "-f", "raw",
                   "--persistent", "-x", EXPORT]
            if self.transport == "unix":
                cmd += ["--socket", self.sock_path]
            else:
                cmd += ["--bind", "127.0.0.1", "--port", str(self.port)]
            return cmd + [self.path]
        if n == "nbd-server":
            conf = self.ctx.sockdir / f"nbd-server-{self.transport}.conf"
            lines = ["[generic]", "    allowlist = false"]
            if self.transport == "unix":
                lines.append(f"    unixsock = {self.sock_path}")
            else:
                lines += ["    listenaddr = 127.0.0.1", f"    port = {self.port}"]
            lines += [f"[{EXPORT}]", f"    exportname = {self.path}", ""]
            conf.write_text("\n".join(lines))
            self.pidfile = self.ctx.sockdir / f"nbd-server-{self.transport}.pid"
            self.pidfile.unlink(missing_ok=True)  # a restart must not read the old pid
            # nbd-server -d serves a single connection in the foreground and then exits, so
            # it runs as the daemon it is meant to be; we manage it by the pid in its pid file.
            return ["nbd-server", "-C", str(conf), "-p", str(self.pidfile)]
        raise ValueError(n)

    def start(self) -> None:
        cmd = self.command()
        self.cmd = cmd
        if self.transport == "unix" and os.path.lexists(self.sock_path):
            os.unlink(self.sock_path)  # left by an instance of ours that was killed
        self.register()
        self.spawn(cmd, self.ctx.sockdir)
        if self.name == "nbd-server":
            self.pid = None
            try:
                rc = self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.pid = self.proc.pid  # did not daemonize: manage the process we started
                rc = None
            if rc not in (None, 0):
                raise StartError(f"nbd-server exited with status {rc}: {self.log_tail()}")
            if rc == 0:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        self.pid = int(self.pidfile.read_text().split()[0])
                        break
                    except (OSError, ValueError, IndexError):
                        time.sleep(0.05)
                if self.pid is None:
                    raise StartError("nbd-server wrote no pid file")
            st = proc_stat(self.pid) if self.pid is not None else None
            self.starttime = st[19] if st else None
        self.wait_ready()

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.alive():
                raise StartError(f"exited during startup: {self.log_tail()}")
            try:
                sock, size = nbd_open(self.endpoint, self.export, timeout=5)
                nbd_close(sock)
                if size != self.size:
                    raise StartError(f"export size {size}, expected {self.size}")
                return
            except (OSError, NbdError) as e:
                last = str(e)
                time.sleep(0.1)
        raise StartError(f"not ready after {timeout:.0f} s ({last}): {self.log_tail()}")

    def settle(self, baseline_kids: set[int], timeout: float = 3) -> None:
        """Waits for per-connection processes (nbd-server) to exit and be reaped."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if set(descendants(self.pid)) <= baseline_kids:
                return
            time.sleep(0.05)

    def stop(self) -> None:
        if self in self.ctx.running:
            self.ctx.running.remove(self)
        if self.pid is None and self.name == "nbd-server" and self.proc is not None:
            # Interrupted between its launcher's exit and our reading of the pid file.
            try:
                self.pid = int(self.pidfile.read_text().split()[0])
                st = proc_stat(self.pid)
                if st is None or b"nbd-server" not in Path(f"/proc/{self.pid}/cmdline").read_bytes():
                    self.pid = None
                else:
                    self.starttime = st[19]
            except (OSError, ValueError, IndexError):
                self.pid = None
            if self.pid is None and self.proc.poll() is None:
                self.pid = self.proc.pid
        if self.pid is None:
            return
        self.terminate()
