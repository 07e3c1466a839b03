# Sourced by failover-nbd.sh and failover-vm.sh: a private shareblkd and the control calls
# both scripts make. Expects: prog (a name for messages), here (this directory), shareblkd,
# shareblk, python (Debian's /usr/bin/python3), work (a temporary directory).
# shellcheck shell=bash disable=SC2154  # the variables above are the caller's

# A missing tool: skip (exit 77, which ctest reads as "skipped"), or fail under CI=true, where
# a skip would hide that the check did not run.
skip() {
  if [ "${CI:-}" = true ]; then
    echo "$prog: FAIL (CI=true, so not skipped): $*" >&2
    exit 1
  fi
  echo "$prog: SKIP: $*" >&2
  exit 77
}

die() {
  echo "$prog: FAIL: $*" >&2
  if [ -f "$work/shareblkd.log" ]; then
    echo "--- shareblkd log (last 30 lines)" >&2
    tail -n 30 "$work/shareblkd.log" >&2
  fi
  exit 1
}

now_ns() { date +%s%N; }

# PATH VALUE: a file the clients wait for and then read. Written aside and renamed, so that a
# client never sees it existing but still empty.
put_signal() {
  echo "$2" >"$1.tmp"
  mv "$1.tmp" "$1"
}
ms_since() { echo $((($(now_ns) - $1) / 1000000)); }

# Starts shareblkd on $work/state, NBD on $work/nbd.sock and a free TCP port; sets daemon_pid.
# The caller's EXIT trap stops it (stop_daemon).
start_daemon() {
  "$shareblkd" --state-dir "$work/state" --listen-unix "$work/nbd.sock" \
    --listen-tcp 127.0.0.1:0 >"$work/shareblkd.log" 2>&1 &
  daemon_pid=$!
  control=$work/state/shareblk.sock
  local _
  for _ in $(seq 200); do
    rpc volume_list '{}' >/dev/null 2>&1 && return 0
    kill -0 "$daemon_pid" 2>/dev/null || die "shareblkd exited at start"
    sleep 0.05
  done
  die "shareblkd's control socket does not answer"
}

# The EXIT trap of both scripts: whatever this shell still runs (clients, QEMUs, when a
# failure cut a case short; its own jobs only), the daemon, then $work unless KEEP_WORK=1.
cleanup() {
  local pid
  for pid in $(jobs -p); do [ "$pid" = "${daemon_pid:-}" ] || kill -9 "$pid" 2>/dev/null || true; done
  stop_daemon
  if [ "${KEEP_WORK:-}" = 1 ]; then echo "$prog: kept $work" >&2; else rm -rf "$work"; fi
}

stop_daemon() {
  [ -n "${daemon_pid:-}" ] || return 0
  kill "$daemon_pid" 2>/dev/null || true
  wait "$daemon_pid" 2>/dev/null || true
  daemon_pid=""
}

# At the end of a run: the daemon stops cleanly on SIGTERM, and said nothing a sanitizer says
# (ctest runs these scripts against the ASan and TSan builds too).
finish_daemon() {
  local status=0
  kill "$daemon_pid"
  wait "$daemon_pid" || status=$?
  daemon_pid=""
  [ "$status" = 0 ] || die "shareblkd exited with status $status on SIGTERM"
  ! grep -q 'Sanitizer' "$work/shareblkd.log" || die "shareblkd's log has a sanitizer report"
}

rpc() { # METHOD JSON: the call's result as JSON on stdout; a refusal fails
  "$shareblk" --socket "$control" --json call "$1" "$2"
}

field() { # PATH: one field of the JSON on stdin (a.b.c)
  "$python" "$here/failover-client.py" json "$1"
}

# NAME SIZE TRANSPORT_A TRANSPORT_B: a multiattach volume with writer_policy single, its
# writer on node-a and a standby on node-b, both attached read-write and marked attached.
# Sets vol, att_a, att_b, uri_a, uri_b.
make_volume() {
  local name=$1 size=$2 ta=$3 tb=$4 v a b att
  v=$(rpc volume_create "{\"name\":\"$name\",\"size\":\"$size\",\"multiattach\":true,\"writer_policy\":\"single\"}")
  vol=$(field id <<<"$v")
  a=$(rpc attachment_create "{\"volume_id\":\"$vol\",\"instance_uuid\":\"$name-a\",\"mode\":\"rw\",\"connector\":{\"host\":\"node-a\",\"transport\":\"$ta\"}}")
  b=$(rpc attachment_create "{\"volume_id\":\"$vol\",\"instance_uuid\":\"$name-b\",\"mode\":\"rw\",\"connector\":{\"host\":\"node-b\",\"transport\":\"$tb\"}}")
  att_a=$(field id <<<"$a")
  att_b=$(field id <<<"$b")
  uri_a=$(field connection_info.data.uri <<<"$a")
  uri_b=$(field connection_info.data.uri <<<"$b")
  for att in "$att_a" "$att_b"; do rpc attachment_complete "{\"attachment_id\":\"$att\"}" >/dev/null; done
  # The first rw attachment of a single-writer volume writes; the second is a standby.
  [ "$(field write_access <<<"$a")" = True ] || die "$name: node-a is not the writer"
  [ "$(field write_access <<<"$b")" = False ] || die "$name: node-b is not a standby"
  echo "$name: volume $vol, writer node-a ($uri_a), standby node-b ($uri_b)"
}

takeover() { # volume_takeover to node-b; prints its result; fails unless node-b now writes
  local r
  r=$(rpc volume_takeover "{\"volume_id\":\"$vol\",\"attachment_id\":\"$att_b\"}") ||
    die "volume_takeover failed"
  [ "$(field writer <<<"$r")" = "$att_b" ] || die "takeover: writer is not node-b: $r"
  echo "$r"
}

admissions() { # ATTACHMENT_ID: how many NBD connections the daemon admitted to it so far
  grep -c "nbd: admitted .* to attachment $1 " "$work/shareblkd.log" || true
}
