"""bench/compare-tls: shareblkd with TLS against itself without TLS and against qemu-nbd.

Contract: `main()` parses the options of bench/README.md ("TLS: bench/compare-tls"), makes one
PSK file (psktool) that every TLS server and fio use, builds the LD_PRELOAD shim that lets
fio's nbd engine read it (bench/nbd_uri_local_files.c), starts the four servers of each
transport on the same backing file, records the cipher each TLS server negotiates with fio's
libnbd, runs the jobs in interleaved, rotating rounds (the servers stay up; a server that
stops is restarted, as in bench/compare) and writes a report of medians, ratios and the
issue's targets. It reuses bench/compare's measuring (`measure.run_fio`) and processes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import fio
from .context import REPO, Context, Result, human_size, log, parse_size
from .jobs import JOB_BY_NAME, Job, ServerPool, record
from .measure import ensure_backing
from .procs import StartError, run_cmd, tool_version
from .servers import EXPORT, Server

IDENTITY = "bench"
# shareblkd's own priority is fixed (target/tls.cc, kPriority: AES-GCM first, server order).
# qemu-nbd with GnuTLS's default priority lets libnbd choose, and libnbd (GnuTLS NORMAL) puts
# ChaCha20-Poly1305 ahead of AES-128-GCM on TLS 1.3 here: qemu-nbd then runs ChaCha20, which
# is slower on a CPU with AES instructions. For a like-for-like comparison qemu-nbd gets
# ChaCha20 removed by default (--qemu-priority '' restores its own default).
QEMU_PRIORITY = "NORMAL:-CHACHA20-POLY1305"

# name -> (is TLS, description)
TLS_SERVERS = {
    "shareblkd": (False, "shareblkd, no TLS"),
    "shareblkd-tls": (True, "shareblkd --tls require --tls-psk-file KEYS"),
    "qemu-nbd": (False, "qemu-nbd --aio=io_uring --cache=none, no TLS (reference)"),
    "qemu-nbd-tls": (True, "qemu-nbd ... --object tls-creds-psk,dir=DIR --tls-creds"),
}
TLS_JOBS = ["rr4k-qd32", "rw4k-qd32", "sr1m-qd8", "sw1m-qd8"]
# The targets: (job, ours, theirs, threshold).
TARGETS = [
    ("rr4k-qd32", "shareblkd-tls", "shareblkd", 0.8),
    ("rr4k-qd32", "shareblkd-tls", "qemu-nbd-tls", 1.3),
]


class TlsServer(Server):
    """One of TLS_SERVERS on one transport. TLS ones are reached with nbds URIs that name the
    PSK file; fio runs with the shim preloaded for every server, plain ones too, so the client
    is the same binary with the same libraries in every cell."""

    def __init__(self, name: str, transport: str, ctx: Context, tls: "TlsSetup"):
        self.tls_setup = tls
        self.tls = TLS_SERVERS[name][0]
        # Server.__init__ looks NAME up in bench/compare's catalogue: start from the plain
        # server's, then take this name.
        super().__init__(name.removesuffix("-tls"), transport, ctx)
        self.name = name
        self.log_path = ctx.logs / f"{name}-{transport}.log"
        if transport == "unix":
            self.sock_path = str(ctx.sockdir / f"{name}.sock")
            self.endpoint = ("unix", self.sock_path)
        self.set_export(EXPORT)
        self.fio_env = {"LD_PRELOAD": str(tls.shim)}
        self.cipher = ""

    def set_export(self, export: str) -> None:
        super().set_export(export)
        if getattr(self, "tls", False):
            keys = self.tls_setup.psk_file
            if self.transport == "unix":
                self.uri = (f"nbds+unix://{IDENTITY}@/{export}?socket={self.sock_path}"
                            f"&tls-psk-file={keys}")
            else:
                self.uri = f"nbds://{IDENTITY}@127.0.0.1:{self.port}/{export}?tls-psk-file={keys}"

    def command(self) -> list[str]:
        a = self.ctx.args
        if self.name.startswith("shareblkd"):
            cmd = [a.shareblkd, "--export", f"{EXPORT}={self.path}"]
            cmd += (["--listen-unix", self.sock_path] if self.transport == "unix"
                    else ["--listen-tcp", f"127.0.0.1:{self.port}"])
            if self.tls:
                cmd += ["--tls", "require", "--tls-psk-file", str(self.tls_setup.psk_file)]
            if a.workers is not None:
                cmd += ["--workers", str(a.workers)]
            return cmd
        # qemu-nbd: both instances serve the same file at once, so the image lock is off
        # (--image-opts file.locking=off); otherwise as bench/compare's qemu-nbd.
        cmd = ["qemu-nbd", "--aio=io_uring", "--cache=none", "--shared=8", "--persistent",
               "-x", EXPORT]
        if self.tls:
            creds = f"tls-creds-psk,id=tls0,endpoint=server,dir={self.tls_setup.dir}"
            if a.qemu_priority:
                creds += f",priority={a.qemu_priority}"
            cmd += ["--object", creds, "--tls-creds", "tls0"]
        cmd += (["--socket", self.sock_path] if self.transport == "unix"
                else ["--bind", "127.0.0.1", "--port", str(self.port)])
        return cmd + ["--image-opts",
                      f"driver=raw,file.driver=file,file.filename={self.path},file.locking=off"]

    def wait_ready(self, timeout: float = 20) -> None:
        """Ready when nbdinfo (libnbd, which reads the PSK file itself) sees the export's
        size; for TLS servers this also proves the credentials."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.alive():
                raise StartError(f"exited during startup: {self.log_tail()}")
            r = run_cmd(["nbdinfo", "--size", self.uri], 10)
            if r.returncode == 0:
                size = int(r.stdout.strip())
                if size != self.size:
                    raise StartError(f"export size {size}, expected {self.size}")
                return
            last = (r.stderr or "").strip()[-300:]
            time.sleep(0.2)
        raise StartError(f"not ready after {timeout:.0f} s ({last}): {self.log_tail()}")

    def probe_cipher(self) -> str:
        """What fio's own libnbd negotiates: a few reads with LIBNBD_DEBUG=1."""
        env = {**os.environ, **self.fio_env, "LIBNBD_DEBUG": "1"}
        r = fio.run(["fio", *fio.options(name="probe", rw="randread", bs="4k", io_size="64k",
                                         ioengine="nbd", uri=self.uri, output="/dev/null")],
                    None, 60, env=env)
        m = re.search(r"connection is using TLS: (.*)", r.stderr or "")
        if m:
            return m.group(1).strip()
        if r.returncode == 0:
            return "no TLS"
        return f"probe failed: {(r.stderr or '').strip()[-200:]}"


class TlsSetup:
    """The PSK file (DIR/keys.psk, QEMU's layout) and the shim, made once per run."""

    def __init__(self, workdir: Path, sockdir: Path):
        self.dir = sockdir / "tls"
        self.dir.mkdir(mode=0o700)
        self.psk_file = self.dir / "keys.psk"
        r = run_cmd(["psktool", "-u", IDENTITY, "-p", str(self.psk_file)], 30)
        if r.returncode != 0 or not self.psk_file.exists():
            raise SystemExit(f"psktool failed ({r.returncode}): {(r.stderr or '').strip()} "
                             "(apt-get install gnutls-bin)")
        src = Path(__file__).resolve().parents[1] / "nbd_uri_local_files.c"
        (workdir / "bin").mkdir(exist_ok=True)
        self.shim = workdir / "bin" / "nbd_uri_local_files.so"
        r = run_cmd(["cc", "-O2", "-Wall", "-shared", "-fPIC", "-o", str(self.shim), str(src),
                     "-ldl"], 120)
        if r.returncode != 0:
            raise SystemExit(f"cannot build {src}: {(r.stderr or '').strip()[-400:]}")


def fio_client_cpu(ctx: Context, job: str, transport: str, server: str, rnd: int) -> float | None:
    """fio's own CPU (its job thread: libnbd, and with TLS GnuTLS) per I/O, in µs."""
    path = ctx.fio_dir / f"{transport}-{job}-{server}-r{rnd}.json"
    try:
        j = fio.load(path)["jobs"][0]
        ios = sum(j[d]["total_ios"] for d in ("mixed", "read", "write") if d in j)
        runtime_ms = j.get("job_runtime") or max(j[d]["runtime"] for d in ("mixed", "read", "write") if d in j)
        return (j["usr_cpu"] + j["sys_cpu"]) / 100 * runtime_ms * 1000 / ios if ios else None
    except (OSError, ValueError, KeyError, IndexError):
        return None


def run_transport(ctx: Context, transport: str, jobs: list[Job], servers: list[str],
                  tls: TlsSetup, client_cpu: dict, ciphers: dict) -> None:
    log(f"=== transport {transport} ===")

    def started(name: str, srv: TlsServer) -> None:
        if srv.tls:
            srv.cipher = srv.probe_cipher()
            ciphers[(transport, name)] = srv.cipher
            log(f"    fio's libnbd negotiated: {srv.cipher}")
            if "GCM" not in srv.cipher:
                ctx.failures.append(f"{name} / {transport}: negotiated {srv.cipher!r}, "
                                    "not AES-GCM")

    pool = ServerPool(ctx, transport, lambda name: TlsServer(name, transport, ctx, tls), started)
    try:
        for name in servers:
            pool.launch(name)
        for rnd in range(ctx.args.rounds):
            for i, job in enumerate(jobs):
                k = (i + rnd) % len(servers)
                order = servers[k:] + servers[:k]
                log(f"  {job.name} ({job.title}), round {rnd + 1}/{ctx.args.rounds}")
                for name in order:
                    res = pool.run(name, job, rnd)
                    if res is None:
                        continue
                    record(ctx, res)
                    if res.ok:
                        c = fio_client_cpu(ctx, job.name, transport, name, rnd)
                        if c is not None:
                            client_cpu.setdefault((job.name, transport, name), []).append(c)
    finally:
        pool.stop()


def median_of(runs: list[Result]) -> Result | None:
    ok = sorted((r for r in runs if r.ok), key=lambda r: r.iops)
    return ok[(len(ok) - 1) // 2] if ok else None


def render(ctx: Context, argv: list[str], transports: list[str], jobs: list[Job],
           servers: list[str], client_cpu: dict, ciphers: dict, started, finished) -> str:
    a = ctx.args
    rev = tool_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                  if ln.startswith("model name")), "?")
    out = [
        "## TLS: shareblkd with and without TLS, and qemu-nbd with the same PSK",
        "",
        f"- Command: `{shlex.join(argv)}`",
        f"- Date: {started.isoformat(timespec='seconds')} – {finished.isoformat(timespec='seconds')}",
        f"- Machine: {tool_version(['nproc'])} CPUs, {model}, kernel {platform.release()}",
        f"- shareblkd: {ctx.shareblkd_origin}; repository at git {rev}",
        f"- Tools: {tool_version(['fio', '--version'])}; "
        f"{tool_version(['qemu-nbd', '--version'])}; libnbd {tool_version(['nbdinfo', '--version']).split()[-1]}",
        f"- Backing file: `{ctx.backing}`, {human_size(ctx.size)} of random data; O_DIRECT "
        "servers (shareblkd default, qemu-nbd `--cache=none --aio=io_uring`)",
        f"- fio nbd engine (libnbd), one connection; {a.runtime} s per job, {a.rounds} rounds, "
        "servers interleaved in a rotating order; cells are the median round by IOPS; page "
        "cache dropped before every run. fio runs with bench/nbd_uri_local_files.c preloaded "
        "(all servers), so that libnbd may read the `tls-psk-file` the nbds URI names.",
        f"- PSK: one `psktool` key (identity `{IDENTITY}`) for both TLS servers; qemu-nbd's "
        f"tls-creds priority: `{a.qemu_priority or '(GnuTLS default)'}`",
        "- CPU µs/IO: server = utime+stime of the server process (all threads) over the run / "
        "I/Os; client = fio's job thread (usr+sys, from fio's JSON) / I/Os. With TLS the "
        "client pays for its own encryption too; both share the same 2 CPUs.",
        "",
        "Negotiated (fio's libnbd with `LIBNBD_DEBUG=1`, a short probe after each start):",
        "",
    ]
    for (t, name), c in sorted(ciphers.items()):
        out.append(f"- {name} / {t}: {c}")
    for t in transports:
        out += ["", f"### Transport: {t}", "",
                "| job | server | IOPS | MiB/s | p50 µs | p99 µs | server CPU µs/IO | fio CPU µs/IO "
                "| IOPS min–max |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for job in jobs:
            for s in servers:
                runs = ctx.results.get((job.name, t, s), [])
                r = median_of(runs)
                if r is None:
                    if runs:
                        out.append(f"| {job.name} | {s} | FAILED | | | | | | |")
                    continue
                cc = client_cpu.get((job.name, t, s), [])
                ok = [x.iops for x in runs if x.ok]
                cpu = f"{r.cpu_us_per_io:.1f}" if r.cpu_us_per_io is not None else "n/a"
                out.append(f"| {job.name} | {s} | {r.iops:,.0f} | {r.mib_s:,.1f} | {r.p50_us:,.1f} | "
                           f"{r.p99_us:,.1f} | {cpu} | "
                           f"{statistics.median(cc):.1f} | {min(ok):,.0f}–{max(ok):,.0f} ({len(ok)}) |"
                           if cc else
                           f"| {job.name} | {s} | {r.iops:,.0f} | {r.mib_s:,.1f} | {r.p50_us:,.1f} | "
                           f"{r.p99_us:,.1f} | {cpu} | n/a | {min(ok):,.0f}–{max(ok):,.0f} ({len(ok)}) |")
        out += ["", f"Ratios ({t}), medians, throughput:", "",
                "| job | shareblkd TLS / no TLS | shareblkd TLS / qemu-nbd TLS | qemu-nbd TLS / no TLS "
                "| shareblkd no TLS / qemu-nbd no TLS | server CPU/IO TLS / no TLS (shareblkd) |",
                "|---|---:|---:|---:|---:|---:|"]

        def ratio(job, x, y, metric="iops"):
            rx, ry = (median_of(ctx.results.get((job, t, s), [])) for s in (x, y))
            if rx is None or ry is None:
                return "n/a"
            vx, vy = getattr(rx, metric), getattr(ry, metric)
            return f"{vx / vy:.2f}x" if vx and vy else "n/a"
        for job in jobs:
            out.append(f"| {job.name} | {ratio(job.name, 'shareblkd-tls', 'shareblkd')} | "
                       f"{ratio(job.name, 'shareblkd-tls', 'qemu-nbd-tls')} | "
                       f"{ratio(job.name, 'qemu-nbd-tls', 'qemu-nbd')} | "
                       f"{ratio(job.name, 'shareblkd', 'qemu-nbd')} | "
                       f"{ratio(job.name, 'shareblkd-tls', 'shareblkd', 'cpu_us_per_io')} |")
        out += ["", f"Targets ({t}):", "", "| target | value | |", "|---|---:|---|"]
        for job, x, y, thr in TARGETS:
            rx, ry = (median_of(ctx.results.get((job, t, s), [])) for s in (x, y))
            if rx is None or ry is None:
                out.append(f"| {job}: {x} >= {thr}x {y} | n/a | N/A |")
                continue
            v = rx.iops / ry.iops
            out.append(f"| {job}: {x} >= {thr}x {y} | {v:.2f}x | {'MET' if v >= thr else 'NOT MET'} |")
    if ctx.notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in ctx.notes]
    out += ["", "Failures:", ""] + ([f"- {f}" for f in ctx.failures] or ["none"])
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(
        description="shareblkd with TLS against shareblkd without TLS and against qemu-nbd "
                    "with the same PSK (fio nbd engine); writes a markdown report.")
    ap.add_argument("--runtime", type=int, default=5, help="seconds per fio job (default 5)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5); "
                    "cells are the median round")
    ap.add_argument("--size", default="2G", help="backing file size (default 2G)")
    ap.add_argument("--only", help="servers, comma separated: " + ",".join(TLS_SERVERS))
    ap.add_argument("--jobs", help="jobs, comma separated, from: " + ",".join(TLS_JOBS))
    ap.add_argument("--transport", choices=["unix", "tcp", "both"], default="tcp",
                    help="default tcp (where TLS is used)")
    ap.add_argument("--shareblkd", default=str(REPO / "build/release/cmd/shareblkd"))
    ap.add_argument("--workers", type=int, help="pass --workers N to shareblkd")
    ap.add_argument("--qemu-priority", default=QEMU_PRIORITY,
                    help=f"qemu-nbd's tls-creds priority (default {QEMU_PRIORITY}; '' = GnuTLS's "
                         "default, which lets libnbd pick ChaCha20 here)")
    ap.add_argument("--dir", default=str(REPO / "bench/out"), help="work dir (default bench/out)")
    ap.add_argument("--results", help="report path (default DIR/RESULTS-tls.md)")
    args = ap.parse_args()
    if args.rounds < 1 or args.runtime < 1:
        ap.error("--rounds and --runtime must be at least 1")
    size = parse_size(args.size)
    servers = list(TLS_SERVERS)
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        if bad := [s for s in wanted if s not in TLS_SERVERS]:
            ap.error(f"unknown server(s) {','.join(bad)}")
        servers = [s for s in TLS_SERVERS if s in wanted]
    names = TLS_JOBS
    if args.jobs:
        names = [j.strip() for j in args.jobs.split(",") if j.strip()]
        if bad := [j for j in names if j not in TLS_JOBS]:
            ap.error(f"unknown job(s) {','.join(bad)}")
    jobs = [JOB_BY_NAME[j] for j in names]
    for tool in ("fio", "nbdinfo", "psktool", "cc"):
        if not shutil.which(tool):
            print(f"bench/compare-tls: {tool} is not installed", file=sys.stderr)
            return 2
    transports = ["unix", "tcp"] if args.transport == "both" else [args.transport]

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    argv = [sys.argv[0]] + sys.argv[1:]
    workdir = Path(args.dir).resolve()
    for sub in ("logs", "fio", "bin"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    results_path = Path(args.results) if args.results else workdir / "RESULTS-tls.md"
    sockdir = Path(tempfile.mkdtemp(prefix="shareblk-bench-tls-", dir="/tmp"))
    ctx = Context(args=args, workdir=workdir, logs=workdir / "logs", fio_dir=workdir / "fio",
                  sockdir=sockdir, backing=workdir / f"backing-{human_size(size)}.img", size=size)
    # Run a copy, so that a rebuild during the run does not mix binaries.
    copy = workdir / "bin" / "shareblkd-tls-bench"
    shutil.copy2(args.shareblkd, copy)
    built = datetime.datetime.fromtimestamp(os.stat(args.shareblkd).st_mtime).astimezone()
    ctx.shareblkd_origin = (f"`{args.shareblkd}` (built {built.isoformat(timespec='seconds')}), "
                            f"run from a copy at `{copy}`")
    args.shareblkd = str(copy)
    client_cpu: dict = {}
    ciphers: dict = {}
    interrupted = False
    started = datetime.datetime.now().astimezone()
    try:
        tls = TlsSetup(workdir, sockdir)
        ensure_backing(ctx)
        for t in transports:
            run_transport(ctx, t, jobs, servers, tls, client_cpu, ciphers)
    except KeyboardInterrupt as e:
        interrupted = True
        ctx.failures.append(f"interrupted ({str(e) or 'Ctrl-C'}); the report is partial")
    finally:
        for srv in list(ctx.running):
            srv.stop()
        shutil.rmtree(sockdir, ignore_errors=True)  # also the PSK file
    finished = datetime.datetime.now().astimezone()
    report = render(ctx, argv, transports, jobs, servers, client_cpu, ciphers, started, finished)
    if interrupted:
        results_path = workdir / "RESULTS-tls-partial.md"
    results_path.write_text(report)
    sys.stdout.write(report)
    log(f"report written to {results_path}")
    return 130 if interrupted else (1 if ctx.failures else 0)
