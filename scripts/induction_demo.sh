#!/usr/bin/env bash
# The trained induction-head model of examples/induction.c, in one command:
# trains it (seeded: the same result on every run), prints the per-head
# scores, ablations and pruning, and draws both layers' heads with mha viz.
#
#   bash scripts/induction_demo.sh [OUT_DIR]     (default: induction_out)
#
# Writes OUT_DIR/report.txt (what was printed), layer1.png and layer2.png
# (every head's attention weights on one held-out sequence, tokens on the
# axes), and the inputs of those pictures: layer{1,2}.safetensors,
# x0.npy / x1.npy (each layer's input), tokens.txt.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-induction_out}"
mkdir -p "$out"
if [ ! -x "$root/build/example_induction" ] || [ ! -x "$root/build/mha" ]; then
  cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$root/build" -j"$(nproc)" >/dev/null
fi
"$root/build/example_induction" --out "$out" | tee "$out/report.txt"
for l in 1 2; do
  "$root/build/mha" viz --weights "$out/layer$l.safetensors" \
    --query "$out/x$((l - 1)).npy" --causal-top-left --tokens "$out/tokens.txt" \
    --png "$out/layer$l.png"
done
