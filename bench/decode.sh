#!/usr/bin/env bash
# The decoding step's benchmark (docs/BENCHMARKS.md, "Decoding with a KV
# cache"): ROUNDS interleaved rounds of `mha bench --decode
# --attention-only` (2 threads; E = 4096, H = 32, d_h = 128) over the
# Inference issue's cases, and with BOUND=1 the same steps with the cache
# small enough for the L3 (Lk 2 048 at H_kv = 8, Lk 1 024 at H_kv = 32),
# which tell a step bound by memory from one bound by its arithmetic.
# Given several mha binaries (builds to compare), each case runs on each
# binary in turn before the next case, so that the machine's drift falls
# on all of them alike.  One JSON object per line on stdout; summarise
# with bench/decode_summary.py.
#   bash bench/decode.sh [ROUNDS] [MHA ...]      (BOUND=1: the L3 cases too)
set -euo pipefail
rounds=${1:-3}
shift || true
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(build/mha)
threads=${THREADS:-2}
# "case name|flags"; repeat counts keep each run near a second.
cases=(
  "f16|--kv-seq 32768 --kv-heads 32 --kv-dtype f16 --repeat 10"
  "f32|--kv-seq 32768 --kv-heads 32 --kv-dtype f32 --repeat 10"
  "bf16|--kv-seq 32768 --kv-heads 32 --kv-dtype bf16 --repeat 10"
  "q8|--kv-seq 32768 --kv-heads 32 --kv-dtype q8 --repeat 10"
  "gqa f16|--kv-seq 32768 --kv-heads 8 --kv-dtype f16 --repeat 30"
  "gqa f32|--kv-seq 32768 --kv-heads 8 --kv-dtype f32 --repeat 30"
  "gqa bf16|--kv-seq 32768 --kv-heads 8 --kv-dtype bf16 --repeat 30"
  "gqa q8|--kv-seq 32768 --kv-heads 8 --kv-dtype q8 --repeat 30"
  "Lk 4096 f16|--kv-seq 4096 --kv-heads 32 --kv-dtype f16 --repeat 50"
  "ragged f16|--kv-seq 4096 --kv-heads 32 --kv-dtype f16 --batch 8 --ragged --repeat 10"
  "ragged f32|--kv-seq 4096 --kv-heads 32 --kv-dtype f32 --batch 8 --ragged --repeat 10"
)
if [ "${BOUND:-0}" = 1 ]; then
  cases+=(
    "L3 f16|--kv-seq 1024 --kv-heads 32 --kv-dtype f16 --repeat 500"
    "L3 q8|--kv-seq 1024 --kv-heads 32 --kv-dtype q8 --repeat 500"
    "L3 gqa f16|--kv-seq 2048 --kv-heads 8 --kv-dtype f16 --repeat 500"
    "L3 gqa f32|--kv-seq 2048 --kv-heads 8 --kv-dtype f32 --repeat 500"
    "L3 gqa q8|--kv-seq 2048 --kv-heads 8 --kv-dtype q8 --repeat 500"
  )
fi
for r in $(seq "$rounds"); do
  for c in "${cases[@]}"; do
    name=${c%%|*}
    flags=${c#*|}
    for b in "${bins[@]}"; do
      # shellcheck disable=SC2086
      j=$("$b" bench --decode --attention-only --embed-dim 4096 --heads 32 \
          --threads "$threads" --json $flags)
      echo "{\"round\": $r, \"case\": \"$name\", \"mha\": \"$b\", \"r\": $j}"
    done
  done
done
