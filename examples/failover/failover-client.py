#!/usr/bin/python3
"""NBD clients and checks for failover-nbd.sh (and the check of failover-vm.sh).

Run with Debian's /usr/bin/python3: the nbd module is python3-libnbd's, and a python3 that
comes first on PATH (pyenv, a venv) usually does not have it. The `check`, `check-vm` and
`json` subcommands need no nbd module.

A block is 4 KiB and says who wrote it and with which sequence number, so that a reader can
tell an acknowledged write from one that never landed, one that landed where it should not,
and a torn or foreign block: the 64-byte line "SBFO <tag> <seq, 12 digits>", padded with
spaces and ended by a newline, 64 times (a guest's busybox shell makes the same block).

Writer A's block for sequence number s lives at block s - 1 of the first half of the volume;
the standby B writes in the second half, so that nothing B writes can hide a block of A's.

Writer log (one line per event, written with os.write before/after the event, so a kill -9
loses at most a line that was never true yet):

    sent SEQ NS       about to send the write of SEQ (CLOCK_REALTIME, ns)
    ack SEQ NS        the server acknowledged SEQ (with FUA: it is on stable storage)
    fail SEQ ERRNO NS the server refused SEQ (ERRNO is a name: EPERM, EIO, ...)
"""
import argparse
import errno as errno_mod
import json
import os
import re
import sys
import time

BLOCK = 4096
LINE = 64


def make_block(tag, seq):
    return f"{f'SBFO {tag} {seq:012d}':<{LINE - 1}}\n".encode() * (BLOCK // LINE)


def parse_block(data):
    """('zero', None, None), ('ok', tag, seq) or ('bad', None, None)."""
    if data.count(0) == len(data):
        return "zero", None, None
    try:
        magic, tag, seq = data[:LINE].split()
        seq = int(seq)
        tag = tag.decode()
        if magic == b"SBFO" and data == make_block(tag, seq):
            return "ok", tag, seq
    except ValueError:
        pass
    return "bad", None, None


def now_ns():
    return time.time_ns()


def errname(e):
    """The errno name of an nbd.Error (python3-libnbd gives the name, or a number)."""
    if isinstance(e.errno, int):
        return errno_mod.errorcode.get(e.errno, str(e.errno))
    return e.errno or "unknown"


def connect(uri):
    import nbd  # only the NBD subcommands need python3-libnbd

    h = nbd.NBD()
    h.set_handle_name("failover-example")
    h.connect_uri(uri)
    return nbd, h


# --- writer ------------------------------------------------------------------------------


def cmd_writer(args):
    """Writes A's blocks seq 1, 2, ... with FUA, `depth` in flight, logging each event.

    Keeps going after errors, as a fenced writer that does not know it is fenced would, but
    waits `backoff` ms after a refused write before sending more (so that a refused writer
    does not use up its region in a moment). Stops at the end of its region or once the stop
    file exists, after its writes in flight are answered."""
    nbd, h = connect(args.uri)
    if not h.can_fua():
        sys.exit("writer: the server does not advertise FUA; an ack would not mean durable")
    region = h.get_size() // 2 // BLOCK
    log = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    inflight = {}  # cookie -> (seq, buffer kept alive until the write completes)
    seq = 0
    refused = False
    while True:
        if refused:
            time.sleep(args.backoff / 1000)
            refused = False
        stopping = os.path.exists(args.stop_file) if args.stop_file else False
        while not stopping and len(inflight) < args.depth and seq < region:
            seq += 1
            buf = nbd.Buffer.from_bytearray(bytearray(make_block("A", seq)))
            os.write(log, f"sent {seq} {now_ns()}\n".encode())
            cookie = h.aio_pwrite(buf, (seq - 1) * BLOCK, flags=nbd.CMD_FLAG_FUA)
            inflight[cookie] = (seq, buf)
        if not inflight:
            break
        h.poll(100)
        for cookie in list(inflight):
            s = inflight[cookie][0]
            try:
                if not h.aio_command_completed(cookie):
                    continue
                os.write(log, f"ack {s} {now_ns()}\n".encode())
            except nbd.Error as e:
                os.write(log, f"fail {s} {errname(e)} {now_ns()}\n".encode())
                refused = True
            del inflight[cookie]
    h.shutdown()


# --- reading a writer's log --------------------------------------------------------------


def read_log(path):
    """Complete lines only: a line being written while we read is not yet true."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")[:-1]  # the part after the last newline is incomplete
    sent, acked, failed = set(), set(), {}
    for line in lines:
        f = line.decode().split()
        if f[0] == "sent":
            sent.add(int(f[1]))
        elif f[0] == "ack":
            acked.add(int(f[1]))
        elif f[0] == "fail":
            failed[int(f[1])] = f[2]
    return sent, acked, failed


def cmd_mark(args):
    """The highest seq whose `sent` line is in the log now: every seq above it is sent later."""
    sent, _, _ = read_log(args.log)
    print(max(sent, default=0))


def cmd_count(args):
    """How many seqs above MARK were sent, and how many of all were acknowledged."""
    sent, acked, failed = read_log(args.log)
    print(len([s for s in sent if s > args.mark]), len(acked), len(failed))


# --- checking a volume's content against a writer's log ----------------------------------


def check_a_region(read, size, log, mark):
    """Checks A's half of the volume. read(offset, length) -> bytes.

    Violations: an acknowledged block missing or not intact; a block that is not one of
    A's at its place (torn, foreign, misplaced); a block whose write was refused; with a
    mark, a block of a seq sent after the mark (after the takeover returned)."""
    sent, acked, failed = read_log(log)
    region = size // 2 // BLOCK
    chunk = 256  # blocks per read: 1 MiB
    present = set()
    violations = []
    for first in range(0, region, chunk):
        n = min(chunk, region - first)
        data = read(first * BLOCK, n * BLOCK)
        for i in range(n):
            kind, tag, seq = parse_block(data[i * BLOCK:(i + 1) * BLOCK])
            index = first + i
            if kind == "zero":
                continue
            if kind == "bad" or tag != "A" or seq != index + 1:
                violations.append(f"block {index}: not A's block {index + 1} (torn or foreign)")
                continue
            present.add(seq)
            if seq in failed:
                violations.append(f"seq {seq}: refused ({failed[seq]}) but landed")
            if mark is not None and seq > mark:
                violations.append(f"seq {seq}: sent after the takeover returned, but landed")
    missing = sorted(acked - present)
    for s in missing[:20]:
        violations.append(f"seq {s}: acknowledged but missing")
    after = {s for s in sent if mark is not None and s > mark}
    return {
        "sent": len(sent),
        "acknowledged": len(acked),
        "verified": len(acked & present),
        "missing": len(missing),
        "unacknowledged_landed": len(present - acked),
        "refused": len(failed),
        "refused_eperm": len([s for s, e in failed.items() if e == "EPERM"]),
        "after_mark_sent": len(after),
        "after_mark_eperm": len([s for s in after if failed.get(s) == "EPERM"]),
        "after_mark_acknowledged": len(after & acked),
        "after_mark_landed": len(after & present),
        "violations": violations,
    }


def cmd_check(args):
    """Checks a dump of the volume (a file) against A's log."""
    size = os.path.getsize(args.dump)
    with open(args.dump, "rb") as f:
        def read(offset, length):
            f.seek(offset)
            return f.read(length)
        result = check_a_region(read, size, args.log, args.mark)
    print(json.dumps(result))
    sys.exit(1 if result["violations"] else 0)


# --- checking what the guests of failover-vm.sh did ----------------------------------------


def read_console(path):
    """A guest's console log: SEND/ACK/FAIL SEQ TAG lines (TAG A, C: A's; B: B's)."""
    events = {"SEND": {}, "ACK": {}, "FAIL": {}}
    with open(path, "rb") as f:
        for raw in f.read().split(b"\n")[:-1]:
            m = re.match(rb"(SEND|ACK|FAIL) (\d+) ([ABC])\r?$", raw)
            if m:
                events[m[1].decode()][int(m[2])] = m[3].decode()
    return events


def cmd_check_vm(args):
    """Checks a copy of the volume that the new writer's guest made against the consoles.

    A's guest writes blocks tagged A, and C once it was told that the takeover returned; its
    block for SEQ is at block SEQ - 1. B's guest writes its SEQ at block half + SEQ."""
    a = read_console(args.a_console)
    b = read_console(args.b_console) if args.b_console else None
    with open(args.image, "rb") as f:
        image = f.read()
    half = len(image) // 2 // BLOCK
    present, violations = {}, []
    for index in range(half):
        kind, tag, seq = parse_block(image[index * BLOCK:(index + 1) * BLOCK])
        if kind == "zero":
            continue
        if kind == "bad" or tag not in ("A", "C") or seq != index + 1:
            violations.append(f"block {index}: not A's block {index + 1} (torn or foreign)")
            continue
        present[seq] = tag
        if tag == "C":
            violations.append(f"seq {seq}: written after the guest knew of the takeover, landed")
    acked = {s for s, t in a["ACK"].items() if t == "A"}
    missing = sorted(acked - set(present))
    violations += [f"seq {s}: acknowledged but missing" for s in missing[:20]]
    after = {s for s, t in a["SEND"].items() if t == "C"}
    after_acked = {s for s, t in a["ACK"].items() if t == "C"}
    violations += [f"seq {s}: written after the takeover, acknowledged" for s in sorted(after_acked)]
    result = {
        "acknowledged": len(acked),
        "verified": len(acked & set(present)),
        "missing": len(missing),
        "unacknowledged_landed": len(set(present) - acked),
        "failed_before_retag": len([s for s, t in a["FAIL"].items() if t == "A"]),
        "after_sent": len(after),
        "after_failed": len([s for s, t in a["FAIL"].items() if t == "C"]),
        "after_acknowledged": len(after_acked),
        "after_landed": len([s for s, t in present.items() if t == "C"]),
    }
    if b is not None:
        b_acked = sorted(s for s, t in b["ACK"].items() if t == "B")
        b_bad = [s for s in b_acked
                 if image[(half + s) * BLOCK:(half + s + 1) * BLOCK] != make_block("B", s)]
        violations += [f"B seq {s}: acknowledged but not on the volume" for s in b_bad]
        result["b_acknowledged"] = len(b_acked)
        result["b_verified"] = len(b_acked) - len(b_bad)
        result["b_failed"] = sorted(b["FAIL"])
    result["violations"] = violations
    print(json.dumps(result))
    sys.exit(1 if violations else 0)


# --- the standby that takes over ---------------------------------------------------------


def wait_for(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"standby: timed out waiting for {path}")
        time.sleep(0.005)


def cmd_standby(args):
    """B: connects once, and on that one connection

    1. tries a write, which must fail with EPERM (a standby);
    2. says ready, waits for `go` (the takeover returned), and writes at once: must succeed;
    3. waits for `final` (A's writer has stopped) and checks the whole volume."""
    nbd, h = connect(args.uri)
    size = h.get_size()
    b_first = size // 2 // BLOCK
    result = {"standby_write": None}
    try:
        h.pwrite(make_block("B", 0), b_first * BLOCK, flags=nbd.CMD_FLAG_FUA)
        result["standby_write"] = "succeeded"
    except nbd.Error as e:
        result["standby_write"] = errname(e)
    open(args.ready, "w").close()

    wait_for(args.go, args.timeout)
    t_go = int(open(args.go).read().split()[0])  # when the takeover returned, ns
    written, errors = 0, []
    for seq in range(1, args.writes + 1):
        try:
            h.pwrite(make_block("B", seq), (b_first + seq) * BLOCK, flags=nbd.CMD_FLAG_FUA)
            written += 1
        except nbd.Error as e:
            errors.append(f"seq {seq}: {e}")
        if seq == 1:
            result["first_write_ms_after_takeover"] = round((now_ns() - t_go) / 1e6, 1)
    result["b_writes"] = args.writes
    result["b_written"] = written

    wait_for(args.final, args.timeout)
    mark = int(open(args.final).read().split()[0])
    result.update(check_a_region(lambda off, n: h.pread(n, off), size, args.log, mark))
    for seq in range(1, args.writes + 1):
        data = h.pread(BLOCK, (b_first + seq) * BLOCK)
        if seq <= written and data != make_block("B", seq):
            errors.append(f"B seq {seq}: written but not read back")
    result["violations"] = errors + result["violations"]
    if result["standby_write"] != "EPERM":
        result["violations"].insert(0, f"standby write before takeover: {result['standby_write']}")
    if written != args.writes:
        result["violations"].insert(0, f"B wrote {written} of {args.writes} after the takeover")
    h.shutdown()
    with open(args.result, "w") as f:
        json.dump(result, f)


def cmd_console(args):
    """Sends one line to a guest's serial console (a QEMU chardev socket, server=on)."""
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.connect(args.socket)
        s.sendall(args.line.encode() + b"\n")
        time.sleep(0.2)  # let QEMU take the line before the connection closes


# --- JSON from the CLI -------------------------------------------------------------------


def cmd_json(args):
    """Prints one field of the JSON object on stdin: json PATH, e.g. connection_info.data.uri."""
    v = json.load(sys.stdin)
    for key in args.path.split("."):
        v = v[key]
    print(v if not isinstance(v, (dict, list)) else json.dumps(v))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer")
    w.add_argument("uri")
    w.add_argument("log")
    w.add_argument("--depth", type=int, default=8)
    w.add_argument("--stop-file")
    w.add_argument("--backoff", type=float, default=5, help="ms after a refused write")
    w.set_defaults(func=cmd_writer)
    m = sub.add_parser("mark")
    m.add_argument("log")
    m.set_defaults(func=cmd_mark)
    c = sub.add_parser("count")
    c.add_argument("log")
    c.add_argument("mark", type=int)
    c.set_defaults(func=cmd_count)
    k = sub.add_parser("check")
    k.add_argument("dump")
    k.add_argument("log")
    k.add_argument("--mark", type=int)
    k.set_defaults(func=cmd_check)
    s = sub.add_parser("standby")
    s.add_argument("uri")
    for name in ("log", "ready", "go", "final", "result"):
        s.add_argument(f"--{name}", required=True)
    s.add_argument("--writes", type=int, default=64)
    s.add_argument("--timeout", type=float, default=30)
    s.set_defaults(func=cmd_standby)
    v = sub.add_parser("check-vm")
    v.add_argument("image")
    v.add_argument("a_console")
    v.add_argument("b_console", nargs="?")
    v.set_defaults(func=cmd_check_vm)
    o = sub.add_parser("console")
    o.add_argument("socket")
    o.add_argument("line")
    o.set_defaults(func=cmd_console)
    j = sub.add_parser("json")
    j.add_argument("path")
    j.set_defaults(func=cmd_json)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
