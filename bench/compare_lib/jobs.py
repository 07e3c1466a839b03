"""The jobs, and the order a transport runs them in.

Contract: `JOBS` is the catalogue of jobs (`--jobs` names, what fio is asked to do).
`run_transport` starts every selected server on one transport, runs every job against every
server in a rotating order for each round, restarts a server that stopped (at most 3 times)
and reruns the job it lost, and stops all it started in a finally block; `ServerPool` is that
starting, restarting and rerunning, shared with compare-tls. Each result goes
through `record`, into `Context.results` (or `Context.failures`). How one run is measured is
`measure`'s business; how results are compared is `report`'s.
"""

from __future__ import annotations

import contextlib
import shlex
from dataclasses import dataclass
from typing import Callable

from .context import Context, Result, log
from .frontends import Frontend
from .measure import fill_file, fmt_disk, idle_connections, prefill, run_fio
from .procs import StartError
from .servers import SERVERS, Server


@dataclass(frozen=True)
class Job:
    name: str
    title: str
    rw: str = ""
    bs: str = "4k"
    iodepth: int = 1
    numjobs: int = 1
    rwmixread: int | None = None
    tmpfs: bool = False  # runs on the tmpfs file (shareblkd-tmpfs against nbdkit-memory)
    memory: bool = False  # the idle-connection RSS test, not a fio job

    @property
    def small(self) -> bool:  # a 4k job: CPU-per-I/O target applies
        return self.bs == "4k" and not self.memory

    @property
    def unit(self) -> str:  # what the throughput ratio is shown in
        return "MiB/s" if self.bs != "4k" else "IOPS"


JOBS = [
    Job("rr4k-qd1", "4k randread QD1", "randread", "4k", 1),
    Job("rr4k-qd32", "4k randread QD32", "randread", "4k", 32),
    Job("rw4k-qd32", "4k randwrite QD32", "randwrite", "4k", 32),
    Job("sr1m-qd8", "1M seq read QD8", "read", "1M", 8),
    Job("sw1m-qd8", "1M seq write QD8", "write", "1M", 8),
    Job("rr4k-4x16", "4 conn x QD16 4k randread", "randread", "4k", 16, 4),
    Job("rrw4k-4x16", "4 conn x QD16 4k randrw 70/30", "randrw", "4k", 16, 4, 70),
    Job("tmpfs-rr4k-qd32", "tmpfs: 4k randread QD32", "randread", "4k", 32, tmpfs=True),
    Job("idle256", "256 idle connections: shareblkd RSS", memory=True),
]
JOB_BY_NAME = {j.name: j for j in JOBS}


def make_server(name: str, transport: str, ctx: Context) -> Server:
    """A fresh, not yet started instance of server NAME on TRANSPORT."""
    return Frontend(name, transport, ctx) if SERVERS[name][0] == "frontend" else Server(name, transport, ctx)


def record(ctx: Context, res: Result) -> None:
    ctx.results.setdefault((res.job, res.transport, res.server), []).append(res)
    if res.ok:
        if res.job == "idle256":
            log(f"    idle256 {res.transport}: RSS +{res.rss_delta_kib / 1024:.1f} MiB "
                f"for {res.connections} connections")
        else:
            cpu = f"{res.cpu_us_per_io:.1f} us" if res.cpu_us_per_io is not None else "n/a"
            log(f"    {res.server:<18} {res.iops:>10.0f} IOPS {res.mib_s:>8.1f} MiB/s "
                f"p50 {res.p50_us:>7.1f} us p99 {res.p99_us:>8.1f} us cpu/io {cpu} "
                f"disk {fmt_disk(res)}")
    else:
        log(f"    {res.server:<18} FAILED: {res.error}")
        ctx.failures.append(f"{res.job} / {res.transport} / {res.server}: {res.error}"
                            + (f"  \n  command: `{res.fio_cmd}`" if res.fio_cmd else ""))


class ServerPool:
    """The servers of one transport: started by MAKE(name), each logged and passed to STARTED
    (which may raise StartError); one that stops is restarted, at most 3 times."""

    def __init__(self, ctx: Context, transport: str, make: Callable[[str], Server],
                 started: Callable[[str, Server], None] = lambda name, srv: None):
        self.ctx, self.transport, self.make, self.on_started = ctx, transport, make, started
        self.running: dict[str, Server] = {}
        self.restarts: dict[str, int] = {}

    def launch(self, name: str) -> None:
        srv = self.make(name)
        try:
            srv.start()
            self.running[name] = srv
            log(f"  started {name} pid {srv.pid}: {shlex.join(srv.cmd)}")
            self.on_started(name, srv)
        except (StartError, OSError) as e:
            srv.stop()
            self.running.pop(name, None)
            msg = f"{name} / {self.transport}: failed to start: {e}"
            log("  " + msg)
            self.ctx.failures.append(msg + f"  \n  command: `{shlex.join(srv.cmd)}`")

    def ensure(self, name: str, job: Job) -> Server | None:
        """The running server NAME; restarted (at most 3 times) if it has stopped."""
        srv = self.running.get(name)
        if srv is None or srv.alive():
            return srv
        why, outside = srv.exit_reason()
        srv.stop()
        del self.running[name]
        msg = f"{name} / {self.transport} stopped before or during {job.name}: {why}"
        if outside:
            self.ctx.notes.append(msg + " (stopped from outside this script; restarted)")
        else:
            self.ctx.failures.append(msg)
        log("  " + msg)
        if self.restarts.get(name, 0) >= 3:
            return None
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self.launch(name)
        return self.running.get(name)

    def run(self, name: str, job: Job, rnd: int) -> Result | None:
        """JOB on server NAME; if the server died under it, restarted and run once more."""
        srv = self.ensure(name, job)
        if srv is None:
            return None
        res = run_fio(self.ctx, job, srv, self.transport, rnd)
        if not res.ok and not srv.alive():
            log(f"    {name} FAILED ({res.error}); restarting, running again")
            srv = self.ensure(name, job)
            if srv is not None:
                res = run_fio(self.ctx, job, srv, self.transport, rnd)
        return res

    def retire(self, name: str) -> None:
        """Stops server NAME; a later launch starts it afresh."""
        srv = self.running.pop(name, None)
        if srv is not None:
            srv.stop()

    def stop(self) -> None:
        for srv in self.running.values():
            srv.stop()


@contextlib.contextmanager
def tmpfs_resident(ctx: Context, pool: ServerPool, names: list[str]):
    """The tmpfs job's file and its servers (nbdkit-memory's RAM disk) exist only while the
    job runs. Held through the whole run, their 4 GiB of memory lowered the kernel's dirty
    background threshold (10% of the memory it may dirty) below the 2 GiB of the page-cache
    servers' sw1m-qd8 writes, which then ran with writeback, unlike the same job run on its
    own (bench/PROFILE.md, "Two regimes: with and without writeback")."""
    fill_file(ctx.tmpfs_file, ctx.tmpfs_size, "tmpfs file")
    try:
        for name in names:
            pool.launch(name)
        yield
    finally:
        for name in names:
            pool.retire(name)
        ctx.tmpfs_file.unlink(missing_ok=True)


def run_transport(ctx: Context, transport: str, jobs: list[Job], servers: list[str],
                  with_fuse: bool) -> None:
    """Runs every job on TRANSPORT. shareblk-fuse has no transport: it runs with the first
    transport only (WITH_FUSE), beside that transport's shareblkd."""
    log(f"=== transport {transport} ===")
    if not with_fuse:
        servers = [s for s in servers if s != "shareblk-fuse"]
    file_jobs = [j for j in jobs if not j.memory and not j.tmpfs]
    needed = [s for s in servers if s != "local" and SERVERS[s][0] != "tmpfs" and file_jobs]

    def started(name: str, srv: Server) -> None:
        if name == "nbdkit-memory":
            prefill(ctx, srv)
        if isinstance(srv, Frontend) and not srv.fuse:
            log(f"    its shareblkd pid {srv.daemon.pid}: {shlex.join(srv.daemon.cmd)}")

    pool = ServerPool(ctx, transport, lambda name: make_server(name, transport, ctx), started)
    try:
        for name in needed:
            pool.launch(name)
        for rnd in range(ctx.args.rounds):
            for i, job in enumerate(j for j in jobs if not j.memory):
                if job.tmpfs:
                    order = [s for s in servers if SERVERS[s][0] == "tmpfs"]
                else:
                    order = [s for s in servers if SERVERS[s][0] != "tmpfs"]
                # Rotate the order from job to job so that no server always runs first.
                k = (i + rnd) % max(len(order), 1)
                order = order[k:] + order[:k]
                log(f"  {job.name} ({job.title}), round {rnd + 1}/{ctx.args.rounds}")
                with tmpfs_resident(ctx, pool, order) if job.tmpfs else contextlib.nullcontext():
                    for name in order:
                        if name == "local":
                            record(ctx, run_fio(ctx, job, "local", transport, rnd))
                            continue
                        res = pool.run(name, job, rnd)
                        if res is not None:
                            record(ctx, res)
        if any(j.memory for j in jobs) and "shareblkd" in servers:
            log("  idle256: 256 idle connections to a fresh shareblkd")
            res = idle_connections(ctx, transport)
            if not res.ok:
                log(f"    idle256 FAILED ({res.error}); once more")
                ctx.notes.append(f"idle256 / {transport}: first attempt failed: {res.error}")
                res = idle_connections(ctx, transport)
            record(ctx, res)
    finally:
        pool.stop()
