#!/usr/bin/env bash
# `cmake --install BUILD --prefix P` puts everything under P, with units naming P's paths, man
# pages that render without a warning and programs that run (docs/install.md, "Install").
# Usage: check-install.sh BUILD_DIR VERSION [TEST_HOOKS]: TEST_HOOKS is the build's
# SHAREBLK_TEST_HOOKS (ON or OFF, default OFF). Exit 77: a tool is missing (a skip, not under CI).
set -euo pipefail
build=$1 version=$2 hooks=${3:-OFF}
skip() {
  if [ "${CI:-}" = true ]; then echo "required under CI: $1" >&2; exit 1; fi
  echo "skipped: $1"; exit 77
}
command -v man >/dev/null || skip "man (man-db) is not installed"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
p=$tmp/prefix
cmake --install "$build" --prefix "$p" >"$tmp/install.log"

fail=0
check() { # what, then a command that must succeed
  local what=$1; shift
  if ! "$@"; then echo "FAIL: $what" >&2; fail=1; fi
}
plugin=$(cd "$p" && find lib -name nbdkit-shareblk-plugin.so)
expected=$(printf '%s\n' bin/shareblk sbin/shareblkd sbin/shareblk-helper "$plugin" \
  lib/systemd/system/shareblkd.service lib/systemd/system/shareblkd.socket \
  lib/systemd/system/shareblkd-nbd.socket lib/systemd/system/shareblk-helper.service \
  lib/systemd/system/shareblk-helper.socket etc/shareblk/shareblkd.conf \
  share/man/man1/shareblk.1 share/man/man8/shareblkd.8 \
  share/bash-completion/completions/shareblk share/bash-completion/completions/shareblkd \
  share/doc/shareblk/install.md share/doc/shareblk/examples/privileged-helper.conf \
  lib/sysusers.d/shareblk.conf | sort)
actual=$(cd "$p" && find . -type f -printf '%P\n' | sort)
check "installed files: expected vs actual:
$(diff <(echo "$expected") <(echo "$actual"))" test "$expected" = "$actual"
check "the nbdkit plugin in nbdkit's plugin directory under P" \
  test "$(dirname "$plugin")" != . -a "${plugin#lib/}" != "$plugin"
outside=$(grep -v "^$p/" "$build/install_manifest.txt" || true)
check "every installed path is under P, not: $outside" test -z "$outside"

unit=$p/lib/systemd/system/shareblkd.service
check "ExecStart names P's daemon and config" \
  grep -qx "ExecStart=$p/sbin/shareblkd --config $p/etc/shareblk/shareblkd.conf" "$unit"
check "the unit is Type=notify with a watchdog" \
  grep -q -e "^Type=notify$" -e "^WatchdogSec=" "$unit"
if command -v systemd-analyze >/dev/null; then
  check "systemd-analyze verify" systemd-analyze verify --man=no "$unit" \
    "$p/lib/systemd/system/shareblkd.socket" "$p/lib/systemd/system/shareblkd-nbd.socket" \
    "$p/lib/systemd/system/shareblk-helper.service" "$p/lib/systemd/system/shareblk-helper.socket"
elif [ "${CI:-}" = true ]; then
  check "systemd-analyze is installed (required under CI)" false
fi

for page in "$p/share/man/man1/shareblk.1" "$p/share/man/man8/shareblkd.8"; do
  warnings=$(MANWIDTH=80 man --warnings -E UTF-8 -l -Tutf8 "$page" 2>&1 >"$tmp/page.txt")
  check "man -l $page renders without warnings: $warnings" test -z "$warnings"
  check "$page is rendered and names version $version" grep -q "shareblk $version" "$tmp/page.txt"
done

# The crash and pause points' variables are named in the daemon only when the build has them
# (docs/install.md, "Install"): a plain build's daemon cannot obey them.
if grep -qa SHAREBLK_TEST_KILL_AT "$p/sbin/shareblkd"; then named=ON; else named=OFF; fi
check "the daemon names SHAREBLK_TEST_KILL_AT: $named, the build's SHAREBLK_TEST_HOOKS: $hooks" \
  test "$named" = "$hooks"

check "shareblkd --version" test "$("$p/sbin/shareblkd" --version)" = "shareblkd $version"
check "shareblk --version" test "$("$p/bin/shareblk" --version)" = "shareblk $version"
# The example config is one the daemon accepts (it is parsed before --help is answered).
check "shareblkd reads the example config" \
  "$p/sbin/shareblkd" --config "$p/etc/shareblk/shareblkd.conf" --help >/dev/null
exit $fail
