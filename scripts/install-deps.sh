#!/usr/bin/env bash
# Installs, from Debian 12's packages, everything mha needs to build, test
# and cross-check against PyTorch. Run as root. Does nothing when all is
# already installed.  With arguments, installs those packages instead (the
# same way: scripts/test-aarch64.sh's arm64 ones).
set -euo pipefail

packages=(
  build-essential cmake pkg-config   # compiler and build
  libopenblas-dev                    # CBLAS for the projections
  libopenblas0-openmp                # its OpenMP build: one thread pool
  libdnnl-dev                        # oneDNN: the default GEMM backend
  libgfortran-12-dev                 # -lgfortran of OpenBLAS's static link line
  libcjson-dev                       # JSON of the safetensors header
  libcmocka-dev                      # the C test framework
  libpng-dev                         # PNG heatmaps of `mha viz` (the command only)
  libopenmpi-dev openmpi-bin         # libmha_mpi: ring attention over MPI (optional)
  valgrind                           # memory checks in the test suite
  clang libomp-14-dev                # ThreadSanitizer build (LLVM OpenMP)
  libclang-rt-14-dev                 # clang's sanitizer runtimes (TSan)
  python3-numpy python3-torch        # the independent oracle (Debian's own)
  python3-venv python3-dev python3-pip  # the Python package's venv and build
)

[ $# -gt 0 ] && packages=("$@")

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" ||
    missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
