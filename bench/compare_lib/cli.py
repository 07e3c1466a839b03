"""The command line and the run's lifetime: options, set-up, transports, cleanup, report.

Contract: `main()` parses the options of bench/README.md, prepares the work dir and the
data, runs each transport (`jobs.run_transport`), stops everything it started and unmounts
what it mounted even when interrupted, then writes the report. Exit status: 0 when
everything ran, 1 on any failure, 2 on bad usage, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from .context import MIB, REPO, Context, human_size, log, parse_size
from .frontends import lazy_unmount, mount_points
from .jobs import JOB_BY_NAME, JOBS, run_transport
from .measure import ensure_backing
from .report import Report, closing_notes, machine_header
from .servers import SERVERS


# Where bench/RESULTS.md's TLS section (bench/compare-tls) begins; kept when the file is rewritten.
TLS_MARKER = "<!-- bench/compare-tls section"


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Benchmark shareblkd against nbdkit, qemu-nbd, nbd-server and the local "
                    "io_uring limit with fio; write a markdown report of ratios and targets.")
    ap.add_argument("--short", action="store_true",
                    help="smoke test: 3 s per job, 256 MiB file, report to bench/out/RESULTS-short.md")
    ap.add_argument("--runtime", type=int, help="seconds per fio job (default 20; 3 with --short)")
    ap.add_argument("--size", help="backing file size (default 2G; 256M with --short)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every job N times and report the median run (default 1)")
    ap.add_argument("--only", help="servers to run, comma separated: " + ",".join(SERVERS))
    ap.add_argument("--jobs", help="jobs to run, comma separated: " + ",".join(JOB_BY_NAME))
    ap.add_argument("--shareblkd", default=str(REPO / "build/release/cmd/shareblkd"),
                    help="the shareblkd binary (default build/release/cmd/shareblkd)")
    ap.add_argument("--nbdkit-plugin",
                    help="nbdkit-shareblk-plugin.so for shareblk-nbdkit (default: nbdkit/ in the "
                         "build tree of --shareblkd, e.g. build/release/nbdkit/)")
    ap.add_argument("--workers", type=int, help="pass --workers N to shareblkd")
    ap.add_argument("--transport", choices=["unix", "tcp", "both"], default="both")
    ap.add_argument("--dir", default=str(REPO / "bench/out"),
                    help="work dir for the backing file, logs and fio output (default bench/out)")
    ap.add_argument("--results", help="report path (default bench/RESULTS.md; "
                    "bench/out/RESULTS-short.md with --short)")
    args = ap.parse_args()

    args.runtime = args.runtime or (3 if args.short else 20)
    size = parse_size(args.size) if args.size else (256 * MIB if args.short else 2 << 30)
    if size <= 0 or size % 4096:
        ap.error("--size must be a positive multiple of 4 KiB")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    servers = list(SERVERS)
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        bad = [s for s in wanted if s not in SERVERS]
        if bad:
            ap.error(f"unknown server(s) {','.join(bad)}; known: {','.join(SERVERS)}")
        servers = [s for s in SERVERS if s in wanted]
    jobs = list(JOBS)
    if args.jobs:
        wanted = [j.strip() for j in args.jobs.split(",") if j.strip()]
        bad = [j for j in wanted if j not in JOB_BY_NAME]
        if bad:
            ap.error(f"unknown job(s) {','.join(bad)}; known: {','.join(JOB_BY_NAME)}")
        jobs = [j for j in JOBS if j.name in wanted]
    transports = ["unix", "tcp"] if args.transport == "both" else [args.transport]
    args.shareblkd = str(Path(args.shareblkd).resolve()) if "/" in args.shareblkd else args.shareblkd
    if args.nbdkit_plugin is None:  # CMake puts it in BUILD/nbdkit/, beside BUILD/cmd/shareblkd
        build = Path(args.shareblkd).parent.parent if "/" in args.shareblkd else REPO / "build/release"
        args.nbdkit_plugin = str(build / "nbdkit" / "nbdkit-shareblk-plugin.so")
    args.nbdkit_plugin = str(Path(args.nbdkit_plugin).resolve())
    workdir = Path(args.dir).resolve()
    results_path = Path(args.results) if args.results else (
        workdir / "RESULTS-short.md" if args.short else REPO / "bench/RESULTS.md")
    if not shutil.which("fio"):
        print("bench/compare: fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2

    # Stop cleanly (the finally blocks below) on SIGTERM/SIGHUP as on Ctrl-C.
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    argv = [sys.argv[0]] + sys.argv[1:]
    started = datetime.datetime.now().astimezone()
    for sub in ("logs", "fio"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    sockdir = Path(tempfile.mkdtemp(prefix="shareblk-bench-", dir="/tmp"))  # short socket paths
    ctx = Context(args=args, workdir=workdir, logs=workdir / "logs", fio_dir=workdir / "fio",
                  sockdir=sockdir, backing=workdir / f"backing-{human_size(size)}.img", size=size,
                  tmpfs_size=size)
    shm_dir = None
    interrupted = False
    # Others rebuild build/release while we run: serve a copy, so that every instance in
    # this run (restarts included) is the same binary.
    def use_copy(path: str) -> tuple[str, str]:
        """(the copy's path, where it came from) for PATH, or (PATH, the error)."""
        try:
            st = os.stat(path)
            built = datetime.datetime.fromtimestamp(st.st_mtime).astimezone()
            (workdir / "bin").mkdir(exist_ok=True)
            copy = workdir / "bin" / Path(path).name
            tmp = copy.with_name(f".{copy.name}.{os.getpid()}")
            shutil.copy2(path, tmp)
            os.replace(tmp, copy)
            return str(copy), (f"`{path}` (built {built.isoformat(timespec='seconds')}), "
                               f"run from a copy at `{copy}`")
        except OSError as e:
            return path, f"`{path}`: {e.strerror}"

    try:
        args.shareblkd, ctx.shareblkd_origin = use_copy(args.shareblkd)
        if "shareblk-nbdkit" in servers:
            args.nbdkit_plugin, ctx.plugin_origin = use_copy(args.nbdkit_plugin)
        if any(not j.tmpfs for j in jobs):
            ensure_backing(ctx)
        if any(j.tmpfs for j in jobs) and any(SERVERS[s][0] == "tmpfs" for s in servers):
            free = shutil.disk_usage("/dev/shm").free
            if free < ctx.tmpfs_size + 64 * MIB:
                ctx.failures.append(f"tmpfs job skipped: /dev/shm has {free // MIB} MiB free, "
                                    f"needs {ctx.tmpfs_size // MIB} MiB")
                jobs = [j for j in jobs if not j.tmpfs]
            else:
                shm_dir = Path(tempfile.mkdtemp(prefix="shareblk-bench-", dir="/dev/shm"))
                ctx.tmpfs_file = shm_dir / "vol.img"  # filled for the tmpfs job only (jobs.py)
        for t in transports:
            run_transport(ctx, t, jobs, servers, with_fuse=t == transports[0])
    except KeyboardInterrupt as e:
        interrupted = True
        ctx.failures.append(f"interrupted ({str(e) or 'Ctrl-C'}); the report is partial")
        log("interrupted: stopping servers")
    finally:
        for srv in list(ctx.running):
            srv.stop()
        # FUSE mount points live in sockdir; never remove it with a mount still inside.
        for mp in sorted(m for m in mount_points() if m.startswith(f"{sockdir}/")):
            how = lazy_unmount(mp)
            ctx.notes.append(f"{mp} was still mounted at the end; "
                             + (f"detached with `{how}`" if how else "COULD NOT UNMOUNT"))
        if not any(m.startswith(f"{sockdir}/") for m in mount_points()):
            shutil.rmtree(sockdir, ignore_errors=True)
        if shm_dir is not None:
            shutil.rmtree(shm_dir, ignore_errors=True)

    finished = datetime.datetime.now().astimezone()
    closing_notes(ctx, servers)
    report = Report(ctx, transports, jobs, servers).render(
        machine_header(ctx, argv, servers, started, finished))
    if interrupted:  # never replace a complete report with a partial one
        results_path = workdir / "RESULTS-partial.md"
    results_path.parent.mkdir(parents=True, exist_ok=True)
    kept = ""
    try:  # bench/compare-tls's section (hand-copied from its report) outlives this rewrite
        old = results_path.read_text()
        if TLS_MARKER in old:
            kept = "\n" + old[old.index(TLS_MARKER):]
    except OSError:
        pass
    results_path.write_text(report + kept)
    sys.stdout.write(report)
    log(f"report written to {results_path}")
    if ctx.failures:
        log(f"{len(ctx.failures)} failure(s):")
        for f in ctx.failures:
            log("  " + f.split("  \n")[0])
    return 130 if interrupted else (1 if ctx.failures else 0)
