"""Processes this script started: run, watched and stopped by pid; CPU and RSS from /proc.

Contract: every process is known by pid and start time, so a recycled pid is never taken
for ours; nothing is ever stopped by name. `Process.terminate()` sends SIGTERM, SIGKILL
after 5 s, then SIGKILL to the descendants it had. `run_cmd` runs a command with a time
limit and takes its whole process group down on timeout or interrupt. `StartError` is what
every start-up failure raises.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [0] is state (field 3)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def alive(pid: int, starttime: str | None = None) -> bool:
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return starttime is None or st[19] == starttime


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = proc_stat(int(entry))
        if st is not None:
            kids.setdefault(int(st[1]), []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    kids = children_map()
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def machine_ticks() -> tuple[int, int]:
    """(busy, available) CPU ticks of the whole machine so far, from /proc/stat: busy is
    user, nice, system, irq and softirq; available leaves out steal (what the hypervisor
    kept)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, _steal = fields
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait


def tree_cpu_ticks(pid: int) -> int:
    """utime+stime (+ reaped children's) of PID and every live descendant, in clock ticks.

    /proc/PID/stat sums all threads of a process. nbd-server forks one process per
    connection; once reaped their time shows up in the parent's cutime/cstime.
    """
    total = 0
    for p in [pid] + descendants(pid):
        st = proc_stat(p)
        if st is not None:
            total += sum(int(x) for x in st[11:15])
    return total


def vm_rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def run_cmd(cmd: list[str], timeout: float | None, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, **kw) -> subprocess.CompletedProcess:
    """subprocess.run with a time limit (None: none) that also kills the command's own process
    group (fio forks one process per job). Its output is captured (text) unless STDOUT or
    STDERR say otherwise (subprocess.DEVNULL, subprocess.STDOUT, None to inherit)."""
    proc = subprocess.Popen(
        cmd, stdout=stdout, stderr=stderr, text=True,
        start_new_session=True, **kw,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        err = (err or "") + f"\n(killed after the {timeout:.0f} s time limit)"
        return subprocess.CompletedProcess(cmd, -9, out, err)
    except BaseException:  # Ctrl-C, SIGTERM: take the command's whole group down with us
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def tool_version(cmd: list[str]) -> str:
    try:
        r = run_cmd(cmd, 10)
    except OSError as e:
        return f"unavailable ({e.strerror})"
    text = (r.stdout or "") + (r.stderr or "")
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return "?"


class StartError(Exception):
    pass


class Process:
    """A process we started, in its own session with its output in a log file. It is known
    by its pid and start time, so a recycled pid is never taken for it."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.starttime: str | None = None
        self.cmd: list[str] = []

    def spawn(self, cmd: list[str], cwd: Path) -> None:
        self.cmd = cmd
        exe = shutil.which(cmd[0]) if "/" not in cmd[0] else cmd[0]
        if not exe or not os.access(exe, os.X_OK):
            raise StartError(f"{cmd[0]}: not found or not executable")
        logf = open(self.log_path, "w")
        logf.write("$ " + shlex.join(cmd) + "\n")
        logf.flush()
        try:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=cwd,
            )
        finally:
            logf.close()
        self.pid = self.proc.pid
        st = proc_stat(self.pid)
        self.starttime = st[19] if st else None

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self.proc is not None and self.proc.pid == self.pid and self.proc.poll() is not None:
            return False
        return alive(self.pid, self.starttime)

    def exit_reason(self) -> tuple[str, bool]:
        """Why a process that is no longer running stopped: (text, stopped_from_outside).

        Exit status 0 after SIGTERM/SIGINT, or death by SIGTERM/SIGINT/SIGKILL, means that
        something outside this script stopped it (other users of the machine); anything
        else (a crash, an error exit) is a failure of the server."""
        rc = None
        if self.proc is not None and self.proc.pid == self.pid:
            rc = self.proc.poll()
        tail = self.log_tail(3)
        if rc is None:
            return f"gone (exit status unknown); log: {tail}", False
        if rc < 0:
            sig = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
            outside = -rc in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
            return f"killed by {sig}; log: {tail}", outside
        # Status 0: a clean stop, which these servers do only when told to (SIGTERM).
        return f"exit status {rc}; log: {tail}", rc == 0

    def cpu_ticks(self) -> int:
        return tree_cpu_ticks(self.pid)

    def log_tail(self, lines: int = 6) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()[1:]
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    def terminate(self) -> None:
        """SIGTERM by pid, SIGKILL after 5 s, then SIGKILL to the descendants it had."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        kids = [(k, (proc_stat(k) or [None] * 20)[19]) for k in descendants(pid)]
        if alive(pid, self.starttime):
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and alive(pid, self.starttime):
                if self.proc is not None and self.proc.pid == pid and self.proc.poll() is not None:
                    break
                time.sleep(0.05)
            if alive(pid, self.starttime):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for k, kstart in kids:
            if kstart and alive(k, kstart):
                try:
                    os.kill(k, signal.SIGKILL)
                except OSError:
                    pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
