"""fio, run one way by every benchmark in bench/ (compare, compare-tls, initiators,
rbd-compare, ab-pagecache, qos-accuracy).

Contract: `options(**kw)` spells fio options from keywords, in their order (`--key=value`; a
bare `--key` for True); `job_file` writes a job file the same way; `json_output(out)` asks
for fio's JSON report in OUT. A benchmark puts its fio command line together from those
("fio" first) and `run` runs it through `procs.run_cmd` (a time limit that takes fio's whole
process group down, and its output captured unless the caller says otherwise), after
removing a report an earlier run left in OUT. The `Run` it returns has fio's exit status and
output, and its report (`Run.report()`, read by `load`, which skips what the nbd engine prints
ahead of the JSON). `directions` and `clat_us` read one job of a report. What a benchmark
asks of fio, and which figures of the report it keeps, stay with the benchmark.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .procs import run_cmd


def _spelled(kw: dict, prefix: str) -> list[str]:
    return [f"{prefix}{key}" if value is True else f"{prefix}{key}={value}"
            for key, value in kw.items() if value is not None and value is not False]


def options(**kw) -> list[str]:
    """fio command-line options, in the order given: name="x" is --name=x, True a bare
    --name, None and False leave the option out."""
    return _spelled(kw, "--")


def job_file(path: Path, global_options: dict, jobs: list[tuple[str, dict]]) -> Path:
    """Writes a job file to PATH: a [global] section, then one section per (name, options)
    of JOBS, each option spelled as in `options` (key=value, a bare key for True)."""
    lines = ["[global]", *_spelled(global_options, "")]
    for name, opts in jobs:
        lines += [f"[{name}]", *_spelled(opts, "")]
    path.write_text("\n".join(lines) + "\n")
    return path


def json_output(out: Path | str) -> list[str]:
    """The options that make fio write its JSON report to OUT."""
    return ["--output-format=json", f"--output={out}"]


def parse(text: str) -> dict:
    """fio's JSON report in TEXT, past any lines ahead of it (the nbd engine prints
    "fio: connected to NBD server" there). ValueError if there is none."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON in fio output")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def load(path: Path) -> dict:
    """fio's JSON report in the file PATH (`parse`); OSError if there is no file."""
    return parse(Path(path).read_text(errors="replace"))


@dataclass
class Run:
    """One fio run: its command line, exit status and output (None where not captured)."""

    cmd: list[str]
    out: Path | None
    returncode: int
    stdout: str | None
    stderr: str | None

    def check(self) -> Run:
        """Raises subprocess.CalledProcessError if fio failed, as subprocess.run(check=True)."""
        if self.returncode != 0:
            raise subprocess.CalledProcessError(self.returncode, self.cmd, self.stdout,
                                                self.stderr)
        return self

    def text(self) -> str:
        """The report file as fio left it; "" if there is none."""
        try:
            return self.out.read_text(errors="replace") if self.out else ""
        except OSError:
            return ""

    def report(self) -> dict:
        """fio's JSON report (`load`)."""
        return load(self.out)


def run(cmd: list[str], out: Path | None, timeout: float | None = None, **kw) -> Run:
    """Runs fio's command line CMD, whose JSON report goes to OUT (None: it asks for none);
    TIMEOUT in seconds (None: no limit). KW goes to procs.run_cmd: env, stdout and stderr
    (captured by default), preexec_fn."""
    if out is not None:
        out = Path(out)
        out.unlink(missing_ok=True)  # never read an earlier run's report as this one's
    r = run_cmd(cmd, timeout, **kw)
    return Run(cmd, out, r.returncode, r.stdout, r.stderr)


def directions(job: dict) -> list[dict]:
    """The directions of one job of a report that did I/O: "mixed" alone if fio ran with
    unified_rw_reporting=mixed, else "read" and "write"."""
    dirs = [job["mixed"]] if "mixed" in job else [job[d] for d in ("read", "write") if d in job]
    return [d for d in dirs if d.get("total_ios", 0) > 0]


def clat_us(direction: dict, percentile: float) -> float:
    """A completion-latency percentile of one direction (clat_us(d, 99): p99), in µs; 0 if
    fio reported none."""
    return direction["clat_ns"].get("percentile", {}).get(f"{percentile:.6f}", 0) / 1000
