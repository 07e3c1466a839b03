#!/usr/bin/env bash
# The .deb under a real systemd (docs/install.md): a container booted with systemd-nspawn from
# the host's own /usr (an overlay, so that dpkg can write) installs the package, and then
# `systemctl start shareblkd` brings the daemon up (Type=notify: start returns once it is
# READY), `shareblk volume-list` answers, the watchdog is fed, with the socket units the first
# client starts it, the daemon runs as the user shareblk without capabilities, and FUSE local
# attach reaches the host with the documented drop-in, through the privileged helper, the daemon
# still without capabilities.
# The container is started and stopped by pid in a temp dir, on a private network.
# Usage: check-systemd.sh BUILD_DIR VERSION. Exit 77: no root or systemd-nspawn (not under CI).
set -euo pipefail
build=$1 version=$2
skip() {
  if [ "${CI:-}" = true ]; then echo "required under CI: $1" >&2; exit 1; fi
  echo "skipped: $1"; exit 77
}
[ "$(id -u)" = 0 ] || skip "needs root (systemd-nspawn)"
command -v systemd-nspawn >/dev/null || skip "systemd-nspawn (systemd-container) is not installed"
[ -x /lib/systemd/systemd ] || skip "systemd is not installed"
[ -c /dev/fuse ] || skip "no /dev/fuse (FUSE local attach)"
tmp=$(mktemp -d)
nspawn=
# Run by the EXIT trap below; shellcheck 0.9 takes its body for unreachable (SC2317).
# shellcheck disable=SC2317
cleanup() {
  if [ -n "$nspawn" ] && kill -0 "$nspawn" 2>/dev/null; then
    kill -TERM "$nspawn"  # nspawn powers the container off
    for _ in $(seq 100); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$nspawn" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

(cd "$tmp" && cpack -G DEB --config "$build/CPackConfig.cmake" -B "$tmp/deb") >"$tmp/cpack.log" 2>&1 ||
  { cat "$tmp/cpack.log"; exit 1; }
mkdir "$tmp/shared"
cp "$tmp/deb/shareblk_${version}_$(dpkg --print-architecture).deb" "$tmp/shared/shareblk.deb"

# A root of its own: /usr is the host's (under an overlay), /etc and /var are fresh.
root=$tmp/root
mkdir -p "$root"/{etc,var/lib,tmp,run,proc,sys,dev,root,usr}
for d in bin lib lib64 sbin; do ln -s "usr/$d" "$root/$d"; done
cp /usr/lib/os-release "$root/etc/os-release"
: >"$root/etc/machine-id"
cp /etc/passwd /etc/group /etc/nsswitch.conf "$root/etc/"
cp -a /etc/dpkg "$root/etc/"
cp -a /var/lib/dpkg "$root/var/lib/"
mkdir -p "$root/etc/systemd/system/multi-user.target.wants"
cat >"$root/etc/systemd/system/shareblk-probe.service" <<'UNIT'
[Unit]
Description=shareblk package probe
After=basic.target
SuccessAction=poweroff
FailureAction=poweroff
[Service]
Type=oneshot
ExecStart=/bin/bash /shared/probe.sh
StandardOutput=append:/shared/probe.log
StandardError=inherit
UNIT
ln -s ../shareblk-probe.service "$root/etc/systemd/system/multi-user.target.wants/"
cat >"$tmp/shared/probe.sh" <<'PROBE'
set -x
export SHAREBLK_SOCKET=/run/shareblk/shareblk.sock
dpkg -i /shared/shareblk.deb && echo "probe: installed"
systemctl is-enabled shareblkd.service; systemctl is-active shareblkd.service
systemctl start shareblkd && echo "probe: started"
systemctl show -p ActiveState -p SubState -p Type -p WatchdogUSec -p StatusText shareblkd
shareblk volume-create v 1M && shareblk volume-list && echo "probe: volume-list answered"
# The unit's user (made by postinst), with no capability, owns the state.
pid=$(systemctl show -p MainPID --value shareblkd)
echo "probe: daemon runs as $(ps -o user= -p "$pid") with CapEff $(sed -n 's/^CapEff:\t//p' "/proc/$pid/status")"
echo "probe: state owned by $(stat -c %U /var/lib/shareblk /var/lib/shareblk/shareblk.db | sort -u)"
echo "probe: user shareblk's shell $(getent passwd shareblk | cut -d: -f7)"
shareblk --version
# The watchdog: with WatchdogSec=1s the daemon lives on only if it sends WATCHDOG=1.
mkdir -p /etc/systemd/system/shareblkd.service.d
printf '[Service]\nWatchdogSec=1s\n' >/etc/systemd/system/shareblkd.service.d/watchdog.conf
systemctl daemon-reload && systemctl restart shareblkd && sleep 3
echo "probe: watchdog $(systemctl show -p WatchdogUSec -p NRestarts -p ActiveState --value shareblkd | tr '\n' ' ')"
rm /etc/systemd/system/shareblkd.service.d/watchdog.conf && systemctl daemon-reload
systemctl stop shareblkd && echo "probe: stopped ($(systemctl is-active shareblkd))"
# Socket activation: the sockets listen, the first client starts the daemon.
systemctl start shareblkd.socket shareblkd-nbd.socket && echo "probe: sockets listening"
systemctl is-active shareblkd
shareblk volume-list | grep -q '^[0-9a-f]' && echo "probe: activated volume-list answered"
echo "probe: after activation $(systemctl is-active shareblkd)"
# FUSE local attach: the host sees an attachment's disk only with the FUSE drop-in. Mountpoints
# lie below --fuse-mount-root (its default).
mounts=/run/shareblk/mounts
fuse_disk() { # NAME: a volume and a FUSE attachment at $mounts/NAME; does the host see its disk?
  local v a
  v=$(shareblk --json volume-create "fuse-$1" 1M | sed -n 's/.*"id": *"\([^"]*\)".*/\1/p')
  a=$(shareblk --json attachment-create "$v" "i-$1" | sed -n 's/.*"id": *"\([^"]*\)".*/\1/p')
  mkdir -p "$mounts/$1"
  shareblk call attachment_update "{\"attachment_id\": \"$a\", \"connector\": {\"host\": \"h\",
    \"transport\": \"fuse\", \"mountpoint\": \"$mounts/$1\"}}" >/dev/null
  test -e "$mounts/$1/disk" && echo yes || echo no
}
echo "probe: FUSE disk seen by the host, hardened unit: $(fuse_disk hardened)"
mkdir -p /etc/systemd/system/shareblkd.service.d
cp /usr/share/doc/shareblk/examples/privileged-helper.conf /etc/systemd/system/shareblkd.service.d/
systemctl daemon-reload && systemctl restart shareblkd
echo "probe: FUSE disk seen by the host, with the drop-in: $(fuse_disk dropin)"
pid=$(systemctl show -p MainPID --value shareblkd)
echo "probe: with the helper, the daemon runs as $(ps -o user= -p "$pid") with CapEff $(sed -n 's/^CapEff:\t//p' "/proc/$pid/status")"
helper=$(systemctl show -p MainPID --value shareblk-helper)
echo "probe: the helper runs as $(ps -o user= -p "$helper")"
journalctl -u shareblk-helper --no-pager | tail -5
journalctl -u shareblkd --no-pager | tail -20
echo "probe: done"
PROBE

start=$SECONDS
systemd-nspawn -q -D "$root" --overlay=/usr::/usr --bind="$tmp/shared:/shared" \
  --bind=/dev/fuse --private-network --register=no --keep-unit -b >"$tmp/console.log" 2>&1 </dev/null &
nspawn=$!
for _ in $(seq 600); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$nspawn" 2>/dev/null; then
  echo "the container did not power off within 60 s"
  tail -30 "$tmp/console.log"
  cat "$tmp/shared/probe.log" 2>/dev/null
  exit 1
fi
wait "$nspawn" || true
nspawn=
echo "container up and down in $((SECONDS - start)) s"
log=$(cat "$tmp/shared/probe.log" 2>/dev/null || true)
fail=0
for line in "probe: installed" "probe: started" "ActiveState=active" "SubState=running" \
  "Type=notify" "WatchdogUSec=30s" "probe: volume-list answered" "shareblk $version" \
  "probe: daemon runs as shareblk with CapEff 0000000000000000" \
  "probe: state owned by shareblk" "probe: user shareblk's shell /usr/sbin/nologin" \
  "probe: watchdog 1s 0 active" \
  "probe: stopped (inactive)" "probe: sockets listening" "probe: activated volume-list answered" \
  "probe: after activation active" "probe: FUSE disk seen by the host, hardened unit: no" \
  "probe: FUSE disk seen by the host, with the drop-in: yes" \
  "probe: with the helper, the daemon runs as shareblk with CapEff 0000000000000000" \
  "probe: the helper runs as root" "probe: done"; do
  grep -qF -- "$line" <<<"$log" || { echo "FAIL: the probe did not say: $line"; fail=1; }
done
echo "--- probe log"; echo "$log"
[ $fail = 0 ] || { echo "--- console"; tail -40 "$tmp/console.log"; }
exit $fail
