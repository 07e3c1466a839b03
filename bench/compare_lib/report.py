"""The markdown report: ratios, raw results, frontends, targets, notes and failures.

Contract: `Report(ctx, ...).render(header)` turns `Context.results` into the report text and
changes nothing; `machine_header` is its opening (machine, command, tools, method), and
`closing_notes` adds the run's fixed notes to `Context.notes` before rendering. Every rule of
comparison lives here: which server is ours and which are its peers in each caching mode,
"best peer", the median of rounds, and every target with its threshold.
"""

from __future__ import annotations

import datetime
import platform
import shlex

from .context import MIB, REPO, Context, Result, human_size
from .jobs import JOB_BY_NAME, Job
from .measure import disk_stat_path, fmt_disk
from .procs import run_cmd, tool_version
from .servers import FRONTENDS, SERVERS

OURS = {"direct": "shareblkd", "cache": "shareblkd-buffered", "tmpfs": "shareblkd-tmpfs"}
PEERS = {
    "direct": ["nbdkit-nocache", "qemu-nbd"],
    "cache": ["nbdkit", "nbd-server"],
    "tmpfs": ["nbdkit-memory"],
}
MODE_TITLE = {"direct": "O_DIRECT", "cache": "page cache", "tmpfs": "tmpfs/RAM"}


def median_result(results: list[Result]) -> Result | None:
    ok = [r for r in results if r.ok]
    if not ok:
        return None
    if len(ok) == 1:
        return ok[0]
    if ok[0].job == "idle256":
        ok.sort(key=lambda r: r.rss_delta_kib)
    else:
        ok.sort(key=lambda r: r.iops)
    return ok[(len(ok) - 1) // 2]


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def fmt_thr(job: Job, r: Result) -> str:
    return f"{r.mib_s:,.0f} MiB/s" if job.unit == "MiB/s" else f"{r.iops:,.0f}"


class Report:
    def __init__(self, ctx: Context, transports: list[str], jobs: list[Job], servers: list[str]):
        self.ctx, self.transports, self.jobs, self.servers = ctx, transports, jobs, servers

    def get(self, job: str, transport: str, server: str) -> Result | None:
        return median_result(self.ctx.results.get((job, transport, server), []))

    def best_peer(self, job: str, transport: str, mode: str, metric: str):
        """(name, result) of the best peer in MODE: highest IOPS, or lowest p50 / CPU."""
        cands = []
        for p in PEERS[mode]:
            r = self.get(job, transport, p)
            if r is None:
                continue
            if metric == "cpu" and not r.cpu_us_per_io:
                continue
            cands.append((p, r))
        if not cands:
            return None, None
        if metric == "thr":
            return max(cands, key=lambda c: c[1].iops)
        if metric == "p50":
            return min(cands, key=lambda c: c[1].p50_us)
        return min(cands, key=lambda c: c[1].cpu_us_per_io)

    def ratio(self, job: str, transport: str, mode: str, metric: str):
        ours = self.get(job, transport, OURS[mode])
        name, peer = self.best_peer(job, transport, mode, metric)
        if ours is None or peer is None:
            return None, name
        if metric == "thr":
            return ours.iops / peer.iops, name
        if metric == "p50":
            return (ours.p50_us / peer.p50_us if peer.p50_us else None), name
        if ours.cpu_us_per_io is None:
            return None, name
        return ours.cpu_us_per_io / peer.cpu_us_per_io, name

    def vs_local(self, job: str, transport: str) -> float | None:
        ours, loc = self.get(job, transport, "shareblkd"), self.get(job, transport, "local")
        if ours is None or loc is None or not loc.iops:
            return None
        return ours.iops / loc.iops

    def modes_for(self, job: Job) -> list[str]:
        """Caching modes compared for JOB: those whose shareblkd variant was selected."""
        modes = ["tmpfs"] if job.tmpfs else ["direct", "cache"]
        return [m for m in modes if OURS[m] in self.servers]

    def raw_table(self, transport: str) -> list[str]:
        spread = self.ctx.args.rounds > 1
        out = ["| job | server | IOPS | MiB/s | p50 µs | p99 µs | server CPU µs/IO "
               "| disk in-flight (busy %) |" + (" IOPS min–max over rounds |" if spread else ""),
               "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if spread else "")]
        for job in self.jobs:
            if job.memory:
                continue
            for s in self.servers:
                if (SERVERS[s][0] == "tmpfs") != job.tmpfs or SERVERS[s][0] == "frontend":
                    continue  # the frontends have their own section
                runs = self.ctx.results.get((job.name, transport, s), [])
                if not runs:
                    continue
                r = median_result(runs)
                if r is None:
                    out.append(f"| {job.name} | {s} | FAILED | | | | | |")
                    continue
                cpu = f"{r.cpu_us_per_io:.1f}" if r.cpu_us_per_io is not None else "n/a"
                row = (f"| {job.name} | {s} | {r.iops:,.0f} | {r.mib_s:,.1f} | "
                       f"{r.p50_us:,.1f} | {r.p99_us:,.1f} | {cpu} | {fmt_disk(r)} |")
                if spread:
                    ok = [x.iops for x in runs if x.ok]
                    row += f" {min(ok):,.0f}–{max(ok):,.0f} ({len(ok)} runs) |"
                out.append(row)
        return out

    def ratio_table(self, transport: str) -> list[str]:
        out = ["| job | mode | shareblkd | best peer | throughput ratio | CPU/IO ratio "
               "(vs lowest peer) | p50 ratio (vs lowest peer) | shareblkd vs local limit |",
               "|---|---|---:|---|---:|---:|---:|---:|"]
        for job in self.jobs:
            if job.memory:
                continue
            for mode in self.modes_for(job):
                ours = self.get(job.name, transport, OURS[mode])
                pname, peer = self.best_peer(job.name, transport, mode, "thr")
                if ours is None and peer is None:
                    continue
                thr, _ = self.ratio(job.name, transport, mode, "thr")
                cpu, cpu_peer = self.ratio(job.name, transport, mode, "cpu")
                p50, p50_peer = self.ratio(job.name, transport, mode, "p50")
                loc = self.vs_local(job.name, transport) if mode == "direct" else None
                ours_s = f"{OURS[mode]} {fmt_thr(job, ours)}" if ours else f"{OURS[mode]} n/a"
                peer_s = f"{pname} {fmt_thr(job, peer)}" if peer else "n/a"
                out.append(
                    f"| {job.name} | {MODE_TITLE[mode]} | {ours_s} | {peer_s} | **{fmt_ratio(thr)}** | "
                    f"{fmt_ratio(cpu)}{f' ({cpu_peer})' if cpu is not None else ''} | "
                    f"{fmt_ratio(p50)}{f' ({p50_peer})' if p50 is not None else ''} | "
                    f"{fmt_ratio(loc) if mode == 'direct' else '–'} |")
        return out

    def frontend_tables(self) -> list[str]:
        """One table per job: shareblkd's listener and the frontends, with their ratios to
        the listener of the same transport (shareblk-fuse: the transport it ran beside)."""
        fronts = [s for s in self.servers if s in FRONTENDS]
        if not fronts:
            return []
        spread = self.ctx.args.rounds > 1
        out = ["", "## Frontends: the same volume through shareblkd's listener, the nbdkit "
               "plugin and FUSE", "",
               "The backing file as one volume of a managed shareblkd (`--state-dir`), attached "
               "once per frontend: `shareblk-nbdkit` is nbdkit with the shareblk plugin (fio's "
               "nbd engine; CPU is nbdkit's plus its shareblkd's), `shareblk-fuse` is the "
               "daemon's FUSE local attach (fio's io_uring engine on MOUNTPOINT/disk"
               + (", direct=1" if self.ctx.fuse_direct and all(self.ctx.fuse_direct) else "")
               + "; CPU is the daemon's, "
               "whose threads serve FUSE). FUSE has no transport: it ran once, beside the "
               f"{self.transports[0]} listener. Ratios are against `shareblkd` (standalone, its "
               "own NBD listener) in the same run; above 1 is more IOPS, higher latency, more "
               "CPU. These are not peers: no other ratio or target counts them.",
               "",
               "*Page cache after*: how much of the backing file was in the page cache right "
               "after the run (`fincore`; the cache is dropped before every run). An O_DIRECT "
               "server leaves about 0. Where a frontend leaves much more, some of its I/O went "
               "through the page cache (unaligned ranges do), so its figures include page "
               "cache hits and buffered writes and are not an O_DIRECT comparison."]
        for job in self.jobs:
            if job.memory or job.tmpfs:
                continue
            rows = []
            for t in self.transports:
                base = self.get(job.name, t, "shareblkd")
                for s in ["shareblkd"] + fronts:
                    runs = self.ctx.results.get((job.name, t, s), [])
                    if not runs:
                        continue
                    name = "shareblkd (listener)" if s == "shareblkd" else s
                    where = f"none (beside {t})" if s == "shareblk-fuse" else t
                    r = median_result(runs)
                    if r is None:
                        rows.append(f"| {name} | {where} | FAILED | | | | | | | | |"
                                    + (" |" if spread else ""))
                        continue

                    def vs(mine, theirs):
                        if s == "shareblkd":
                            return "–"
                        if base is None or mine is None or not theirs:
                            return "n/a"
                        return fmt_ratio(mine / theirs)

                    cpu = f"{r.cpu_us_per_io:.1f}" if r.cpu_us_per_io is not None else "n/a"
                    cached = f"{r.cached_bytes / MIB:,.0f}" if r.cached_bytes is not None else "n/a"
                    row = (f"| {name} | {where} | {r.iops:,.0f} | {r.mib_s:,.1f} | "
                           f"{r.p50_us:,.1f} | {r.p99_us:,.1f} | {cpu} | {cached} | "
                           f"**{vs(r.iops, base.iops if base else None)}** | "
                           f"{vs(r.p50_us, base.p50_us if base else None)} | "
                           f"{vs(r.cpu_us_per_io, base.cpu_us_per_io if base else None)} |")
                    if spread:
                        ok = [x.iops for x in runs if x.ok]
                        row += f" {min(ok):,.0f}–{max(ok):,.0f} ({len(ok)} runs) |"
                    rows.append(row)
            if rows:
                out += ["", f"### {job.name}: {job.title}", "",
                        "| frontend | transport | IOPS | MiB/s | p50 µs | p99 µs | server CPU µs/IO "
                        "| page cache after MiB | IOPS vs listener | p50 vs listener "
                        "| CPU/IO vs listener |" + (" IOPS min–max over rounds |" if spread else ""),
                        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
                        + ("---:|" if spread else "")] + rows
        return out

    def targets(self) -> list[tuple[str, str, str, str]]:
        rows = []
        names = {j.name for j in self.jobs}

        def add(target, transport, value, ok_fn, figure):
            if value is None:
                rows.append((target, transport, figure or "not measured", "N/A"))
            else:
                rows.append((target, transport, figure, "MET" if ok_fn(value) else "NOT MET"))

        def against(job, t, v, peer, mode="direct"):
            # With O_DIRECT, no server can pass the disk: local io_uring / best peer is the
            # highest ratio this run's disk allowed (see bench/PROFILE.md).
            if v is None:
                return ""
            fig = f"{fmt_ratio(v)} vs {peer}"
            vl = self.vs_local(job, t) if mode == "direct" else None
            if vl:
                fig += f" (local io_uring: {fmt_ratio(v / vl)})"
            return fig

        for t in self.transports:
            for job in ("rr4k-qd32", "rw4k-qd32"):
                if job not in names:
                    continue
                v, peer = self.ratio(job, t, "direct", "thr")
                add(f"{job}: >= 1.4x best O_DIRECT peer", t, v, lambda x: x >= 1.4,
                    against(job, t, v, peer))
            if "rr4k-qd32" in names:
                v = self.vs_local("rr4k-qd32", t)
                add("rr4k-qd32: >= 0.9x local io_uring limit", t, v, lambda x: x >= 0.9,
                    fmt_ratio(v) if v is not None else "")
            for job in ("rr4k-4x16", "rrw4k-4x16"):
                if job not in names:
                    continue
                for mode in self.modes_for(JOB_BY_NAME[job]):
                    v, peer = self.ratio(job, t, mode, "thr")
                    add(f"{job}: >= 1.5x best peer ({MODE_TITLE[mode]})", t, v,
                        lambda x: x >= 1.5, against(job, t, v, peer, mode))
            small = [j for j in self.jobs if j.small]
            for mode in [m for m in ("direct", "cache", "tmpfs") if OURS[m] in self.servers]:
                per_job = []
                for j in small:
                    if mode not in self.modes_for(j):
                        continue
                    v, peer = self.ratio(j.name, t, mode, "cpu")
                    if v is not None:
                        per_job.append((v, j.name, peer))
                if not any(mode in self.modes_for(j) for j in small):
                    continue
                if per_job:
                    worst = max(per_job)
                    fig = (f"worst {worst[0]:.2f}x ({worst[1]} vs {worst[2]}); "
                           + ", ".join(f"{n} {v:.2f}x" for v, n, _ in per_job))
                    add(f"server CPU per 4k I/O <= 0.5x best peer, every 4k job ({MODE_TITLE[mode]})",
                        t, worst[0], lambda x: x <= 0.5, fig)
                else:
                    add(f"server CPU per 4k I/O <= 0.5x best peer, every 4k job ({MODE_TITLE[mode]})",
                        t, None, None, "")
            for job in ("sr1m-qd8", "sw1m-qd8"):
                if job not in names:
                    continue
                v = self.vs_local(job, t)
                add(f"{job}: >= 0.9x local io_uring limit", t, v, lambda x: x >= 0.9,
                    fmt_ratio(v) if v is not None else "")
            if "rr4k-qd1" in names:
                for mode in self.modes_for(JOB_BY_NAME["rr4k-qd1"]):
                    v, peer = self.ratio("rr4k-qd1", t, mode, "p50")
                    ours = self.get("rr4k-qd1", t, OURS[mode])
                    fig = (f"{fmt_ratio(v)} ({ours.p50_us:.1f} µs vs {peer})"
                           if v is not None else "")
                    add(f"rr4k-qd1 p50 latency <= 0.8x best peer ({MODE_TITLE[mode]})", t, v,
                        lambda x: x <= 0.8, fig)
            if "tmpfs-rr4k-qd32" in names:
                v, peer = self.ratio("tmpfs-rr4k-qd32", t, "tmpfs", "thr")
                add("tmpfs-rr4k-qd32: >= 1.5x nbdkit memory", t, v, lambda x: x >= 1.5,
                    fmt_ratio(v) if v is not None else "")
            if "idle256" in names:
                r = self.get("idle256", t, "shareblkd")
                v = r.rss_delta_kib / 1024 if r else None
                fig = (f"+{v:.1f} MiB for {r.connections} connections "
                       f"({r.rss_delta_kib / r.connections:.1f} KiB each; "
                       f"{r.rss_before_kib / 1024:.1f} MiB before)" if r else "")
                add("256 idle connections: shareblkd RSS delta < 64 MiB", t, v,
                    lambda x: x < 64, fig)
        return rows

    def render(self, header: list[str]) -> str:
        out = list(header)
        for t in self.transports:
            out += ["", f"## Transport: {t}", "", "### Ratios: shareblkd against the best peer of "
                    "the same caching mode", ""]
            out += self.ratio_table(t)
            out += ["", f"### Raw results ({t})", ""]
            out += self.raw_table(t)
        out += self.frontend_tables()
        out += ["", "## Targets", "", "| target | transport | figure | status |",
                "|---|---|---|---|"]
        for target, t, fig, status in self.targets():
            mark = f"**{status}**" if status != "MET" else status
            out.append(f"| {target} | {t} | {fig} | {mark} |")
        if self.ctx.notes:
            out += ["", "## Notes", ""] + [f"- {n}" for n in self.ctx.notes]
        out += ["", "## Failures", ""]
        out += [f"- {f}" for f in self.ctx.failures] or ["none"]
        return "\n".join(out) + "\n"


def machine_header(ctx: Context, argv: list[str], servers: list[str], started: datetime.datetime,
                   finished: datetime.datetime) -> list[str]:
    model = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    nproc = tool_version(["nproc"])
    rev = tool_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = run_cmd(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], 20)
    if dirty.returncode == 0 and dirty.stdout.strip():
        rev += " (with uncommitted changes)"
    fstype = " on ".join(
        tool_version(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", str(ctx.backing)]).split())
    disk = disk_stat_path(ctx.backing)
    disk_name = f"{disk.parent.resolve().name}, `{disk}`" if disk else "none found"
    a = ctx.args
    lines = [
        "# shareblkd against other NBD servers",
        "",
        "Generated by `bench/compare` (see bench/README.md). Ratios are measured side by side "
        "in one run on a shared, noisy machine: compare ratios, not absolute numbers.",
        "",
        f"- Command: `{shlex.join(argv)}`",
        f"- Date: {started.isoformat(timespec='seconds')} – {finished.isoformat(timespec='seconds')}",
        f"- Machine: {nproc} CPUs (`nproc`), {model}, kernel {platform.release()}",
        f"- shareblkd: {ctx.shareblkd_origin}; repository at git {rev}"
        + (f", --workers {a.workers}" if a.workers is not None else ""),
    ]
    if "shareblk-nbdkit" in servers:
        lines.append(f"- nbdkit plugin: {ctx.plugin_origin}")
    lines += [
        f"- Tools: {tool_version(['fio', '--version'])}; {tool_version(['nbdkit', '--version'])}; "
        f"{tool_version(['qemu-nbd', '--version'])}; "
        f"{tool_version(['nbd-server', '-V'])}",
        f"- Backing file: `{ctx.backing}`, {human_size(ctx.size)} of random data (no holes), "
        f"on {fstype}; tmpfs file {human_size(ctx.tmpfs_size)} in /dev/shm, which with the "
        "tmpfs servers exists only while the tmpfs job runs",
        f"- fio: {a.runtime} s per job, time based, {a.rounds} round(s)"
        + (" (median by IOPS)" if a.rounds > 1 else "")
        + "; page cache dropped before every fio run"
        + ("" if ctx.drop_caches_ok else " (FAILED, see notes)"),
        "- Server CPU µs/IO: utime+stime of the server process and its children "
        "(/proc/PID/stat) over the fio run, divided by the I/Os fio completed",
        f"- Disk in-flight (busy %), raw results: the backing file's block device ({disk_name}) "
        "read just before and just after each fio run (the server CPU window): average requests "
        "in flight = Δtime_in_queue / Δwall time, busy = Δio_ticks / Δwall time. The window "
        "includes fio's own ramp (start-up and wind-down), and the counters are device wide "
        "(other I/O on the device counts too); – = not measured (tmpfs jobs, or no block "
        "device).",
        "- p50/p99: fio completion latency (clat). For `local` (io_uring), a request that "
        "completes inside the submitting io_uring_enter call counts as submission latency, so "
        "its clat can be near zero; no ratio uses local latencies.",
        "- Modes: O_DIRECT = shareblkd vs nbdkit-nocache (file cache=none), qemu-nbd "
        "(cache=none); page cache = shareblkd-buffered vs nbdkit (file), nbd-server; "
        "tmpfs = shareblkd-tmpfs vs nbdkit-memory. Best peer = highest IOPS for "
        "throughput, lowest value for latency and CPU.",
    ]
    if any(s in FRONTENDS for s in servers):
        lines.append("- Frontends (shareblk-nbdkit, shareblk-fuse) are shareblk itself through "
                     "its other frontends; they are compared only with shareblkd's listener, in "
                     "their own section, and are not peers.")
    return lines


def closing_notes(ctx: Context, servers: list[str]) -> None:
    """The notes that every report with these servers carries, and the frontends' page
    cache warnings; added after the run, before rendering."""
    if "nbd-server" in servers:
        ctx.notes.append("nbd-server runs as a daemon (its -d mode serves one connection and "
                         "exits); it is managed by the pid from its -p pid file, and it forks "
                         "one process per connection, all counted in its CPU figure. It serves "
                         "the Unix socket via the `unixsock` config option.")
    if any(s in FRONTENDS for s in servers):
        ctx.notes.append("shareblk-nbdkit and shareblk-fuse each ran a managed shareblkd "
                         "(`--state-dir` under the work dir) with one volume created through "
                         "the control API at the backing file's size; before anything opened "
                         "it, the file store's volume file was replaced by a hard link to the "
                         "backing file, so they serve the same bytes as every other server.")
    for name in FRONTENDS:
        cached = sorted({r.job for (_, _, srv), runs in ctx.results.items() if srv == name
                         for r in runs if r.ok and r.cached_bytes and r.cached_bytes > ctx.size // 10})
        if cached:
            ctx.notes.append(f"{name} left more than 10% of the backing file in the page cache "
                             f"after {', '.join(cached)}: that I/O went through the page cache, "
                             f"not O_DIRECT (see the Frontends section).")
    if "nbdkit-nocache" in servers:
        ctx.notes.append("nbdkit 1.32's file plugin has no O_DIRECT: cache=none evicts the pages "
                         "it touched (posix_fadvise DONTNEED) rather than bypassing the page cache.")
