#!/usr/bin/env bash
# test-python-asan.sh BUILD -- the Python package's tests (python/tests)
# under ASan + UBSan, over the extension of an instrumented C build: BUILD
# configured with -DMHA_SANITIZE=address,undefined -DMHA_BUILD_PYTHON=ON
# and -DPython_EXECUTABLE=.venv/bin/python (scripts/test.sh --all's ASan
# stage), so the C and the Python tests share one instrumented libmha.
# The package's Python files and that extension go into BUILD/py-asan;
# the sanitizer runtimes are preloaded into the interpreter (the
# instrumented extension does not import without them, so these tests
# cannot silently run a plain build), and a check that `mha` came from
# there runs first.  CPython and torch keep memory until exit by design:
# leaks are not reported here (the C suite's ASan stage checks libmha's).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# = 1 ] || { echo "usage: bash scripts/test-python-asan.sh BUILD" >&2; exit 2; }
build=$(cd "$1" && pwd)
py=$PWD/.venv/bin/python
[ -x "$py" ] || { echo "no $py: scripts/python-env.sh makes it" >&2; exit 1; }
core=$(ls "$build"/python/_core*.so 2>/dev/null | head -1)
[ -n "$core" ] || { echo "no $build/python/_core*.so: configure $build with -DMHA_BUILD_PYTHON=ON" >&2; exit 1; }
readelf -d "$core" | grep -q 'NEEDED.*libasan' ||
  { echo "$core is not instrumented (MHA_SANITIZE=address,undefined)" >&2; exit 1; }
ovl=$build/py-asan
rm -rf "$ovl" && mkdir -p "$ovl"
cp -r python/mha "$ovl/mha"
cp "$core" "$ovl/mha/"
(cd python &&
 export PYTHONPATH="$ovl" \
   LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
   ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
   UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 &&
 "$py" -P -c 'import mha, sys; assert mha.__file__.startswith(sys.argv[1]), mha.__file__' "$ovl" &&
 "$py" -P -m pytest -q -p no:cacheprovider tests)
