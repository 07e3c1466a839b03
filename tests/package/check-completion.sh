#!/usr/bin/env bash
# The bash completion (dist/bash-completion/shareblk) offers every command and option that
# `shareblk --help` and `shareblkd --help` list, each command's own options, and option values.
# Usage: check-completion.sh COMPLETION_FILE SHAREBLK SHAREBLKD. Exit 77: no bash-completion.
set -uo pipefail
file=$1 cli=$2 daemon=$3
lib=/usr/share/bash-completion/bash_completion
if [ ! -f $lib ]; then
  if [ "${CI:-}" = true ]; then echo "required under CI: bash-completion" >&2; exit 1; fi
  echo "skipped: bash-completion is not installed"; exit 77
fi
# shellcheck disable=SC1090
source $lib
# shellcheck disable=SC1090
source "$file"

# What completing the last word of the given command line offers, one per line.
offers() {
  COMP_WORDS=("$@")
  COMP_CWORD=$(($# - 1))
  COMP_LINE="$*"
  COMP_POINT=${#COMP_LINE}
  COMPREPLY=()
  "_$1" "$1" "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD - 1]}"
  printf '%s\n' "${COMPREPLY[@]}"
}
fail=0
expect_all() { # what, the words expected (newline-separated), what was offered
  local missing
  missing=$(comm -23 <(sort -u <<<"$2") <(sort -u <<<"$3"))
  if [ -n "$missing" ]; then
    echo "FAIL: $1 does not offer: ${missing//$'\n'/ }" >&2
    fail=1
  fi
}

help=$("$cli" --help)
# The command table: "  NAME ARGS..." lines between "commands:" and the blank line.
commands=$(sed -n '/^commands:/,/^$/p' <<<"$help" | awk 'NF && $1 != "commands:" {print $1}')
expect_all "shareblk <TAB>" "$commands" "$(offers shareblk '')"
expect_all "shareblk --<TAB>" "$(grep -o -- '--[a-z][a-z0-9_-]*' <<<"$(sed -n '/^options:/,$p' <<<"$help")" |
  grep -v -e --command -e --args)" "$(offers shareblk --)"
while read -r command rest; do
  options=$(grep -o -- '--[a-z][a-z0-9_-]*' <<<"$rest")
  [ -n "$options" ] && expect_all "shareblk $command --<TAB>" "$options" "$(offers shareblk "$command" --)"
done < <(sed -n '/^commands:/,/^$/p' <<<"$help" | sed '1d;/^$/d')
expect_all "shareblk attachment-create V I --mode <TAB>" $'rw\nro' \
  "$(offers shareblk attachment-create V I --mode '')"
expect_all "shareblk --socket S volume-update V --writer-policy <TAB>" $'multi\nsingle' \
  "$(offers shareblk --socket S volume-update V --writer-policy '')"

expect_all "shareblkd --<TAB>" "$("$daemon" --help | grep -o -- '--[a-z][a-z0-9_-]*' | sort -u)" \
  "$(offers shareblkd --)"
expect_all "shareblkd --tls <TAB>" $'off\non\nrequire' "$(offers shareblkd --tls '')"
expect_all "shareblkd --log-level <TAB>" $'trace\ndebug\ninfo\nwarn\nerror' \
  "$(offers shareblkd --log-level '')"
exit $fail
