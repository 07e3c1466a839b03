#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Failover between two QEMU guests on one single-writer volume (TCG: no KVM needed).
#
#   failover-vm.sh [SHAREBLKD SHAREBLK]     (default: build/release/cmd/ of this checkout)
#
# Needs (Debian packages; this script installs nothing): qemu-system-x86, a kernel at
# /boot/vmlinuz-*-cloud-amd64 (linux-image-cloud-amd64; or KERNEL=/path/to/vmlinuz with its
# modules in /lib/modules/VERSION), a static busybox at /bin/busybox (busybox-static; or
# BUSYBOX=path), cpio and gzip. As root: apt-get install qemu-system-x86
# linux-image-cloud-amd64 busybox-static cpio.
#
# Each guest boots the kernel with a tiny initramfs (busybox and the virtio modules) whose
# /init takes commands on the serial console and answers there; the host sends them through
# a QEMU chardev socket and reads the console's log file. The volume is the guest's virtio-blk
# disk /dev/vda, QEMU's own NBD client connected to the attachment's URI (cache=none,
# werror=report: a refused write is an I/O error in the guest, not a stopped VM).
#
# A guest's write is one 4 KiB block, sequence-numbered, written with dd oflag=direct
# conv=fsync: O_DIRECT, then a flush, so dd succeeds only once the block is on the daemon's
# stable storage; then the guest prints "ACK SEQ". Each such line is a write the guest had
# acknowledged to it.
#
#   1. "writer dies": guest A writes; its QEMU is killed with SIGKILL mid-write; node-b
#      takes over; guest B boots, copies the volume to a scratch disk, and the host checks
#      that every block A acknowledged is there.
#   2. "writer keeps writing": guests A and B run (B a standby: its write fails). A writes
#      through the takeover; once volume_takeover has returned, A is told so and tags its
#      later writes C. B writes at once, on the connection its QEMU opened as a standby. None
#      of A's C writes may succeed or land.
#
# Exit status: 0 both cases held, 1 a violation or an error, 77 something needed is missing
# (a failure instead under CI=true).
set -euo pipefail

prog=failover-vm
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
shareblkd=${1:-$root/build/release/cmd/shareblkd}
shareblk=${2:-$root/build/release/cmd/shareblk}
python=/usr/bin/python3 # the checks need no nbd module, but a python3 that is surely there
client=("$python" "$here/failover-client.py")
work=""
# shellcheck source=lib.sh
. "$here/lib.sh"

for bin in "$shareblkd" "$shareblk"; do
  [ -x "$bin" ] || skip "$bin is not built (cmake --preset release && cmake --build build/release)"
done
command -v qemu-system-x86_64 >/dev/null || skip "qemu-system-x86_64 is missing (Debian package qemu-system-x86)"
command -v cpio >/dev/null || skip "cpio is missing (Debian package cpio)"
command -v gzip >/dev/null || skip "gzip is missing"
[ -x "$python" ] || skip "$python is missing (Debian package python3)"
kernel=${KERNEL:-$(find /boot -maxdepth 1 -name 'vmlinuz-*-cloud-amd64' 2>/dev/null | sort -V | tail -n 1)}
if [ -z "$kernel" ] || [ ! -r "$kernel" ]; then
  skip "no readable /boot/vmlinuz-*-cloud-amd64 (Debian package linux-image-cloud-amd64), or set KERNEL"
fi
kver=${kernel##*/vmlinuz-}
modules=/lib/modules/$kver
[ -f "$modules/modules.dep" ] || skip "no $modules/modules.dep for kernel $kernel"
busybox=${BUSYBOX:-/bin/busybox}
[ -x "$busybox" ] || skip "no $busybox (Debian package busybox-static)"
# The initramfs has no libc: a dynamically linked busybox (Debian's busybox) cannot run there.
if LC_ALL=C ldd "$busybox" 2>&1 | grep -q '=>'; then
  skip "$busybox is dynamically linked; install busybox-static (or set BUSYBOX)"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/failover-vm.XXXXXX")
trap cleanup EXIT

# --- the initramfs ---------------------------------------------------------------------------

# NAME: prints the module files NAME needs, its dependencies first, nothing if it is built in.
module_files() {
  local name=$1 line file d deps=()
  if grep -Eq "/$name\.ko(\.[a-z]+)?$" "$modules/modules.builtin" 2>/dev/null; then return 0; fi
  line=$(grep -E "(^|/)$name\.ko(\.[a-z]+)?:" "$modules/modules.dep") ||
    die "kernel $kver has no module $name and does not build it in"
  file=${line%%:*}
  read -ra deps <<<"${line#*:}"
  # modules.dep lists dependencies so that loading them from the last to the first works.
  for ((d = ${#deps[@]} - 1; d >= 0; d--)); do echo "${deps[d]}"; done
  echo "$file"
}

build_initramfs() {
  local dir=$work/initramfs f name
  mkdir -p "$dir"/{bin,dev,proc,sys,tmp,modules}
  cp "$busybox" "$dir/bin/busybox"
  # virtio-pci is the transport of QEMU's virtio-blk-pci, virtio_blk the disk driver.
  : >"$dir/modules/order"
  for f in $({ module_files virtio_pci; module_files virtio_blk; } | awk '!seen[$0]++'); do
    name=$(basename "$f")
    case $f in # busybox insmod takes plain .ko files
      *.ko) cp "$modules/$f" "$dir/modules/$name" ;;
      *.ko.xz) xz -dc "$modules/$f" >"$dir/modules/${name%.xz}" ;;
      *.ko.zst) zstd -qdc "$modules/$f" >"$dir/modules/${name%.zst}" ;;
      *.ko.gz) gzip -dc "$modules/$f" >"$dir/modules/${name%.gz}" ;;
      *) die "unknown module file $f" ;;
    esac
    echo "${name%.ko*}.ko" >>"$dir/modules/order"
  done
  cat >"$dir/init" <<'EOF'
#!/bin/busybox sh
# /init of failover-vm.sh's guests. Commands come on the serial console, one a line; answers
# go back there. A's blocks for SEQ go to block SEQ-1, B's to the second half of the disk.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
for m in $(cat /modules/order); do insmod "/modules/$m" || echo "SBFO insmod $m failed"; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
stty -echo # nothing echoed back: the host's lines would cut into the guest's
half=$(($(cat /sys/block/vda/size) / 8 / 2))

# The same 4 KiB as failover-client.py's make_block: "SBFO TAG SEQ" padded to 64 bytes, 64 times.
block() {
  line=$(printf 'SBFO %s %012d' "$1" "$2")
  j=0
  while [ $j -lt 64 ]; do printf '%-63s\n' "$line"; j=$((j + 1)); done >/tmp/blk
}
# TAG SEQ INDEX: O_DIRECT, then fsync (a flush of the disk): success means on stable storage.
put() {
  block "$1" "$2"
  dd if=/tmp/blk of=/dev/vda bs=4096 seek="$3" count=1 oflag=direct conv=notrunc,fsync 2>/tmp/err
}
said_error=
fail() {
  echo "FAIL $1 $2"
  [ -n "$said_error" ] || echo "SBFO first failure: $(grep -m1 'dd:' /tmp/err)"
  said_error=1
}
writer() { # FIRST LAST: tag A, or C once the host said "retag" (the takeover had returned)
  seq=$1
  while [ "$seq" -le "$2" ] && [ ! -e /tmp/stop ]; do
    tag=A
    [ -e /tmp/retag ] && tag=C
    echo "SEND $seq $tag"
    if put $tag "$seq" $((seq - 1)); then echo "ACK $seq $tag"; else fail "$seq" $tag; fi
    seq=$((seq + 1))
  done
  echo "SBFO WRITER DONE"
}

echo "SBFO READY $(cat /sys/block/vda/size) sectors"
while read -r cmd x y; do
  case $cmd in
    write) writer "$x" "$y" & ;;
    retag) touch /tmp/retag && echo "SBFO RETAGGED" ;;
    stop) touch /tmp/stop ;;
    bwrite) # FIRST COUNT of B's blocks
      seq=$x
      while [ "$seq" -lt $((x + y)) ]; do
        if put B "$seq" $((half + seq)); then echo "ACK $seq B"; else fail "$seq" B; fi
        seq=$((seq + 1))
      done
      echo "SBFO BWRITE DONE" ;;
    copy) # the whole disk to the scratch disk, for the host to check
      if dd if=/dev/vda of=/dev/vdb bs=1M iflag=direct oflag=direct conv=fsync 2>/tmp/err
      then echo "SBFO COPY DONE"; else echo "SBFO COPY FAILED $(cat /tmp/err)"; fi ;;
    off) poweroff -f ;;
  esac
done
EOF
  chmod +x "$dir/init"
  (cd "$dir" && find . | cpio -o -H newc --quiet | gzip -1) >"$work/initrd.gz"
  echo "initramfs: busybox, $(tr '\n' ' ' <"$dir/modules/order")($(du -k "$work/initrd.gz" | cut -f1) KiB); kernel $kernel"
}

# --- the guests ------------------------------------------------------------------------------

# NAME URI [SCRATCH]: boots a guest in the background with the volume as /dev/vda (and
# SCRATCH as /dev/vdb); sets qemu_pid. Console log: $work/NAME.console; input: $work/NAME.sock.
boot() {
  local name=$1 uri=$2 scratch=${3:-} extra=()
  [ -z "$scratch" ] || extra=(-drive "file=$scratch,format=raw,if=virtio,cache=none")
  qemu-system-x86_64 -accel tcg -m 256 -smp 1 -nodefaults -display none -no-reboot \
    -kernel "$kernel" -initrd "$work/initrd.gz" \
    -append "console=ttyS0 quiet loglevel=3 panic=-1" \
    -chardev "socket,id=con,path=$work/$name.sock,server=on,wait=off,logfile=$work/$name.console" \
    -serial chardev:con \
    -drive "file=$uri,format=raw,if=virtio,cache=none,werror=report,rerror=report" \
    "${extra[@]}" >"$work/$name.qemu.log" 2>&1 &
  qemu_pid=$!
}

# NAME PATTERN: how many lines of NAME's console match PATTERN (0 before it has any).
count() {
  [ -f "$work/$1.console" ] || { echo 0; return; }
  grep -cE "$2" "$work/$1.console" || true
}

# NAME PATTERN N PID [SECONDS]: waits until NAME's console has N lines matching PATTERN.
wait_console() {
  local name=$1 pattern=$2 n=$3 pid=$4 limit=${5:-120} start=$SECONDS
  while [ "$(count "$name" "$pattern")" -lt "$n" ]; do
    kill -0 "$pid" 2>/dev/null || die "guest $name's QEMU exited: $(tail -n 5 "$work/$name.qemu.log" "$work/$name.console" 2>&1)"
    [ $((SECONDS - start)) -lt "$limit" ] ||
      die "guest $name: no $n lines '$pattern' in $limit s: $(tail -n 5 "$work/$name.console" 2>&1)"
    sleep 0.1
  done
}

say() { "${client[@]}" console "$work/$1.sock" "$2"; } # NAME LINE: to NAME's console

# NAME PID: powers the guest off and waits for its QEMU to exit.
power_off() {
  say "$1" off
  local _
  for _ in $(seq 300); do kill -0 "$2" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$2" 2>/dev/null || true
  wait "$2" 2>/dev/null || true
}


# --- case 1: guest A dies mid-write ------------------------------------------------------------

case1() {
  local a b r t0 gen summary
  make_volume failover-vm-dies 16M unix unix

  boot case1-a "$uri_a"
  a=$qemu_pid
  wait_console case1-a '^SBFO READY' 1 "$a"
  echo "case 1: guest A booted: $(grep -m1 '^SBFO READY' "$work/case1-a.console" | tr -d '\r')"
  say case1-a "write 1 2048"
  wait_console case1-a '^ACK [0-9]+ A' 40 "$a"
  kill -9 "$a"
  wait "$a" 2>/dev/null || true
  echo "case 1: guest A's QEMU killed (SIGKILL) after $(count case1-a '^ACK ') acknowledged" \
    "writes, $(count case1-a '^SEND ') begun"

  t0=$(now_ns)
  r=$(takeover)
  gen=$(field fencing_generation <<<"$r")
  echo "case 1: volume_takeover to node-b returned in $(ms_since "$t0") ms, fencing_generation $gen"

  truncate -s 16M "$work/case1-copy.img"
  boot case1-b "$uri_b" "$work/case1-copy.img"
  b=$qemu_pid
  wait_console case1-b '^SBFO READY' 1 "$b"
  say case1-b copy
  wait_console case1-b '^SBFO COPY' 1 "$b"
  grep -q '^SBFO COPY DONE' "$work/case1-b.console" || die "case 1: guest B could not read the volume"
  power_off case1-b "$b"

  summary=$("${client[@]}" check-vm "$work/case1-copy.img" "$work/case1-a.console") || true
  "$python" - "$summary" <<'EOF' || die "case 1: violations (above)"
import json, sys
r = json.loads(sys.argv[1])
for v in r["violations"]:
    print("case 1: VIOLATION:", v)
print(f"case 1 (guest A dies): acknowledged {r['acknowledged']}, verified {r['verified']}, "
      f"missing {r['missing']} (in flight at the kill and landed anyway: "
      f"{r['unacknowledged_landed']}); guest B read them through its virtio disk")
sys.exit(1 if r["violations"] or r["missing"] or r["verified"] != r["acknowledged"] else 0)
EOF
}

# --- case 2: guest A keeps writing through the takeover ----------------------------------------

case2() {
  local a b r t0 t1 gen summary conns_b
  make_volume failover-vm-hangs 16M unix unix

  truncate -s 16M "$work/case2-copy.img"
  boot case2-a "$uri_a"
  a=$qemu_pid
  boot case2-b "$uri_b" "$work/case2-copy.img"
  b=$qemu_pid
  wait_console case2-a '^SBFO READY' 1 "$a"
  wait_console case2-b '^SBFO READY' 1 "$b"

  # B is a standby: its write is refused (an I/O error in the guest).
  say case2-b "bwrite 0 1"
  wait_console case2-b '^SBFO BWRITE DONE' 1 "$b"
  grep -q '^FAIL 0 B' "$work/case2-b.console" || die "case 2: guest B's write as a standby was not refused"
  echo "case 2: guest B (standby) write before the takeover:" \
    "$(grep -m1 '^SBFO first failure' "$work/case2-b.console" | tr -d '\r' | sed 's/^SBFO first failure: //')"

  say case2-a "write 1 2048"
  wait_console case2-a '^ACK [0-9]+ A' 20 "$a"

  conns_b=$(admissions "$att_b")
  t0=$(now_ns)
  r=$(takeover)
  t1=$(now_ns)
  # From now on A's writes may not land; A is told, and tags what it writes from then on C.
  say case2-a retag
  say case2-b "bwrite 1 16"
  gen=$(field fencing_generation <<<"$r")
  echo "case 2: volume_takeover to node-b returned in $(((t1 - t0) / 1000000)) ms," \
    "fencing_generation $gen; guest A had acknowledged $(count case2-a '^ACK [0-9]+ A')"

  wait_console case2-a '^SBFO RETAGGED' 1 "$a"
  wait_console case2-b '^SBFO BWRITE DONE' 2 "$b"
  wait_console case2-a '^SEND [0-9]+ C' 20 "$a"
  say case2-a stop
  wait_console case2-a '^SBFO WRITER DONE' 1 "$a"
  echo "case 2: guest A, told after the return, went on writing: $(grep -m1 '^SBFO first failure' \
    "$work/case2-a.console" | tr -d '\r' | sed 's/^SBFO first failure: /first failure: /')"

  say case2-b copy
  wait_console case2-b '^SBFO COPY' 1 "$b"
  grep -q '^SBFO COPY DONE' "$work/case2-b.console" || die "case 2: guest B could not read the volume"
  power_off case2-b "$b"
  power_off case2-a "$a"
  [ "$(admissions "$att_b")" = "$conns_b" ] || die "case 2: guest B's QEMU connected again after the takeover"

  summary=$("${client[@]}" check-vm "$work/case2-copy.img" "$work/case2-a.console" \
    "$work/case2-b.console") || true
  "$python" - "$summary" <<'EOF' || die "case 2: violations (above)"
import json, sys
r = json.loads(sys.argv[1])
for v in r["violations"]:
    print("case 2: VIOLATION:", v)
print(f"case 2: guest B after the takeover: {r['b_acknowledged']} writes acknowledged, "
      f"{r['b_verified']} on the volume, without reconnecting (no NBD connection of "
      f"node-b admitted after the takeover)")
print(f"case 2: guest A before it was told: acknowledged {r['acknowledged']}, verified "
      f"{r['verified']}, missing {r['missing']}; failed {r['failed_before_retag']}")
print(f"case 2 (guest A keeps writing): writes after takeover attempted {r['after_sent']}, "
      f"landed {r['after_landed']}, acknowledged {r['after_acknowledged']}, "
      f"failed with an I/O error {r['after_failed']}")
bad = (r["violations"] or r["after_landed"] or r["after_acknowledged"] or r["missing"]
       or r["after_sent"] == 0 or r["after_failed"] != r["after_sent"]
       or r["b_acknowledged"] != 16 or r["b_verified"] != 16)
sys.exit(1 if bad else 0)
EOF
}

start=$(now_ns)
build_initramfs
start_daemon
case1
case2
finish_daemon
echo "$prog: both cases held ($(ms_since "$start") ms)"
