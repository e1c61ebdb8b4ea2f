#!/usr/bin/env bash
# Tests of the `mha` command: exit codes, messages, and `mha example`
# checked against NumPy (tests/check_example.py).
set -u
mha="$1"; here="$(cd "$(dirname "$0")" && pwd)"
fails=0; passes=0
ok()   { passes=$((passes + 1)); }
bad()  { echo "FAIL: $*"; fails=$((fails + 1)); }

expect() {  # expect STATUS PATTERN -- command...
  local want="$1" pat="$2"; shift 3
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ "$rc" -ne "$want" ]; then bad "$* exited $rc, expected $want: $out"; return; fi
  if ! grep -qE -- "$pat" <<<"$out"; then bad "$*: output lacks /$pat/: $out"; return; fi
  ok
}

expect 0 "^mha [0-9]+\.[0-9]+\.[0-9]+$" -- "$mha" --version
expect 0 "usage: mha" -- "$mha" --help
expect 0 "usage: mha example" -- "$mha" example --help
expect 2 "unknown command 'frobnicate'" -- "$mha" frobnicate
expect 2 "usage: mha" -- "$mha"
expect 1 "unexpected argument 'extra'" -- "$mha" example extra

if /usr/bin/python3 -c "import numpy" 2>/dev/null; then
  if /usr/bin/python3 "$here/check_example.py" "$mha"; then ok
  else bad "mha example disagrees with NumPy"; fi
else
  bad "python3-numpy is missing (scripts/install-deps.sh installs it)"
fi
echo "$passes passed, $fails failed"
[ "$fails" -eq 0 ]
