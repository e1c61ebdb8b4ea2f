#!/usr/bin/env bash
# pytest_source.sh PYTHON SRC PYTEST-ARGS... -- the Python package's tests
# against the package's Python files in this tree (SRC/python/mha), over
# the compiled extension installed into PYTHON's environment (.venv, by
# scripts/test-python.sh): so that scripts/mutate.py's one-line mutations
# of python/mha/*.py are seen without a pip install.  Exit 77 (skipped)
# when PYTHON has no installed mha.
set -u
py=$1 src=$2; shift 2
[ -x "$py" ] || { echo "no $py: scripts/python-env.sh makes it"; exit 77; }
core=$("$py" -c 'import glob, os, mha; print(glob.glob(os.path.join(os.path.dirname(mha.__file__), "_core*"))[0])' 2>/dev/null) ||
  { echo "mha is not installed in $py's environment"; exit 77; }
ovl=$(mktemp -d); trap 'rm -rf "$ovl"' EXIT
cp -r "$src/python/mha" "$ovl/mha"
ln -s "$core" "$ovl/mha/$(basename "$core")"
cd "$src/python" && PYTHONPATH="$ovl" "$py" -P -m pytest -q -p no:cacheprovider "$@" &&
  "$py" -c 'import sys; sys.path.insert(0, sys.argv[1]); import mha; assert mha.__file__.startswith(sys.argv[1]), mha.__file__' "$ovl"
