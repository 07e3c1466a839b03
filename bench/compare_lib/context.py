"""One run's shared state, its progress log and size units.

Contract: `Context` is everything a run shares (its arguments, paths, the servers that the
finally blocks must stop, and what it gathered: results, failures, notes); it is created
once by `cli` and passed to every other module. `Result` is one measurement (one fio run or
one idle-connection count) of one job, transport and server. `log` writes progress to
stderr, never to the report. Nothing here starts a process or touches the disk.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # bench/compare_lib/ is two below the root
MIB = 1 << 20


def log(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Result:
    job: str
    transport: str
    server: str
    ok: bool = False
    error: str = ""
    iops: float = 0.0
    mib_s: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    total_ios: int = 0
    cpu_us_per_io: float | None = None
    cpu_ticks: int | None = None
    rss_delta_kib: int | None = None  # idle256 only
    rss_before_kib: int | None = None
    cached_bytes: int | None = None  # the backing file's page cache right after the run
    disk_inflight: float | None = None  # the backing file's block device over the run:
    disk_busy: float | None = None  # requests in flight on average, fraction of time busy
    connections: int = 0
    fio_cmd: str = ""


@dataclass
class Context:
    args: argparse.Namespace
    workdir: Path
    logs: Path
    fio_dir: Path
    sockdir: Path
    backing: Path
    size: int
    shareblkd_origin: str = ""
    plugin_origin: str = ""
    tmpfs_file: Path | None = None
    tmpfs_size: int = 0
    running: list = field(default_factory=list)
    results: dict = field(default_factory=dict)  # (job, transport, server) -> [Result]
    failures: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    drop_caches_ok: bool = True
    fuse_direct: list = field(default_factory=list)  # O_DIRECT worked on the FUSE file?


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def human_size(n: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
