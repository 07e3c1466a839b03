"""Measuring: the data, one fio run, and the idle-connection count.

Contract: `ensure_backing` makes (once) the random, fully allocated backing file.
`run_fio` drops the page cache (for a page-cache server, after reading the backing file
once), runs one fio job (through the `fio` module) against one server (or `local`), and
returns a `Result` with throughput, latency, server CPU per I/O (from /proc, all threads and
children), the page cache the run left and the disk's queue depth; it never raises for a
failed run, it sets `Result.error`. `idle_connections` measures a fresh shareblkd's RSS
growth for 256 idle connections. Nothing here decides what is compared.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import fio
from .context import MIB, Context, Result, human_size, log
from .nbd import NbdError, nbd_close, nbd_open
from .procs import StartError, descendants, run_cmd, vm_rss_kib
from .servers import SERVERS
from .servers import EXPORT, FRONTENDS, Server

if TYPE_CHECKING:  # jobs imports this module
    from .jobs import Job

CLK_TCK = os.sysconf("SC_CLK_TCK")


def fill_file(path: Path, size: int, what: str) -> None:
    """Writes SIZE bytes of random data (preallocated, no holes) to PATH."""
    log(f"creating {what} {path} ({human_size(size)} of random data)")
    chunk = 4 * MIB
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            pass  # tmpfs and others without fallocate: the writes below allocate anyway
        done = 0
        while done < size:
            n = min(chunk, size - done)
            buf = os.urandom(n)
            view = memoryview(buf)
            while view:
                w = os.pwrite(fd, view, done)
                view = view[w:]
                done += w
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_backing(ctx: Context) -> None:
    path, size = ctx.backing, ctx.size
    marker = path.with_name(path.name + ".done")
    try:
        st = path.stat()
        if (marker.exists() and marker.read_text().strip() == str(size) and st.st_size == size
                and st.st_blocks * 512 >= size):
            log(f"reusing backing file {path} ({human_size(size)}, fully allocated)")
            return
    except OSError:
        pass
    marker.unlink(missing_ok=True)
    fill_file(path, size, "backing file")
    st = path.stat()
    if st.st_blocks * 512 < size:
        raise SystemExit(f"backing file {path} is sparse after filling: "
                         f"{st.st_blocks * 512} of {size} bytes allocated")
    marker.write_text(f"{size}\n")


def drop_caches(ctx: Context) -> None:
    run_cmd(["sync"], 300)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        if ctx.drop_caches_ok:
            ctx.drop_caches_ok = False
            msg = f"cannot drop the page cache ({e.strerror}); results are with a warm cache"
            log("WARNING: " + msg)
            ctx.notes.append(msg)


def settle_page_cache(ctx: Context) -> None:
    """Reads the backing file once through the page cache, so that the drop_caches after it
    frees as much memory as a page-cache run can fill. A page-cache run after one that cached
    little (an O_DIRECT server, a 4k write job) otherwise filled the page cache with memory this
    VM's balloon had given back to the host, and the first copy out of each page cost 3-8x the
    CPU: 1M sequential reads at 320-460 MiB/s, whichever server it was (bench/PROFILE.md,
    "Page-cache mode, 1 MiB sequential"). This makes such runs rarer, not impossible."""
    buf = bytearray(MIB)
    try:
        with open(ctx.backing, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    except OSError as e:
        log(f"WARNING: cannot read {ctx.backing} ahead of a run: {e.strerror}")


def fio_command(job: Job, target, runtime: int, out: Path, ctx: Context) -> list[str]:
    rand = job.rw.startswith("rand")
    cmd = ["fio", *fio.options(name=job.name, rw=job.rw, bs=job.bs, iodepth=job.iodepth,
                               numjobs=job.numjobs, group_reporting=True, time_based=True,
                               runtime=runtime, unified_rw_reporting="mixed"),
           *fio.json_output(out),
           *fio.options(randrepeat=0 if rand else None, norandommap=rand,
                        rwmixread=job.rwmixread)]
    if target == "local":
        cmd += fio.options(ioengine="io_uring", direct=1, filename=ctx.backing, size=ctx.size)
    else:
        cmd += target.fio_target()
    return cmd


def parse_fio(res: Result, data: dict) -> None:
    jobs = data.get("jobs") or []
    if not jobs:
        raise ValueError("fio JSON has no jobs")
    errors = [j.get("error", 0) for j in jobs if j.get("error", 0)]
    if errors:
        raise ValueError(f"fio job error {errors[0]}")
    iops = bw = 0.0
    ios = 0
    p50 = p99 = 0.0
    for j in jobs:  # one with group_reporting
        dirs = fio.directions(j)
        for d in dirs:
            iops += d["iops"]
            bw += d["bw_bytes"]
            ios += d["total_ios"]
        if dirs:
            main = max(dirs, key=lambda d: d["total_ios"])
            p50, p99 = fio.clat_us(main, 50), fio.clat_us(main, 99)
    if ios == 0:
        raise ValueError("fio completed no I/O")
    res.iops, res.mib_s, res.total_ios, res.p50_us, res.p99_us = iops, bw / MIB, ios, p50, p99


def cached_bytes(path: Path) -> int | None:
    """How much of PATH is in the page cache (util-linux fincore), or None."""
    try:
        r = run_cmd(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], 30)
        return int(r.stdout.split()[0]) if r.returncode == 0 else None
    except (OSError, ValueError, IndexError):
        return None


def disk_stat_path(path: Path | None) -> Path | None:
    """/sys/dev/block/MAJ:MIN/stat of the block device (or partition) holding PATH, or None
    when there is none (tmpfs, and other file systems with an anonymous st_dev)."""
    if path is None:
        return None
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.is_file() else None


def read_disk_stat(stat: Path | None) -> tuple[float, int, int] | None:
    """(monotonic seconds, io_ticks ms, time_in_queue ms) from a block device's stat file
    (Documentation/block/stat.rst: fields 10 and 11), or None."""
    if stat is None:
        return None
    try:
        now = time.monotonic()
        fields = stat.read_text().split()
        return now, int(fields[9]), int(fields[10])
    except (OSError, ValueError, IndexError):
        return None


def run_fio(ctx: Context, job: Job, target, transport: str, rnd: int) -> Result:
    name = "local" if target == "local" else target.name
    res = Result(job.name, transport, name)
    out = ctx.fio_dir / f"{transport}-{job.name}-{name}-r{rnd}.json"
    cmd = fio_command(job, target, ctx.args.runtime, out, ctx)
    # A target may need fio to run with extra environment (bench/compare-tls: LD_PRELOAD).
    fio_env = getattr(target, "fio_env", None) if target != "local" else None
    res.fio_cmd = shlex.join(cmd)
    if fio_env:
        res.fio_cmd = " ".join(f"{k}={shlex.quote(v)}" for k, v in fio_env.items()) + " " + res.fio_cmd
    if target != "local" and not target.alive():
        res.error = "server is not running"
        return res
    if not job.tmpfs and SERVERS.get(name, ("",))[0] == "cache":
        settle_page_cache(ctx)
    drop_caches(ctx)
    ticks0 = kids0 = None
    if target != "local":
        kids0 = set(descendants(target.pid))
        ticks0 = target.cpu_ticks()
    # The tmpfs jobs serve a /dev/shm file or RAM: no block device under them.
    disk = disk_stat_path(None if job.tmpfs else ctx.backing)
    disk0 = read_disk_stat(disk)
    r = fio.run(cmd, out, ctx.args.runtime + 90,
                **({"env": {**os.environ, **fio_env}} if fio_env else {}))
    disk1 = read_disk_stat(disk)
    if disk0 is not None and disk1 is not None and disk1[0] > disk0[0]:
        wall_ms = (disk1[0] - disk0[0]) * 1000
        res.disk_busy = (disk1[1] - disk0[1]) / wall_ms
        res.disk_inflight = (disk1[2] - disk0[2]) / wall_ms
    if name in FRONTENDS or name == "shareblkd":
        # The cache was dropped before the run: what is cached now, this server put there.
        res.cached_bytes = cached_bytes(ctx.backing)
    if target != "local":
        if target.alive():
            target.settle(kids0)
            res.cpu_ticks = target.cpu_ticks() - ticks0
        else:
            res.error = f"server died during the job: {target.log_tail()}"
    try:
        if r.returncode != 0:
            raise ValueError(f"fio exit status {r.returncode}")
        parse_fio(res, r.report())
    except (OSError, ValueError, KeyError) as e:
        stderr = " | ".join(line for line in (r.stderr or "").splitlines() if line.strip())[-600:]
        res.error = (res.error + "; " if res.error else "") + f"{e}: {stderr or '(no stderr)'}"
        return res
    if res.error:
        return res
    if res.cpu_ticks is not None:
        res.cpu_us_per_io = res.cpu_ticks / CLK_TCK * 1e6 / res.total_ios
    res.ok = True
    return res


def prefill(ctx: Context, server: Server) -> None:
    """Writes the whole nbdkit memory disk once so that reads do not hit holes."""
    out = ctx.fio_dir / f"{server.transport}-prefill-{server.name}.json"
    cmd = ["fio", *fio.options(name="prefill", ioengine="nbd", uri=server.uri, rw="write",
                               bs="1M", iodepth=8), *fio.json_output(out)]
    log(f"  prefilling {server.name} ({human_size(server.size)})")
    r = fio.run(cmd, out, 600)
    if r.returncode != 0:
        raise StartError(f"prefill failed ({r.returncode}): {(r.stderr or '').strip()[-300:]}")


def idle_connections(ctx: Context, transport: str, count: int = 256) -> Result:
    """A fresh shareblkd; RSS before and after COUNT idle connections (NBD_OPT_GO done)."""
    res = Result("idle256", transport, "shareblkd")
    srv = Server("shareblkd", transport, ctx)
    srv.log_path = ctx.logs / f"shareblkd-idle256-{transport}.log"
    if transport == "unix":
        srv.sock_path = str(ctx.sockdir / "shareblkd-idle.sock")
        srv.endpoint = ("unix", srv.sock_path)
    socks = []
    try:
        srv.start()
        time.sleep(0.5)
        before = vm_rss_kib(srv.pid)
        for _ in range(count):
            sock, _size = nbd_open(srv.endpoint, EXPORT, timeout=10)
            socks.append(sock)
        time.sleep(1.0)
        after = vm_rss_kib(srv.pid)
        if not srv.alive():
            raise StartError(f"died with {len(socks)} connections open: {srv.log_tail()}")
        if before is None or after is None:
            raise StartError("cannot read VmRSS")
        res.rss_before_kib, res.rss_delta_kib, res.connections = before, after - before, len(socks)
        res.ok = True
    except (StartError, NbdError, OSError) as e:
        res.error = f"after {len(socks)} connections: {e}"
    finally:
        for s in socks:
            nbd_close(s)
        srv.stop()
    return res


def fmt_disk(r: Result) -> str:
    """Average requests in flight on the backing file's device, and how busy it was."""
    if r.disk_inflight is None or r.disk_busy is None:
        return "–"
    return f"{r.disk_inflight:.1f} ({r.disk_busy * 100:.0f}%)"
