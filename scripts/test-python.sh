#!/usr/bin/env bash
# The Python package's tests: scripts/python-env.sh makes .venv (torch
# 2.13, numpy, pytest, scikit-build-core) once, pip installs ./python (which
# builds libmha from this tree), then pytest.  Not yet a stage of
# scripts/test.sh: it joins the suite once the CI machines are known to
# install torch 2.13 from their local wheels (docs/TESTING.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/python-env.sh
.venv/bin/python -m pip install --quiet --no-build-isolation ./python
mkdir -p build
(cd python && ../.venv/bin/python -P -m pytest -q -p no:cacheprovider \
   --junitxml="$PWD/../build/pytest.xml" tests)
