#!/usr/bin/env bash
# What a new user meets on a machine just installed (issue 40): the README's first command,
# `./dev run`, brings the daemon up on ./var and `shareblk` answers there without settings;
# and what installing the package list left in /dev -- lvm2's postinst makes
# /dev/mapper/control even on a kernel without device-mapper -- does not break the LVM store.
# Run by `./dev test` right after the release build. Usage: check-fresh-machine.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# What the packages left behind, said, so that a CI log shows which case this machine is.
if [ -e /dev/mapper/control ]; then
  if dmsetup version >/dev/null 2>&1; then
    echo "fresh machine: /dev/mapper/control is there and device-mapper answers"
  else
    echo "fresh machine: /dev/mapper/control is there, but no device-mapper behind it (a stale node)"
  fi
else
  echo "fresh machine: no /dev/mapper/control"
fi
# The LVM store with a stale node, whatever this machine has: the test makes one in a private
# mount namespace.
build/release/tests/e2e_lvm_tests --gtest_filter='LvmStoreWithStaleMapperNode.*' \
  --gtest_brief=1 || fail "the LVM store with a stale /dev/mapper/control"

# `./dev run` on ./var, as the README says; a developer's own ./var is left alone.
if [ -e var ]; then
  [ "${CI:-}" = true ] && fail "./var exists in a clean clone"
  echo "fresh machine: ./var exists (a developer's); ./dev run not tried"
  exit 0
fi
log=$(mktemp)
cleanup() {
  if [ -n "${pid:-}" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -rf var "$log"
}
trap cleanup EXIT
./dev run --listen-tcp 127.0.0.1:0 >"$log" 2>&1 &
pid=$!
for _ in $(seq 6000); do  # ./dev run builds first: a no-op after `./dev build`
  [ -S var/shareblk.sock ] && break
  kill -0 "$pid" 2>/dev/null || { cat "$log"; fail "./dev run exited"; }
  sleep 0.1
done
[ -S var/shareblk.sock ] || { cat "$log"; fail "./dev run: no control socket after 10 min"; }
# No SHAREBLK_SOCKET: the CLI finds ./var/shareblk.sock itself.
(unset SHAREBLK_SOCKET; build/release/cmd/shareblk volume-create fresh 1M >/dev/null &&
  build/release/cmd/shareblk volume-list | grep -q fresh) ||
  { cat "$log"; fail "shareblk volume-create and volume-list against ./dev run"; }
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
pid=
[ "$status" = 0 ] || { cat "$log"; fail "./dev run's daemon exited $status on SIGTERM"; }
echo "fresh machine: ./dev run served shareblk volume-create and volume-list, stopped with 0"
