"""shareblk's other frontends: nbdkit with the shareblk plugin, and FUSE local attach.

Contract: a `Frontend` is a `Server` (same start/stop/fio_target interface) backed by its
own `ManagedDaemon`, a shareblkd in managed mode holding one volume whose file is a hard
link to the backing file, and one attachment. Stopping it detaches, stops the daemon,
removes its state dir (never the backing file) and lazily unmounts a mount left behind,
recording a note. `mount_points` and `lazy_unmount` are also used for the final cleanup.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from shareblk import control

from .context import Context, log
from .procs import Process, StartError, run_cmd
from .servers import Server


class ControlError(StartError):
    pass


def mount_points() -> set[str]:
    """Mount points of this mount namespace (/proc/self/mountinfo, octal escapes decoded)."""
    out = set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4:
                    out.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    except OSError:
        pass
    return out


def lazy_unmount(path: str) -> str:
    """Detaches whatever is mounted at PATH: fusermount3 -u -z, else umount -l. Returns the
    command that did it, or "" if PATH is still mounted."""
    for cmd in (["fusermount3", "-u", "-z", path], ["umount", "-l", path]):
        try:
            run_cmd(cmd, 30)
        except OSError:
            continue
        if path not in mount_points():
            return shlex.join(cmd)
    return ""


class ManagedDaemon(Process):
    """shareblkd in managed mode (--state-dir) behind one frontend, with one volume whose
    file-store file is the backing file, and one attachment."""

    def __init__(self, tag: str, ctx: "Context"):
        super().__init__(ctx.logs / f"{tag}-shareblkd.log")
        self.tag, self.ctx = tag, ctx
        self.control = str(ctx.sockdir / f"{tag}-control.sock")
        self.nbd_sock = str(ctx.sockdir / f"{tag}-nbd.sock")
        self.state_dir: Path | None = None
        self.volume_id: str | None = None
        self.attachment_id: str | None = None

    def call(self, method: str, params: dict, timeout: float = 30) -> dict:
        """One call on the control socket (shareblk.control); any failure is a ControlError."""
        try:
            return control.ControlClient(self.control, timeout).call(method, params)
        except control.ControlError as e:
            raise ControlError(f"{method} failed: {json.dumps(e.error)}") from None
        except control.ConnectionClosed:
            raise ControlError(f"{method}: the control socket closed without a reply") from None
        except ValueError as e:
            raise ControlError(f"{method}: a reply that is not JSON ({e})") from None
        except OSError as e:
            raise ControlError(f"{method}: control socket {self.control}: {e}") from None

    def start(self) -> None:
        # The state dir sits next to the backing file, on the same file system, so that the
        # volume's file can be a hard link to the backing file (see create_volume).
        self.state_dir = Path(tempfile.mkdtemp(prefix=f"state-{self.tag}-", dir=self.ctx.workdir))
        cmd = [self.ctx.args.shareblkd, "--state-dir", str(self.state_dir),
               "--control-socket", self.control, "--listen-unix", self.nbd_sock]
        if self.ctx.args.workers is not None:
            cmd += ["--workers", str(self.ctx.args.workers)]
        for path in (self.control, self.nbd_sock):
            if os.path.lexists(path):
                os.unlink(path)
        self.spawn(cmd, self.ctx.sockdir)
        deadline = time.monotonic() + 20
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.alive():
                raise StartError(f"shareblkd exited during startup: {self.log_tail()}")
            try:
                self.call("volume_list", {}, timeout=5)
                return
            except ControlError as e:
                last = str(e)
                time.sleep(0.1)
        raise StartError(f"shareblkd's control socket not ready after 20 s ({last})")

    def create_volume(self) -> None:
        """A volume of the backing file's size, whose store file then becomes the backing file.

        The file store keeps a volume as STATE_DIR/volumes/<id>.img, preallocated at create;
        shareblkd opens it only when an attachment first needs it. So the fresh file is
        replaced (an atomic rename) by a hard link to the backing file before anything opens
        it: the same inode, the same random bytes, as every other server serves."""
        vol = self.call("volume_create", {"name": "bench", "size": self.ctx.size})
        self.volume_id = vol["id"]
        store_file = self.state_dir / "volumes" / f"{self.volume_id}.img"
        if not store_file.is_file():
            raise StartError(f"the file store has no {store_file} after volume_create")
        link = store_file.with_name(f".{self.volume_id}.bench-link")
        os.link(self.ctx.backing, link)
        os.replace(link, store_file)

    def attach(self, connector: dict) -> dict:
        """Creates and completes the attachment; returns its connection_info."""
        a = self.call("attachment_create", {"volume_id": self.volume_id,
                                            "instance_uuid": f"bench-{self.tag}",
                                            "connector": connector})
        self.attachment_id = a["id"]
        a = self.call("attachment_complete", {"attachment_id": self.attachment_id})
        if not a.get("connection_info"):
            raise StartError(f"attachment {self.attachment_id} has no connection_info")
        return a["connection_info"]

    def detach(self) -> str:
        """attachment_delete, which also unmounts a FUSE attachment. Returns a problem, or ""."""
        if self.attachment_id is None or not self.alive():
            return ""
        try:
            reply = self.call("attachment_delete", {"attachment_id": self.attachment_id},
                              timeout=20)
        except ControlError as e:
            return str(e)
        self.attachment_id = None
        return "attachment_delete unmounted lazily" if reply.get("unmounted_lazily") else ""

    def stop(self) -> None:
        self.terminate()
        if self.state_dir is not None:
            # Removes the daemon's database and the volume's hard link, never the backing file.
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None


class Frontend(Server):
    """shareblk-nbdkit: nbdkit with the shareblk plugin in front of a managed shareblkd; the
    server is nbdkit plus the daemon (which answers export_resolve), and fio uses its nbd
    engine. shareblk-fuse: the daemon's FUSE local attach; the server is the daemon (its FUSE
    threads serve the file), and fio runs io_uring on MOUNTPOINT/disk."""

    def __init__(self, name: str, transport: str, ctx: "Context"):
        super().__init__(name, transport, ctx)
        self.daemon = ManagedDaemon(f"{name}-{transport}", ctx)
        self.fuse = name == "shareblk-fuse"
        self.mountpoint = str(ctx.sockdir / f"fuse-{transport}") if self.fuse else None
        self.device_path: str | None = None
        self.direct = True  # fio --direct=1 on the FUSE file (checked at start)
        if self.fuse:
            self.log_path = self.daemon.log_path

    def command(self) -> list[str]:  # shareblk-nbdkit's nbdkit; the export name is the attachment's
        return (["nbdkit", "-f", "--exit-with-parent"] + self._listen_args_nbdkit()
                + [self.ctx.args.nbdkit_plugin, f"control={self.daemon.control}"])

    def start(self) -> None:
        self.register()
        if not self.fuse and not os.path.isfile(self.ctx.args.nbdkit_plugin):
            raise StartError(f"no nbdkit plugin at {self.ctx.args.nbdkit_plugin} (--nbdkit-plugin)")
        self.daemon.start()
        self.cmd = self.daemon.cmd  # what a failure report shows until nbdkit runs
        self.daemon.create_volume()
        if self.fuse:
            os.makedirs(self.mountpoint, exist_ok=True)
            info = self.daemon.attach({"host": "bench", "transport": "fuse",
                                       "mountpoint": self.mountpoint})
            self.device_path = info["data"]["device_path"]
            # The daemon is the server process here.
            self.proc, self.pid, self.starttime = self.daemon.proc, self.daemon.pid, self.daemon.starttime
            self.cmd = self.daemon.cmd
            self.check_fuse_file()
        else:
            # The connector's transport only names the daemon's own listener in
            # connection_info; nbdkit serves the export name on its own socket or port.
            info = self.daemon.attach({"host": "bench", "transport": "unix"})
            self.set_export(info["data"]["export_name"])
            super().start()

    def check_fuse_file(self) -> None:
        """The file has the volume's size and holds the backing file's bytes; O_DIRECT is
        tried, and fio uses --direct=0 only if the FUSE file refuses it."""
        try:
            size = os.stat(self.device_path).st_size
        except OSError as e:
            raise StartError(f"{self.device_path}: {e.strerror}") from None
        if size != self.size:
            raise StartError(f"{self.device_path} has {size} bytes, expected {self.size}")
        buf = mmap.mmap(-1, 4096)  # page aligned, as O_DIRECT wants
        try:
            fd = os.open(self.device_path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise StartError(f"open {self.device_path}: {e.strerror}") from None
            self.direct = False
            self.ctx.notes.append(f"shareblk-fuse: O_DIRECT open of {self.device_path} failed "
                                  f"(EINVAL); fio ran it with --direct=0")
            fd = os.open(self.device_path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [buf], 0)
        except OSError as e:
            raise StartError(f"read {self.device_path}: {e.strerror}") from None
        finally:
            os.close(fd)
        with open(self.ctx.backing, "rb") as f:
            want = f.read(4096)
        if got != 4096 or buf[:] != want:
            raise StartError(f"{self.device_path} does not read as the backing file")
        self.ctx.fuse_direct.append(self.direct)

    def fio_target(self) -> list[str]:
        if not self.fuse:
            return super().fio_target()
        return ["--ioengine=io_uring", f"--direct={1 if self.direct else 0}",
                f"--filename={self.device_path}", f"--size={self.size}"]

    def alive(self) -> bool:
        return super().alive() and (self.fuse or self.daemon.alive())

    def exit_reason(self) -> tuple[str, bool]:
        if not self.fuse and not self.daemon.alive():
            why, outside = self.daemon.exit_reason()
            return f"its shareblkd: {why}", outside
        return super().exit_reason()

    def cpu_ticks(self) -> int:
        return super().cpu_ticks() + (0 if self.fuse else self.daemon.cpu_ticks())

    def stop(self) -> None:
        if self in self.ctx.running:
            self.ctx.running.remove(self)
        if self.fuse:
            self.pid = None  # the daemon's pid: stopped below, after the detach
        else:
            self.terminate()  # nbdkit first: its connections go with it
        problem = self.daemon.detach()
        if problem:
            self.ctx.notes.append(f"{self.name} / {self.transport}: detach at stop: {problem}")
        self.daemon.stop()
        if self.mountpoint and self.mountpoint in mount_points():
            how = lazy_unmount(self.mountpoint)
            msg = (f"{self.name} / {self.transport}: {self.mountpoint} was still mounted after "
                   f"shareblkd stopped; " + (f"detached with `{how}`" if how else "COULD NOT UNMOUNT"))
            log("  " + msg)
            self.ctx.notes.append(msg)
