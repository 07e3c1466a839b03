#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Failover on one single-writer volume, with real NBD clients (libnbd and QEMU's), no VMs.
#
#   failover-nbd.sh [SHAREBLKD SHAREBLK]     (default: build/release/cmd/ of this checkout)
#
# Starts its own shareblkd in a temporary directory and runs two cases, each on a fresh
# volume with two read-write attachments: node-a (the writer) and node-b (a standby).
#
#   1. "writer dies": A writes sequence-numbered 4 KiB blocks with FUA, 8 in flight, logging
#      each acknowledgement; it is killed with SIGKILL mid-write; node-b takes over and reads
#      the volume through QEMU's NBD client; every block A had acknowledged must be there.
#   2. "writer keeps writing": A goes on writing through the takeover, as a hung or
#      partitioned host would. Once volume_takeover returns, none of A's writes may land
#      (each gets EPERM), and B writes at once on the connection it opened as a standby.
#
# Exit status: 0 both cases held, 1 a violation (or an error), 77 a tool is missing (under
# CI=true a missing tool is a failure instead).
set -euo pipefail

prog=failover-nbd
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
shareblkd=${1:-$root/build/release/cmd/shareblkd}
shareblk=${2:-$root/build/release/cmd/shareblk}
# Debian's python3: python3-libnbd's module is there, not in a pyenv or venv python3.
python=/usr/bin/python3
client=("$python" "$here/failover-client.py")
work=""
# shellcheck source=lib.sh
. "$here/lib.sh"

for bin in "$shareblkd" "$shareblk"; do
  [ -x "$bin" ] || skip "$bin is not built (cmake --preset release && cmake --build build/release)"
done
command -v qemu-img >/dev/null || skip "qemu-img is missing (Debian package qemu-utils)"
command -v qemu-io >/dev/null || skip "qemu-io is missing (Debian package qemu-utils)"
[ -x "$python" ] || skip "$python is missing (Debian package python3)"
"$python" -c 'import nbd' 2>/dev/null || skip "$python has no nbd module (Debian package python3-libnbd)"

work=$(mktemp -d "${TMPDIR:-/tmp}/failover-nbd.XXXXXX")
trap cleanup EXIT

start_daemon

# Waits until LOG has at least N lines starting with WORD; fails after 20 s or if PID died.
wait_log() {
  local log=$1 word=$2 n=$3 pid=$4
  for _ in $(seq 2000); do
    if [ -f "$log" ] && [ "$(grep -c "^$word " "$log" || true)" -ge "$n" ]; then return 0; fi
    kill -0 "$pid" 2>/dev/null || die "the writer exited early (log: $(tail -n 2 "$log" 2>/dev/null))"
    sleep 0.01
  done
  die "timed out waiting for $n '$word' lines in $log"
}

# --- case 1: the writer dies mid-write -------------------------------------------------------

case1() {
  local dir=$work/case1 out r gen t0 summary
  mkdir -p "$dir"
  make_volume failover-dies 64M unix tcp

  # The standby is a standby: QEMU's client, advertised read-write, gets EPERM on a write.
  out=$(qemu-io -f raw "$uri_b" -c 'write -P 0xbb 32M 4k' 2>&1 || true)
  grep -q 'Operation not permitted' <<<"$out" || die "case 1: standby write was not refused: $out"
  echo "case 1: node-b (standby) write before the takeover: refused (Operation not permitted)"

  "${client[@]}" writer "$uri_a" "$dir/a.log" --depth 8 &
  local writer=$!
  wait_log "$dir/a.log" ack 500 "$writer"
  kill -9 "$writer"
  wait "$writer" 2>/dev/null || true
  echo "case 1: node-a's writer killed (SIGKILL) after $(grep -c '^ack ' "$dir/a.log") acknowledged writes, $(grep -c '^sent ' "$dir/a.log") sent"

  t0=$(now_ns)
  r=$(takeover)
  gen=$(field fencing_generation <<<"$r")
  echo "case 1: volume_takeover to node-b returned in $(ms_since "$t0") ms, fencing_generation $gen"

  # node-b reads the whole volume through QEMU's NBD client; the check reads A's log.
  qemu-img convert -f raw -O raw "$uri_b" "$dir/volume.img" || die "case 1: node-b cannot read"
  summary=$("${client[@]}" check "$dir/volume.img" "$dir/a.log") || true
  "$python" - "$summary" <<'EOF' || die "case 1: violations (above)"
import json, sys
r = json.loads(sys.argv[1])
for v in r["violations"]:
    print("case 1: VIOLATION:", v)
print(f"case 1 (writer dies): acknowledged {r['acknowledged']}, verified {r['verified']}, "
      f"missing {r['missing']} (sent {r['sent']}; in flight at the kill and landed anyway: "
      f"{r['unacknowledged_landed']})")
sys.exit(1 if r["violations"] or r["missing"] or r["verified"] != r["acknowledged"] else 0)
EOF

  # And node-b writes now, through a new connection of its own.
  out=$(qemu-io -f raw "$uri_b" -c 'write -P 0xbb 32M 4k' 2>&1) || die "case 1: node-b cannot write: $out"
  echo "case 1: node-b writes after the takeover: ok"
}

# --- case 2: the writer keeps writing through the takeover -----------------------------------

case2() {
  local dir=$work/case2 t0 t1 r gen mark after conns_b
  mkdir -p "$dir"
  make_volume failover-hangs 64M unix tcp

  # B connects first and keeps that one connection: it must write after the takeover
  # without reconnecting.
  "${client[@]}" standby "$uri_b" --log "$dir/a.log" --ready "$dir/ready" --go "$dir/go" \
    --final "$dir/final" --result "$dir/result.json" &
  local standby=$!
  for _ in $(seq 500); do [ -e "$dir/ready" ] && break; sleep 0.01; done
  [ -e "$dir/ready" ] || die "case 2: node-b's client did not connect"

  "${client[@]}" writer "$uri_a" "$dir/a.log" --depth 8 --stop-file "$dir/stop" &
  local writer=$!
  wait_log "$dir/a.log" ack 300 "$writer"

  # The takeover, while A has writes in flight. When it returns, the highest seq A had
  # logged as sent is the mark: every seq above it was sent after the return.
  conns_b=$(admissions "$att_b")
  t0=$(now_ns)
  r=$(takeover)
  t1=$(now_ns)
  put_signal "$dir/go" "$t1"
  mark=$("${client[@]}" mark "$dir/a.log")
  gen=$(field fencing_generation <<<"$r")
  echo "case 2: volume_takeover to node-b returned in $(((t1 - t0) / 1000000)) ms," \
    "fencing_generation $gen; node-a had sent up to seq $mark by then (the mark)"

  # A keeps writing: let it send a few hundred more after the mark, then stop it.
  for _ in $(seq 2000); do
    read -r after _ _ < <("${client[@]}" count "$dir/a.log" "$mark")
    [ "$after" -ge 300 ] && break
    kill -0 "$writer" 2>/dev/null || die "case 2: the writer exited early"
    sleep 0.01
  done
  touch "$dir/stop"
  wait "$writer" || die "case 2: the writer failed"
  # Every write A sent is now answered. B checks the volume on its own connection.
  put_signal "$dir/final" "$mark"
  wait "$standby" || die "case 2: node-b's client failed"
  [ "$(admissions "$att_b")" = "$conns_b" ] || die "case 2: node-b connected again after the takeover"

  "$python" - "$dir/result.json" <<'EOF' || die "case 2: violations (above)"
import json, sys
r = json.load(open(sys.argv[1]))
for v in r["violations"]:
    print("case 2: VIOLATION:", v)
print(f"case 2: node-b before the takeover: write {r['standby_write']}; after: "
      f"{r['b_written']} of {r['b_writes']} writes ok on the same connection, the first "
      f"{r['first_write_ms_after_takeover']} ms after the takeover returned (no new connection)")
print(f"case 2: node-a before the mark: acknowledged {r['acknowledged']}, verified "
      f"{r['verified']}, missing {r['missing']}; refused in the takeover window: "
      f"{r['refused_eperm'] - r['after_mark_eperm']}")
print(f"case 2 (writer keeps writing): writes after takeover attempted "
      f"{r['after_mark_sent']}, landed {r['after_mark_landed']}, acknowledged "
      f"{r['after_mark_acknowledged']}, refused with EPERM {r['after_mark_eperm']}")
bad = (r["violations"] or r["after_mark_landed"] or r["after_mark_acknowledged"]
       or r["after_mark_eperm"] != r["after_mark_sent"] or r["after_mark_sent"] == 0
       or r["missing"])
sys.exit(1 if bad else 0)
EOF
}

start=$(now_ns)
case1
case2
finish_daemon
echo "$prog: both cases held ($(ms_since "$start") ms)"
