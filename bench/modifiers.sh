#!/usr/bin/env bash
# The score modifiers' costs (docs/BENCHMARKS.md, "Score modifiers"):
# ROUNDS interleaved rounds of `mha bench` at B=1, L=4096, H=8, d_h=64,
# causal, each modifier alone against plain attention (attention only,
# forward; and the module's training step, forward + backward); then
# causal attention at L=32768 with and without a window of 1,024 (peak
# RSS by /usr/bin/time).  One JSON object per line on stdout.
#   bash bench/modifiers.sh [ROUNDS] [MHA]   (LONG_ROUNDS=0: skip L=32768)
set -euo pipefail
rounds=${1:-3}
mha=${2:-build/mha}
mods=("" "--rope neox" "--alibi" "--sinks" "--window 4096,0" "--softcap 30")
for r in $(seq "$rounds"); do
  for m in "${mods[@]}"; do
    # shellcheck disable=SC2086
    j=$("$mha" bench --batch 1 --seq 4096 --embed-dim 512 --heads 8 --causal \
        --attention-only --repeat 5 --warmup 1 --json $m)
    echo "{\"round\": $r, \"what\": \"forward\", \"mods\": \"$m\", \"r\": $j}"
    # shellcheck disable=SC2086
    j=$("$mha" bench --batch 1 --seq 4096 --embed-dim 512 --heads 8 --causal \
        --backward --repeat 5 --warmup 1 --json $m)
    echo "{\"round\": $r, \"what\": \"train step\", \"mods\": \"$m\", \"r\": $j}"
  done
done
for r in $(seq "${LONG_ROUNDS:-$rounds}"); do
  for m in "--window 1023,0" ""; do
    # shellcheck disable=SC2086
    out=$( { /usr/bin/time -f '%M' "$mha" bench --batch 1 --seq 32768 \
        --embed-dim 512 --heads 8 --causal --attention-only --repeat 3 \
        --warmup 1 --json $m; } 2>&1 )
    j=$(echo "$out" | head -1)
    rss=$(echo "$out" | tail -1)
    echo "{\"round\": $r, \"what\": \"L32768\", \"mods\": \"$m\", \"rss_kb\": $rss, \"r\": $j}"
  done
done
