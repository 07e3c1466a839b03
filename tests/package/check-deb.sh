#!/usr/bin/env bash
# CPack builds the .deb (docs/install.md, "The Debian package"): package shareblk of this
# version, dependencies computed, the maintainer scripts and conffile, every file at its
# Debian path, and a unit that runs /usr/sbin/shareblkd.
# Usage: check-deb.sh BUILD_DIR VERSION. Exit 77: a tool is missing (a skip, not under CI).
set -euo pipefail
build=$1 version=$2
skip() {
  if [ "${CI:-}" = true ]; then echo "required under CI: $1" >&2; exit 1; fi
  echo "skipped: $1"; exit 77
}
command -v dpkg-deb >/dev/null || skip "dpkg-deb is not installed"
command -v dpkg-shlibdeps >/dev/null || skip "dpkg-shlibdeps (dpkg-dev) is not installed"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && cpack -G DEB --config "$build/CPackConfig.cmake" -B "$tmp") >"$tmp/cpack.log" 2>&1 ||
  { cat "$tmp/cpack.log"; exit 1; }
deb=$tmp/shareblk_${version}_$(dpkg --print-architecture).deb
[ -f "$deb" ] || { echo "no $deb:"; ls "$tmp"; cat "$tmp/cpack.log"; exit 1; }

fail=0
check() { # what, then a command that must succeed
  local what=$1; shift
  if ! "$@"; then echo "FAIL: $what" >&2; fail=1; fi
}
field() { dpkg-deb -f "$deb" "$1"; }
check "Package: shareblk" test "$(field Package)" = shareblk
check "Version: $version" test "$(field Version)" = "$version"
depends=$(field Depends)
for lib in libc6 liburing2 libsqlite3-0 libsystemd0 libgnutls30; do
  check "Depends names $lib (computed by dpkg-shlibdeps): $depends" grep -q "$lib" <<<"$depends"
done
dpkg-deb -I "$deb" >"$tmp/info"
for member in postinst prerm postrm conffiles; do
  check "control member $member" grep -qw "$member" "$tmp/info"
done
dpkg-deb -e "$deb" "$tmp/control"
check "conffiles: /etc/shareblk/shareblkd.conf" \
  test "$(cat "$tmp/control/conffiles")" = /etc/shareblk/shareblkd.conf
check "postinst enables and starts nothing" \
  bash -c "! grep -Eq 'systemctl (enable|start)|deb-systemd-invoke' '$tmp/control/postinst'"

dpkg-deb -c "$deb" | awk '{print $NF}' >"$tmp/contents"
for path in ./usr/sbin/shareblkd ./usr/bin/shareblk \
  "./usr/lib/$(dpkg-architecture -qDEB_HOST_MULTIARCH)/nbdkit/plugins/nbdkit-shareblk-plugin.so" \
  ./usr/lib/systemd/system/shareblkd.service ./usr/lib/systemd/system/shareblkd.socket \
  ./usr/lib/systemd/system/shareblkd-nbd.socket ./etc/shareblk/shareblkd.conf \
  ./usr/share/man/man1/shareblk.1 ./usr/share/man/man8/shareblkd.8 \
  ./usr/share/bash-completion/completions/shareblk \
  ./usr/share/bash-completion/completions/shareblkd; do
  check "the package holds $path" grep -qx -- "$path" "$tmp/contents"
done
dpkg-deb -x "$deb" "$tmp/root"
check "the unit runs /usr/sbin/shareblkd with /etc's config" \
  grep -qx "ExecStart=/usr/sbin/shareblkd --config /etc/shareblk/shareblkd.conf" \
  "$tmp/root/usr/lib/systemd/system/shareblkd.service"
check "the packaged daemon runs: $("$tmp/root/usr/sbin/shareblkd" --version 2>&1)" \
  test "$("$tmp/root/usr/sbin/shareblkd" --version)" = "shareblkd $version"
exit $fail
