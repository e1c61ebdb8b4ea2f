#!/usr/bin/env bash
# Fuzzes every file reader with libFuzzer: installs clang and libFuzzer
# (Debian: clang, libclang-rt-14-dev), builds the targets with ASan and
# UBSan, and runs each for SECONDS (default 60) from its committed corpus.
# New inputs go to build-fuzz/corpus-<target>/, crashes to build-fuzz/.
# Usage: bash scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
bash scripts/install-deps.sh
for p in clang libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends "$p" >/dev/null; }
done
cmake -S . -B build-fuzz -DMHA_FUZZ=ON -DCMAKE_C_COMPILER=clang \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
for t in npy safetensors module; do
  cmake --build build-fuzz --target "fuzz_$t" -j"$(nproc)" >/dev/null
  mkdir -p "build-fuzz/corpus-$t"
  echo "== fuzz_$t for ${seconds}s"
  (cd build-fuzz && ./fuzz/"fuzz_$t" -max_total_time="$seconds" \
     -max_len=4096 "corpus-$t" "../fuzz/corpus/$t")
done
