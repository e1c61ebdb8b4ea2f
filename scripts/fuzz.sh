#!/usr/bin/env bash
# Fuzzes every file reader, the KV cache's operation sequences, the mha
# command's option parsing, and the tiers against the float64 reference,
# with libFuzzer: installs clang and libFuzzer (Debian: clang,
# libclang-rt-14-dev), builds the targets with ASan and
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
cmake --build build-fuzz -j"$(nproc)" --target fuzz_npy fuzz_safetensors \
  fuzz_module fuzz_cache fuzz_cli fuzz_tiers >/dev/null
# fuzz_tiers runs on the CPU's best tier (MHA_ISA in the environment picks
# another) and reads about 40 bytes of each input.
for t in npy safetensors module cache cli tiers; do
  len=4096
  [ "$t" = tiers ] && len=64
  mkdir -p "build-fuzz/corpus-$t"
  echo "== fuzz_$t for ${seconds}s"
  (cd build-fuzz && ./fuzz/"fuzz_$t" -max_total_time="$seconds" \
     -max_len="$len" "corpus-$t" "../fuzz/corpus/$t")
done
